"""CUDA graphs over the torch backend's fixed shapes: its fast path on a GPU without TensorRT.

A decoding round launches hundreds of small kernels; at batch 1 the GPU waits on Python between
them. A CUDA graph records one call's kernels once and replays them in one launch, as vLLM and
gpt-fast do. A graph replays the memory it was captured with, so:
  - one graph per input shape (and binding, below), captured lazily on its first call (the runtime keeps
    the shapes few: verify widths T = 1..K+1, the drafter's rows padded to K+1, caches at the context limit);
  - an input is read by reference (bound: the graph is captured reading the caller's own tensor) or
    from the graph's own clone, into which every call copies it. The caches are always bound: the
    runtime writes them between replays and they are never copied. A caller binds more of its inputs
    where it keeps them at fixed addresses for as long as the graphs live (a device round's buffers,
    `device_round._RoundBuffers`), so its steady-state round copies nothing; other callers' fresh tensors
    of the same shapes (a cost measurement, a short prefill, the general round) replay graphs of their
    own, with clones. A bound input's address is the captured one at every replay, or it is copied in
    (a call given another tensor than at capture: correct, counted as `copied_bound`), into the tensor
    the graph was captured over: callers sharing one backend's graphs (two runtimes over one backend)
    take turns, a stream at a time;
  - outputs are static buffers too, overwritten by the next replay of the same graph: the runtime
    consumes them (commits K/V rows, copies ids to the host) before that, or has the graph copy one into
    a tensor of its own (`into`: the copy is captured with the call, so it costs the host no launch; a
    device round's drafts into its verify call's ids), a destination bound like an input: the captured
    one at every replay, or copied out of it (counted as `copied_bound`).
The capture itself is the only CUDA-only code (`CudaGraphCapture`, written against the documented
torch.cuda.CUDAGraph API: warm-up on a side stream, then capture, all graphs in one memory pool);
the bookkeeping above is tested on CPU with a capture that replays eagerly into the same buffers.

The runtime captures one function of its own the same way: a device round's bookkeeping (acceptance,
cache commits, the next drafter rows; `device_round._settle_round`), which writes the runtime's state in
place. A capture runs its function eagerly a few times first (the warm-up), so a function with side
effects names warm-up inputs under which it changes nothing that is read later (`warmup`). What a
capture can hold is checked on CPU by `check_capturable`: no host read, no host data, no op whose
output shape depends on the data (a graph replays fixed shapes, and a host read inside a capture fails).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import EagleExportError

WARMUP = 3  # eager calls on a side stream before a capture (cuBLAS handles, lazy inits), as torch's docs do
RECENT = 16  # sets of input tensors a ShapeGraphs knows without looking at their shapes (see __call__)


class CudaGraphCapture:
    """capture(fn, inputs) -> (replay, outputs) on the current CUDA device. All graphs of one backend
    share a memory pool: they run one at a time on one stream, so their intermediates may share memory."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable, inputs: list[torch.Tensor], warmup: list[torch.Tensor] | None = None):
        """warmup: the inputs of the eager warm-up calls (default `inputs`): a capture records without
        running, the warm-up runs, so a function that writes its inputs warms up on ones it leaves as they were."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn(*(inputs if warmup is None else warmup))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*inputs)
        return graph.replay, outputs


class ShapeGraphs:
    """A module called by input name, one captured graph per (inputs bound by reference, input shapes, the
    bound inputs' strides, the outputs a call writes `into` its own tensors). `bound` names the inputs
    every call binds (the caches); a call may bind more of its own (`__call__`). A bound input is
    captured as the caller's tensor itself, which the graph holds (so its memory is never freed while
    the graph lives) and reads in place at every replay; every other input is the graph's own clone,
    copied into at every call. The invariant: a bound input's address at every replay of a graph is the
    one it was captured with, or the call's tensor is copied in there (another tensor of the same layout
    than at capture: correct, counted as `copied_bound`). The bound inputs' strides are part of the key
    because the graph reads them in place: buffers regrown with another row stride
    (`device_round._RoundBuffers.fit`) get a graph of their own. `warmup` maps a capture's inputs to
    those its warm-up calls get (None: the same; see CudaGraphCapture). `by_address`: the bound inputs'
    addresses are part of the key too, so a bound input is never copied in (another tensor gets a graph
    of its own): for a function that writes its bound inputs in place (a device round's bookkeeping),
    whose writes would otherwise land in the captured tensor and not in the caller's. `output_names`:
    what a call's `into` names the outputs by."""

    def __init__(self, fn: Callable, input_names: list[str], bound: tuple[str, ...], capture: Callable,
                 warmup: Callable | None = None, by_address: bool = False, output_names: list[str] = ()):
        self.fn, self.input_names, self.bound, self.capture, self.warmup = fn, input_names, bound, capture, warmup
        self.by_address, self.output_names = by_address, list(output_names)
        # (which are bound, shapes, bound layouts, `into`'s names and layouts) -> (static inputs, replay, outputs,
        # the destinations captured)
        self.graphs: dict[tuple, tuple] = {}
        self.copied_bound = 0  # bound inputs (destinations) copied in (out): another tensor than at capture
        self._recent = {}  # the last calls' (names bound, id of `into`, ids of inputs) -> (inputs, `into`, graph, refs)

    def keys(self) -> set[tuple[int, int]]:
        """(batch, width) of every captured graph: the first input's shape (input_ids [B, T])."""
        return {tuple(key[1][0]) for key in self.graphs}

    def __call__(self, feeds: dict[str, torch.Tensor], bound: tuple[str, ...] = (),
                 into: tuple[tuple[str, torch.Tensor], ...] = ()) -> tuple[torch.Tensor, ...]:
        """Copy the inputs not bound into the graph's clones, and replay. `bound`: the inputs the caller
        binds beside the graphs' own `bound`, tensors it keeps at fixed addresses (it writes them only
        between calls and never frees them while the graphs live). `into`: ((output name, destination),
        ...), outputs the replay also writes into tensors the caller keeps as it keeps its bound inputs
        (a tuple made once: it is known by its id), the copies captured in the graph after the function's
        own work (an epilogue: a graph per set of destination names and layouts, beside the graph without
        them). The same tensors as one of the last RECENT calls' with the same names bound and the same
        `into` (a device round's buffers and views, the caches: the same few sets of tensors at every
        width a stream alternates between) are known to have its key: every torch call here, a tensor's
        shape or address included, is host time in every round. Where such a call's inputs are all bound and
        each the very tensor its graph was captured over, and its destinations the captured ones (`quiet`:
        a device round's steady state), there is nothing to copy in or out: the call is the replay alone."""
        given = [feeds[name] for name in self.input_names]
        ids = (bound, id(into), *map(id, given))
        recent = self._recent.get(ids)
        if recent is not None:
            (inputs, replay, outputs, dests), refs, quiet = recent[2:5]
            if quiet:  # (`quiet`'s case, found by the same lookup)
                replay()
                return outputs
        else:
            names = set(self.bound) | set(bound)
            if not names <= set(self.input_names):
                raise ValueError(f"bound inputs {sorted(names - set(self.input_names))} are not inputs of this "
                                 f"graph ({self.input_names})")
            if not {name for name, _ in into} <= set(self.output_names):
                raise ValueError(f"outputs {sorted({n for n, _ in into} - set(self.output_names))} written `into` "
                                 f"are not outputs of this graph ({self.output_names})")
            refs = tuple(name in names for name in self.input_names)
            key = (refs, tuple(tuple(t.shape) for t in given),
                   tuple((t.stride(), t.data_ptr() if self.by_address else None) for t, r in zip(given, refs) if r),
                   tuple((name, tuple(t.shape), t.stride(), t.data_ptr() if self.by_address else None)
                         for name, t in into))
            if key not in self.graphs:
                self.graphs[key] = self._capture(key, given, refs, into)
            inputs, replay, outputs, dests = self.graphs[key]
            quiet = (all(ref and static is tensor for static, tensor, ref in zip(inputs, given, refs))
                     and all(static is dest for static, (_, dest) in zip(dests, into)))
            if len(self._recent) >= RECENT:  # (the oldest goes: an eager call's fresh outputs are seen once)
                del self._recent[next(iter(self._recent))]
            self._recent[ids] = (given, into, self.graphs[key], refs, quiet)  # (holding them keeps their ids unique)
        self._feed(inputs, given, refs)
        replay()
        for static, (_, dest) in zip(dests, into):  # (a destination other than the captured one: copied out)
            if static is not dest and static.data_ptr() != dest.data_ptr():
                dest.copy_(static)
                self.copied_bound += 1
        return outputs

    def quiet(self, feeds: dict[str, torch.Tensor], bound: tuple[str, ...] = (),
              into: tuple[tuple[str, torch.Tensor], ...] = ()) -> tuple[torch.Tensor, ...] | None:
        """The call `__call__` would make of a recent quiet call's very tensors (see there): replayed -> its
        outputs; None for any other call (which `__call__` serves), untouched. A caller that decides by
        the inputs' shapes whether to replay at all (`TorchBackend._run`) asks this first: a call known
        quiet was replayed before, so it is one to replay, and its shapes need not be read."""
        recent = self._recent.get((bound, id(into), *[id(feeds[name]) for name in self.input_names]))
        if recent is None or not recent[4]:
            return None
        replay, outputs = recent[2][1:3]
        replay()
        return outputs

    def _feed(self, inputs, given, refs) -> None:
        """A call's inputs where its graph reads them: each one not bound into the graph's clone; a bound
        one given as another tensor than at capture (of the same layout: the key holds a bound input's
        strides) into the captured one, counted."""
        for static, tensor, ref in zip(inputs, given, refs):
            if static is tensor:
                continue
            if not ref:  # (the graph's own clone: never the caller's memory)
                static.copy_(tensor)
            elif static.data_ptr() != tensor.data_ptr():
                static.copy_(tensor)
                self.copied_bound += 1

    def _capture(self, key, given, refs, into):
        """A graph of the function over the call's inputs (its bound ones by reference, the others cloned),
        followed by the copies of its outputs `into` the call's destinations (the graph holds them)."""
        inputs = [t if ref else t.clone() for ref, t in zip(refs, given)]
        dests = [(self.output_names.index(name), dest) for name, dest in into]
        fn = self.fn
        if dests:
            def fn(*args):
                outputs = self.fn(*args)
                for i, dest in dests:
                    dest.copy_(outputs[i])
                return outputs
        try:
            replay, outputs = self.capture(fn, inputs, None if self.warmup is None else self.warmup(inputs))
        except RuntimeError as e:  # an op that syncs with the host or allocates on the CPU inside the graph
            raise EagleExportError(f"CUDA graph capture failed for input shapes {key[1]}: {str(e).splitlines()[0]}",
                                   "run without CUDA graphs (--no-cuda-graphs, or cuda_graphs=False)") from e
        return inputs, replay, tuple(outputs), [dest for _, dest in dests]


# Ops a CUDA graph cannot hold: a read of a value on the host (a sync, refused while capturing), or an
# output whose shape depends on the data (a graph replays the shapes it recorded).
HOST_READS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "allclose"}
DATA_SHAPED = {"nonzero", "nonzero_numpy", "argwhere", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
               "unique_consecutive", "unique_dim_consecutive", "bincount", "histc",
               "repeat_interleave"}  # (without output_size: its length is read on the host)
HOST_DATA = {"lift_fresh", "lift_fresh_copy"}  # torch.tensor(python data) inside
MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}  # x[mask], x[mask] = v: nonzero inside


# Reads of a tensor on the host that, on a CPU tensor, issue no aten op (so the dispatch level misses them).
HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
                     torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class _HostReads(TorchFunctionMode):
    """The host reads a function makes at the Python level (`.tolist()`, `.cpu()`, ...)."""

    def __init__(self, problems: list[str]):
        super().__init__()
        self.problems = problems

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_METHODS:
            self.problems.append(f"{func.__name__}: reads a value on the host")
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Records every aten op a function issues (the ops a capture would record) and what makes it
    uncapturable."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.ops, self.problems = device, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.ops.append(name)
        if name in HOST_READS:
            self.problems.append(f"{name}: reads a value on the host")
        elif name in DATA_SHAPED:
            self.problems.append(f"{name}: its output's shape depends on the data")
        elif name in HOST_DATA:
            self.problems.append(f"{name}: a tensor made from host data")
        elif name in MASK_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                          for i in (args[1] if len(args) > 1 else ()) if i is not None):
            self.problems.append(f"{name}: a boolean mask selects a data-dependent number of elements")
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                self.problems.append(f"{name}: makes a tensor on {t.device}, outside the graph's device {self.device}")
        return out


def check_capturable(fn: Callable, inputs: list[torch.Tensor], variants: list[list[torch.Tensor]] = ()) -> list[str]:
    """Whether a CUDA graph can hold `fn(*inputs)`, checked on whatever device the inputs are on (a CPU
    proof for a GPU capture): the aten ops it issues are recorded, and it fails on a host read
    (`.item()`, `.tolist()`, a tensor's truth value: aten._local_scalar_dense), an op whose output shape
    depends on the data (nonzero, masked_select, unique, a boolean-mask index, ...), a tensor made from
    host data or on another device, and, over `variants` (inputs of the same shapes holding other data),
    a different sequence of ops (a branch taken on the data).
    Returns the ops of `inputs`' run; raises EagleExportError naming the first problem."""
    device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
    runs = []
    for run_inputs in [inputs, *variants]:
        recorder = _Recorder(device)
        with _HostReads(recorder.problems), recorder:
            fn(*run_inputs)
        if recorder.problems:
            raise EagleExportError(f"{getattr(fn, '__name__', 'the function')} cannot be captured in a CUDA graph: "
                                   f"{recorder.problems[0]}",
                                   "keep the values on the device: tensor ops of fixed shapes, no host reads")
        runs.append(recorder.ops)
    if any(ops != runs[0] for ops in runs[1:]):
        raise EagleExportError(f"{getattr(fn, '__name__', 'the function')} cannot be captured in a CUDA graph: "
                               "other data of the same shapes runs other ops (a branch on a value)",
                               "compute both sides with torch.where instead of branching on a value")
    return runs[0]
