"""Host time of a goodput round that calls no drafter (k = 0) against a plain decoding step, on CPU.

A tiny target and drafter (the tests' random-weight pair, so the graph calls are short and the host's
own work shows) on the torch backend, greedy. Plain decoding and the goodput policy at synthetic
acceptance 0 (it settles on k = 0 rounds between probes) run in turn, --repeat times each; a round's
host time is its wall time less its graph calls' (the runtime's timings). Printed per batch size: the
median over the rounds of each run, then the median over the runs, and the k = 0 round's over the plain
step's. --compare adds, run in turn in the same sitting, the k = 0 round with its drafter row appended in
each round's bookkeeping (as before the rows waited for one batched append: `DeviceRounds._defers_rows`)
and the general round's k = 0 round.

Run: PYTHONPATH=. python scripts/k0_round_host_time.py [--tokens 160] [--repeat 5] [--batch 1 4] [--compare]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_models import write_tiny_drafter, write_tiny_target  # noqa: E402

from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter  # noqa: E402
from eagle_export.models.checkpoint import load_drafter, load_target  # noqa: E402
from eagle_export.runtime.backends import TorchBackend  # noqa: E402
from eagle_export.runtime.replay import recorded_costs  # noqa: E402
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime  # noqa: E402
from eagle_export.speculation.synthetic import SyntheticDrafts  # noqa: E402

K = 3


class Timed(SpeculativeRuntime):
    """Records (drafted, host seconds) for every decoding round: wall less graph time. `variant`: None (the
    runtime as it is), "appended" (each k = 0 round appends its drafter row itself) or "general" (every
    round on the general round)."""

    variant = None

    def _defers_rows(self, state, policy, drafted):
        return self.variant != "appended" and super()._defers_rows(state, policy, drafted)

    def _device_rounds(self, state):
        return self.variant != "general" and super()._device_rounds(state)

    def _round(self, state, live, policy=None, drafted=False):
        graphs, start = self.timings.draft + self.timings.verify, time.perf_counter()
        events = list(super()._round(state, live, policy, drafted))  # (the round's work, not the consumer's)
        wall = time.perf_counter() - start
        self.rounds.append((drafted, wall - (self.timings.draft + self.timings.verify - graphs)))
        yield from events


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--compare", action="store_true",
                        help="also the k = 0 round with its row appended each round, and on the general round")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        target = load_target(write_tiny_target(Path(tmp) / "t", "qwen2"), aux_layer_ids=(1, 3, 4))
        drafter = load_drafter(write_tiny_drafter(Path(tmp) / "d", "3.1"), target=target)
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, K, False))
    runtime = Timed.for_models(backend, target, drafter, max_context=512, costs=recorded_costs("H200 bf16"))
    runtime.rounds = []
    config = GenerationConfig(max_new_tokens=args.tokens)
    print(f"tiny qwen2 pair, torch CPU, K={K}, {args.tokens} tokens, H200 bf16 costs; host us per round, "
          f"median of {args.repeat} runs (each the median of its rounds)")
    variants = [None, "appended", "general"] if args.compare else [None]
    names = {None: "goodput k = 0 round", "appended": "k = 0, row appended each round",
             "general": "k = 0, general round"}
    print("| batch | plain step | " + " | ".join(f"{names[v]} | ratio" for v in variants) + " | goodput drafted rounds |")
    print("|---|---|" + "---|---|" * len(variants) + "---|")
    for batch in args.batch:
        prompts = [[1 + (7 * i + j) % 300 for j in range(12)] for i in range(batch)]
        synthetic = SyntheticDrafts.for_prompts(runtime, prompts, config, (0.0,) * K)
        plain, k0, probes = [], {v: [] for v in variants}, 0
        for _ in range(args.repeat):  # (interleaved: a change of the machine's load touches every column alike)
            for variant in ["plain", *variants]:
                speculative = variant != "plain"
                runtime.variant, runtime.rounds = None if variant == "plain" else variant, []
                runtime.generate(prompts, config, speculative=speculative, verify_policy="goodput",
                                 synthetic=synthetic if speculative else None)
                host = [s for drafted, s in runtime.rounds if not drafted]
                (k0[variant] if speculative else plain).append(statistics.median(host) * 1e6)
                probes = sum(drafted for drafted, _ in runtime.rounds) if variant is None else probes
        p = statistics.median(plain)
        cells = " | ".join(f"{statistics.median(k0[v]):.0f} | {statistics.median(k0[v]) / p:.2f}" for v in variants)
        print(f"| {batch} | {p:.0f} | {cells} | {probes} |")

if __name__ == "__main__":
    main()
