"""The verify policies replayed against recorded cost curves and a synthetic drafter, on any CPU.

The real policy objects (`verify_policy.py`) are driven round by round as the runtime drives them (a
chain's drafted round asks `choose_chain` on lists where the policy has it, as the device round does), a
batch of B sequences in lock step, with nothing measured: each round is priced from cost curves
(`costs.CostCurves`: the drafter over its pending rows, the verify call over the tokens kept) and the
drafts come from a synthetic drafter of known quality:

    the drafts made at position n      right in a row for r of them: r = the first d with a failed
                                       draw (draft d right with probability true[d-1] given drafts
                                       1..d-1 were), the same draw for every policy at (sequence, n)
    what the drafter's probabilities   claimed[d-1] for draft d (a calibrated drafter: claimed = true;
    say                                a real one runs high or low, and differently by depth)

so goodput, fixed K and plain decoding are compared on the same acceptance and the same costs, in graph
time (host work left out: the runtime's own measurement, not the policy's). A sequence's tokens are its
positions, so the hindsight the policy reads (tokens emitted later against the drafts) is exact.

`RECORDED` holds the cost curves measured by `eagle-export gpu-kit` on the Llama-3.1-8B shape (CUDA
graphs, batch 1/4 on an H200, batch 16 on an H100): where the kit's report gives T = 1 and T = K+1
only, the verify cost in between is the straight line between them (the curve is flat on a GPU to
within that). "H200 exact bf16" is `gpu-kit --exact --steps costs` (the width-invariant kernels), every
width measured, the drafter the middle of its measured 1.78-1.80 / 1.84-1.86 ms at batch 1 / 4.

The kit recorded the drafter at K+1 rows only, not catching up (a drafter call after plain rounds runs
over every row they added: the first probe of a request over the whole prompt). A catch-up call of R
rows per sequence is priced at the drafter's K+1-row call plus (R - K - 1) x batch rows at the
drafter's cost per row: the steepest rise per row between the card's batch sizes (a batch of b runs
b (K+1) rows through the first step), which bounds it from above (a batch's rows pass every draft
step and the LM head too, a catch-up's extra rows the first step only); a card recorded at one batch
size takes the steepest of all cards'. A catch-up call is longer than any captured graph, so it runs
eagerly: `eager_ms` adds a fixed cost for that, which graph-time curves cannot show.
"""

from __future__ import annotations

import torch

from .costs import CATCH_UP_ROWS, CostCurves
from .verify_policy import make_policy

DEPTH = 4


def _line(t1: float, t5: float) -> dict[int, float]:
    return {t: t1 + (t5 - t1) * (t - 1) / DEPTH for t in range(1, DEPTH + 2)}


# name -> batch -> (verify ms by tokens T, drafter ms): Llama-3.1-8B shape, random weights, K = 4
RECORDED = {
    "H200 fp32": {1: ({1: 10.4, 2: 13.6, 3: 19.2, 4: 19.2, 5: 19.2}, 2.8)},
    "H200 bf16": {1: (_line(7.87, 8.87), 1.85), 4: (_line(9.97, 11.11), 2.16)},
    "H100 bf16": {1: (_line(9.57, 10.56), 2.17), 16: (_line(20.7, 23.0), 3.73)},
    # exact mode (the width-invariant kernels), bf16, every verify width measured at 256 cached positions
    "H200 exact bf16": {1: ({1: 8.047, 2: 8.476, 3: 8.581, 4: 8.581, 5: 8.647}, 1.79),
                        4: ({1: 8.245, 2: 8.671, 3: 8.839, 4: 8.9, 5: 10.366}, 1.85),
                        16: ({1: 8.744, 2: 11.017, 3: 13.433, 4: 14.975, 5: 18.191}, 2.211)},
}


# The sample build on a shared 2-core CPU (ONNX Runtime; its costs.json): verify ms by tokens T, the
# drafter at K+1 rows, the drafter catching up over CATCH_UP_ROWS rows, at batch 1 and 4. Its drafter
# runs below break-even on humaneval at batch 4 (fixed K = 4 0.65x of plain decoding there).
SAMPLE_CPU = {1: ({1: 39.2, 2: 44.1, 3: 44.6, 4: 49.0, 5: 49.0}, 9.7, 15.1),
              4: ({1: 49.5, 2: 64.4, 3: 65.1, 4: 72.3, 5: 82.1}, 12.9, 31.0)}


def sample_cpu_costs() -> CostCurves:
    """`SAMPLE_CPU` as the policy reads it (seconds), catching up measured."""
    return CostCurves({b: {t: ms / 1e3 for t, ms in verify.items()} for b, (verify, _, _) in SAMPLE_CPU.items()},
                      {b: {w: draft / 1e3 for w in range(1, DEPTH + 2)} for b, (_, draft, _) in SAMPLE_CPU.items()},
                      {b: {CATCH_UP_ROWS: ms / 1e3} for b, (_, _, ms) in SAMPLE_CPU.items()})


def row_ms(name: str) -> float:
    """The drafter's cost per input row on a card (ms): the steepest rise between its recorded batch
    sizes per row added, b (K+1) rows at batch b (see the module); at one batch size, every card's steepest."""
    batches = sorted(RECORDED[name])
    if len(batches) == 1:
        return max(row_ms(other) for other in RECORDED if len(RECORDED[other]) > 1)
    draft = {b: RECORDED[name][b][1] for b in batches}
    return max((draft[b] - draft[a]) / ((b - a) * (DEPTH + 1)) for a, b in zip(batches, batches[1:]))


def recorded_costs(name: str, catch_up: bool = False, eager_ms: float = 0.0) -> CostCurves:
    """One card's recorded curves as the policy reads them (seconds; the drafter the same at 1..K+1 rows);
    `catch_up`: the drafter catching up on CATCH_UP_ROWS rows priced as the module says (else as its
    K+1-row call, as recorded), `eager_ms` added to it."""
    slope = row_ms(name)
    return CostCurves({b: {t: ms / 1e3 for t, ms in verify.items()} for b, (verify, _) in RECORDED[name].items()},
                      {b: {w: draft / 1e3 for w in range(1, DEPTH + 2)} for b, (_, draft) in RECORDED[name].items()},
                      {b: {CATCH_UP_ROWS: (draft + eager_ms + slope * b * (CATCH_UP_ROWS - DEPTH - 1)) / 1e3}
                       for b, (_, draft) in RECORDED[name].items()} if catch_up else {})


def round_cost(costs: CostCurves, batch: int, drafter_rows: int, width: int) -> float:
    """A round's graph time: the drafter over `drafter_rows` rows per sequence (0: not called; more than
    K+1 after plain rounds: catching up), then the target over `width` tokens."""
    return (costs.draft(batch, drafter_rows) if drafter_rows else 0.0) + costs.verify(batch, width)


def _right_in_a_row(true: tuple[float, ...], sequences: int, positions: int, seed: int) -> list[list[int]]:
    """[sequence][position]: how many drafts made there are right in a row (see the module)."""
    draws = torch.rand(sequences, positions, DEPTH, generator=torch.Generator().manual_seed(seed))
    right = (draws < torch.tensor(true)).int().cumprod(-1).sum(-1)
    return right.tolist()


def recorded_drafts(prompts_rounds: list[list[dict]], new_tokens: int | None = None) -> list[dict]:
    """A real drafter's rounds as `replay` reads them, from `scripts/drafter_calibration.py --save`: per
    prompt, at every position n its plain decoding reached (from the first after the prompt's token), the
    chain's reach p_1 ... p_d its probabilities said ("reach": the whole chain's entry) and how many of its
    drafts were the target's own tokens ("right"); "end": the tokens plain decoding emitted. `new_tokens`
    cuts each to its first ones. -> [{"start", "end", "joint": {n: [D]}, "right": {n: int}}]."""
    drafts = []
    for rounds in prompts_rounds:
        start = min(r["n"] for r in rounds)
        end = min(rounds[0]["end"], start + new_tokens) if new_tokens else rounds[0]["end"]
        drafts.append({"start": start, "end": end, "joint": {r["n"]: r["reach"][-1] for r in rounds},
                       "right": {r["n"]: min(r["right"], end - r["n"] - 1) for r in rounds}})
    return drafts


def replay(policy, costs: CostCurves, batch: int, true=None, claimed=None, prompts: int = 32, new_tokens: int = 128,
           prompt_rows: int = 64, seed: int = 0, recorded: list[dict] | None = None) -> dict:
    """One policy ("goodput", "fixed", or a policy object; None: plain decoding) over `prompts` sequences
    of `new_tokens` tokens, `batch` at a time, at per-depth acceptance `true` with probabilities saying
    `claimed` (None: calibrated); or over a real drafter's `recorded` rounds (`recorded_drafts`: each
    sequence its prompt's positions, claims and drafts right, as recorded). -> {speedup over plain
    decoding, tau, drafted rounds, rounds}."""
    if recorded is None:
        joint = torch.cumprod(torch.tensor(claimed if claimed is not None else tuple(true)), 0).tolist()
        right = _right_in_a_row(tuple(true), prompts, new_tokens + DEPTH + 1, seed)
        sequences = [(0, new_tokens, dict.fromkeys(range(len(r)), joint), dict(enumerate(r))) for r in right]
    else:
        sequences = [(s["start"], s["end"], s["joint"], s["right"]) for s in recorded]
    if isinstance(policy, str):
        policy = make_policy(policy, DEPTH, costs)
    first_drafts = (torch.arange(DEPTH)[None] < torch.arange(DEPTH + 1)[:, None]).float()  # [J+1, D]: S_j keeps d <= j
    widths, parents = list(range(1, DEPTH + 2)), torch.arange(-1, DEPTH - 1).expand(batch, -1)
    spent = plain = rounds = drafted_rounds = tokens = sequence_rounds = 0
    for first in range(0, len(sequences), batch):
        group = sequences[first:first + batch]
        b = len(group)
        n, pending, ends = [s[0] for s in group], [prompt_rows] * b, [s[1] for s in group]
        plain += max(e - s[0] for e, s in zip(ends, group)) * costs.verify(batch, 1)
        if policy is not None:
            policy.start(b)
        learn = getattr(policy, "learn", None)
        as_list = getattr(policy, "live_as_list", False)  # (the live mask as the runtime passes it)
        while any(m < e for m, e in zip(n, ends)):
            alive = [m < e for m, e in zip(n, ends)]
            live = torch.tensor(alive)
            drafted = policy is not None and policy.should_draft(alive if as_list else live)
            if learn is not None:  # (where the runtime runs it: after the round's first launch)
                learn()
            j, accepted, caught_up = 0, [0] * b, 0
            if drafted:
                caught_up = max(p for p, a in zip(pending, alive) if a)
                right = [s[3].get(m, 0) for s, m in zip(group, n)]  # (a finished sequence's: none)
                joint = [s[2].get(m, [0.0] * DEPTH) for s, m in zip(group, n)]
                nodes = [[m + d + 1 if d < r else -1 for d in range(DEPTH)] for m, r in zip(n, right)]
                if policy.verifies_whole_tree:
                    j = DEPTH
                elif hasattr(policy, "choose_chain"):  # as the device round asks it (`runtime._chosen`)
                    j = policy.choose_chain(joint, alive, widths, nodes)
                else:
                    menu = torch.tensor(joint)[:, None, :] * first_drafts  # [B, J+1, D]
                    j = policy.choose(menu, live, widths, (torch.tensor(nodes), parents[:b]))
                accepted = [min(r, j) if a else 0 for r, a in zip(right, alive)]
                drafted_rounds += 1
            spent += round_cost(costs, b, caught_up, j + 1)
            rounds += 1
            sequence_rounds += sum(alive)
            emitted = [list(range(m + 1, m + c + 2)) if a else [] for m, c, a in zip(n, accepted, alive)]
            if policy is not None:
                policy.observe(j, accepted, alive if as_list else live, drafted, emitted)
            pending = [c + 1 if drafted else p + 1 for p, c in zip(pending, accepted)]
            tokens += sum(len(e) for e in emitted)
            n = [m + len(e) for m, e in zip(n, emitted)]
    return {"speedup": plain / spent, "tau": tokens / max(1, sequence_rounds), "drafted": drafted_rounds,
            "rounds": rounds}


def compare(costs: CostCurves, batch: int, true=None, claimed=None, goodput="goodput", **kw) -> dict:
    """goodput's speedup, fixed K's, and goodput over the better of fixed and plain decoding."""
    good, fixed = replay(goodput, costs, batch, true, claimed, **kw), replay("fixed", costs, batch, true, claimed, **kw)
    return {"goodput": good["speedup"], "fixed": fixed["speedup"],
            "vs_best": good["speedup"] / max(1.0, fixed["speedup"]), "drafted": good["drafted"], "rounds": good["rounds"]}
