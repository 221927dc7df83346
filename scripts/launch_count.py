"""The kernels one decoding call launches through the exact kernels, counted on the CPU.

    python scripts/launch_count.py [--layers 2] [--depth 4] [--batch 1]

A GPU runs each launch to its end before the next (or overlaps two at most, with PDL), so at batch 1,
where a decoder layer's kernels each take microseconds, a call's fixed cost is its count of launches
(a CUDA graph removes the host's work per launch, not the device's ramp and drain per kernel), and a
torch op between two of the kernels breaks their programmatic overlap (only the kernels launch with
PDL). This counts, for the target's plain step (T = 1), its verify call (T = K+1) and the chain
drafter's call (K steps, K+1 rows in), the Triton kernels launched and the torch ops that launch a
kernel of their own (views, allocations and ops that return their input launch nothing), each op by
the line of the package that called it. Random-weight tiny models (`gpu-kit`'s "tiny" shape, its
drafter) through the Triton interpreter: a count is a property of the graph's code, not of the shapes,
apart from the layer count (a target's per-layer count is the difference of two layer counts).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # (before Triton is imported)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Aten ops that launch no kernel: views, allocations, metadata.
NO_KERNEL = frozenset("""view reshape _unsafe_view _reshape_alias slice select expand unsqueeze squeeze t transpose
permute as_strided alias detach lift_fresh split split_with_sizes chunk unbind narrow unfold diagonal view_as
expand_as movedim flatten unflatten empty empty_like empty_strided new_empty new_empty_strided set_""".split())


class Launches(TorchDispatchMode):
    """Counts, while active, the Triton kernels launched through `eagle_export.kernels.triton_ops` and the
    torch ops outside them that launch a kernel, each by the package line that called it."""

    def __init__(self):
        super().__init__()
        self.kernels, self.ops, self._inside = collections.Counter(), collections.Counter(), 0

    def __enter__(self):
        from eagle_export.kernels import triton_ops

        self._patched = []
        for name, fn in vars(triton_ops).items():
            if type(fn).__name__ in ("JITFunction", "InterpretedFunction"):
                self._patched.append((fn, fn.__class__))
                fn.__class__ = type(fn.__class__.__name__, (fn.__class__,), {"__getitem__": self._launcher(name)})
        return super().__enter__()

    def __exit__(self, *exc):
        for fn, cls in self._patched:
            fn.__class__ = cls
        return super().__exit__(*exc)

    def _launcher(self, name):
        def getitem(kernel, grid):
            launch = super(type(kernel), kernel).__getitem__(grid)

            def run(*args, **kwargs):
                self.kernels[name] += 1
                self._inside += 1  # (the interpreter's own torch calls are the kernel's, not launches)
                try:
                    return launch(*args, **kwargs)
                finally:
                    self._inside -= 1
            return run
        return getitem

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        returned_input = any(out is a for a in args)
        if not self._inside and name not in NO_KERNEL and not returned_input:
            self.ops[name, _caller()] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.kernels.values()) + sum(self.ops.values())


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/eagle_export/" in path and "/kernels/" not in path:
            return f"{path.split('/eagle_export/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def graphs(layers: int, depth: int, seed: int = 0):
    """The tiny target and its drafter, random weights, bound to the kernels -> (TargetGraph, UnrolledDrafter)."""
    from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
    from eagle_export.runtime import exact
    from eagle_export.tools.gpu_kit import random_pair

    target, drafter = random_pair("tiny", "cpu", torch.bfloat16, layers=layers, seed=seed)
    pair = TargetGraph(target, False), UnrolledDrafter(drafter, depth, False)
    exact.bind(*pair)
    return pair


def calls(target_graph, drafter_graph, batch: int = 1, cached: int = 24, seed: int = 0) -> dict:
    """name -> a function making one call: the plain step, the verify call, the drafter call."""
    t, d = target_graph.target, drafter_graph.drafter
    g = torch.Generator().manual_seed(seed)
    k = drafter_graph.depth
    lens = torch.full((batch,), cached)
    target_k, target_v = (torch.randn(c.shape, generator=g).to(c.dtype) for c in t.empty_cache(batch, cached + 16))
    draft_k, draft_v = (torch.randn(c.shape, generator=g).to(c.dtype) for c in d.empty_cache(batch, cached + 16))

    def target_call(width):
        ids = torch.randint(0, t.config.vocab_size, (batch, width), generator=g)
        positions, mask = lens[:, None] + torch.arange(width), torch.ones(width, width, dtype=torch.bool).tril()
        return lambda: target_graph(ids, positions, target_k, target_v, lens, mask.expand(batch, -1, -1))

    ids = torch.randint(0, t.config.vocab_size, (batch, k + 1), generator=g)
    aux = torch.randn(batch, k + 1, d.config.num_aux * d.config.target_hidden_size, generator=g).to(torch.bfloat16)
    valid = torch.full((batch,), k + 1)
    return {"plain step (T=1)": target_call(1), f"verify (T={k + 1})": target_call(k + 1),
            f"drafter, chain K={k}": lambda: drafter_graph(ids, aux, valid, draft_k, draft_v, lens)}


def count(call, warm: bool = True) -> Launches:
    """The launches of call's second run (the first makes what the kernels keep: their counters; not
    run where `warm` is False: the call has run before)."""
    with torch.inference_mode():
        if warm:
            call()
        with Launches() as seen:
            call()
    return seen


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="the target's decoder layers (default 2)")
    parser.add_argument("--depth", type=int, default=4, help="the chain's K (default 4)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sites", action="store_true", help="each torch op by the line that called it")
    args = parser.parse_args(argv)
    made = {layers: calls(*graphs(layers, args.depth), batch=args.batch) for layers in (args.layers, args.layers + 1)}
    for name in made[args.layers]:
        seen, more = count(made[args.layers][name]), count(made[args.layers + 1][name])
        per_layer = "" if name.startswith("drafter") else f"; each target layer adds {more.total - seen.total}"
        kernels = ", ".join(f"{k.strip('_')} {n}" for k, n in sorted(seen.kernels.items()))
        print(f"{name}: {seen.total} launches, {sum(seen.kernels.values())} Triton kernels ({kernels}) and "
              f"{sum(seen.ops.values())} torch ops{per_layer}")
        if args.sites:
            for (op, site), n in sorted(seen.ops.items(), key=lambda item: item[0][1]):
                print(f"    {n:3d} {op:14s} {site}")


if __name__ == "__main__":
    main()
