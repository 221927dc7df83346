"""ONNX Runtime CPU latency: one unrolled depth-4 drafter call against four single-step calls.

    python scripts/bench_unrolled.py [--target DIR] [--past 256] [--runs 30] [--threads 1]

The drafter is random (EAGLE-3.1 layout) and sized for the target: the sample target
(SmolLM2-135M: hidden 576, 9 heads / 3 KV heads, aux ids (2, 15, 27), draft vocabulary 8192) by
default, else pass --target. Both graphs are exported here in fp32 and measured side by side,
interleaved, at batch 1 and 4, as the median of --runs calls after warm-up:
  unrolled   one K=4 call over W=5 input rows (step 0 plus three feedback steps in-graph)
  4 x K=1    four calls of the K=1 graph with one input row each (T=1), the graph work of four
             separate single-step launches (their host-side feedback plumbing is not counted)
Also prints export time and node counts before/after the ONNX passes for each graph.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle_export.export.export import export_drafter, export_target
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import ort_session
from eagle_export.speculation.tree import TreeShape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import write_tiny_drafter  # noqa: E402


def feeds(spec, drafter, depth, width, batch, past):
    cfg = drafter.config
    cache = torch.randn(1, batch, cfg.num_kv_heads, past, cfg.head_dim)
    args = (torch.randint(0, cfg.vocab_size, (batch, width)),
            torch.randn(batch, width, cfg.num_aux * cfg.target_hidden_size),
            torch.full((batch,), width), cache, cache.clone(), torch.full((batch,), past - width))
    return {name: a.numpy() for name, a in spec.feeds(args).items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target")
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.target is None:
        from eagle_export.data.sample import sample_target_dir

        args.target = sample_target_dir()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = load_target(args.target)
        cfg = target.config
        aux = target.aux_layer_ids if len(target.aux_layer_ids) == 3 else (2, cfg.num_layers // 2, cfg.num_layers - 3)
        path = write_tiny_drafter(tmp / "drafter", "3.1", seed=0, target_hidden=cfg.hidden_size,
                                  vocab=cfg.vocab_size, draft_vocab=min(8192, cfg.vocab_size), aux=aux,
                                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                  intermediate_size=cfg.intermediate_size)
        drafter = load_drafter(path, target=target)
        stats = {"target": export_target(target, tmp / "target.onnx", return_logits=False)}
        for depth in (1, 4):
            stats[f"drafter K={depth}"] = export_drafter(drafter, depth, False, tmp / f"drafter{depth}.onnx")
        for name, s in stats.items():
            print(f"{name:12} export {s['export_seconds']:6.2f} s  passes {s['passes_seconds']:6.2f} s  "
                  f"nodes {s['nodes_exported']} -> {s['nodes_after_passes']}")

        unrolled, single = (ort_session(tmp / "drafter4.onnx", threads=args.threads),
                           ort_session(tmp / "drafter1.onnx", threads=args.threads))
        spec4 = C.drafter_graph(drafter.config, TreeShape.chain(4), False)
        spec1 = C.drafter_graph(drafter.config, TreeShape.chain(1), False)
        print(f"ONNX Runtime CPU, {args.threads} thread(s), past {args.past}, median of {args.runs} runs (ms):")
        for batch in (1, 4):
            feed4 = feeds(spec4, drafter, 4, 5, batch, args.past)
            feed1 = feeds(spec1, drafter, 1, 1, batch, args.past)
            times4, times1 = [], []
            for i in range(args.runs + 3):  # interleaved; the first 3 are warm-up
                start = time.perf_counter()
                unrolled.run(None, feed4)
                t4 = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(4):
                    single.run(None, feed1)
                t1 = time.perf_counter() - start
                if i >= 3:
                    times4.append(t4)
                    times1.append(t1)
            m4, m1 = statistics.median(times4) * 1e3, statistics.median(times1) * 1e3
            print(f"  batch {batch}: unrolled K=4 {m4:7.2f}   4 x K=1 {m1:7.2f}   ratio {m1 / m4:4.2f}x")


if __name__ == "__main__":
    main()
