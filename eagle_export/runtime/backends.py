"""Backends: run the target and drafter graphs by the contract's names, on torch tensors in and out.

torch: the exported torch modules themselves (the reference, and a GPU path); onnxruntime: the
ONNX files (CPU, or the CUDA provider when installed); tensorrt: the engines. The runtime loop is
the same for all three; only `target()` and `drafter()` differ.

This is also the one home for running an exported ONNX file anywhere else (tests, validation, the
quantize command's checks): `ort_session` makes every ONNX Runtime session, `run_onnx` runs one on
torch tensors, and `run_graph` runs a graph file on CPU whatever it holds (NVFP4 graphs, which ONNX
Runtime cannot run, go to onnx.reference with the reference kernel of TensorRT's FP4 quantizer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from ..engine.trt_session import TensorRTSession
from ..errors import REBUILD, EagleExportError
from ..models import contract as C
from ..models.layers import width_invariant
from ..speculation.tree import Speculation, as_tree
from . import exact as exact_mode
from .cuda_graphs import CudaGraphCapture, ShapeGraphs
from .fp4_reference import reference_evaluator

_ORT_TYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16,
              "tensor(int64)": torch.int64, "tensor(int32)": torch.int32, "tensor(bool)": torch.bool}


def ort_session(path, providers=("CPUExecutionProvider",), threads: int | None = None):
    """An ONNX Runtime session for an exported graph, with ORT's graph optimizations on and its QDQ
    fusions off. Those fusions rewrite DequantizeLinear + MatMul into MatMulIntegerToFloat, whose
    kernels reject float8 inputs, and our only Q/DQ graphs are FP8; a graph without Q/DQ nodes is
    optimized as without the setting (bit for bit). FP8 graphs once ran with every optimization
    off instead, which left each call dequantizing every weight: the FP8 sample target took 3.7x as
    long per verify call, while constant folding now dequantizes each weight once, at load (the
    session holds it in fp32: 1.26 GB resident for the sample target instead of 0.40)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    # No spinning: each session owns a thread pool whose workers spin after a run, and the runtime
    # alternates two sessions, so the drafter's spinning workers took the cores the target's workers
    # needed (on 2 cores a 5-token verify cost 2.1x a 1-token step; 1.3x without spinning).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    try:
        return ort.InferenceSession(str(path), options, providers=list(providers))
    except Exception as e:  # ORT raises its own exception types for unreadable files
        raise EagleExportError(f"ONNX Runtime cannot load {Path(path).name}: {str(e).splitlines()[0]}",
                               f"rebuild with {REBUILD} (or export again)") from None


def run_onnx(session, feeds: dict[str, torch.Tensor], output_names: list[str] | None = None
             ) -> dict[str, torch.Tensor]:
    """Run an ONNX Runtime session on CPU torch tensors given by name (names the graph does not take
    are ignored); its outputs (`output_names`, default all) come back as torch tensors in the graph's
    own dtypes. bf16 travels as its bits, as numpy has no bf16."""
    import onnxruntime as ort

    inputs = {}
    for i in session.get_inputs():
        tensor = feeds[i.name].contiguous()
        if tensor.dtype == torch.bfloat16:
            bits = tensor.view(torch.int16).numpy().view(np.uint16)
            inputs[i.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx.TensorProto.BFLOAT16)
        else:
            inputs[i.name] = ort.OrtValue.ortvalue_from_numpy(tensor.numpy())
    names = output_names or [o.name for o in session.get_outputs()]
    out = {}
    for name, value in zip(names, session.run_with_ort_values(names, inputs)):
        if value.data_type() == "tensor(bfloat16)":
            out[name] = torch.from_numpy(value.numpy().view(np.int16).copy()).view(torch.bfloat16)
        else:
            out[name] = torch.from_numpy(value.numpy())
    return out


_NUMPY_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
                torch.int32: np.int32, torch.bool: np.bool_}


def output_shapes(session, feeds: dict[str, torch.Tensor], step_rows: int, nodes: int) -> dict[str, tuple[int, ...]]:
    """Each output's shape for the given inputs, from the session's declared shapes: fixed dims as
    declared, the contract's axes (batch, tokens, past) sized from the inputs. The drafter's new K/V
    rows are its input rows plus `step_rows` (its later steps' rows: K-1 for a chain,
    tree.TreeShape.step_rows for a tree), and its draft outputs hold `nodes` drafts (K for a chain).
    Graphs exported now declare the contract's shapes (`passes.PinOutputShapesPass`); in builds made
    before, a dim the exporter left named but static (new_key's head size comes out as
    'Concatnew_key_dim_4', a dynamic tree's node count as a TopK's) is, for the draft outputs, the
    node count, and otherwise the cache input's at the same position: the new K/V rows have the
    cache's layout."""
    axes, cache = {}, None
    for i in session.get_inputs():
        shape = feeds[i.name].shape
        axes.update({d: shape[j] for j, d in enumerate(i.shape) if isinstance(d, str)})
        cache = shape if i.name == C.PAST_KEY else cache
    if C.TOKENS in axes:
        axes[C.DRAFTER_NEW_ROWS] = axes[C.TOKENS] + step_rows

    def size(output, j, d):
        if isinstance(d, int):
            return d
        if d in axes:
            return axes[d]
        return nodes if output.startswith("draft_") and j == 1 else cache[j]

    return {o.name: tuple(size(o.name, j, d) for j, d in enumerate(o.shape)) for o in session.get_outputs()}


def run_bound(session, feeds: dict[str, torch.Tensor], output_names: list[str], step_rows: int, nodes: int,
              device: str = "cpu") -> dict[str, torch.Tensor]:
    """Run an ONNX Runtime session with IO binding: inputs and outputs are torch tensors on `device`
    bound by address (the provider reads and writes them in place, nothing is copied through numpy),
    outputs allocated here in the graph's dtypes at `output_shapes`. The same path on CPU and CUDA."""
    torch_device = torch.device(device)
    binding = session.io_binding()
    kept = []  # the inputs made contiguous stay alive until the run
    for i in session.get_inputs():
        tensor = feeds[i.name].contiguous()
        dtype = _ORT_TYPES[i.type]
        if tensor.dtype != dtype or tensor.device.type != torch_device.type:
            raise EagleExportError(f"ONNX Runtime input {i.name} is {tensor.dtype} on {tensor.device.type}, the "
                                   f"session takes {dtype} on {torch_device.type}",
                                   "open the build with open_build(), which allocates what its graphs take")
        kept.append(tensor)
        binding.bind_input(i.name, torch_device.type, torch_device.index or 0, _NUMPY_TYPES[dtype],
                           tuple(tensor.shape), tensor.data_ptr())
    types = {o.name: _ORT_TYPES[o.type] for o in session.get_outputs()}
    shapes = output_shapes(session, feeds, step_rows, nodes)
    out = {}
    for name in output_names:
        out[name] = torch.empty(shapes[name], dtype=types[name], device=torch_device)
        binding.bind_output(name, torch_device.type, torch_device.index or 0, _NUMPY_TYPES[types[name]],
                            shapes[name], out[name].data_ptr())
    if torch_device.type == "cuda":  # the runtime wrote the caches on torch's stream; ORT runs on its own
        torch.cuda.current_stream().synchronize()
    session.run_with_iobinding(binding)
    return out


def run_graph(path, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run an exported graph file on CPU: in ONNX Runtime (as `ort_session` sets it up), or, for
    NVFP4 graphs, which ONNX Runtime has no kernels for, in onnx.reference with the
    TRT_FP4DynamicQuantize reference kernel."""
    model = onnx.load(str(path))
    fp4 = (any(t.data_type == onnx.TensorProto.FLOAT4E2M1 for t in model.graph.initializer)
           or any(n.op_type == "TRT_FP4DynamicQuantize" for n in model.graph.node))
    if not fp4:
        return run_onnx(ort_session(path), feeds)
    names = [i.name for i in model.graph.input]
    outputs = reference_evaluator(model).run(None, {n: feeds[n].numpy() for n in names})
    return {o.name: torch.from_numpy(np.asarray(v)) for o, v in zip(model.graph.output, outputs)}


class Backend:
    name = "?"
    device = "cpu"
    cuda_graphs = False  # calls replayed from CUDA graphs: the runtime must keep its caches static
    capture = None  # with cuda_graphs: capture(fn, inputs, warmup) -> (replay, outputs) (cuda_graphs.py)
    exact = False  # bound to the width-invariant kernels (the torch backend's exact mode)

    def __init__(self, speculation: int | Speculation, model_dtype: torch.dtype, has_logits: bool,
                 has_sampling: bool, drafter_dtype: torch.dtype | None = None):
        """speculation: what the drafter graph proposes (tree.Speculation; a bare int K is a chain);
        model_dtype: the target graph's float dtype (its caches, its aux outputs); drafter_dtype: the
        drafter graph's (its caches and aux input), when it differs."""
        self.speculation = as_tree(speculation)
        self.depth, self.model_dtype, self.drafter_dtype = self.speculation.depth, model_dtype, drafter_dtype or model_dtype
        self.num_nodes = self.speculation.num_nodes  # drafts per call (K for a chain)
        self.step_rows = self.speculation.step_rows  # the drafter's new K/V rows after its input rows
        self.verify_width = self.speculation.verify_width  # the widest verify call
        self.has_logits, self.has_sampling = has_logits, has_sampling

    def target(self, feeds: dict[str, torch.Tensor], need_logits: bool = False,
               bound: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The target graph on `feeds` (contract names). `bound`: the names of feeds the caller owns at
        fixed addresses, beside the caches (always bound): tensors it writes only between calls and never
        frees or repurposes while the backend lives (the device round's buffers and the views made once
        of them, `device_round.TARGET_BOUND`). A backend replaying CUDA graphs captures them by reference
        and reads them in place at every replay, instead of copying each into a static clone at every
        call (a launch and host time each, 5-10 us on a GPU). Its invariant (`cuda_graphs.ShapeGraphs`):
        a bound input's address is the one its graph was captured with at every replay, or the call's
        tensor is copied in there (another tensor than at capture: correct, counted as `copied_bound`).
        The other backends read every input in place at every call and ignore it."""
        raise NotImplementedError

    def drafter(self, feeds: dict[str, torch.Tensor], sampling: bool = False, bound: tuple[str, ...] = (),
                into: tuple[tuple[str, torch.Tensor], ...] = ()) -> dict[str, torch.Tensor]:
        """The drafter graph (the sampling one with `sampling`) on `feeds`; `bound` as in `target`
        (`device_round.DRAFTER_BOUND`). `into`: ((output name, tensor), ...), outputs the call also
        writes into tensors the caller keeps as it keeps its bound inputs (a tuple made once: the device
        round's drafts into its verify call's ids, `device_round._RoundBuffers.into`). A backend replaying
        CUDA graphs captures the copies with the call (`cuda_graphs.ShapeGraphs`: no launch of the host's);
        the others copy after the call (`write_into`)."""
        raise NotImplementedError


def write_into(out: dict[str, torch.Tensor], into: tuple[tuple[str, torch.Tensor], ...]) -> dict[str, torch.Tensor]:
    """A call's outputs `out`, those named in `into` copied into its tensors (`Backend.drafter`, eagerly)."""
    for name, dest in into:
        dest.copy_(out[name])
    return out


class TorchBackend(Backend):
    """The exported torch modules. `cuda_graphs`: replay each call of at most K+1 tokens (verify,
    plain steps, the drafter's padded rows) from a CUDA graph captured per input shape and binding (see
    cuda_graphs.py); longer calls (prefill, a drafter catching up) run eagerly. The runtime then
    keeps its caches static: they are bound by reference in every call (`CACHES`), beside the inputs a
    call binds (`Backend.target`). `capture` makes the graphs (default: torch.cuda.CUDAGraph). `exact`: the
    models bound once to the width-invariant kernels (runtime/exact.py): True insists (refused where they
    cannot hold), False keeps torch's kernels, None (the default) binds them on a CUDA GPU wherever
    they hold and says in one line why not where they do not (`exact.resolve`).

    On the CPU the modules are bound to the width-invariant forms (`layers.width_invariant`: Linears
    in fixed-shape GEMMs, the attention core `layers.attend`), so a position gets the same bits as row 0 of a plain
    step and as row j of a verify call, at any batch (DESIGN.md: width invariance)."""

    name = "torch"

    def __init__(self, target_graph, drafter_graph, drafter_sampling_graph=None, device: str = "cpu",
                 cuda_graphs: bool = False, capture=None, exact: bool | None = None):
        target = target_graph.target
        self.exact = exact_mode.resolve(exact, str(device), target, drafter_graph.drafter)
        if self.exact:
            exact_mode.bind(*(g for g in (target_graph, drafter_graph, drafter_sampling_graph) if g is not None))
        super().__init__(drafter_graph.tree, target.embed_tokens.weight.dtype, target_graph.return_logits,
                         drafter_sampling_graph is not None, drafter_graph.drafter.fc.weight.dtype)
        self.device = device
        if torch.device(device).type == "cpu" and not self.exact:  # (exact mode binds its own kernels)
            for graph in (target_graph, drafter_graph, drafter_sampling_graph):
                if graph is not None:
                    width_invariant(graph)
        # Each graph with the contract spec it is exported by: inputs and outputs bind by its names.
        self.graphs = {None: (target_graph,
                              C.target_graph(target.config, len(target.aux_layer_ids), target_graph.return_logits))}
        self.graphs.update({sampling: (graph, C.drafter_graph(graph.drafter.config, graph.tree, sampling))
                            for sampling, graph in ((False, drafter_graph), (True, drafter_sampling_graph))
                            if graph is not None})
        self._output_names = {key: spec.output_names for key, (_, spec) in self.graphs.items()}  # (a property: a list)
        self.cuda_graphs = cuda_graphs
        self.captured = {}  # graph key (None: target, False/True: drafter) -> ShapeGraphs
        self.capture = None  # what captures a graph (the runtime captures its round's bookkeeping with it too)
        if cuda_graphs:
            if capture is None and str(device) != "cuda":
                raise EagleExportError(f"CUDA graphs need a CUDA device, the torch backend runs on {device}",
                                       "run on a machine with a CUDA GPU, or without --cuda-graphs")
            capture = self.capture = capture or CudaGraphCapture()
            self.captured = {key: ShapeGraphs(graph, spec.input_names, self.CACHES, capture,
                                              output_names=spec.output_names)
                             for key, (graph, spec) in self.graphs.items()}

    CACHES = (C.PAST_KEY, C.PAST_VALUE)  # bound in every call: the runtime's static caches (see `Backend.target`)

    def _run(self, key, feeds, bound, into=()):
        """A call: a recent quiet one (a device round's steady state, `ShapeGraphs.quiet`) is its replay alone,
        without inference mode (a replay records nothing for autograd) or a look at its shapes; any other
        runs in inference mode, replayed (a call of at most K+1 tokens: captured on its first) or eagerly."""
        names = self._output_names[key]
        if key in self.captured:
            outputs = self.captured[key].quiet(feeds, bound, into)
            if outputs is not None:
                return dict(zip(names, outputs))
        with torch.inference_mode():
            if key in self.captured and feeds[C.INPUT_IDS].shape[1] <= self.depth + 1:
                return dict(zip(names, self.captured[key](feeds, bound, into)))
            graph, spec = self.graphs[key]
            return write_into(dict(zip(names, graph(*[feeds[name] for name in spec.input_names]))), into)

    def target(self, feeds, need_logits=False, bound=()):
        return self._run(None, feeds, bound)

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        return self._run(sampling, feeds, bound, into)


def check_bound_names(path, session, role: str, outputs=()) -> None:
    """Refuse a graph (a hand-made or foreign one) without an input or output the runtime binds for
    `role` (contract.BOUND_NAMES, and `outputs`), naming what is missing, before any call fails on it."""
    inputs, needed = C.BOUND_NAMES[role]
    has_inputs, has_outputs = {i.name for i in session.get_inputs()}, {o.name for o in session.get_outputs()}
    missing = ([f"input {n}" for n in inputs if n not in has_inputs]
               + [f"output {n}" for n in (*needed, *outputs) if n not in has_outputs])
    if missing:
        raise EagleExportError(f"{Path(path).name} is not a {role} graph eagle-export can run: it has no "
                               + ", ".join(missing), f"export it again: {REBUILD} (or `eagle-export export`)")


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, target_onnx: Path, drafter_onnx: Path, drafter_sampling_onnx: Path | None = None,
                 providers: list[str] | None = None, threads: int | None = None, speculation=None):
        """speculation: what the drafter graph proposes (the build's manifest says); None reads a
        chain's depth from the graph."""
        import onnxruntime as ort

        available = ort.get_available_providers()
        providers = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]

        def session(path):
            return ort_session(path, providers, threads)

        self.target_session, self.drafter_session = session(target_onnx), session(drafter_onnx)
        self.drafter_sampling_session = session(drafter_sampling_onnx) if drafter_sampling_onnx else None
        check_bound_names(target_onnx, self.target_session, "target")
        tree = speculation is not None and not as_tree(speculation).is_chain
        for path, graph in ((drafter_onnx, self.drafter_session), (drafter_sampling_onnx, self.drafter_sampling_session)):
            if graph is not None:
                check_bound_names(path, graph, "drafter", (C.DRAFT_PARENTS,) if tree else ())  # (else read as a chain)
        for path, graph, sampling in ((drafter_onnx, self.drafter_session, False),
                                      (drafter_sampling_onnx, self.drafter_sampling_session, True)):
            if graph is not None and sampling != any(i.name == C.TEMPERATURE for i in graph.get_inputs()):
                raise EagleExportError(f"{path} is a {'greedy' if sampling else 'sampling'} drafter graph, given "
                                       f"where the {'sampling' if sampling else 'greedy'} one goes",
                                       "pass the greedy drafter.onnx as the drafter and drafter_sampling.onnx "
                                       "as the sampling drafter (`export --sampling` writes both)")
        target_outputs = [o.name for o in self.target_session.get_outputs()]
        past, drafter_past = (next(i for i in s.get_inputs() if i.name == C.PAST_KEY)
                              for s in (self.target_session, self.drafter_session))
        if "tensor(bfloat16)" in (past.type, drafter_past.type):
            raise EagleExportError("ONNX Runtime's CPU provider cannot feed bfloat16 graphs from numpy",
                                   "build with precision fp32 or fp16 for ONNX Runtime, or use --backend torch")
        speculation = speculation or int(self.drafter_session.get_outputs()[0].shape[1])
        super().__init__(speculation, _ORT_TYPES[past.type],
                         C.LOGITS in target_outputs, self.drafter_sampling_session is not None,
                         _ORT_TYPES[drafter_past.type])
        # The providers the sessions got, not those asked for: ORT drops the CUDA provider, with only
        # a warning, when its CUDA libraries do not load, and runs on the CPU.
        self.providers = self.target_session.get_providers()
        self.device = provider_device(self.providers)
        if provider_device(self.drafter_session.get_providers()) != self.device:
            raise EagleExportError(f"ONNX Runtime put the target graph on {self.device} and the drafter graph "
                                   f"elsewhere ({self.drafter_session.get_providers()})",
                                   "pass providers=['CPUExecutionProvider'] to run both on the CPU")

    def target(self, feeds, need_logits=False, bound=()):
        names = [o.name for o in self.target_session.get_outputs() if need_logits or o.name != C.LOGITS]
        return run_bound(self.target_session, feeds, names, self.step_rows, self.num_nodes, self.device)

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        session = self.drafter_sampling_session if sampling else self.drafter_session
        return write_into(run_bound(session, feeds, [o.name for o in session.get_outputs()], self.step_rows,
                                    self.num_nodes, self.device), into)


def provider_device(providers: list[str]) -> str:
    """Where a session's tensors live, from the providers it runs with (session.get_providers())."""
    return "cuda" if providers and providers[0] == "CUDAExecutionProvider" else "cpu"


class TensorRTBackend(Backend):
    """Engines bound by name; profile 0 serves prefill, profile 1 decode (see engine.engine_profiles)."""

    name = "tensorrt"
    device = "cuda"

    def __init__(self, target_engine: Path, drafter_engine: Path, speculation, has_logits: bool):
        self.target_session, self.drafter_session = TensorRTSession(target_engine), TensorRTSession(drafter_engine)
        # The caches are allocated in the dtypes the engines take (checked again at every call).
        super().__init__(speculation, self.target_session.dtypes[C.PAST_KEY], has_logits, has_sampling=False,
                         drafter_dtype=self.drafter_session.dtypes[C.PAST_KEY])
        # The widest verify call (a tree's root and nodes): what the target's decode profile was built for.
        self.verify_width = int(self.target_session.engine.get_tensor_profile_shape(C.INPUT_IDS, 1)[2][1])

    def _profile(self, feeds, graph):
        """Profile 1 (decode) for calls up to its widest: a verify call, or the drafter's K+1 rows."""
        widest = self.verify_width if graph == "target" else self.depth + 1
        return 1 if feeds[C.INPUT_IDS].shape[1] <= widest else 0

    def target(self, feeds, need_logits=False, bound=()):
        return self.target_session.run(dict(feeds), self._profile(feeds, "target"))

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        return write_into(self.drafter_session.run(dict(feeds), self._profile(feeds, "drafter")), into)
