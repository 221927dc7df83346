"""The standard model pipeline (torch level, before quantization) and the registry of every pass.

Order: share_embeddings first (a drafter's duplicate table goes before anything counts it), then
the gain folds, then the fusions (the folds work on fused layers too, so the order between them is
free; folding first keeps each fold a per-projection rewrite), then the vocabulary table.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle_export.errors import EagleExportError

from .base import PassBase, PassManager
from .draft_vocab import ApplyDraftVocab, ShareEmbeddings
from .eagle_models import EagleModels
from .fold_norms import FoldFcNorm, FoldFcNormIntoTarget, FoldNormGains
from .fuse_projections import FuseGateUp, FuseQKV
from .onnx_cleanup import (
    CastCleanupPass,
    CommonSubexpressionEliminationPass,
    ConstantFoldingPass,
    DeadCodeEliminationPass,
    IdentityEliminationPass,
    InitializerDeduplicationPass,
    TopologicalSortPass,
)
from .onnx_pin import PinIrVersionPass, PinOutputShapesPass
from .trt_lint import TensorRTLintPass

__all__ = ["EagleModels", "FC_NORM_PLACEMENTS", "DEFAULT_FC_NORM_PLACEMENT", "PassInfo", "all_passes",
           "model_passes", "model_pipeline"]

FC_NORM_PLACEMENTS = ("drafter", "target")
# Where EAGLE-3.1's gain-free aux normalization runs after its gains fold into fc. "target", by
# scripts/bench_fc_norm_placement.py on the sample-sized pair (1 CPU thread, a loaded 2-core host,
# two runs): the drafter's step 0 becomes one matmul and was the fastest form in every measurement
# (ONNX Runtime, 5 rows: 202 / 406 us vs 234 / 459 us with the gain-free norms kept in the drafter;
# 64 rows: 1215 / 5571 us vs 1505 / 10512 us), while the exported target graph gains no node at all
# (the aux normalization is CSE'd with the next layer's input normalization, same eps). The values
# reaching fc are bit-identical. Without a target in the models, the fold stays in the drafter.
DEFAULT_FC_NORM_PLACEMENT = "target"


def model_passes(fc_norm_placement: str = DEFAULT_FC_NORM_PLACEMENT) -> list[PassBase]:
    if fc_norm_placement not in FC_NORM_PLACEMENTS:
        raise EagleExportError(f"unknown fc_norm placement {fc_norm_placement!r}",
                               f"use one of {', '.join(FC_NORM_PLACEMENTS)}")
    # For "target", fold_fc_norm follows as the fallback: it skips once the norm has moved, and
    # folds in the drafter when there is no target to move it to.
    fc_norm = [FoldFcNormIntoTarget(), FoldFcNorm()] if fc_norm_placement == "target" else [FoldFcNorm()]
    return [ShareEmbeddings(), *fc_norm, FoldNormGains(), FuseQKV(), FuseGateUp(), ApplyDraftVocab()]


def model_pipeline(fc_norm_placement: str = DEFAULT_FC_NORM_PLACEMENT) -> PassManager:
    """The model passes in order; call the result on an EagleModels(target, drafter)."""
    return PassManager(model_passes(fc_norm_placement))


@dataclass(frozen=True)
class PassInfo:
    level: str  # "model" (torch modules) or "onnx" (exported graphs)
    name: str
    summary: str


def _summary(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


# Every pass, in the order `eagle-export passes` lists them: the model passes in pipeline order
# (both fc_norm placements), then the ONNX passes in the clean-up pipeline's order, then the lint.
MODEL_PASSES = (ShareEmbeddings, FoldFcNorm, FoldFcNormIntoTarget, FoldNormGains, FuseQKV, FuseGateUp, ApplyDraftVocab)
ONNX_PASSES = (ConstantFoldingPass, DeadCodeEliminationPass, IdentityEliminationPass, CastCleanupPass,
               InitializerDeduplicationPass, CommonSubexpressionEliminationPass, TopologicalSortPass, PinOutputShapesPass,
               PinIrVersionPass, TensorRTLintPass)


def all_passes() -> list[PassInfo]:
    """Every pass of both levels, with the first line of its docstring."""
    return ([PassInfo("model", c.name, _summary(c)) for c in MODEL_PASSES]
            + [PassInfo("onnx", c.name, _summary(c)) for c in ONNX_PASSES])
