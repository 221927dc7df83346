"""Numerics conformance: does a drafter behave the way its config.json says it was trained?

A loader that misreads one config key (the aux layer numbering, `norm_before_residual`, the
feedback state, the vocabulary map) serves a drafter whose outputs stay "correct" under greedy
verification while its acceptance collapses. Nothing in the weights says which reading is right;
only the numbers do. So on a few real prompts the target answers greedily, the drafter's first two
steps are run teacher-forced under the conventions its config states and under each plausible
alternative, and the teacher-forced acc@1 of each (agreement of the draft with the target's greedy
token) is compared:

- aux layer ids shifted by -1 and +1 (a checkpoint numbered by the layer each state leaves, as
  SGLang, SpecForge and TorchSpec count, read as vLLM's "entering" numbering, or the reverse), and
  the last id at L-4 where the config says L-3 (TensorRT Edge-LLM's default capture);
- `norm_output` flipped: pre- vs post-norm feedback (acts from step 1 on);
- `fc_norm` flipped, and `norm_before_fc` flipped (a norm the checkpoint has no gain for is
  applied gain-free);
- `norm_before_residual` flipped;
- the vocabulary map: d2t as offsets (the convention), ignored (identity), or as absolute ids.

Each variant is an ordinary `Drafter` built from the same tensors with a changed DrafterConfig, so
the variants run the drafter's one forward and its one feedback rule, never a parallel copy. An
alternative that beats the configured reading by a clear margin names its field ("behaves as if
norm_before_residual were true"); a drafter near zero under every reading matches no convention.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import load_drafter, load_target
from .drafter import Drafter
from .errors import EagleExportError
from .files import load_tokenizer, read_text
from .prompts import ChatTemplate, chat_prompts
from .reference import parallel_drafts
from .target import Target

STEPS = 2            # step 0 and the first feedback step
MARGIN = 0.05        # absolute acc@1 an alternative must gain to be named (paired, same positions)
MIN_ACC = 0.05       # below this under every reading, the drafter matches no convention
FLAGS = ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output")


@dataclass(frozen=True)
class Reading:
    """One way to read the checkpoint: the aux layer ids (vLLM numbering), the flags, the vocab map."""
    name: str
    field: str | None          # the config field this reading changes (None: as configured)
    value: object              # the value it gives that field
    aux_layer_ids: tuple[int, ...]
    flags: dict
    vocab_map: str = "offsets"  # "offsets" (target = draft + d2t[draft]), "identity", "absolute"


def readings(drafter: Drafter, num_target_layers: int, aux_layer_ids: tuple[int, ...]) -> list[Reading]:
    """The configured reading first, then each plausible alternative (duplicates and impossible ones left out)."""
    cfg, n = drafter.config, num_target_layers
    flags = {f: getattr(cfg, f) for f in FLAGS}
    ids = tuple(aux_layer_ids)
    out = [Reading("as configured", None, None, ids, flags)]
    for shift, why in ((-1, "one lower"), (+1, "one higher")):
        moved = tuple(i + shift for i in ids)
        if all(0 <= i <= n for i in moved):
            out.append(Reading(f"aux ids {why}", "eagle_aux_hidden_state_layer_ids", list(moved), moved, flags))
    if ids and ids[-1] == n - 3:
        edge = ids[:-1] + (n - 4,)
        out.append(Reading("last aux id L-4 (Edge-LLM)", "eagle_aux_hidden_state_layer_ids", list(edge), edge, flags))
    for flag in FLAGS:
        out.append(Reading(f"{flag}={not flags[flag]}", flag, not flags[flag], ids, {**flags, flag: not flags[flag]}))
    if drafter.d2t.any():
        out.append(Reading("d2t ignored", "d2t", "identity", ids, flags, vocab_map="identity"))
        absolute = drafter.d2t
        if int(absolute.min()) >= 0 and int(absolute.max()) < cfg.vocab_size:
            out.append(Reading("d2t as absolute ids", "d2t", "absolute", ids, flags, vocab_map="absolute"))
    return out


def read_as(drafter: Drafter, reading: Reading) -> Drafter:
    """A Drafter over the same tensors (no copies) that follows `reading`'s flags and vocabulary map.
    A norm the checkpoint has no gain for (fc_norm or norm_before_fc switched on) runs gain-free."""
    cfg = dataclasses.replace(drafter.config, **reading.flags)
    with torch.device("meta"):
        variant = Drafter(cfg)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}
    own = variant.state_dict()
    variant.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False, assign=True)
    for name, module in variant.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_meta:
            module.weight = None  # only norms can be missing here: run them gain-free
    variant.inv_freq = drafter.inv_freq
    variant.share_embeddings(drafter.embed_tokens)
    if reading.vocab_map == "identity":
        variant.d2t = torch.zeros_like(drafter.d2t)
    elif reading.vocab_map == "absolute":
        variant.d2t = drafter.d2t - torch.arange(len(drafter.d2t))
    return variant.eval()


@torch.no_grad()
def capture(target: Target, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: the residual stream entering every layer (and the final state) [T, L+1, H], and
    the target's greedy token at each position [T]. One forward each, raw states (no aux norm)."""
    saved, saved_eps = target.aux_layer_ids, target.aux_norm_eps
    n, h = target.config.num_layers, target.config.hidden_size
    target.aux_layer_ids, target.aux_norm_eps = tuple(range(n + 1)), None
    try:
        out = []
        for ids in sequences:
            k, v = target.empty_cache(1, 0)
            logits, aux, _, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None], k, v, torch.zeros(1, dtype=torch.long))
            out.append((aux[0].view(len(ids), n + 1, h), logits[0].argmax(-1)))
        return out
    finally:
        target.aux_layer_ids, target.aux_norm_eps = saved, saved_eps


@torch.no_grad()
def accuracy(drafter: Drafter, reading: Reading, sequences, captured, starts) -> tuple[list[int], int]:
    """Correct counts at steps 0..STEPS-1 and the number of positions, over positions p >= start.
    Step k at position p consumes token p+k+1 and must give the target's greedy token at p+k+1."""
    variant = read_as(drafter, reading)
    correct, total = [0] * STEPS, 0
    layers = list(reading.aux_layer_ids)
    for ids, (states, greedy), start in zip(sequences, captured, starts):
        t = len(ids) - STEPS  # positions with every step's label
        if t <= start:
            continue
        aux = states[:t, layers].reshape(1, t, -1).to(drafter.fc.weight.dtype)
        next_ids = torch.tensor([ids[1:]])
        logits = parallel_drafts(variant, next_ids, aux, STEPS, first_chain=start)
        for k in range(STEPS):
            drafts = variant.to_target_ids(logits[k][0].argmax(-1))
            correct[k] += int((drafts == greedy[start + k + 1:t + k + 1]).sum())
        total += t - start
    return correct, total


def conformance_check(target: Target, drafter: Drafter, prompts: list[list[int]], new_tokens: int = 48,
                      eos_ids=()) -> dict:
    """Teacher-forced acc@1 at steps 0 and 1 under every reading, on the target's greedy answers to
    `prompts` (positions from the last prompt token on: where drafting happens in decoding).

    -> {"readings": [...], "findings": [...], "matched": bool, "ok": bool, ...}; `findings` names
    each field whose alternative beats the configured reading by MARGIN at step 0 or 1 (a feedback
    convention shows only from step 1 on); `matched` is False when
    no reading reaches MIN_ACC at step 0."""
    aux_ids = tuple(drafter.config.resolved_aux_layer_ids(target.config))
    sequences, starts = [], []
    for ids in prompts:
        answer = target.generate_greedy(ids, new_tokens, eos_ids=eos_ids) if new_tokens else []
        sequences.append(list(ids) + answer)
        starts.append(len(ids) - 1 if new_tokens else 0)
    captured = capture(target, sequences)
    rows = []
    for reading in readings(drafter, target.config.num_layers, aux_ids):
        correct, total = accuracy(drafter, reading, sequences, captured, starts)
        rows.append({"reading": reading.name, "field": reading.field, "value": reading.value,
                     "acc@1": [round(c / max(total, 1), 4) for c in correct], "positions": total})
    configured = rows[0]["acc@1"]
    best: dict[str, tuple[float, int, dict]] = {}  # per field, the reading that gains most over the configured one
    for row in rows[1:]:
        gains = [a - c for a, c in zip(row["acc@1"], configured)]
        k = max(range(STEPS), key=gains.__getitem__)  # a feedback convention shows only from step 1 on
        if gains[k] >= MARGIN and gains[k] > best.get(row["field"], (0.0,))[0]:
            best[row["field"]] = (gains[k], k, row)
    findings = [{"field": row["field"], "value": row["value"], "reading": row["reading"], "step": k,
                 "acc@1": row["acc@1"][k], "configured_acc@1": configured[k],
                 "message": _message(row, k, configured[k], aux_ids)}
                for _, k, row in sorted(best.values(), key=lambda b: -b[0])]  # the strongest first
    best = max(r["acc@1"][0] for r in rows)
    matched = best >= MIN_ACC
    return {"prompts": len(prompts), "positions": rows[0]["positions"], "new_tokens": new_tokens,
            "aux_layer_ids": list(aux_ids), "readings": rows, "findings": findings, "matched": matched,
            "ok": matched and not findings, "margin": MARGIN, "min_acc": MIN_ACC}


def _message(row: dict, k: int, configured: float, aux_ids) -> str:
    measured = f"(acc@1 at step {k}: {row['acc@1'][k]:.3f}, {configured:.3f} as configured)"
    field, value = row["field"], row["value"]
    if field == "eagle_aux_hidden_state_layer_ids":
        return (f"this drafter behaves as if its aux layer ids were {value} in vLLM numbering, not "
                f"{list(aux_ids)} ({row['reading']}) {measured}")
    if field == "d2t":
        how = "draft ids were target ids (d2t ignored)" if value == "identity" else "d2t held absolute target ids"
        return f"this drafter behaves as if {how} {measured}"
    return f"this drafter behaves as if {field} were {str(value).lower()} {measured}"


def check_prompts(target_dir, source: str = "mt-bench", count: int = 16, max_tokens: int = 256) -> list[list[int]]:
    """Prompts for the check: a chat prompt set rendered with the target's chat template (mt-bench,
    sharegpt), or a text file whose lines are tokenized as they stand (no template)."""
    if source in ("mt-bench", "sharegpt"):
        return list(chat_prompts(ChatTemplate(target_dir), source, count, max_tokens))
    path = Path(source)
    if not os.path.lexists(path):
        raise EagleExportError(f"prompt source {source!r} is neither mt-bench, sharegpt nor a file",
                               "pass mt-bench, sharegpt, or a text file with one prompt per line")
    if not os.path.lexists(Path(target_dir) / "tokenizer.json"):
        raise EagleExportError(f"{target_dir} has no tokenizer.json to tokenize {path}",
                               "use a target directory that holds its tokenizer")
    tokenizer = load_tokenizer(Path(target_dir) / "tokenizer.json")
    text = read_text(path, "save it as UTF-8 text, one prompt a line, readable to this user")
    lines = [line for line in text.splitlines() if line.strip()][:count]
    return [tokenizer.encode(line, add_special_tokens=False).ids[:max_tokens] for line in lines]


def check_checkpoint(drafter_dir, target_dir, prompts: list[list[int]], new_tokens: int = 0) -> dict:
    """Load the pair in fp32 (whatever they are stored in) and run `conformance_check` on `prompts`."""
    target = load_target(target_dir, dtype="float32")
    drafter = load_drafter(drafter_dir, target=target, dtype="float32")
    return conformance_check(target, drafter, prompts, new_tokens, target.config.eos_ids)


CACHE_FORMAT = 1


def cache_dir() -> Path:
    from .sample import cache_root

    return cache_root() / "conformance"


def cache_file(source_files: dict, prompts: list[list[int]], new_tokens: int = 0) -> Path:
    """Where `check_checkpoint`'s result for a pair is kept: named by the sha256 of both checkpoints'
    file hashes (manifest.source_files), the prompts and the rule that decides the verdict, so a changed
    file, prompt, threshold or version is a miss and the check runs again."""
    from . import __version__

    key = json.dumps({"format": CACHE_FORMAT, "version": __version__, "files": source_files, "prompts": prompts,
                      "new_tokens": new_tokens, "rule": [STEPS, MARGIN, MIN_ACC, list(FLAGS)]}, sort_keys=True)
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_cached(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a cache, not an artifact: missing or bad is a miss


def write_cached(path: Path, result: dict) -> None:
    """Atomically; an unwritable cache only costs the next build the check."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's private 0600 would outlive the rename
        with os.fdopen(fd, "w") as f:
            json.dump(result, f)
        os.replace(tmp, path)
    except OSError:
        pass
