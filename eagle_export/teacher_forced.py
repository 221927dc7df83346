"""The lossless contract of a quantized target, checked by teacher forcing.

Greedy speculative decoding verifies up to K+1 tokens per target call; plain decoding makes one per
call. An fp32/fp16/bf16 target gives the same tokens either way (that contract is checked by
equality). A quantized target's kernels round differently with the call's width, so at a near-tie
speculative decoding may take the other token and go on along its own, equally valid, continuation.
Its contract is per token instead:

    run the target one token at a time over the speculative output's own prefix; every emitted
    token is that call's argmax, or its logit is within `eps` of the argmax's.

`eps` is measured for each build (`measure_eps`), never chosen: on calibration prompts the logits
of the same positions are computed by calls of width 1 and by calls of width K+1, each building its
own cache (as plain and speculative decoding do), and

    eps = SAFETY_FACTOR * max |logit(width 1) - logit(width K+1)|,

SAFETY_FACTOR = 2 * 2: an emitted token beats the argmax in the wide call while both their logits
move by at most the difference, so its margin in the narrow call is at most twice it; and twice
again for positions the calibration prompts did not show. An eps above the 10th percentile of the
target's own top-2 margins would excuse one token in ten: such a build is too noisy to verify.

Both the measurement and the check run the target through the build's backend with a cache of
exactly the tokens seen (their own, not the runtime's), so a runtime bug (a cache row written at the
wrong offset, a draft accepted that the target did not choose) shows as a token outside the contract.
"""

from __future__ import annotations

import torch

from . import contract as C
from .backends import Backend
from .layers import causal_mask
from .progress import track

SAFETY_FACTOR = 4.0
# The last this many tokens of each calibration prompt are computed at both widths (the rest of the
# prompt is one prefill shared by both): enough to cross several K+1 chunks, cheap on a CPU.
EPS_POSITIONS = 24
MARGIN_PERCENTILE = 10


class TargetCalls:
    """Target calls on one sequence through a backend, each appending its new K/V to a cache of
    exactly the tokens seen; returns each call's logits [T, V] in fp32."""

    def __init__(self, backend: Backend, cache_shape: tuple[int, int, int]):
        layers, heads, dim = cache_shape
        self.backend = backend
        self.key = torch.zeros(layers, 1, heads, 0, dim, dtype=backend.model_dtype, device=backend.device)
        self.value = torch.zeros_like(self.key)

    def fork(self) -> "TargetCalls":
        twin = TargetCalls.__new__(TargetCalls)
        twin.backend, twin.key, twin.value = self.backend, self.key, self.value  # never written in place
        return twin

    def __call__(self, ids: list[int]) -> torch.Tensor:
        n, device = self.key.shape[3], self.backend.device
        feeds = {C.INPUT_IDS: torch.tensor([ids], device=device),
                 C.POSITIONS: torch.arange(n, n + len(ids), device=device)[None],
                 C.PAST_KEY: self.key, C.PAST_VALUE: self.value, C.CACHE_LENS: torch.tensor([n], device=device),
                 C.TREE_MASK: causal_mask(1, len(ids), device)}
        out = self.backend.target(feeds, need_logits=True)
        self.key = torch.cat([self.key, out[C.NEW_KEY]], dim=3)
        self.value = torch.cat([self.value, out[C.NEW_VALUE]], dim=3)
        return out[C.LOGITS][0].float().cpu()


@torch.no_grad()
def measure_eps(backend: Backend, cache_shape, prompts: list[list[int]], depth: int,
                positions: int = EPS_POSITIONS) -> dict:
    """eps for this build's target on this backend (see the module docstring), from the last
    `positions` tokens of each prompt at call widths 1 and depth+1."""
    largest, counted = 0.0, 0
    for ids in track(prompts, "eps (call width 1 vs K+1)"):
        start = max(1, len(ids) - positions)
        if start >= len(ids):
            continue
        narrow = TargetCalls(backend, cache_shape)
        narrow(ids[:start])
        wide = narrow.fork()
        rest = ids[start:]
        one = torch.cat([narrow([t]) for t in rest])
        chunked = torch.cat([wide(rest[i:i + depth + 1]) for i in range(0, len(rest), depth + 1)])
        largest = max(largest, float((one - chunked).abs().max()))
        counted += len(rest)
    return {"eps": SAFETY_FACTOR * largest, "max_logit_difference": largest, "safety_factor": SAFETY_FACTOR,
            "widths": [1, depth + 1], "prompts": len(prompts), "positions": counted, "backend": backend.name}


@torch.no_grad()
def teacher_forced(backend: Backend, cache_shape, prompt: list[int], tokens: list[int], eps: float) -> dict:
    """Every emitted token against the width-1 target call over the prompt and the tokens before it.
    Returns the near-tie exceptions (not the argmax, margin <= eps), the violations (margin > eps),
    and every call's top-2 margin."""
    calls = TargetCalls(backend, cache_shape)
    logits = calls(prompt)[-1]
    exceptions, violations, margins = [], [], []
    for i, token in enumerate(tokens):
        if i:
            logits = calls([tokens[i - 1]])[0]
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        best = int(logits.argmax())
        if token != best:
            gap = float(logits[best] - logits[token])
            (exceptions if gap <= eps else violations).append(
                {"index": i, "token": token, "argmax": best, "margin": gap})
    return {"exceptions": exceptions, "violations": violations, "margins": margins}


def agreement(spec: list[int], plain: list[int]) -> dict:
    """Exact agreement of a speculative output with plain decoding's: where they first part ways
    (None: never) and the fraction of positions holding the same token."""
    first = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b),
                 None if len(spec) == len(plain) else min(len(spec), len(plain)))
    same = sum(a == b for a, b in zip(spec, plain))
    return {"first_divergence": first, "match_fraction": same / max(len(spec), len(plain), 1)}


def margin_percentile(margins: list[float], percentile: float = MARGIN_PERCENTILE) -> float:
    return float(torch.quantile(torch.tensor(margins, dtype=torch.float64), percentile / 100))
