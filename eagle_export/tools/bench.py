"""`eagle-export bench`: speculative decoding of one build or several (a chain and a tree of the same
target, say) under both depth policies, and plain autoregressive decoding, same backend, same prompts,
side by side.

All runs of a build go through one runtime object, and plain decoding is the first build's target graph
called one token at a time, so each ratio measures speculation and nothing else. The runs take turns
batch by batch (their order rotating), so all see the same machine load. `efficiency` compares the
measured speedup with what the accepted tokens promise at the measured per-call costs:
    ideal = tokens * t_ar_step / (t_verify + t_draft)        (graph time only)
    efficiency = decode_speedup / ideal, both without the prompt pass (prefill), which is the same work
    in every run; `speedup` itself is end to end, prefill included.
Host time (everything that is not a graph call) is what keeps efficiency below 1. For the goodput
policy a round may be a plain step (no drafter call, k = 0): `depth_histogram` counts rounds by the
number of drafts verified, `draft_calls` the rounds that called the drafter; `verify_width_mean` is the
mean number of tokens per verify call (a chain's k+1, a tree's root plus the nodes kept), and
`round_cost_in_steps` a round's graph time (drafter and verify call) in plain decoding steps.
`plain_round_vs_step` is a round that called no drafter (k = 0, or a last step near the limit) against
a plain decoding step, both timed whole (graph and host) by the runtime: the ratio of their medians over
the bench, which a few rounds slowed by other work on a shared machine do not move. Goodput's `trust` is
what it learned of the drafter's calibration in the last stream, per depth (how often the target's path
reached a depth per time the drafter's probabilities said it would; 1: as good as they say), see
verify_policy.py.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from ..errors import EagleExportError
from ..output_dir import write_output
from ..progress import track
from ..runtime.costs import disagreement
from ..runtime.runtime import GenerationConfig, SpeculativeRuntime
from ..runtime.verify_policy import POLICIES, break_even_acceptance, make_policy, round_speedup
from ..speculation.stats import acceptance_by_depth, mean_accepted_length
from ..speculation.synthetic import SyntheticDrafts, label, verify_width_continuations
from ..speculation.tree import describe


def _batches(prompts, batch):
    return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


def device_name(runtime: SpeculativeRuntime) -> str:
    if runtime.device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU"


def model_speedup(costs, batch: int, depth: int, verify_width: int, acceptance, policy: str) -> float:
    """What the cost model promises at synthetic acceptance a_1..a_D along the spine: greedy rounds
    yield E_k = 1 + sum_{i<=k} prod_{j<=i} a_j tokens verifying k spine drafts, against one token per
    plain step of c_verify(1):
        fixed     E_D * c_v(1) / (c_draft + c_v(verify_width))     (the whole chain or tree)
        goodput   max(1, max_k E_k * c_v(1) / (c_draft + c_v(k + 1)))   (k = 0: plain steps)"""
    reach = [1.0]
    for a in acceptance[:depth]:
        reach.append(reach[-1] * a)
    expected = [sum(reach[:k + 1]) for k in range(depth + 1)]
    if policy == "fixed":
        return round_speedup(costs, batch, expected[depth], verify_width)
    return max([1.0] + [round_speedup(costs, batch, expected[k], k + 1) for k in range(1, depth + 1)])


COST_NOISE = 1.25  # two measurements of one target graph farther apart than this are not noise


def cost_disagreements(runtimes: dict[str, SpeculativeRuntime], batch: int) -> list[str]:
    """Builds of one target call the same target graph, so their verify curves must agree within
    COST_NOISE; where they do not (curves cached at other times and loads, or a load that changed
    mid-run), goodput decides differently on the same target and the comparison misleads."""
    first, *others = runtimes
    found = []
    for name in others:
        worst = disagreement(runtimes[first].costs.verify_s.get(batch, {}), runtimes[name].costs.verify_s.get(batch, {}))
        if worst is not None and worst[1] > COST_NOISE:
            found.append(f"{first} and {name} have the same target, but their verify costs at T={worst[0]} differ "
                         f"{worst[1]:.2f}x (batch {batch}): the machine's load changed between the measurements")
    return found


def bench(runtimes: dict[str, SpeculativeRuntime], prompts: list[list[int]], batch: int, config: GenerationConfig,
          warmup: int = 1, acceptances: list | None = None, repeat: int = 1, progress=None) -> dict:
    """runtimes: the builds to compare, by name, all of one target (plain decoding runs on the first).
    acceptances: None, the real drafters; else synthetic settings (`synthetic.py`), one run of each
    build and policy per setting, the drafts of each batch replaced after the real drafter call.
    repeat: passes over the prompts (the runs' order keeps rotating), for medians over more batches.
    progress: called with one line as each batch finishes, every run's speedup over the batches so far."""
    plain = next(iter(runtimes))
    settings = acceptances or [None]
    runs = [(name, p, a) for name in runtimes for a in range(len(settings)) for p in POLICIES] + [(plain, None, None)]
    for chunk in _batches(prompts, batch)[:warmup]:  # first calls pay for allocation and kernel selection
        for name, policy in dict.fromkeys((name, policy) for name, policy, _ in runs):
            runtimes[name].generate(chunk, GenerationConfig(max_new_tokens=8, eos_ids=config.eos_ids),
                                    speculative=policy is not None, verify_policy=policy)
    for runtime in runtimes.values():
        runtime.cost_curves(batch)  # measured (or read from the cache) before anything is timed
    cost_warnings = cost_disagreements(runtimes, batch)
    # One policy object per build, setting and policy (each stream starts it afresh: what it learned by
    # the last stream's end is what the record reports as trust).
    learners = {run: make_policy(run[1], runtimes[run[0]].depth, runtimes[run[0]].costs) for run in runs[:-1]}

    totals = {run: Counter() for run in runs}
    plain_round_s = {run: [] for run in runs}
    stats = {run: [] for run in runs[:-1]}
    per_batch = {run: [] for run in runs[:-1]}
    distinct = _batches(prompts, batch)
    chunks, continued, began = distinct * repeat, {}, time.perf_counter()
    for i, chunk in enumerate(track(chunks, f"batch {batch}")):
        synthetic = [None] * len(settings)
        if acceptances:  # one continuation for every setting and repeat (target-only greedy decoding: the same
            # for every build and every pass over the prompts)
            first = i % len(distinct)  # (this chunk's first pass)
            if first not in continued:
                continued[first] = verify_width_continuations(runtimes[plain], chunk, config)
            continuations = continued[first]
            synthetic = [SyntheticDrafts(a, continuations, runtimes[plain].vocab_size, seed=i) for a in settings]
        order = runs[i % len(runs):] + runs[:i % len(runs)]
        rates, tokens = {}, {}
        for run in order:
            runtime, policy = runtimes[run[0]], run[1]
            drafts = None if run[2] is None else synthetic[run[2]]  # None: the real drafter's own drafts
            start = time.perf_counter()
            results = runtime.generate(chunk, config, speculative=policy is not None,
                                       verify_policy=learners.get(run), synthetic=drafts)
            seconds, t = time.perf_counter() - start, runtime.timings
            if policy is not None:
                totals[run]["rounds"] += max(r.stats.rounds for r in results)  # a batch advances in lock step
                totals[run]["draft_calls"] += max(r.stats.draft_calls for r in results)
                stats[run].extend(r.stats for r in results)
            else:
                totals[run]["steps"] += max(r.stats.new_tokens for r in results)
            tokens[run] = [r.tokens for r in results]
            count = sum(r.stats.new_tokens for r in results)
            totals[run].update({"tokens": count, "seconds": seconds, "prefill": t.prefill, "draft": t.draft,
                                "verify": t.verify, "synthetic": t.synthetic})
            plain_round_s[run] += t.plain_round_s
            rates[run] = count / seconds
        for run in runs[:-1]:
            per_batch[run].append(rates[run] / rates[runs[-1]])
            # Greedy speculation must reproduce plain decoding token for token: bench checks it on every batch,
            # and synthetic runs also against the verify-width continuation their drafts were read from.
            totals[run]["differing"] += sum(a != b for a, b in zip(tokens[run], tokens[runs[-1]]))
            if settings[run[2]] is not None:
                wide = [c[:config.max_new_tokens] for c in synthetic[run[2]].continuations]
                totals[run]["differing_wide"] += sum(a != b for a, b in zip(tokens[run], wide))
        if progress:
            plain_rate = totals[runs[-1]]["tokens"] / totals[runs[-1]]["seconds"]

            def so_far(run):  # rounded as the record's `speedup` is first (the last line is its headline, the same)
                return round(totals[run]["tokens"] / totals[run]["seconds"] / plain_rate, 4)
            progress(f"batch size {batch}: {i + 1}/{len(chunks)} batches in {time.perf_counter() - began:.0f} s; "
                     "speedup so far " + ", ".join(
                         " ".join(filter(None, (name if len(runtimes) > 1 else None, policy,
                                                None if settings[a] is None else f"at {label(settings[a])}")))
                         + f" {so_far((name, policy, a)):.2f}x"
                         for name, policy, a in runs[:-1]))

    ar = totals[runs[-1]]
    ar_round_s = statistics.median(plain_round_s[runs[-1]]) if plain_round_s[runs[-1]] else None
    t_ar_step = ar["verify"] / ar["steps"]
    first = runtimes[plain]
    result = {
        "backend": first.backend.name, "device": device_name(first), "batch": batch,
        "cuda_graphs": first.backend.cuda_graphs, "static_cache": first.static_cache,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # torch's idle threads spin unless PASSIVE
        "prompts": len(prompts), "repeat": repeat, "max_new_tokens": config.max_new_tokens,
        "ar_tokens_per_s": round(ar["tokens"] / ar["seconds"], 2), "ar_step_ms": round(1000 * t_ar_step, 3),
        "ar_round_ms": _ms(ar_round_s),
        "cost_warnings": cost_warnings,
        "builds": {},
    }
    if acceptances:
        result["synthetic"] = {"acceptance": [label(a) for a in settings],
                               "note": "synthetic acceptance: the real drafter call runs, its drafts are replaced"}
    for name, runtime in runtimes.items():
        curves, backend = runtime.costs, runtime.backend
        build = result["builds"][name] = {
            "speculation": describe(backend.speculation), "depth": runtime.depth, "nodes": backend.num_nodes,
            "verify_width": backend.verify_width,
            "costs": curves.in_ms(batch),
        }
        records = []
        for a, setting in enumerate(settings):
            policies = {p: _policy_record(totals[(name, p, a)], stats[(name, p, a)], per_batch[(name, p, a)], ar,
                                          t_ar_step, runtime.depth, plain_round_s[(name, p, a)], ar_round_s)
                        for p in POLICIES}
            for p, record in policies.items():  # each pass over the prompts on its own (median over its batches)
                batches = per_batch[(name, p, a)]
                size = len(batches) // repeat
                record["speedup_by_pass"] = [round(statistics.median(batches[r * size:(r + 1) * size]), 4)
                                             for r in range(repeat)]
            # What goodput learned of the drafter's calibration (drafts accepted / promised; 1: as it says).
            policies["goodput"]["trust"] = [round(t, 4) for t in learners[(name, "goodput", a)].trust]
            if setting is not None:
                acceptance = SyntheticDrafts(setting, [], runtime.vocab_size or 1).probabilities(runtime.depth).tolist()
                for p, record in policies.items():
                    record["identical_to_verify_width"] = totals[(name, p, a)]["differing_wide"] == 0
                    record["model_speedup"] = round(model_speedup(curves, batch, runtime.depth, backend.verify_width,
                                                                  acceptance, p), 4)
                    record["efficiency_vs_model"] = round(record["decode_speedup"] / record["model_speedup"], 4)
            records.append({"acceptance": label(setting) if setting is not None else "drafter",
                            "policies": policies})
        build["policies"] = records[0]["policies"]
        if len(records) > 1:
            build["sweep"] = records
        if acceptances:
            pays = break_even_acceptance(curves, batch, runtime.depth, margin=1.0)
            build["break_even_acceptance"] = None if pays is None else round(pays[0], 4)
    return result


def _ms(seconds: float | None) -> float | None:
    """Seconds as the JSON's milliseconds (None: nothing was timed)."""
    return None if seconds is None else round(1000 * seconds, 3)


def _policy_record(s: Counter, seqs: list, per_batch: list[float], ar: Counter, t_ar_step: float, depth: int,
                   plain_round_s: list[float], ar_round_s: float | None) -> dict:
    """One policy's figures over the bench: tau, depths, widths, speedups, efficiency, time split.
    plain_round_s: the seconds of each of its rounds without a drafter call; ar_round_s: plain
    decoding's median step (None: there was none)."""
    round_s = statistics.median(plain_round_s) if plain_round_s else None
    accepted = [a for q in seqs for a in q.accepted]
    depths = [k for q in seqs for k in q.depths]
    widths = [w for q in seqs for w in q.widths]
    spec_tps = s["tokens"] / s["seconds"]
    decode_speedup = (s["tokens"] / (s["seconds"] - s["prefill"])) / (ar["tokens"] / (ar["seconds"] - ar["prefill"]))
    tau = mean_accepted_length(accepted)
    round_graph_s = (s["draft"] + s["verify"]) / s["rounds"]
    ideal = tau * t_ar_step / round_graph_s
    host = s["seconds"] - s["prefill"] - s["draft"] - s["verify"]
    return {
        "tau": round(tau, 4),
        "acceptance_by_depth": [round(a, 4) for a in acceptance_by_depth(accepted, depth, 0.0, verified=depths)],
        "depth_histogram": {k: depths.count(k) for k in range(depth + 1)},
        "verify_width_mean": round(statistics.mean(widths), 3),
        "round_cost_in_steps": round(round_graph_s / t_ar_step, 3),
        # A round without a drafter call should cost what a plain decoding step does: the runtime's
        # speculative bookkeeping is the difference (pending drafter rows, the policy, the stats).
        "plain_round_ms": _ms(round_s),
        "plain_round_vs_step": round(round_s / ar_round_s, 4) if round_s and ar_round_s else None,
        "rounds": s["rounds"], "draft_calls": s["draft_calls"],
        "identical_to_autoregressive": s["differing"] == 0,
        "spec_tokens_per_s": round(spec_tps, 2), "speedup": round(spec_tps / (ar["tokens"] / ar["seconds"]), 4),
        "speedup_median_over_batches": round(statistics.median(per_batch), 4), "batches": len(per_batch),
        "time_split": {"prefill": round(s["prefill"], 4), "draft": round(s["draft"], 4),
                       "verify": round(s["verify"], 4), "host": round(host, 4),
                       "draft_per_round_ms": round(1000 * s["draft"] / s["rounds"], 3),
                       "verify_per_round_ms": round(1000 * s["verify"] / s["rounds"], 3),
                       "host_per_round_ms": round(1000 * host / s["rounds"], 3),
                       # of host, the synthetic drafts' making (the benchmark's own work, not the runtime's)
                       "synthetic_per_round_ms": round(1000 * s["synthetic"] / s["rounds"], 3)},
        "decode_speedup": round(decode_speedup, 4), "ideal_speedup": round(ideal, 4),
        "efficiency": round(decode_speedup / ideal, 4),
    }


SWEEP = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def pyplot(path=None):
    """matplotlib's pyplot (file output only), or the error naming the extra that installs it; with
    `path`, also refused where its suffix names a format matplotlib does not write. The commands ask
    before they measure anything, so a missing extra or a misspelt --plot costs no run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EagleExportError("--plot needs matplotlib, which is not installed",
                               "pip install 'eagle-export[plot]'") from None
    if path is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if plot_format(path) not in formats:
            raise EagleExportError(f"--plot {path}: matplotlib cannot write a .{plot_format(path)} file",
                                   f"name the plot with one of the suffixes {', '.join(sorted(formats))} "
                                   "(e.g. bench.png)")
    return plt


def plot_format(path) -> str:
    """The image format a plot's file name asks for: its suffix, or matplotlib's default (png) without one."""
    suffix = Path(path).suffix.lower().removeprefix(".")
    if suffix:
        return suffix
    import matplotlib

    return matplotlib.rcParams["savefig.format"]


def save_figure(fig, path, dpi: int) -> None:
    """`fig` into `path` in the format its name asks for, written beside and renamed (`write_output`)."""
    write_output(path, write=lambda tmp: fig.savefig(tmp, format=plot_format(path), dpi=dpi))


def plot(results: list[dict], path) -> None:
    """Acceptance by depth, the measured cost curves, the goodput policy's depth histogram, and the
    speedup of both policies by batch, per build, as a PNG."""
    plt = pyplot()
    fig, ((accept, costs), (hist, speed)) = plt.subplots(2, 2, figsize=(11, 8))
    first = results[0]
    names = list(first["builds"])
    width = 0.8 / len(names)
    max_depth = max(b["depth"] for b in first["builds"].values())
    for j, name in enumerate(names):
        build = first["builds"][name]
        fixed = build["policies"]["fixed"]
        offset = (j - (len(names) - 1) / 2) * width
        accept.bar([d + offset for d in range(1, build["depth"] + 1)], fixed["acceptance_by_depth"], width,
                   label=f"{name}: {build['speculation']}, tau {fixed['tau']:.2f}")
        h = build["policies"]["goodput"]["depth_histogram"]
        total = max(1, sum(h.values()))
        hist.bar([int(k) + offset for k in h], [n / total for n in h.values()], width, label=name)
    accept.set(xlabel="draft depth", ylabel="acceptance rate", ylim=(0, 1), xticks=list(range(1, max_depth + 1)),
               title=f"acceptance by depth (fixed policy, batch {first['batch']})")
    accept.legend(fontsize=8)
    hist.set(xlabel="depth verified (0: plain step or k = 0)", ylabel="share of rounds",
             xticks=list(range(max_depth + 1)), title=f"depths the goodput policy chose (batch {first['batch']})")
    hist.legend(fontsize=8)
    for r in results:
        for name, build in r["builds"].items():
            verify = {int(t): ms for t, ms in build["costs"]["verify_ms"].items()}
            draft = {int(w): ms for w, ms in build["costs"]["draft_ms"].items()}
            line, = costs.plot(list(verify), list(verify.values()), marker="o", label=f"verify, {name}, batch {r['batch']}")
            costs.plot(list(draft), list(draft.values()), marker="x", linestyle="--", color=line.get_color(),
                       label=f"drafter ({build['speculation']}), batch {r['batch']}")
    costs.set(xlabel="tokens per call T (verify) / input rows W (drafter)", ylabel="ms per call", ylim=(0, None),
              title="measured cost per call")
    costs.legend(fontsize=7)
    batches = [r["batch"] for r in results]
    for name in names:
        for p, marker in (("goodput", "o"), ("fixed", "s")):
            speed.plot(batches, [r["builds"][name]["policies"][p]["speedup"] for r in results], marker=marker,
                       label=f"{name}, {p}")
        speed.plot(batches, [r["builds"][name]["policies"]["fixed"]["ideal_speedup"] for r in results], marker="x",
                   linestyle="--", label=f"{name}, fixed, ideal (tau-bound)")
    speed.axhline(1.0, color="gray", linewidth=0.8)
    speed.set(xlabel="batch", ylabel="speedup over autoregressive", xscale="log",
              title=f"{first['backend']} on {first['device']}")
    speed.set_xticks(batches, [str(b) for b in batches])
    speed.minorticks_off()
    speed.legend(fontsize=7)
    if "synthetic" in first:
        fig.suptitle(f"SYNTHETIC acceptance {', '.join(first['synthetic']['acceptance'])}: the real drafter call "
                     "runs, its drafts are replaced", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def plot_sweep(results: list[dict], path) -> None:
    """Speedup against synthetic acceptance, per build, policy and batch, beside the cost model's
    promise, with each batch's break-even acceptance, as a PNG."""
    plt = pyplot()
    cols = min(2, len(results))  # batches side by side; builds or shapes one under another
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.set_visible(False)
    for ax, r in zip(axes.flat, results):
        for name, build in r["builds"].items():
            flat = [rec for rec in build["sweep"] if "/" not in rec["acceptance"]]  # one value for every depth
            xs = [float(rec["acceptance"]) for rec in flat]
            for p, marker in (("goodput", "o"), ("fixed", "s")):
                line, = ax.plot(xs, [rec["policies"][p]["decode_speedup"] for rec in flat], marker=marker,
                                label=f"{p}, measured" + (f" ({name})" if len(r["builds"]) > 1 else ""))
                ax.plot(xs, [rec["policies"][p]["model_speedup"] for rec in flat], linestyle="--",
                        color=line.get_color(), label=f"{p}, cost model")
            if build.get("break_even_acceptance") is not None:
                ax.axvline(build["break_even_acceptance"], color="gray", linestyle=":",
                           label=f"break-even {build['break_even_acceptance']:.2f}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        first = next(iter(r["builds"].values()))
        ax.set(xlabel="synthetic acceptance per draft", ylabel="decode speedup over plain decoding",
               title=f"{r['backend']} on {r['device']}, batch {r['batch']}, {first['speculation']}", xlim=(0, 1))
        ax.legend(fontsize=7)
    fig.suptitle("synthetic acceptance: the real drafter call runs, its drafts are replaced", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
