"""Loading a target-drafter pair as `build` makes it: one path for every command that needs the pair.

load the target -> load the drafter against it (checked to fit, sharing its embedding table) -> point
the target's aux layers at the states the drafter was trained on -> the model passes (fold norm
gains, fuse q/k/v and gate/up, ...), which change no output (each pass is translation-validated)
but do change what quantization calibrates and what a graph holds (one weight scale for a fused
q/k/v, not three).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from ..models.checkpoint import load_drafter, load_target
from ..models.drafter import Drafter
from ..models.target import Target
from ..passes.base import PassBase, PassManager, PassRecord
from ..passes.model_pipeline import EagleModels, model_passes
from .heap import keep_large_blocks_in_heap, release_freed_memory, return_large_blocks_at_once


def passes_skipping(skip: Iterable[str]) -> list[PassBase]:
    """The standard model passes (build's order) less those named in `skip` (a recipe's passes.skip)."""
    skip = set(skip)
    return [p for p in model_passes() if p.name not in skip]


def prepare_pair(target: Target, drafter: Drafter | None, passes: Iterable[PassBase] | None = None,
                 aux_layer_ids: Iterable[int] | None = None) -> list[PassRecord]:
    """Point the target's aux layers at the drafter's (`aux_layer_ids`, e.g. a build's recorded ids,
    overrides the drafter's config; no drafter keeps the target's own), then run `passes` on the pair
    (None: every model pass, as `build` runs them; an empty list: none). Returns what each pass did."""
    if aux_layer_ids is not None:
        target.aux_layer_ids = tuple(aux_layer_ids)
    elif drafter is not None:
        target.aux_layer_ids = tuple(drafter.config.resolved_aux_layer_ids(target.config))
    pipeline = PassManager(model_passes() if passes is None else list(passes))
    return pipeline(EagleModels(target, drafter)).records


def load_pair(target_dir: str | Path, drafter_dir: str | Path | None, dtype: str | torch.dtype | None,
              passes: Iterable[PassBase] | None = None, drafter_dtype: str | torch.dtype | None = None,
              aux_layer_ids: Iterable[int] | None = None) -> tuple[Target, Drafter | None]:
    """The target (in `dtype`; None: its checkpoint's own) and the drafter (in `drafter_dtype`; None:
    the target's dtype as loaded, since the drafter reads the target's aux states), then
    `prepare_pair(target, drafter, passes, aux_layer_ids)`. No `drafter_dir`: the target alone, through
    the passes that apply to it. Loaded with every block of 1 MiB or more its own mapping and trimmed
    after (`return_large_blocks_at_once`, `release_freed_memory`): measured on a Qwen3-1.7B-shaped fp16
    pair, the passes' peak 4.27 GiB instead of 5.63, and 3.77 GiB resident after, not 5.63."""
    return_large_blocks_at_once()  # the weights the passes fuse go back to the system as they are freed
    target = load_target(target_dir, dtype=dtype)
    drafter = None
    if drafter_dir is not None:
        drafter_dtype = drafter_dtype if drafter_dtype is not None else target.embed_tokens.weight.dtype
        drafter = load_drafter(drafter_dir, target=target, dtype=drafter_dtype)
    prepare_pair(target, drafter, passes, aux_layer_ids)
    release_freed_memory()
    keep_large_blocks_in_heap()  # what comes next (forward passes) allocates and frees large blocks
    return target, drafter
