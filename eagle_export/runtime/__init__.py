"""The draft-verify loop over a build's graphs: `SpeculativeRuntime` on a `Backend` (ONNX Runtime,
TensorRT, torch), `GenerationConfig` per request. `eagle_export.build.build_dir.open_build` makes
one from a build directory."""

from .runtime import GenerationConfig, PairShapes, SpeculativeRuntime

__all__ = ["GenerationConfig", "PairShapes", "SpeculativeRuntime"]
