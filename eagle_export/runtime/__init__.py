"""The draft-verify loop over a build's graphs: `SpeculativeRuntime` on a `Backend` (ONNX Runtime,
TensorRT, torch), `GenerationConfig` per request. `eagle_export.builder.build_dir.open_build` makes
one from a build directory.

The three names are read from `runtime.runtime` on first use, not at import: commands that read a
build's manifest import `runtime.costs` (the cost cache's file name) and must not load torch."""

__all__ = ["GenerationConfig", "PairShapes", "SpeculativeRuntime"]


def __getattr__(name: str):
    if name in __all__:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
