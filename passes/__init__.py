"""Graph passes, installed as eagle_export.passes: torch-level model passes and ONNX-level passes."""

from .base import PassBase, PassManager, PassRecord, PassResult, PipelineResult, PostconditionError

__all__ = ["PassBase", "PassManager", "PassRecord", "PassResult", "PipelineResult", "PostconditionError"]
