"""TensorRT engines: the decisions as pure functions, the API calls as thin, linear wrappers.

Everything a build decides (optimization profiles, engine file names, whether an engine fits this
GPU and TensorRT) is computed here without TensorRT and unit-tested on any machine. The wrapper at
the bottom only translates those decisions into TensorRT 10.x calls (strongly typed networks, so no
precision flags: the ONNX graph's explicit casts and Q/DQ nodes decide every layer's type). Running
an engine is the runtime's part: `trt_session.TensorRTSession`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import REBUILD, EagleExportError
from ..models.contract import BATCH, DRAFTER_NEW_ROWS, PAST, TOKENS, GraphSpec
from ..speculation.tree import Speculation

# A cache view always has at least one slot (masked out by cache_lens when empty), so no profile
# has to cover zero-length tensors.
MIN_PAST = 1


@dataclass(frozen=True)
class Engine:
    """One entry of manifest.engines: a TensorRT engine for one graph, GPU and TensorRT release."""
    graph: str
    file: str
    tensorrt: str
    compute_capability: str
    gpu: str = "?"


def axis_ranges(speculation: Speculation, profiles: dict, graph: str, phase: str) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of every dynamic axis for one optimization profile; `profiles` is a recipe's
    `profiles` block (batch and context ranges).

    target/prefill: the prompt (tokens up to the context); target/decode: a verify call, up to
    `speculation.verify_width` tokens; drafter/prefill: the prompt's rows; drafter/decode: W <= depth+1
    newly accepted rows (an accepted path and the target's token). The drafter's new K/V rows are its
    input rows plus `speculation.step_rows`."""
    batch = profiles["batch"]
    ctx = profiles["context"]
    decode_tokens = speculation.verify_width if graph == "target" else speculation.depth + 1
    ranges = {BATCH: (batch["min"], batch["opt"], batch["max"])}
    if phase == "prefill":
        ranges[TOKENS] = (1, min(ctx["opt"], ctx["max"]), ctx["max"])
        # The runtime's caches grow to at most context.max slots (cache_step rounding is capped
        # there), and the prefill call may already get that many: every profile reaches it.
        ranges[PAST] = (MIN_PAST, MIN_PAST, ctx["max"])
    elif phase == "decode":
        ranges[TOKENS] = (1, decode_tokens, decode_tokens)
        ranges[PAST] = (MIN_PAST, ctx["opt"], ctx["max"])
    else:
        raise ValueError(f"unknown phase {phase!r}")
    if graph == "drafter":
        lo, opt, hi = ranges[TOKENS]
        extra = speculation.step_rows
        ranges[DRAFTER_NEW_ROWS] = (lo + extra, opt + extra, hi + extra)
    return ranges


def profile_shapes(spec: GraphSpec, ranges: dict[str, tuple[int, int, int]]) -> dict[str, tuple]:
    """Input name -> (min, opt, max) shapes, for inputs with a dynamic axis."""
    shapes = {}
    for t in spec.inputs:
        if not t.dynamic_axes:
            continue
        missing = [a for a in t.dynamic_axes.values() if a not in ranges]
        if missing:
            raise ValueError(f"no range for axes {missing} of input {t.name}")
        shapes[t.name] = tuple(tuple(ranges[d][i] if isinstance(d, str) else d for d in t.shape)
                               for i in range(3))
    return shapes


def engine_profiles(spec: GraphSpec, speculation: Speculation, profiles: dict, graph: str) -> list[dict[str, tuple]]:
    """Profile 0 serves prefill, profile 1 decode; the runtime picks by phase."""
    return [profile_shapes(spec, axis_ranges(speculation, profiles, graph, phase)) for phase in ("prefill", "decode")]


def engine_file_name(graph: str, compute_capability: str, trt_version: str) -> str:
    """An engine is valid for one GPU architecture and one TensorRT release: both go in the name."""
    sm = compute_capability.replace(".", "")
    trt = ".".join(trt_version.split(".")[:2])
    return f"{graph}.sm{sm}.trt{trt}.engine"


def engine_compatibility_problems(meta: Engine, compute_capability: str | None, trt_version: str | None) -> list[str]:
    """Why an engine recorded in a manifest cannot run here; empty when it can."""
    problems = []
    if trt_version is None:
        problems.append("TensorRT is not installed")
    elif meta.tensorrt.split(".")[:2] != trt_version.split(".")[:2]:
        problems.append(f"built with TensorRT {meta.tensorrt}, this machine has {trt_version}")
    if compute_capability is None:
        problems.append("no CUDA GPU")
    elif meta.compute_capability != compute_capability:
        problems.append(f"built for compute capability {meta.compute_capability} ({meta.gpu}), "
                        f"this GPU has {compute_capability}")
    return problems


def pick_engine(engines: list[Engine], compute_capability: str | None, trt_version: str | None) -> Engine:
    """The manifest's engine entry that fits this machine, or an error listing why none does."""
    reasons = []
    for meta in engines:
        problems = engine_compatibility_problems(meta, compute_capability, trt_version)
        if not problems:
            return meta
        reasons.append(f"{meta.file}: {'; '.join(problems)}")
    raise EagleExportError("no engine in this build fits this machine: " + " | ".join(reasons) if reasons
                           else "this build has no TensorRT engines",
                           f"rebuild the engines here with {REBUILD}, or use --backend onnxruntime")


# ---------------------------------------------------------------- TensorRT API (thin)

def build_engine(onnx_path: Path, engine_path: Path, profiles: list[dict[str, tuple]],
                 workspace_bytes: int, timing_cache_path: Path | None = None) -> None:
    """Parse a strongly typed ONNX graph and serialize an engine with the given profiles."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        lines = [f"node {e.node_name() or e.node()} ({e.node_operator()}): {e.desc()}" for e in errors]
        raise EagleExportError(f"TensorRT cannot parse {onnx_path.name}:\n  " + "\n  ".join(lines),
                               "run `eagle-export export` and check its trt_lint report for these nodes")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    # Layer details (precisions, tactics) for the engine inspector (`selftest --gpu` reads FP8 layers there).
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    cache_bytes = timing_cache_path.read_bytes() if timing_cache_path and timing_cache_path.is_file() else b""
    timing_cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(timing_cache, ignore_mismatch=False)
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EagleExportError(f"TensorRT failed to build an engine from {onnx_path.name} (see its log above)",
                               "lower profiles.context.max or profiles.batch.max, or raise engine.workspace_gib")
    engine_path.write_bytes(bytes(serialized))
    if timing_cache_path is not None:
        timing_cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
