"""Is ONNX Runtime position-invariant? (issue 43: the torch CPU backend's width-invariant layout makes a
row's bits independent of its place in a verify call; would the exported graph need it too?)

A random-weight target (Llama-3.2-1B's layer shapes, LAYERS layers, a VOCAB-word vocabulary), fp32,
exported with logits as a build exports it, then along its own greedy tokens
`teacher_forced.position_variance` (every position p as row 0 of a one-token call over past p, and as
row p - s of a verify-width call over past s, for every s a round could start at: rows compared,
rows whose logits or new K/V differ, the largest logit difference, argmax flips) through
    onnxruntime      the exported graph on ONNX Runtime's CPU provider
    torch layout     the torch CPU backend's form (layers.width_invariant)
    torch graph      the exported graphs' own form in torch (attend_graph, nn.Linear): what the layout fixes
and each one's median seconds of a one-token call and of a verify-width call over 64 cached positions.

    PYTHONPATH=. python scripts/ort_position_variance.py [--tokens 12] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eagle_export.builder.teacher_forced import position_variance
from eagle_export.export.export import export_target
from eagle_export.export.unrolled import TargetGraph
from eagle_export.models import contract as C
from eagle_export.models.config import TargetConfig
from eagle_export.models.layers import width_invariant
from eagle_export.models.target import Target
from eagle_export.runtime.backends import ort_session, run_onnx
from eagle_export.tools.gpu_kit import TARGETS, random_prompts

LAYERS, VOCAB, WIDTH = 2, 8192, 5


class Graph:
    """The least of a backend that position_variance calls: target(feeds) on the CPU, fp32."""
    device, model_dtype = "cpu", torch.float32

    def __init__(self, name, run):
        self.name, self.run = name, run

    def target(self, feeds, need_logits=True):
        return self.run(feeds)


def torch_graph(graph):
    spec = C.target_graph(graph.target.config, len(graph.target.aux_layer_ids), True)

    @torch.no_grad()
    def run(feeds):
        return dict(zip(spec.output_names, graph(*[feeds[n] for n in spec.input_names])))
    return run


def call_seconds(backend, cache_shape, width: int, reps: int = 15) -> float:
    layers, heads, dim = cache_shape
    k = torch.zeros(layers, 1, heads, 64, dim)
    feeds = {C.INPUT_IDS: torch.ones(1, width, dtype=torch.int64), C.POSITIONS: torch.arange(64, 64 + width)[None],
             C.PAST_KEY: k, C.PAST_VALUE: k.clone(), C.CACHE_LENS: torch.tensor([64]),
             C.TREE_MASK: torch.ones(width, width, dtype=torch.bool).tril()[None]}
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        backend.target(feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = Target(TargetConfig.from_hf(dict(TARGETS["llama-3.2-1b"], num_hidden_layers=LAYERS, vocab_size=VOCAB),
                                         "llama-3.2-1b, 2 layers")).eval()
    cfg = target.config
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    prompt = random_prompts(VOCAB, 1, lengths=(20, 20))[0]
    sequences = [(prompt, target.generate_greedy(prompt, args.tokens))]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "target.onnx"
        export_target(target, path, return_logits=True)
        session = ort_session(path, threads=args.threads)
        backends = [Graph("onnxruntime", lambda feeds: run_onnx(session, feeds)),
                    Graph("torch layout", torch_graph(width_invariant(TargetGraph(target, True)))),
                    Graph("torch graph", torch_graph(TargetGraph(target, True)))]
        for backend in backends:
            variance = position_variance(backend, shape, sequences, WIDTH)
            times = {"step_ms": round(1e3 * call_seconds(backend, shape, 1), 3),
                     "verify_ms": round(1e3 * call_seconds(backend, shape, WIDTH), 3)}
            print(backend.name, json.dumps({**variance, **times}), flush=True)


if __name__ == "__main__":
    main()
