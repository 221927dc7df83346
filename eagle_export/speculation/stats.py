"""Acceptance statistics of a draft-verify loop, from the drafts accepted in each round.

Shared by the runtime, the torch reference loop, `bench`, `validate` and `diagnose`: plain
arithmetic on lists, so the runtime reads them without loading the reference models.
"""

from __future__ import annotations


def mean_accepted_length(accepted: list[int], empty: float = float("nan")) -> float:
    """tau: mean tokens per round, the accepted drafts plus the target's own token (`empty` for no rounds)."""
    return sum(m + 1 for m in accepted) / len(accepted) if accepted else empty


def acceptance_by_depth(accepted: list[int], depth: int, unreached: float = float("nan"),
                        verified: list[int] | None = None) -> list[float]:
    """For depth i: the fraction of rounds that accepted draft i among those that accepted drafts 1..i-1
    and verified draft i (`verified`: drafts verified per round, all `depth` when None; `unreached`
    where no round got that far)."""
    verified = verified if verified is not None else [depth] * len(accepted)
    rates = []
    for i in range(1, depth + 1):
        reached = sum(m >= i - 1 and k >= i for m, k in zip(accepted, verified))
        rates.append(sum(m >= i for m in accepted) / reached if reached else unreached)
    return rates
