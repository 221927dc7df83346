"""CUDA graphs over the torch backend's fixed shapes: its fast path on a GPU without TensorRT.

A decoding round launches hundreds of small kernels; at batch 1 the GPU waits on Python between
them. A CUDA graph records one call's kernels once and replays them in one launch, as vLLM and
gpt-fast do. A graph replays the memory it was captured with, so:
  - one graph per input shape, captured lazily on its first call (the runtime keeps the shapes
    few: verify widths T = 1..K+1, the drafter's rows padded to K+1, caches at the context limit);
  - every input lives in a static buffer the graph reads; a call copies its small inputs (ids,
    positions, lengths) into them, while the caches are bound by reference: the graph is captured
    reading the runtime's own cache tensors, which the runtime writes between replays, and they
    are never copied (a call given another cache tensor is copied in, correct but slow);
  - outputs are static buffers too, overwritten by the next replay of the same graph: the runtime
    consumes them (commits K/V rows, copies ids to the host) before that.
The capture itself is the only CUDA-only code (`CudaGraphCapture`, written against the documented
torch.cuda.CUDAGraph API: warm-up on a side stream, then capture, all graphs in one memory pool);
the bookkeeping above is tested on CPU with a capture that replays eagerly into the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import EagleExportError

WARMUP = 3  # eager calls on a side stream before a capture (cuBLAS handles, lazy inits), as torch's docs do


class CudaGraphCapture:
    """capture(fn, inputs) -> (replay, outputs) on the current CUDA device. All graphs of one backend
    share a memory pool: they run one at a time on one stream, so their intermediates may share memory."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable, inputs: list[torch.Tensor]):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*inputs)
        return graph.replay, outputs


class ShapeGraphs:
    """A module called by input name, one captured graph per set of input shapes. `bound` names the
    inputs captured by reference (the caches); the others are copied into static buffers."""

    def __init__(self, fn: Callable, input_names: list[str], bound: tuple[str, ...], capture: Callable):
        self.fn, self.input_names, self.bound, self.capture = fn, input_names, bound, capture
        self.graphs: dict[tuple, tuple] = {}  # input shapes -> (static inputs, replay, static outputs)
        self.copied_bound = 0  # bound inputs that had to be copied in (another tensor than at capture)

    def keys(self) -> set[tuple[int, int]]:
        """(batch, width) of every captured graph: the first input's shape (input_ids [B, T])."""
        return {tuple(shapes[0]) for shapes in self.graphs}

    def __call__(self, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        given = [feeds[name] for name in self.input_names]
        key = tuple(tuple(t.shape) for t in given)
        if key not in self.graphs:
            self.graphs[key] = self._capture(key, given)
        inputs, replay, outputs = self.graphs[key]
        for name, static, tensor in zip(self.input_names, inputs, given):
            if static.data_ptr() != tensor.data_ptr() or static.stride() != tensor.stride():
                static.copy_(tensor)
                self.copied_bound += name in self.bound
        replay()
        return outputs

    def _capture(self, key, given):
        inputs = [t if name in self.bound else t.clone() for name, t in zip(self.input_names, given)]
        try:
            replay, outputs = self.capture(self.fn, inputs)
        except RuntimeError as e:  # an op that syncs with the host or allocates on the CPU inside the graph
            raise EagleExportError(f"CUDA graph capture failed for input shapes {key}: {str(e).splitlines()[0]}",
                                   "run without CUDA graphs (--no-cuda-graphs, or cuda_graphs=False)") from e
        return inputs, replay, tuple(outputs)

