"""TensorRT engines: the decisions as pure functions, the API calls as thin, linear wrappers.

Everything a build decides (optimization profiles, engine file names, whether an engine fits this
GPU and TensorRT) is computed here without TensorRT and unit-tested on any machine. The wrappers at
the bottom only translate those decisions into TensorRT 10.x calls (strongly typed networks, so no
precision flags: the ONNX graph's explicit casts and Q/DQ nodes decide every layer's type).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .contract import BATCH, DRAFT_NEW_TOKENS, PAST, TOKENS, GraphSpec
from .errors import EagleExportError
from .manifest import Engine
from .tree import Speculation

# A cache view always has at least one slot (masked out by cache_lens when empty), so no profile
# has to cover zero-length tensors.
MIN_PAST = 1


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
        ranges[DRAFT_NEW_TOKENS] = (lo + extra, opt + extra, hi + extra)
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
                           "rebuild the engines here with `eagle-export build --force`, or use --backend onnxruntime")


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


class TensorRTSession:
    """An engine bound by the contract's tensor names. run() takes torch tensors in the engine's own
    dtypes on its own devices (CUDA for every tensor of our graphs), and enqueues on torch's current
    CUDA stream: the runtime writes the caches there, so the engine reads them after those writes
    without any synchronization, and torch reads the outputs after the engine wrote them."""

    def __init__(self, engine_path: Path):
        import tensorrt as trt

        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise EagleExportError(f"TensorRT cannot load {engine_path.name} (another TensorRT version or GPU, "
                                   "or a corrupt file)", "rebuild it here with `eagle-export build --force`")
        self.name = engine_path.name
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: _TORCH_DTYPES[self.engine.get_tensor_dtype(n).name] for n in names}
        self.devices = {n: "cuda" if self.engine.get_tensor_location(n) == trt.TensorLocation.DEVICE else "cpu"
                        for n in names}
        self.profile = None  # the optimization profile the context is set to

    def run(self, feeds: dict, profile: int = 0) -> dict:
        """Bind `feeds` (input name -> tensor; kept alive in the dict until enqueued), allocate the
        outputs and enqueue the engine on torch's current stream; returns the outputs by name."""
        stream = torch.cuda.current_stream().cuda_stream
        if profile != self.profile:
            if not self.context.set_optimization_profile_async(profile, stream):
                raise EagleExportError(f"{self.name} has no optimization profile {profile}",
                                       "rebuild the engines with `eagle-export build --force`")
            self.profile = profile
        for name in self.inputs:
            if name not in feeds:
                raise EagleExportError(f"{self.name} takes an input {name!r} that was not given",
                                       "this build's engines do not match this eagle-export: rebuild with --force")
            tensor = feeds[name] = self._checked(name, feeds[name].contiguous())
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                lo, _, hi = (tuple(d) for d in self.engine.get_tensor_profile_shape(name, profile))
                raise EagleExportError(
                    f"{self.name}: input {name} has shape {tuple(tensor.shape)}, outside optimization profile "
                    f"{profile} (min {lo}, max {hi})",
                    "keep batches within profiles.batch.max and prompt plus new tokens within profiles.context.max, "
                    "or rebuild with larger profiles (`eagle-export build --set profiles.context.max=N --force`)")
            self._bind(name, tensor)
        outputs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.devices[name])
            self._bind(name, outputs[name])
        if not self.context.execute_async_v3(stream):
            raise EagleExportError(f"TensorRT failed to run {self.name} (see its log above)",
                                   "run `eagle-export doctor` and report its output with this line")
        return outputs

    def _checked(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor bound by address must be of the engine's dtype and on its device: TensorRT reads
        the bytes, so any other would be read as garbage, or its address fault."""
        dtype, device = self.dtypes[name], self.devices[name]
        if tensor.dtype != dtype or tensor.device.type != device:
            raise EagleExportError(f"{self.name}: input {name} is {tensor.dtype} on {tensor.device.type}, "
                                   f"the engine takes {dtype} on {device}",
                                   "open the build with open_build(), which allocates what its engines take; "
                                   "calling a session directly, convert with tensor.to(dtype, device)")
        return tensor

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_tensor_address(name, tensor.data_ptr()):
            raise EagleExportError(f"TensorRT refused the address of {self.name}'s {name} "
                                   f"({tuple(tensor.shape)} {tensor.dtype} on {tensor.device})",
                                   "this is a bug in eagle-export's TensorRT binding: report it with this line")


# TensorRT's DataType member names -> torch dtypes.
_TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
                 "INT64": torch.int64, "INT32": torch.int32, "BOOL": torch.bool}
