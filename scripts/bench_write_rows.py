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

--build BUILD instead runs generation on a build (ONNX Runtime), with the commit as it was (gather) and as
it is (sink) bound in turn in one process: plain decoding and the goodput policy (greedy), --repeat runs of
each at each batch, in rotating order; printed: tokens/s (median), goodput over plain per commit, sink over
gather per mode, and the commits' own time per call and share of the run (each call timed in place).
Every run's tokens must equal plain decoding's under the gather commit.

Run: PYTHONPATH=. python scripts/bench_write_rows.py [--repeat 30] [--threads 1 2] [--batch 1 4 16]
     PYTHONPATH=. python scripts/bench_write_rows.py --build BUILD [--repeat 4] [--batch 1 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

import eagle_export.runtime.device_round as device_round
import eagle_export.runtime.rows as rows_module
import eagle_export.runtime.runtime as runtime_module
from eagle_export.models import contract as C
from eagle_export.runtime.generation import GenerationConfig
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


PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Write a haiku about the sea at night.",
           "def is_palindrome(text: str) -> bool:\n",
           "Name three primary colors and say why they are called primary."]


def bind(commit) -> None:
    """`commit` as the runtime's `_write_rows` wherever a runtime module binds it (as tests/planting.py)."""
    for module in (rows_module, runtime_module, device_round):
        module._write_rows = commit


def on_build(path, batches, repeat, tokens) -> None:
    from eagle_export.builder.build_dir import open_build

    opened = open_build(path, backend="onnxruntime")
    runtime, config = opened.runtime, GenerationConfig(max_new_tokens=tokens)
    prompts = [opened.encode(p) for p in PROMPTS]
    spent = {"s": 0.0, "calls": 0}

    def timed(fn):
        def commit(*args):
            start = time.perf_counter()
            fn(*args)
            spent["s"] += time.perf_counter() - start
            spent["calls"] += 1
        return commit

    commits = {"gather": timed(gather), "sink": timed(_write_rows)}
    modes = ("plain", "goodput")
    print(f"{path}, ONNX Runtime, {tokens} new tokens, {repeat} runs of each, load {os.getloadavg()[0]:.1f}")
    print("| batch | mode | commit | tokens/s | commit us/call | commit share | over gather | goodput/plain |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        chunk = (prompts * batch)[:batch]
        runs = list(itertools.product(modes, commits))
        rates, per_call, share, want = {run: [] for run in runs}, {run: [] for run in runs}, {run: [] for run in runs}, None
        for mode, name in runs:  # warm-up (the goodput policy's costs, the graphs' first calls)
            bind(commits[name])
            runtime.generate(chunk, config, speculative=mode != "plain")
        for r in range(repeat):
            for mode, name in runs[r % len(runs):] + runs[:r % len(runs)]:
                bind(commits[name])
                spent.update(s=0.0, calls=0)
                start = time.perf_counter()
                out = runtime.generate(chunk, config, speculative=mode != "plain")
                wall = time.perf_counter() - start
                got = [o.tokens for o in out]
                want = want or got
                if got != want:
                    raise SystemExit(f"batch {batch}: {mode} with the {name} commit differs from plain decoding")
                rates[mode, name].append(sum(map(len, got)) / wall)
                per_call[mode, name].append(spent["s"] / spent["calls"] * 1e6)
                share[mode, name].append(spent["s"] / wall)
        bind(_write_rows)
        med = {run: statistics.median(v) for run, v in rates.items()}
        for mode, name in runs:
            print(f"| {batch} | {mode} | {name} | {med[mode, name]:.2f} | {statistics.median(per_call[mode, name]):.0f} | "
                  f"{statistics.median(share[mode, name]) * 100:.2f}% | {med[mode, name] / med[mode, 'gather']:.3f}x | "
                  f"{med[mode, name] / med['plain', name]:.3f}x |", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=None, help="calls (default 30), or generations with --build (4)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 4 16, or 1 4 with --build")
    ap.add_argument("--build", help="a build directory: generation A/B instead of the commit alone")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a sequence (with --build)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.build:
        on_build(args.build, args.batch or [1, 4], args.repeat or 4, args.tokens)
        return
    args.repeat, args.batch = args.repeat or 30, args.batch or [1, 4, 16]
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
