"""What the model passes operate on: the target and the drafter of one build, as a pair.

Passes that touch both (share_embeddings, fold_fc_norm_into_target) need the pair; the others
work on whichever of the two is present.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eagle_export.models.drafter import Drafter
from eagle_export.models.layers import RMSNorm
from eagle_export.models.target import Target


@dataclass
class EagleModels:
    target: Target | None = None
    drafter: Drafter | None = None

    def present(self) -> list[tuple[str, nn.Module]]:
        return [(name, m) for name, m in (("target", self.target), ("drafter", self.drafter)) if m is not None]

    def stats(self) -> dict[str, int]:
        """Parameters (a shared tensor counted once), their bytes, and torch modules, over both models."""
        params, seen, modules = 0, set(), 0
        nbytes = 0
        for _, model in self.present():
            modules += sum(1 for _ in model.modules())
            for p in model.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params += p.numel()
                    nbytes += p.numel() * p.element_size()
            for b in model.buffers():
                nbytes += b.numel() * b.element_size()
        return {"parameters": params, "bytes": nbytes, "modules": modules}


@torch.no_grad()
def fold_gain(norm: RMSNorm, linears: list[nn.Linear], start: int = 0) -> tuple[int, int]:
    """Scale input columns [start, start+len(gain)) of each linear by the norm's gain, then drop the
    gain: W @ (g * n) == (W * g) @ n column by column. The product is formed in fp32 and rounded
    once to the weight's dtype (fp64 weights: in fp64). Returns (gain elements removed, their bytes)."""
    removed = (norm.weight.numel(), nbytes(norm.weight))
    gain = norm.weight.detach()
    cols = slice(start, start + gain.numel())
    for linear in linears:
        w = linear.weight
        compute = torch.promote_types(w.dtype, torch.float32)  # fp32, or fp64 for an fp64 model
        w[:, cols] = (w[:, cols].to(compute) * gain.to(compute)).to(w.dtype)
    norm.weight = None
    return removed


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
