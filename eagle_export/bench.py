"""`eagle-export bench`: speculative decoding under both depth policies and plain autoregressive
decoding, same backend, same prompts, side by side.

All runs go through one runtime object: the autoregressive baseline is the target graph called
one token at a time, so each ratio measures speculation and nothing else. The three runs take
turns batch by batch (their order rotating), so all see the same machine load. `efficiency`
compares the measured speedup with what the accepted tokens promise at the measured per-call costs:
    ideal = tokens * t_ar_step / (t_verify + t_draft)        (graph time only)
    efficiency = decode_speedup / ideal, both without the prompt pass (prefill), which is the same work
    in every run; `speedup` itself is end to end, prefill included.
Host time (everything that is not a graph call) is what keeps efficiency below 1. For the goodput
policy a round may be a plain step (no drafter call, k = 0): `depth_histogram` counts rounds by the
number of drafts verified, `draft_calls` the rounds that called the drafter.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections import Counter

import torch

from .depth_policy import POLICIES
from .errors import EagleExportError
from .progress import track
from .reference import acceptance_by_depth, mean_accepted_length
from .runtime import GenerationConfig, SpeculativeRuntime


def _batches(prompts, batch):
    return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


def device_name(runtime: SpeculativeRuntime) -> str:
    if runtime.device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU"


def _timed(runtime, chunk, config, policy):
    start = time.perf_counter()
    results = runtime.generate(chunk, config, speculative=policy is not None, depth_policy=policy)
    return results, time.perf_counter() - start, runtime.timings


def bench(runtime: SpeculativeRuntime, prompts: list[list[int]], batch: int, config: GenerationConfig,
          warmup: int = 1) -> dict:
    runs = (*POLICIES, None)  # None: plain autoregressive decoding
    for chunk in _batches(prompts, batch)[:warmup]:  # first calls pay for allocation and kernel selection
        for policy in runs:
            runtime.generate(chunk, GenerationConfig(max_new_tokens=8, eos_ids=config.eos_ids),
                             speculative=policy is not None, depth_policy=policy)
    runtime.cost_curves(batch)  # measured (or read from the cache) before anything is timed

    totals = {run: Counter() for run in runs}
    accepted = {p: [] for p in POLICIES}
    depths = {p: [] for p in POLICIES}
    per_batch = {p: [] for p in POLICIES}
    for i, chunk in enumerate(track(_batches(prompts, batch), f"batch {batch}")):
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        seconds, tokens = {}, {}
        for run in order:
            results, secs, t = _timed(runtime, chunk, config, run)
            if run is not None:
                totals[run]["rounds"] += max(r.stats.rounds for r in results)  # a batch advances in lock step
                totals[run]["draft_calls"] += max(r.stats.draft_calls for r in results)
                for r in results:
                    accepted[run].extend(r.stats.accepted)
                    depths[run].extend(r.stats.depths)
            else:
                totals[run]["steps"] += max(r.stats.new_tokens for r in results)
            tokens[run] = [r.tokens for r in results]
            count = sum(r.stats.new_tokens for r in results)
            totals[run].update({"tokens": count, "seconds": secs, "prefill": t.prefill, "draft": t.draft,
                                "verify": t.verify})
            seconds[run] = (count, secs)
        ar_rate = seconds[None][0] / seconds[None][1]
        for p in POLICIES:
            per_batch[p].append(seconds[p][0] / seconds[p][1] / ar_rate)
            # Greedy speculation must reproduce plain decoding token for token: bench checks it on every batch.
            totals[p]["differing"] += sum(a != b for a, b in zip(tokens[p], tokens[None]))

    ar = totals[None]
    ar_tps = ar["tokens"] / ar["seconds"]
    t_ar_step = ar["verify"] / ar["steps"]
    curves = runtime.costs
    result = {
        "backend": runtime.backend.name, "device": device_name(runtime), "batch": batch, "depth": runtime.depth,
        "cuda_graphs": runtime.backend.cuda_graphs, "static_cache": runtime.static_cache,
        "prompts": len(prompts), "max_new_tokens": config.max_new_tokens,
        "ar_tokens_per_s": round(ar_tps, 2), "ar_step_ms": round(1000 * t_ar_step, 3),
        "costs": {"verify_ms": {t: round(1000 * s, 3) for t, s in curves.verify_s[batch].items()},
                  "draft_ms": {w: round(1000 * s, 3) for w, s in curves.draft_s[batch].items()}},
        "policies": {},
    }
    for p in POLICIES:
        s = totals[p]
        spec_tps = s["tokens"] / s["seconds"]
        decode_speedup = (s["tokens"] / (s["seconds"] - s["prefill"])) / (ar["tokens"] / (ar["seconds"] - ar["prefill"]))
        tau = mean_accepted_length(accepted[p])
        ideal = tau * t_ar_step / ((s["draft"] + s["verify"]) / s["rounds"])
        host = s["seconds"] - s["prefill"] - s["draft"] - s["verify"]
        result["policies"][p] = {
            "tau": round(tau, 4),
            "acceptance_by_depth": [round(a, 4) for a in acceptance_by_depth(accepted[p], runtime.depth, 0.0,
                                                                             verified=depths[p])],
            "depth_histogram": {k: depths[p].count(k) for k in range(runtime.depth + 1)},
            "rounds": s["rounds"], "draft_calls": s["draft_calls"],
            "identical_to_autoregressive": s["differing"] == 0,
            "spec_tokens_per_s": round(spec_tps, 2), "speedup": round(spec_tps / ar_tps, 4),
            "speedup_median_over_batches": round(statistics.median(per_batch[p]), 4),
            "time_split": {"prefill": round(s["prefill"], 4), "draft": round(s["draft"], 4),
                           "verify": round(s["verify"], 4), "host": round(host, 4),
                           "draft_per_round_ms": round(1000 * s["draft"] / s["rounds"], 3),
                           "verify_per_round_ms": round(1000 * s["verify"] / s["rounds"], 3),
                           "host_per_round_ms": round(1000 * host / s["rounds"], 3)},
            "decode_speedup": round(decode_speedup, 4), "ideal_speedup": round(ideal, 4),
            "efficiency": round(decode_speedup / ideal, 4),
        }
    return result


def pyplot():
    """matplotlib's pyplot (file output only), or the error naming the extra that installs it.
    The bench command asks before it measures anything, so a missing extra costs no bench run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EagleExportError("--plot needs matplotlib, which is not installed",
                               "pip install 'eagle-export[plot]'") from None
    return plt


def plot(results: list[dict], path) -> None:
    """Acceptance by depth, the measured cost curves, the goodput policy's depth histogram, and the
    speedup of both policies by batch, as a PNG."""
    plt = pyplot()
    fig, ((accept, costs), (hist, speed)) = plt.subplots(2, 2, figsize=(11, 8))
    first = results[0]
    fixed = first["policies"]["fixed"]
    depths = list(range(1, first["depth"] + 1))
    accept.bar(depths, fixed["acceptance_by_depth"], color="tab:blue")
    accept.set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1), xticks=depths,
               title=f"acceptance by depth (fixed K, tau {fixed['tau']:.2f}, batch {first['batch']})")
    for r in results:
        verify = {int(t): ms for t, ms in r["costs"]["verify_ms"].items()}
        draft = {int(w): ms for w, ms in r["costs"]["draft_ms"].items()}
        line, = costs.plot(list(verify), list(verify.values()), marker="o", label=f"verify, batch {r['batch']}")
        costs.plot(list(draft), list(draft.values()), marker="x", linestyle="--", color=line.get_color(),
                   label=f"drafter (K={r['depth']}), batch {r['batch']}")
    costs.set(xlabel="tokens per call T (verify) / input rows W (drafter)", ylabel="ms per call", ylim=(0, None),
              title="measured cost per call")
    costs.legend(fontsize=8)
    width = 0.8 / len(results)
    for j, r in enumerate(results):
        h = r["policies"]["goodput"]["depth_histogram"]
        ks = [int(k) for k in h]
        total = max(1, sum(h.values()))
        hist.bar([k + (j - (len(results) - 1) / 2) * width for k in ks], [n / total for n in h.values()], width,
                 label=f"batch {r['batch']}")
    hist.set(xlabel="drafts verified per round (0: plain step or k = 0)", ylabel="share of rounds",
             xticks=list(range(first["depth"] + 1)), title="depths the goodput policy chose")
    hist.legend(fontsize=8)
    batches = [r["batch"] for r in results]
    for p, marker in (("goodput", "o"), ("fixed", "s")):
        speed.plot(batches, [r["policies"][p]["speedup"] for r in results], marker=marker, label=p)
    speed.plot(batches, [r["policies"]["fixed"]["ideal_speedup"] for r in results], marker="x", linestyle="--",
               label="fixed, ideal (tau-bound)")
    speed.axhline(1.0, color="gray", linewidth=0.8)
    speed.set(xlabel="batch", ylabel="speedup over autoregressive", xscale="log",
              title=f"{first['backend']} on {first['device']}")
    speed.set_xticks(batches, [str(b) for b in batches])
    speed.minorticks_off()
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
