"""What the torch CPU backend's width-invariant layout costs, side by side in one process on one
opened build: the graphs' form (each Attention's core unbound: `attend_graph`; plain nn.Linear,
NVFP4Linear through F.linear) against `layers.width_invariant`'s binding, switched call by call on
the same recorded inputs, so machine noise hits both alike. Reports medians and new/old ratios for
the plain step (a T=1 target call), a verify call (T=K+1), the drafter call, and plain/speculative
tokens per second (fixed policy), alternating which layout runs first. Each call is timed on two
clocks: wall time, and the process's CPU time (on a loaded shared machine the waits for a core count
in the first and not in the second; with --threads 1 the second is the call's own work).

    PYTHONPATH=. python scripts/cpu_layout_cost.py BUILD [--repeats 20] [--generations 3] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from eagle_export.builder.build_dir import open_build
from eagle_export.models import contract as C
from eagle_export.models import layers
from eagle_export.runtime.runtime import GenerationConfig

PROMPTS = ["Name three primary colors and say why they are called primary.",
           "Write a haiku about the sea at night."]


def set_layout(modules, new: bool) -> None:
    for graph in modules:
        for m in graph.modules():
            if type(m) in (nn.Linear, layers.RowLinear):
                m.__class__ = layers.RowLinear if new else nn.Linear
            elif hasattr(m, "row_invariant"):
                m.row_invariant = new
            elif isinstance(m, layers.Attention):
                m.core = layers.attend if new else None


def clone(feeds):
    return {k: v.clone() for k, v in feeds.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--generations", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    ap.add_argument("--profile", action="store_true", help="profile each call in the new layout, then exit")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:  # (the torch backend takes torch's setting)
        torch.set_num_threads(args.threads)
    opened = open_build(args.build, backend="torch", verify=False, verify_policy="fixed")
    rt, backend = opened.runtime, opened.runtime.backend
    modules = [g for g, _ in backend.graphs.values()]
    prompts = [opened.encode(p) for p in PROMPTS]

    recorded = {"target": [], "drafter": []}
    target_fn, drafter_fn = backend.target, backend.drafter
    backend.target = lambda feeds, **kw: (recorded["target"].append((clone(feeds), kw)), target_fn(feeds, **kw))[1]
    backend.drafter = lambda feeds, **kw: (recorded["drafter"].append((clone(feeds), kw)), drafter_fn(feeds, **kw))[1]
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    rt.generate(prompts[:1], config, speculative=False)
    plain_calls = list(recorded["target"])
    recorded["target"].clear()
    rt.generate(prompts[:1], config, speculative=True)
    backend.target, backend.drafter = target_fn, drafter_fn
    width = backend.verify_width
    calls = {
        "plain step (T=1)": (target_fn, [c for c in plain_calls if c[0][C.INPUT_IDS].shape[1] == 1][-1]),
        f"verify (T={width})": (target_fn, [c for c in recorded["target"] if c[0][C.INPUT_IDS].shape[1] == width][-1]),
        "drafter call": (drafter_fn, recorded["drafter"][-1]),
    }
    for name, (_, (feeds, _)) in calls.items():
        print(f"{name}: past {int(feeds[C.CACHE_LENS].max())} of a {feeds[C.PAST_KEY].shape[3]}-slot view, "
              f"input {tuple(feeds[C.INPUT_IDS].shape)}")

    if args.profile:
        for name, (fn, (feeds, kw)) in calls.items():
            for new in (False, True):
                set_layout(modules, new)
                fn(clone(feeds), **kw)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        fn(clone(feeds), **kw)
                print(f"== {name} ({'new' if new else 'old'} layout, 3 calls)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        return

    times = {(n, new, clock): [] for n in calls for new in (False, True) for clock in ("wall", "cpu")}
    firsts = {}
    for r in range(args.repeats):
        for name, (fn, (feeds, kw)) in calls.items():
            for new in ((False, True) if r % 2 == 0 else (True, False)):
                set_layout(modules, new)
                f = clone(feeds)
                start, cpu = time.perf_counter(), time.process_time()
                out = fn(f, **kw)
                times[name, new, "cpu"].append(time.process_time() - cpu)
                times[name, new, "wall"].append(time.perf_counter() - start)
                # the new layout must give the same bits call after call (a determinism check on the side)
                key = next(k for k in (C.LOGITS, C.DRAFT_IDS, C.NEW_KEY) if k in out)
                if new:
                    assert torch.equal(firsts.setdefault(name, out[key]), out[key]), name
    print(f"load average after the calls: {os.getloadavg()}, torch threads {torch.get_num_threads()}")
    for name in calls:
        for clock in ("wall", "cpu"):
            old, new = (statistics.median(times[name, n, clock]) * 1e3 for n in (False, True))
            print(f"{name}, {clock} time: old {old:.1f} ms, new {new:.1f} ms, new/old {new / old:.3f} "
                  f"(medians of {args.repeats})")

    rates = {(kind, new): [] for kind in ("plain", "speculative") for new in (False, True)}
    for r in range(args.generations):
        for kind in ("plain", "speculative"):
            for new in ((False, True) if r % 2 == 0 else (True, False)):
                set_layout(modules, new)
                start = time.perf_counter()
                out = rt.generate(prompts, config, speculative=kind == "speculative")
                rates[kind, new].append(sum(len(o.tokens) for o in out) / (time.perf_counter() - start))
    for kind in ("plain", "speculative") if args.generations else ():
        old, new = (statistics.median(rates[kind, n]) for n in (False, True))
        print(f"generate {kind} (batch {len(prompts)} x {args.new_tokens} tokens, fixed policy): old {old:.2f} tok/s, "
              f"new {new:.2f} tok/s, new/old time per token {old / new:.3f} (medians of {args.generations})")
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
