"""`eagle-export bench`: speculative and plain autoregressive decoding, same backend, same prompts.

Both runs go through one runtime object: the autoregressive baseline is the target graph called
one token at a time, so the ratio measures speculation and nothing else. `efficiency` compares the
measured speedup with what tau promises at the measured per-call costs:
    ideal = tau * t_ar_step / (t_verify + t_draft)        (per round vs per AR step)
    efficiency = decode_speedup / ideal, both without the prompt pass (prefill), which is the same work
    in both runs; `speedup` itself is end to end, prefill included.
Host time (everything that is not a graph call) is what keeps efficiency below 1.
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from .errors import EagleExportError
from .reference import acceptance_by_depth, mean_accepted_length
from .runtime import GenerationConfig, SpeculativeRuntime


def _batches(prompts, batch):
    return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


def device_name(runtime: SpeculativeRuntime) -> str:
    if runtime.device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU"


def bench(runtime: SpeculativeRuntime, prompts: list[list[int]], batch: int, config: GenerationConfig,
          warmup: int = 1) -> dict:
    for chunk in _batches(prompts, batch)[:warmup]:  # first calls pay for allocation and kernel selection
        runtime.generate(chunk, GenerationConfig(max_new_tokens=8, eos_ids=config.eos_ids))

    spec = {"tokens": 0, "seconds": 0.0, "prefill": 0.0, "draft": 0.0, "verify": 0.0, "rounds": 0, "accepted": []}
    ar = {"tokens": 0, "seconds": 0.0, "prefill": 0.0, "verify": 0.0, "steps": 0}
    per_batch_speedups = []
    for chunk in _batches(prompts, batch):
        # Side by side, batch by batch, so both see the same machine load.
        start = time.perf_counter()
        spec_results = runtime.generate(chunk, config, speculative=True)
        spec_seconds = time.perf_counter() - start
        t = runtime.timings
        spec["draft"] += t.draft
        spec["prefill"] += t.prefill
        spec["verify"] += t.verify
        spec_tokens = sum(r.stats.new_tokens for r in spec_results)
        rounds = max(r.stats.rounds for r in spec_results)  # a batch advances in lock step
        spec["rounds"] += rounds
        for r in spec_results:
            spec["accepted"].extend(r.stats.accepted)

        # Same lengths for the baseline: each sequence decodes exactly as many tokens as it did above.
        ar_config = GenerationConfig(max_new_tokens=max(r.stats.new_tokens for r in spec_results),
                                     eos_ids=config.eos_ids, stop_strings=config.stop_strings)
        start = time.perf_counter()
        ar_results = runtime.generate(chunk, ar_config, speculative=False)
        ar_seconds = time.perf_counter() - start
        ar["verify"] += runtime.timings.verify
        ar["prefill"] += runtime.timings.prefill
        ar["steps"] += max(r.stats.new_tokens for r in ar_results)
        ar_tokens = sum(r.stats.new_tokens for r in ar_results)

        spec["tokens"] += spec_tokens
        spec["seconds"] += spec_seconds
        ar["tokens"] += ar_tokens
        ar["seconds"] += ar_seconds
        per_batch_speedups.append((spec_tokens / spec_seconds) / (ar_tokens / ar_seconds))

    depth = runtime.depth
    accepted = spec["accepted"]
    tau = mean_accepted_length(accepted)
    by_depth = acceptance_by_depth(accepted, depth, unreached=0.0)
    spec_tps = spec["tokens"] / spec["seconds"]
    ar_tps = ar["tokens"] / ar["seconds"]
    speedup = spec_tps / ar_tps
    t_ar_step = ar["verify"] / ar["steps"]
    t_round = (spec["verify"] + spec["draft"]) / spec["rounds"]
    ideal = tau * t_ar_step / t_round
    # Efficiency compares like with like: decode time only (the prompt pass is the same work in both runs
    # and would pull the measured ratio towards 1, above the ideal).
    decode_speedup = (spec["tokens"] / (spec["seconds"] - spec["prefill"])) / (ar["tokens"] / (ar["seconds"] - ar["prefill"]))
    host = spec["seconds"] - spec["prefill"] - spec["draft"] - spec["verify"]
    return {
        "backend": runtime.backend.name, "device": device_name(runtime), "batch": batch, "depth": depth,
        "prompts": len(prompts), "max_new_tokens": config.max_new_tokens,
        "tau": round(tau, 4), "acceptance_by_depth": [round(a, 4) for a in by_depth],
        "spec_tokens_per_s": round(spec_tps, 2), "ar_tokens_per_s": round(ar_tps, 2),
        "speedup": round(speedup, 4), "speedup_median_over_batches": round(statistics.median(per_batch_speedups), 4),
        "time_split": {"prefill": round(spec["prefill"], 4), "draft": round(spec["draft"], 4), "verify": round(spec["verify"], 4), "host": round(host, 4),
                       "draft_per_round_ms": round(1000 * spec["draft"] / spec["rounds"], 3),
                       "verify_per_round_ms": round(1000 * spec["verify"] / spec["rounds"], 3),
                       "host_per_round_ms": round(1000 * host / spec["rounds"], 3),
                       "ar_step_ms": round(1000 * t_ar_step, 3)},
        "decode_speedup": round(decode_speedup, 4), "ideal_speedup": round(ideal, 4),
        "efficiency": round(decode_speedup / ideal, 4),
    }


def plot(results: list[dict], path) -> None:
    """Acceptance by depth (first result) and speedup by batch, side by side, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EagleExportError("--plot needs matplotlib", "pip install matplotlib") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    first = results[0]
    depths = list(range(1, len(first["acceptance_by_depth"]) + 1))
    left.bar(depths, first["acceptance_by_depth"], color="tab:blue")
    left.set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1),
             title=f"acceptance by depth (tau {first['tau']:.2f}, batch {first['batch']})")
    batches = [r["batch"] for r in results]
    right.plot(batches, [r["speedup"] for r in results], marker="o", label="measured")
    right.plot(batches, [r["ideal_speedup"] for r in results], marker="x", linestyle="--", label="ideal (tau-bound)")
    right.axhline(1.0, color="gray", linewidth=0.8)
    right.set(xlabel="batch", ylabel="speedup over autoregressive", xscale="log", xticks=batches,
              title=f"{first['backend']} on {first['device']}")
    right.set_xticks(batches, [str(b) for b in batches])
    right.minorticks_off()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
