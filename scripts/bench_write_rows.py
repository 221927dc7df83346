"""The cache commit (`rows._write_rows`) against the forms it replaced, side by side in one process.

Each variant commits the first counts[b] of R new K/V rows of each live sequence at starts[b] (one
sequence dead, its rows past the first lying past the cache view, the others committing 1..R rows), into the keys and
values caches [L,B,H,S,D] (fp32), contiguous (the growing caches) or a view along S of a longer buffer
(the static caches). Variants:
  gather      the previous form: gather the rows' slots, where(committed, new, old), scatter them back
  writeback   over the memory's rows: index_select the slots, where(committed, new, old), index_copy_
  sink        this tree's `_write_rows`: index_copy_ of every row, the uncommitted ones to a sink row
  narrow      one narrow + copy_ per live sequence with counts read on the host (not a candidate: the
              device round must not read the host; shown as the floor of an eager CPU commit)
Every variant is first checked bit for bit against a per-row loop on the same inputs (with L = 2).
Printed: the median microseconds of --repeat calls of each (interleaved, so load hits all alike) and
each over `gather`, for the sample target's shape (L=30, H=3, D=64) and the Llama-3.1-8B shape's
(L=32, H=8, D=128), batch 1/4/16, R = 1 and 5, 1 and 2 torch threads.

Run: PYTHONPATH=. python scripts/bench_write_rows.py [--repeat 30] [--threads 1 2] [--batch 1 4 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle_export.models import contract as C
from eagle_export.runtime.rows import _arange, _new_cache, _rows, _write_rows

SHAPES = {"sample": (30, 3, 64, 512), "8B": (32, 8, 128, 256)}  # L, H, D, the slots a view shows


def gather(keys, values, out, starts, counts, live):
    b, r = len(starts), out[C.NEW_KEY].shape[3]
    rows = _arange(r, keys.device)
    slots = (starts.view(b, 1) + rows).clamp_(max=keys.shape[3] - 1).view(1, b, 1, r, 1)
    keep = ((rows < counts.view(b, 1)) & live.view(b, 1)).view(1, b, 1, r, 1)
    for cache, new in ((keys, out[C.NEW_KEY]), (values, out[C.NEW_VALUE])):
        index = slots.expand(*new.shape)
        cache.scatter_(3, index, torch.where(keep, new, cache.gather(3, index)))


def writeback(keys, values, out, starts, counts, live):
    b, r = len(starts), out[C.NEW_KEY].shape[3]
    layers, _, heads = keys.shape[:3]
    rows = _arange(r, keys.device)
    slots = (starts.view(b, 1) + rows).clamp_(max=keys.shape[3] - 1).view(1, b, 1, r)
    keep = ((rows < counts.view(b, 1)) & live.view(b, 1)).view(1, b, 1, r, 1)
    for cache, new in ((keys, out[C.NEW_KEY]), (values, out[C.NEW_VALUE])):
        memory, step, _ = _rows(cache)
        index = torch.add(slots, _arange(layers * b * heads, keys.device).view(layers, b, heads, 1), alpha=step)
        old = memory.index_select(0, index.view(-1)).view(new.shape)
        memory.index_copy_(0, index.view(-1), torch.where(keep, new, old, out=old).view(-1, new.shape[4]))


def narrow(keys, values, out, starts, counts, live):
    for b, (start, count, alive) in enumerate(zip(starts.tolist(), counts.tolist(), live.tolist())):
        if alive and count:
            for cache, new in ((keys, out[C.NEW_KEY]), (values, out[C.NEW_VALUE])):
                cache[:, b, :, start:start + count].copy_(new[:, b, :, :count])


VARIANTS = {"gather": gather, "writeback": writeback, "sink": _write_rows, "narrow": narrow}


def per_row(cache, new, starts, counts, live):
    """The semantics, row by row."""
    for b in range(len(starts)):
        for r in range(int(counts[b]) if live[b] else 0):
            cache[:, b, :, int(starts[b]) + r] = new[:, b, :, r]


def case(layers, heads, dim, slots, batch, rows, static, seed=0):
    """Caches (views of `slots` slots; static: of a buffer twice as long) and those buffers, new rows and
    the bookkeeping."""
    g = torch.Generator().manual_seed(seed)
    buffers = [_new_cache((layers, batch, heads, 2 * slots if static else slots, dim), torch.float32, "cpu")
               for _ in "kv"]
    for full in buffers:
        full.normal_(generator=g)
    caches = [full[:, :, :, :slots] for full in buffers]
    out = {name: torch.randn(layers, batch, heads, rows, dim, generator=g) for name in (C.NEW_KEY, C.NEW_VALUE)}
    starts = torch.randint(0, slots - rows, (batch,), generator=g)
    counts = torch.randint(1, rows + 1, (batch,), generator=g)
    live = torch.ones(batch, dtype=torch.bool)
    if batch > 1:  # one dead sequence, its rows past the first lying past the view (clamped into it; a live
        live[-1], starts[-1] = False, slots - 1  # sequence's rows always fit)
    return caches, buffers, out, starts, counts, live


def check(heads, dim, slots, batch, rows, static):
    for name, fn in VARIANTS.items():
        caches, buffers, out, starts, counts, live = case(2, heads, dim, slots, batch, rows, static)
        wants = [full.clone() for full in buffers]  # whole buffers: slots past the view included
        for want, new in zip(wants, (out[C.NEW_KEY], out[C.NEW_VALUE])):
            per_row(want[:, :, :, :slots], new, starts, counts, live)
        fn(*caches, out, starts, counts, live)
        if not all(torch.equal(full, want) for full, want in zip(buffers, wants)):
            raise SystemExit(f"{name} differs from the per-row commit at batch {batch}, R = {rows}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    print(f"median us of {args.repeat} calls (K and V), fp32; ratio: over gather")
    print("| threads | shape | batch | R | layout | " + " | ".join(VARIANTS) + " | " +
          " | ".join(f"{v}/gather" for v in VARIANTS if v != "gather") + " |")
    print("|---" * (5 + 2 * len(VARIANTS) - 1) + "|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape, (layers, heads, dim, slots) in SHAPES.items():
            for batch in args.batch:
                for rows in (1, 5):
                    for static in (False, True):
                        check(heads, dim, slots, batch, rows, static)
                        caches, _, out, starts, counts, live = case(layers, heads, dim, slots, batch, rows, static)
                        times = {name: [] for name in VARIANTS}
                        for _ in range(args.repeat):
                            for name, fn in VARIANTS.items():
                                start = time.perf_counter()
                                fn(*caches, out, starts, counts, live)
                                times[name].append(time.perf_counter() - start)
                        us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
                        ratios = " | ".join(f"{us[v] / us['gather']:.2f}" for v in VARIANTS if v != "gather")
                        print(f"| {threads} | {shape} | {batch} | {rows} | {'view' if static else 'contiguous'} | "
                              + " | ".join(f"{us[v]:.0f}" for v in VARIANTS) + f" | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
