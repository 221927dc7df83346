"""What the target graph's tree_mask input costs: a build's target.onnx against one exported before
the input existed (same recipe), in ONNX Runtime on the CPU, one thread, side by side.

Each call is timed as the runtime makes it, feeds included: prefill over T prompt tokens (cache
grown to T rounded up to 64 slots, all empty; the new graph gets `layers.causal_mask`) and verify
calls of T = 1 and K+1 tokens over PAST cached slots (the new graph gets `tree.verify_mask` of a
chain, which the runtime computes every round, and of a tree for T = K+1 as well). Median of
--reps interleaved calls; ratio new / old.

Run: python scripts/bench_tree_mask.py OLD_BUILD NEW_BUILD [--reps 7] [--prefill 512,1024,2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from eagle_export.builder.manifest import Manifest
from eagle_export.models import contract as C
from eagle_export.models.layers import causal_mask
from eagle_export.runtime.backends import ort_session, run_bound
from eagle_export.speculation.tree import TreeShape, verify_mask

PAST = 256


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prefill", default="512,1024,2048")
    args = parser.parse_args()
    torch.set_num_threads(1)
    depth = Manifest.read(args.new).depth
    sessions = {name: ort_session(d / "target.onnx", threads=1) for name, d in (("old", args.old), ("new", args.new))}
    past_input = next(i for i in sessions["new"].get_inputs() if i.name == C.PAST_KEY)
    layers, heads, dim = past_input.shape[0], past_input.shape[2], past_input.shape[4]
    outputs = [o.name for o in sessions["new"].get_outputs() if o.name != C.LOGITS]

    def feeds(name, base, tokens, lens, mask):
        """The call's feeds on top of the (preallocated) cache; the new graph's mask made here, as the runtime does."""
        f = dict(base)
        if name == "new":
            f[C.TREE_MASK] = m = mask()
            f[C.POSITIONS] = lens + m.sum(-1) - 1
        else:
            f[C.POSITIONS] = lens + torch.arange(tokens)[None]
        return f

    chain = TreeShape.chain(depth).parent_tensor()[None]
    tree = TreeShape.from_branching([2, 1] + [1] * (depth - 2)).parent_tensor()[None, :depth]  # K nodes, 2 paths
    cases = [(f"prefill T={t}", t, -(-t // 64) * 64, 0, lambda t=t: causal_mask(1, t))
             for t in map(int, args.prefill.split(","))]
    cases += [("verify T=1", 1, PAST + 64, PAST, lambda: verify_mask(chain[:, :0])),
              (f"verify T={depth + 1} (chain)", depth + 1, PAST + 64, PAST, lambda: verify_mask(chain)),
              (f"verify T={depth + 1} (tree)", depth + 1, PAST + 64, PAST, lambda: verify_mask(tree))]
    print(f"{'call':<24} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for label, tokens, past, lens, mask in cases:
        times = {"old": [], "new": []}
        cache = torch.zeros(layers, 1, heads, past, dim)
        base = {C.INPUT_IDS: torch.ones(1, tokens, dtype=torch.int64), C.PAST_KEY: cache, C.PAST_VALUE: cache,
                C.CACHE_LENS: torch.tensor([lens])}
        for rep in range(args.reps + 1):  # the first is a warm-up
            for name in ("old", "new"):
                start = time.perf_counter()
                run_bound(sessions[name], feeds(name, base, tokens, lens, mask), outputs, depth)
                if rep:
                    times[name].append(time.perf_counter() - start)
        old, new = (statistics.median(times[n]) * 1e3 for n in ("old", "new"))
        print(f"{label:<24} {old:9.2f} {new:9.2f} {new / old:8.3f}", flush=True)


if __name__ == "__main__":
    main()
