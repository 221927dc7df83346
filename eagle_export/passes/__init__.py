"""Graph passes, installed as eagle_export.passes: torch-level model passes and ONNX-level passes."""

from .base import PassBase, PassManager, PassRecord, PassResult, PipelineResult, PostconditionError

__all__ = ["PassBase", "PassManager", "PassRecord", "PassResult", "PipelineResult", "PostconditionError"]

# ONNX-level passes (onnx_ir models) and the TensorRT-readiness lint.
from .onnx_cleanup import (
    CastCleanupPass,
    CommonSubexpressionEliminationPass,
    ConstantFoldingPass,
    DeadCodeEliminationPass,
    IdentityEliminationPass,
    InitializerDeduplicationPass,
    TopologicalSortPass,
    onnx_pipeline,
)
from .onnx_pin import ONNX_IR_VERSION, PinIrVersionPass, PinOutputShapesPass
from .trt_lint import Finding, LintReport, TensorRTLintPass, lint_model

__all__ += [
    "CastCleanupPass", "CommonSubexpressionEliminationPass", "ConstantFoldingPass",
    "DeadCodeEliminationPass", "IdentityEliminationPass", "InitializerDeduplicationPass",
    "TopologicalSortPass", "onnx_pipeline", "ONNX_IR_VERSION", "PinIrVersionPass", "PinOutputShapesPass",
    "Finding", "LintReport", "TensorRTLintPass", "lint_model",
]
