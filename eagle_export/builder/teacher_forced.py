"""Width noise of a quantized target, and the T2 tier of the lossless contract that explains it.

Greedy speculative decoding verifies up to K+1 tokens per target call; plain decoding makes one per
call. An fp32/fp16/bf16 target gives the same tokens either way (checked by equality). A quantized
target's kernels round differently with the call's width (a 1e-6 accumulation difference flips an
activation's FP8 rounding, and the flip grows through the layers), so at a near-tie speculative
decoding may take the other token and go on along its own continuation. What can be exact there
(T1 in `validate.py`) is greedy decoding through the verify graph at width K+1, where a row's result
depends on the call's width only. The graph's attention makes it depend on the row's place too: it
scores a row's keys as [cache view | the call's new keys] and sums probs.V as a cache part plus a
call part, so which of a row's keys come from the cache and which from the call (its row, the call's
past length, the view's masked slots) changes the order of its fp32 sums. An FP8 quantizer absorbs
most such last-bit differences, not all; `position_variance` measures, per build, whether any row
of the runtime's layouts gets other bits (README: the lossless contract). The torch backend on a CPU
is width-invariant (`layers.attend`, `layers.row_linear`): no row differs there, at width 1 either,
so its speculative output is plain decoding's and T2 finds nothing to explain. What parts speculative
output from width-1 decoding is explained here (T2):

    d = the first position where the two outputs differ. The speculative token at d must be
    (a) the argmax of the verify logits at d, recomputed as the speculative run computed them: the
        row that verified d, in a call of its width, after the run's own earlier calls,
    (b) at a near-tie of the width-1 reference: its top-1 minus top-2 logit margin at d below delta,
    (c) within delta of the width-1 reference's top: with r = that top (plain decoding's token) and
        s = the speculative token, gap = l1[r] - l1[s] <= delta, so the width noise can swap them.
    Since l1[second] >= l1[s], margin <= gap: (c) implies (b), and a second choice at a margin below
    delta is the case gap = margin. After d the outputs are different continuations and no claim is made.

delta is measured for each build (`measure_delta`), never chosen: on the calibration prompts,
teacher-forced, every position's logits are computed by calls of width 1 and of width K+1, each
building its own cache (as plain and speculative decoding do). With a, b the width-1 top-2 tokens,

    Delta margin = (l1[a] - l1[b]) - (lK[a] - lK[b]),   delta = p99.9 of |Delta margin|,

so a width-K+1 call can prefer b over a only where the width-1 margin is below |Delta margin|, and
at 99.9% of positions that is below delta. The same holds for any pair: a width-K+1 call can prefer
s over r only where l1[r] - l1[s] is below the change of that gap, which is what (c) bounds by delta
(delta is measured on the top-2 pair, the pair every near-tie involves). A real cache or position
bug diverges where the margin is large and fails (b) and (c).
"""

from __future__ import annotations

import torch

from ..errors import REBUILD, EagleExportError
from ..models import contract as C
from ..models.layers import causal_mask
from ..progress import track
from ..runtime.backends import Backend

# The last this many tokens of each calibration prompt are computed at both widths (the rest of the
# prompt is one prefill shared by both): enough to cross several K+1 chunks, cheap on a CPU.
DELTA_POSITIONS = 24
DELTA_QUANTILE = 0.999


class TargetCalls:
    """Target calls on one sequence through a backend, each appending its new K/V to a cache of
    exactly the tokens seen; returns each call's logits [T, V] in fp32. `width` pads a call with
    filler tokens after its live ones (their rows discarded, never cached), as a verify call whose
    drafts are all rejected has them. `view(past, width)` -> the cache slots a call shows (the
    runtime's view: masked slots after the `past` real ones); None: exactly the real ones."""

    def __init__(self, backend: Backend, cache_shape: tuple[int, int, int], view=None):
        layers, heads, dim = cache_shape
        self.backend, self.view = backend, view
        self.key = torch.zeros(layers, 1, heads, 0, dim, dtype=backend.model_dtype, device=backend.device)
        self.value = torch.zeros_like(self.key)

    def fork(self, past: int | None = None) -> "TargetCalls":
        """A twin over this cache, or over its first `past` positions."""
        twin = TargetCalls.__new__(TargetCalls)
        twin.backend, twin.view = self.backend, self.view
        twin.key, twin.value = self.key[:, :, :, :past], self.value[:, :, :, :past]  # never written in place
        return twin

    def __call__(self, ids: list[int], width: int | None = None) -> torch.Tensor:
        """The live rows' logits [T, V]; refused where the target graph returns none."""
        out = self.outputs(ids, width)
        if C.LOGITS not in out:
            raise EagleExportError("the build's target graph returns no logits, which the width-noise checks "
                                   "(delta, T2) read", f"rebuild it: {REBUILD} (a quantized target's graph "
                                   "returns its logits)")
        return out[C.LOGITS]

    def outputs(self, ids: list[int], width: int | None = None) -> dict[str, torch.Tensor]:
        """The live rows' greedy ids [T] and, where the graph returns them, logits [T, V] in fp32."""
        n, device, live = self.key.shape[3], self.backend.device, len(ids)
        ids = list(ids) + [0] * max(0, (width or live) - live)
        masked = (self.view(n, len(ids)) - n) if self.view else 0
        key, value = (torch.nn.functional.pad(c, (0, 0, 0, masked)) for c in (self.key, self.value))
        feeds = {C.INPUT_IDS: torch.tensor([ids], device=device),
                 C.POSITIONS: torch.arange(n, n + len(ids), device=device)[None],
                 C.PAST_KEY: key, C.PAST_VALUE: value, C.CACHE_LENS: torch.tensor([n], device=device),
                 C.TREE_MASK: causal_mask(1, len(ids), device)}
        out = self.backend.target(feeds, need_logits=True)
        self.key = torch.cat([self.key, out[C.NEW_KEY][:, :, :, :live]], dim=3)
        self.value = torch.cat([self.value, out[C.NEW_VALUE][:, :, :, :live]], dim=3)
        got = {C.GREEDY_IDS: out[C.GREEDY_IDS][0, :live].cpu()}
        if C.LOGITS in out:
            got[C.LOGITS] = out[C.LOGITS][0, :live].float().cpu()
        return got


def margin_shift(narrow: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """[P, V] logits of the same positions at width 1 and K+1 -> [P] Delta margin (module docstring)."""
    a, b = narrow.topk(2, dim=-1).indices.unbind(-1)
    rows = torch.arange(len(narrow))
    return (narrow[rows, a] - narrow[rows, b]) - (wide[rows, a] - wide[rows, b])


@torch.no_grad()
def measure_delta(backend: Backend, cache_shape, prompts: list[list[int]], width: int,
                  positions: int = DELTA_POSITIONS) -> dict:
    """delta for this build's target on this backend (module docstring), from the last `positions`
    tokens of each prompt at call widths 1 and `width` (K+1), with the width noise it comes from."""
    shifts, largest, flips, counted = [], 0.0, 0, 0
    for ids in track(prompts, "delta (call width 1 vs K+1)"):
        start = max(1, len(ids) - positions)
        if start >= len(ids):
            continue
        narrow = TargetCalls(backend, cache_shape)
        narrow(ids[:start])
        wide = narrow.fork()
        rest = ids[start:]
        one = torch.cat([narrow([t]) for t in rest])
        chunked = torch.cat([wide(rest[i:i + width]) for i in range(0, len(rest), width)])
        shifts.append(margin_shift(one, chunked).abs())
        largest = max(largest, float((one - chunked).abs().max()))
        flips += int((one.argmax(-1) != chunked.argmax(-1)).sum())
        counted += len(rest)
    shifts = torch.cat(shifts).double() if shifts else torch.zeros(1, dtype=torch.float64)
    return {"delta": float(torch.quantile(shifts, DELTA_QUANTILE)), "quantile": DELTA_QUANTILE,
            "max_margin_shift": float(shifts.max()), "max_logit_difference": largest, "argmax_flips": flips,
            "widths": [1, width], "prompts": len(prompts), "positions": counted, "backend": backend.name}


@torch.no_grad()
def position_variance(backend: Backend, cache_shape, sequences, width: int, view=None) -> dict:
    """Whether a row's result depends on its place in a width-`width` call, in the call layouts a
    speculative run makes, with the cache shown as the runtime shows it (`view`, as TargetCalls).
    For each (prompt, tokens) of `sequences`, every position p of the tokens is computed
      (r) as row 0 of a call over the p positions before it (the T1 reference's layout), and
      (s) as row p - s of one call over past s holding tokens s..s+width-1, for every s in
          p-width+1..p (a round that accepted p - s drafts),
    the cache before the call from the (r) calls in both. Each (s) row is compared with (r) bit for
    bit: its greedy id, its logits where the graph returns them, and the new K/V it returns at every
    layer (a K/V difference that leaves this row's logits equal still changes every later row). A
    graph without logits is probed on the rest: greedy ids and K/V are all a greedy run reads of a
    call, so equal ones make the same tokens, and logits only show a difference before it flips one.
    -> {"rows": compared, "differing": rows with other bits, "max_logit_difference" (None without
    logits), "max_kv_difference" (|K|+|V| differences), "argmax_flips", "view_slots": [fewest, most]
    shown}; all 0 where the layout does not change the bits."""
    rows = differing = flips = 0
    largest = kv_largest = 0.0
    shown = set()
    has_logits = True
    for prompt, tokens in sequences:
        seq = list(prompt) + list(tokens)
        start = len(prompt)
        reference = TargetCalls(backend, cache_shape, view)
        reference.outputs(prompt)
        steps = [reference.outputs([t], width) for t in seq[start:]]  # (r): position start + i at i
        row0 = {name: torch.cat([o[name] for o in steps]) for name in steps[0]} if steps else {}
        for s in range(start, len(seq)):
            window = seq[s:s + width]
            call = reference.fork(s)
            shown.add(view(s, width) if view else s)
            got = call.outputs(window, width)
            expected = {name: t[s - start:s - start + len(window)] for name, t in row0.items()}
            new_kv = sum((getattr(call, c)[:, :, :, s:] - getattr(reference, c)[:, :, :, s:s + len(window)]).abs()
                         .amax(dim=(0, 1, 2, 4)) for c in ("key", "value"))  # per row: max |dK| + max |dV|
            flipped = got[C.GREEDY_IDS] != expected[C.GREEDY_IDS]
            other = flipped | (new_kv.cpu().float() > 0)
            has_logits = C.LOGITS in got
            if has_logits:
                difference = (got[C.LOGITS] - expected[C.LOGITS]).abs().amax(-1)
                other |= difference > 0
                largest = max(largest, float(difference.max()))
            differing += int(other.sum())
            kv_largest = max(kv_largest, float(new_kv.max()))
            flips += int(flipped.sum())
            rows += len(window)
    return {"rows": rows, "differing": differing, "max_logit_difference": largest if has_logits else None,
            "max_kv_difference": kv_largest, "argmax_flips": flips,
            "view_slots": [min(shown), max(shown)] if shown else None}


def verified_logits(backend: Backend, cache_shape, prompt: list[int], tokens: list[int], accepted: list[int],
                    widths: list[int]):
    """The logits at output position len(tokens) after `prompt` + `tokens` (the speculative output so
    far), from the row of the call that verified it, as the speculative run made its calls: one
    prefill (output 0), then per round r a call of width widths[r] over [the last token, the
    accepted drafts] that commits accepted[r] + 1 rows, its row j giving output start_r + j. A
    tree's accepted path is laid out as a chain, its nodes at the rows of their depths (the run
    records no node order). None where the rounds do not reach that position."""
    calls = TargetCalls(backend, cache_shape)
    logits, start, d = calls(prompt)[-1], 1, len(tokens)
    if d == 0:
        return logits
    for a, width in zip(accepted, widths):
        if d <= start + a:  # verified in this round, at row d - start
            return calls(tokens[start - 1:d], width)[-1]
        calls(tokens[start - 1:start + a], width)
        start += a + 1
    return None


def width1_logits(backend: Backend, cache_shape, prompt: list[int], tokens: list[int]):
    """The logits at position len(tokens) after `prompt` + `tokens`, as plain decoding computes them."""
    calls = TargetCalls(backend, cache_shape)
    logits = calls(prompt)[-1]
    for token in tokens:
        logits = calls([token])[0]
    return logits


@torch.no_grad()
def explain_divergence(backend: Backend, cache_shape, prompt: list[int], spec: list[int], plain: list[int],
                       delta: float, accepted: list[int], widths: list[int]) -> dict:
    """T2 for one prompt (module docstring): d (None: identical), the width-1 margin at d, delta, the
    identical-prefix fraction, the speculative token's gap to the width-1 top and its rank there (1:
    the top), conditions (a) (b) (c) and whether all hold. `accepted`, `widths`: the
    speculative run's rounds (its SequenceStats), so (a) reads the row that verified d."""
    first = agreement(spec, plain)
    d = first["first_divergence"]
    record = {"d": d, "delta": delta, "identical_prefix": (len(plain) if d is None else d) / max(len(plain), 1)}
    if d is None:
        return {**record, "margin": None, "explained": True}
    if d >= len(spec) or d >= len(plain):  # one stopped where the other went on: no token pair to explain
        return {**record, "margin": None, "explained": False, "why": "one output ends where the other goes on"}
    token = spec[d]
    verify = verified_logits(backend, cache_shape, prompt, spec[:d], accepted, widths)
    if verify is None:
        return {**record, "margin": None, "explained": False, "why": "the run's recorded rounds end before d"}
    narrow = width1_logits(backend, cache_shape, prompt, plain[:d])
    top = narrow.topk(2)
    margin = float(top.values[0] - top.values[1])
    gap = float(top.values[0] - narrow[token])
    # (c) once asked for the second choice exactly. Where the width noise is as large as a near-tie's
    # neighbours (NVFP4: delta 5.99), the third choice can be within delta of the top as well, and the
    # noise can lift it over the top as readily as the second; what the noise cannot explain is a gap
    # larger than delta, whatever the rank.
    checks = {"argmax_at_verify_width": int(verify.argmax()) == token, "margin_below_delta": margin <= delta,
              "within_delta_of_top": gap <= delta}
    rank = 1 + int((narrow > narrow[token]).sum())  # 1: the width-1 top, 2: its second choice, ...
    return {**record, "margin": margin, "token": token, "plain_token": plain[d], "gap_to_top": gap,
            "width1_rank": rank, **checks, "explained": all(checks.values())}


def agreement(spec: list[int], plain: list[int]) -> dict:
    """Exact agreement of a speculative output with plain decoding's: where they first part ways
    (None: never) and the fraction of positions holding the same token."""
    first = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b),
                 None if len(spec) == len(plain) else min(len(spec), len(plain)))
    same = sum(a == b for a, b in zip(spec, plain))
    return {"first_divergence": first, "match_fraction": same / max(len(spec), len(plain), 1)}
