"""Numerics conformance: does a drafter behave the way its config.json says it was trained?

A loader that misreads one config key (the aux layer numbering, `norm_before_residual`, the
feedback state, the vocabulary map) serves a drafter whose outputs stay "correct" under greedy
verification while its acceptance collapses. Nothing in the weights says which reading is right;
only the numbers do. So on a few real prompts the target answers greedily, the drafter's first two
steps are run teacher-forced under the conventions its config states and under each plausible
alternative, and the readings are compared by the log-probability each gives the target's greedy
token (teacher-forced acc@1, the agreement of the draft with that token, is reported beside it):

- aux layer ids shifted by -1 and +1 (a checkpoint numbered by the layer each state leaves, as
  SGLang, SpecForge and TorchSpec count, read as vLLM's "entering" numbering, or the reverse), and
  the last id at L-4 where the config says L-3 (TensorRT Edge-LLM's default capture);
- `norm_output` flipped: pre- vs post-norm feedback (acts from step 1 on);
- `fc_norm` flipped, and `norm_before_fc` flipped (a norm the checkpoint has no gain for is
  applied gain-free);
- `norm_before_residual` flipped;
- the vocabulary map: d2t as offsets (the convention), ignored (identity), or as absolute ids.

Each variant is an ordinary `Drafter` built from the same tensors with a changed DrafterConfig, so
the variants run the drafter's one forward and its one feedback rule, never a parallel copy.

The statistic. At position p and step k, reading r gives the target's greedy token g the draft
probability q_r(g) (summed over the draft ids r maps to g; floored at FLOOR where r's draft vocabulary
cannot produce g), and

    d_r(p, k) = log q_r(g) - log q_configured(g)        (paired: same position, same step)
    gain_r(k) = sum_p d_r(p, k) / #positions            (nats per position)

acc@1 only counts the positions where the argmax crosses g, and an alternative that moves much of
the distribution (a one-layer aux shift changes the drafter's own top-1 at a fifth of the positions)
can leave it within a point; the log-probability moves at every position. The interval on gain_r(k)
is a seeded percentile bootstrap (BOOTSTRAP resamples, LEVEL) that resamples whole prompts, not
positions: the positions of one prompt share their context, so resampling them one by one would
claim more certainty than the prompts give. An alternative is named ("behaves as if
norm_before_residual were true") when, at step 0 or 1, its interval lies above 0 (not chance) and
its gain exceeds MIN_GAIN (not negligible: 0.01 nats, a 1% higher
geometric-mean probability; the figures behind it are at MIN_GAIN), and its acc@1 is no lower than
the configured reading's at either step (`named`); a drafter near zero acc@1 under every reading
matches no convention, and where only an alternative reading clears MIN_ACC the result says which.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import FLAG, NULL, Const, Either, List, Number, Record, Text, cache_root, read_cache, write_cache
from ..data.prompts import ChatTemplate, chat_prompts, prompt_set
from ..errors import EagleExportError
from ..export.loader import load_pair
from ..files import load_tokenizer, read_text
from ..models.drafter import Drafter
from ..models.target import Target
from ..speculation.eager import parallel_drafts

STEPS = 2            # step 0 and the first feedback step
MIN_GAIN = 0.01      # nats per position an alternative must gain to be named (see below)
FLOOR = math.log(1e-12)  # log q(g) where a reading's draft vocabulary cannot produce g
BOOTSTRAP = 1000     # resamples of the prompts for the interval on the mean gain
LEVEL = 0.95         # two-sided; an alternative is named when the interval's lower end is above 0
SEED = 0             # the bootstrap's generator: the same pair and prompts give the same verdict
MIN_ACC = 0.05       # below this acc@1 under every reading, the drafter matches no convention
# MIN_GAIN: 0.01 nats is a 1% higher geometric-mean probability on the target's token. The interval
# alone says a gain is not chance; on many positions a reading that changes almost nothing clears 0
# too (the sample EAGLE-3.1 pair's gain-free norm_before_fc: +0.002 to +0.004 nats, its interval
# above 0 on 8 prompts), and it must not be named. A one-layer aux shift of that pair, the weakest
# misreading this check exists for, gains the right reading 0.026-0.033 nats on 16 prompts: the
# threshold sits a factor of ~3 from each.
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
def score(drafter: Drafter, reading: Reading, sequences, captured, starts) -> tuple[list[int], int, list[list]]:
    """Correct counts at steps 0..STEPS-1, the number of positions (p >= start), and per step the
    log q(g) of each position, one tensor per sequence. Step k at position p consumes token p+k+1
    and must give the target's greedy token g at p+k+1."""
    variant = read_as(drafter, reading)
    draft_to_target = variant.to_target_ids(torch.arange(variant.lm_head.weight.shape[0]))
    correct, total, logq = [0] * STEPS, 0, [[] for _ in range(STEPS)]
    layers = list(reading.aux_layer_ids)
    for ids, (states, greedy), start in zip(sequences, captured, starts):
        t = len(ids) - STEPS  # positions with every step's label
        if t <= start:
            continue
        aux = states[:t, layers].reshape(1, t, -1).to(drafter.fc.weight.dtype)
        next_ids = torch.tensor([ids[1:]])
        logits = parallel_drafts(variant, next_ids, aux, STEPS, first_chain=start)
        for k in range(STEPS):
            labels = greedy[start + k + 1:t + k + 1]
            correct[k] += int((draft_to_target[logits[k][0].argmax(-1)] == labels).sum())
            logp = logits[k][0].float().log_softmax(-1)
            maps_to_label = draft_to_target[None, :] == labels[:, None]
            logq[k].append(logp.masked_fill(~maps_to_label, -math.inf).logsumexp(-1).clamp_min(FLOOR))
        total += t - start
    return correct, total, logq


def paired_gain(alternative: list, configured: list) -> tuple[float, float, float]:
    """(mean gain, interval low, interval high) of log q_alternative(g) - log q_configured(g) per
    position: the mean over every position, its interval a percentile bootstrap over prompts."""
    sums = torch.stack([(a.double() - c.double()).sum() for a, c in zip(alternative, configured)])
    counts = torch.tensor([float(len(a)) for a in alternative], dtype=torch.float64)
    mean = float(sums.sum() / counts.sum())
    pick = torch.randint(0, len(sums), (BOOTSTRAP, len(sums)), generator=torch.Generator().manual_seed(SEED))
    means = sums[pick].sum(1) / counts[pick].sum(1)
    tail = (1 - LEVEL) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return mean, low, high


def conformance_check(target: Target, drafter: Drafter, prompts: list[list[int]], new_tokens: int = 48,
                      eos_ids=()) -> dict:
    """Teacher-forced acc@1 and the paired log-probability gain over the configured reading, at
    steps 0 and 1, under every reading, on the target's greedy answers to `prompts` (positions from
    the last prompt token on: where drafting happens in decoding).

    -> {"readings": [...], "findings": [...], "matched": bool, "ok": bool, ...}; each reading row
    holds "acc@1", "gain" (nats per position) and "interval" per step; `findings` names each field
    whose alternative's interval lies above 0 with a gain above MIN_GAIN at step 0 or 1 (a feedback
    convention shows only from step 1 on), its strongest reading; `matched` is False when no reading
    reaches MIN_ACC at step 0."""
    aux_ids = tuple(drafter.config.resolved_aux_layer_ids(target.config))
    sequences, starts = [], []
    for ids in prompts:
        answer = target.generate_greedy(ids, new_tokens, eos_ids=eos_ids) if new_tokens else []
        sequences.append(list(ids) + answer)
        starts.append(len(ids) - 1 if new_tokens else 0)
    captured = capture(target, sequences)
    rows, configured_logq = [], None
    for reading in readings(drafter, target.config.num_layers, aux_ids):
        correct, total, logq = score(drafter, reading, sequences, captured, starts)
        configured_logq = configured_logq or logq
        gains = [paired_gain(logq[k], configured_logq[k]) if logq[k] else (0.0, 0.0, 0.0) for k in range(STEPS)]
        rows.append({"reading": reading.name, "field": reading.field, "value": reading.value,
                     "acc@1": [round(c / max(total, 1), 4) for c in correct], "positions": total,
                     "gain": [round(g[0], 4) for g in gains], "interval": [[round(g[1], 4), round(g[2], 4)] for g in gains]})
    configured = rows[0]["acc@1"]
    best: dict[str, tuple[float, int, dict]] = {}  # per field, the reading that gains most over the configured one
    for row in rows[1:]:
        if not named(row, configured):
            continue
        k = max(range(STEPS), key=row["gain"].__getitem__)  # a feedback convention shows only from step 1 on
        if row["gain"][k] > best.get(row["field"], (0.0,))[0]:
            best[row["field"]] = (row["gain"][k], k, row)
    findings = [{"field": row["field"], "value": row["value"], "reading": row["reading"], "step": k,
                 "gain": row["gain"][k], "interval": row["interval"][k],
                 "acc@1": row["acc@1"][k], "configured_acc@1": configured[k],
                 "message": _message(row, k, configured[k], aux_ids)}
                for _, k, row in sorted(best.values(), key=lambda b: -b[0])]  # the strongest first
    passing = gate(rows)
    return {"prompts": len(prompts), "positions": rows[0]["positions"], "new_tokens": new_tokens,
            "aux_layer_ids": list(aux_ids), "readings": rows, "findings": findings, "matched": passing is not None,
            "matched_by": passing and {"reading": passing["reading"], "acc@1": passing["acc@1"][0]},
            "ok": passing is rows[0] and not findings, "min_gain": MIN_GAIN, "level": LEVEL, "min_acc": MIN_ACC}


def gate(rows: list[dict]) -> dict | None:
    """The reading that clears MIN_ACC at step 0: the configured one (rows[0]) if it does, else the
    alternative with the highest acc@1 (the result names it: `matched_by`); None if no reading does."""
    best = max(rows, key=lambda r: r["acc@1"][0])
    return rows[0] if rows[0]["acc@1"][0] >= MIN_ACC else best if best["acc@1"][0] >= MIN_ACC else None


def named(row: dict, configured: list[float]) -> bool:
    """An alternative reading is named when, at step 0 or 1, its log-probability gain is not chance
    (interval above 0) and not negligible (> MIN_GAIN), and its acc@1 is at least the configured
    reading's at both steps. The log-probability is the sharper statistic, but it also rewards a
    reading that only makes the distribution flatter or sharper where the draft is wrong (a
    neighbouring aux layer, whose state differs by one layer's update, can do that at step 1); a
    reading whose drafts agree with the target less often is no better reading of the checkpoint,
    whatever its probabilities, and naming it would contradict the acc@1 the message prints."""
    significant = any(row["interval"][k][0] > 0 and row["gain"][k] > MIN_GAIN for k in range(STEPS))
    return significant and all(row["acc@1"][k] >= configured[k] for k in range(STEPS))


def gate_line(result: dict) -> str:
    """Which reading passed the MIN_ACC gate, said where it is not the configured one."""
    by, configured = result.get("matched_by"), result["readings"][0]["acc@1"][0]
    if not by or by["reading"] == "as configured":
        return ""
    return (f"; acc@1 {configured:.3f} as configured is below {result['min_acc']}: the gate was passed by the "
            f"reading \"{by['reading']}\" (acc@1 {by['acc@1']:.3f})")


def _message(row: dict, k: int, configured: float, aux_ids) -> str:
    low, high = row["interval"][k]
    measured = (f"(step {k}: log-probability of the target's token {row['gain'][k]:+.3f} nats per position, "
                f"{LEVEL:.0%} interval {low:+.3f} to {high:+.3f}; acc@1 {row['acc@1'][k]:.3f}, "
                f"{configured:.3f} as configured)")
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
    path = Path(prompt_set(source, ("mt-bench", "sharegpt")))  # a file, or refused as neither
    if not os.path.lexists(Path(target_dir) / "tokenizer.json"):
        raise EagleExportError(f"{target_dir} has no tokenizer.json to tokenize {path}",
                               "use a target directory that holds its tokenizer")
    tokenizer = load_tokenizer(Path(target_dir) / "tokenizer.json")
    text = read_text(path, "save it as UTF-8 text, one prompt a line, readable to this user")
    lines = [line for line in text.splitlines() if line.strip()][:count]
    return [tokenizer.encode(line, add_special_tokens=False).ids[:max_tokens] for line in lines]


def check_checkpoint(drafter_dir, target_dir, prompts: list[list[int]], new_tokens: int = 0) -> dict:
    """Load the pair in fp32 (whatever they are stored in) and run `conformance_check` on `prompts`."""
    target, drafter = load_pair(target_dir, drafter_dir, "float32", passes=())  # the readings need the models as loaded
    return conformance_check(target, drafter, prompts, new_tokens, target.config.eos_ids)


CACHE_FORMAT = 3  # 2: findings by the paired log-probability gain, not an acc@1 margin; 3: and no lower acc@1


def cache_dir() -> Path:
    return cache_root() / "conformance"


def cache_file(source_files: dict, prompts: list[list[int]], new_tokens: int = 0) -> Path:
    """Where `check_checkpoint`'s result for a pair is kept: named by the sha256 of both checkpoints'
    file hashes (manifest.source_files), the prompts and the rule that decides the verdict, so a changed
    file, prompt, threshold or version is a miss and the check runs again."""
    from .. import __version__

    key = json.dumps({"format": CACHE_FORMAT, "version": __version__, "files": source_files, "prompts": prompts,
                      "new_tokens": new_tokens,
                      "rule": ["logq-gain", STEPS, MIN_GAIN, FLOOR, BOOTSTRAP, LEVEL, SEED, MIN_ACC, list(FLAGS)]},
                     sort_keys=True)
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


# A cached result, as conformance_check returns it; only a drafter that matched is remembered, so a
# cache that says otherwise is not one this tool wrote (it must never refuse a build).
FRACTION, FINITE, COUNT = Number(0, 1), Number(), Number(0, whole=True)
PER_STEP, INTERVAL = List(FINITE, STEPS, STEPS), List(FINITE, 2, 2)
VALUE = Either((NULL, FLAG, Text(), List(COUNT)))  # a reading's value: as configured, a flag, a vocab map, aux ids
CACHED_RESULT = Record({
    "prompts": COUNT, "positions": COUNT, "new_tokens": COUNT, "aux_layer_ids": List(COUNT),
    "readings": List(Record({"reading": Text(), "field": Either((NULL, Text())), "value": VALUE,
                             "acc@1": List(FRACTION, STEPS, STEPS), "positions": COUNT, "gain": PER_STEP,
                             "interval": List(INTERVAL, STEPS, STEPS)}), 1),
    "findings": List(Record({"field": Text(), "value": VALUE, "reading": Text(), "step": Number(0, STEPS - 1, whole=True),
                             "gain": FINITE, "interval": INTERVAL, "acc@1": FRACTION, "configured_acc@1": FRACTION,
                             "message": Text()})),
    "matched": Const(True), "ok": FLAG, "min_gain": FINITE, "level": FRACTION, "min_acc": FRACTION})


def read_cached(path: Path) -> dict | None:
    """The remembered result for a pair, or None (a miss; a bad file is said and checked again)."""
    return read_cache(path, CACHED_RESULT, "checked again")


def write_cached(path: Path, result: dict) -> None:
    """Atomically; an unwritable cache only costs the next build the check."""
    write_cache(path, result, "checked again")
