"""`eagle-export diagnose`: why a drafter stops being accepted, depth by depth.

The target answers each prompt greedily; the drafter's chain then runs at every answer position at
once (`reference.replay_greedy`, which also replays the greedy loop's rounds from the same chains),
with forward hooks on the drafter's own modules (`Probe`), never a copy of it. For draft k = 1..K
(from drafter step k-1), over the chains at every answer position:

- acceptance, teacher-forced: the share of chains whose step k-1 gives the target's greedy token,
  each step fed the target's tokens (the chain the loop runs while its drafts are accepted);
  live: the greedy loop's acceptance of draft k given drafts 1..k-1 were accepted (its rounds);
- hidden RMS: the RMS of the state entering the decoder layer at step k-1: fc's output for k = 1,
  the fed-back state after (pre-norm in EAGLE-3, post-norm in EAGLE-3.1); layer-out RMS: the
  layer's pre-norm output at that step (what EAGLE-3 feeds back);
- attention mass of the step's query, averaged over heads: on position 0 (the sink), on the other
  step-0 (prefix) keys, and on the keys of the chain's own steps 1..k-1 and itself; they sum to 1;
- entropy (nats) of the draft distribution softmax(logits) over the draft vocabulary, its
  confidence (the greedy draft's probability) and the reliability of that confidence against
  teacher-forced acceptance in BINS equal-width bins, with the expected calibration error.
"""

from __future__ import annotations

import math
from copy import deepcopy
from pathlib import Path

import torch

from ..builder.conformance import capture
from ..data.prompts import ChatTemplate, chat_prompts
from ..errors import EagleExportError
from ..export.loader import prepare_pair
from ..models.checkpoint import load_drafter, load_target
from ..models.drafter import Drafter
from ..models.target import Target
from ..progress import track
from ..speculation.eager import replay_greedy
from ..speculation.stats import acceptance_by_depth, mean_accepted_length
from .checkpoint_export import resolve_source

BINS = 10
MIN_PLOTTED_ROUNDS = 20  # live acceptance over fewer rounds is left out of the plot (still in the table)
FIGURES = ("hidden_rms", "layer_out_rms", "sink_mass", "prefix_mass", "chain_mass", "entropy", "confidence")


class Probe:
    """Forward hooks on one drafter's layer, attention weights and lm_head, reducing every step of a
    chain computation to per-chain figures as it runs (the [T, keys] attention weights are not kept).

    `chains`: the number of chains, the last rows of every step; `prefix`: the number of step-0 keys
    (key 0 is the sink, keys 1..prefix-1 the rest of the prefix, later keys the chains' own)."""

    def __init__(self, drafter: Drafter, chains: int, prefix: int):
        self.drafter, self.chains, self.prefix = drafter, chains, prefix
        self.steps: list[dict[str, torch.Tensor]] = []
        layer = drafter.midlayer
        self.handles = [layer.register_forward_pre_hook(self._enter),
                        layer.register_forward_hook(self._leave),
                        layer.self_attn.weights_tap.register_forward_hook(self._attention),
                        drafter.lm_head.register_forward_hook(self._logits)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[0, -self.chains:].float()

    def _enter(self, module, args):
        self.steps.append({"hidden_rms": _rms(self._rows(args[1]))})

    def _leave(self, module, args, output):
        self.steps[-1]["layer_out_rms"] = _rms(self._rows(output[0]))

    def _attention(self, module, args, weights):
        w = weights[0, :, :, -self.chains:].float().flatten(0, 1)  # [heads, chains, keys]
        step = self.steps[-1]
        step["sink_mass"] = w[..., 0].mean(0)
        step["prefix_mass"] = w[..., 1:self.prefix].sum(-1).mean(0)
        step["chain_mass"] = w[..., self.prefix:].sum(-1).mean(0)

    def _logits(self, module, args, logits):
        logp = torch.log_softmax(self._rows(logits), dim=-1)
        step = self.steps[-1]
        step["entropy"] = -(logp.exp() * logp).sum(-1)
        confidence, index = logp.max(-1)
        step["confidence"] = confidence.exp()
        step["draft"] = self.drafter.to_target_ids(index)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1).sqrt()


def reliability(confidence: torch.Tensor, correct: torch.Tensor, bins: int = BINS) -> tuple[list[dict], float]:
    """Confidence against accuracy in `bins` equal-width bins over [0, 1] (a confidence of exactly 1
    falls in the last), and the expected calibration error: sum over bins of |accuracy - mean
    confidence| weighted by the bin's share of the samples."""
    index = (confidence * bins).long().clamp(0, bins - 1)
    rows, ece, total = [], 0.0, len(confidence)
    for b in range(bins):
        inside = index == b
        count = int(inside.sum())
        row = {"lo": b / bins, "hi": (b + 1) / bins, "count": count, "confidence": None, "accuracy": None}
        if count:
            conf, acc = float(confidence[inside].mean()), float(correct[inside].float().mean())
            row.update(confidence=round(conf, 4), accuracy=round(acc, 4))
            ece += count / total * abs(acc - conf)
        rows.append(row)
    return rows, ece


@torch.no_grad()
def chain_figures(drafter: Drafter, sequence: list[int], aux: torch.Tensor, prompt_len: int, max_new_tokens: int,
                  depth: int, eos_ids=()) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor, list[int]]:
    """One prompt: sequence = prompt + the target's greedy continuation (max_new_tokens + depth
    tokens, not cut at EOS), aux [1, len-1, A*Ht] its aux states.
    -> (each figure per step [chains], teacher-forced correctness per step [depth, chains], the
    greedy loop's accepted counts). Chains sit at the answer positions whose every step has a label
    at or before the first EOS of the answer."""
    chains_end = len(sequence) - depth  # replay_greedy's chains: 0 .. len - depth - 1
    first = prompt_len - 1
    with Probe(drafter, chains_end - first, chains_end) as probe:
        replayed = replay_greedy(drafter, sequence, aux, prompt_len, max_new_tokens, [depth], eos_ids)
    answer = sequence[prompt_len:]
    end = next((prompt_len + i + 1 for i, t in enumerate(answer) if t in eos_ids), len(sequence))
    positions = torch.arange(first, chains_end)
    keep = positions + depth + 1 < end  # step k at p predicts sequence[p + k + 2]
    labels = torch.tensor(sequence)
    figures = {name: [step[name][keep] for step in probe.steps] for name in FIGURES}
    correct = torch.stack([step["draft"][keep] == labels[positions[keep] + k + 2]
                           for k, step in enumerate(probe.steps)])
    return figures, correct, replayed[depth].accepted


def summarize(figures: dict[str, list[torch.Tensor]], correct: torch.Tensor, accepted: list[int], depth: int) -> dict:
    """The per-depth table from the figures of every chain of a prompt set."""
    live = acceptance_by_depth(accepted, depth)
    rows = []
    for k in range(depth):
        bins, ece = reliability(figures["confidence"][k], correct[k])
        row = {"depth": k + 1, "acceptance_teacher_forced": round(float(correct[k].float().mean()), 4),
               "acceptance_live": None if math.isnan(live[k]) else round(live[k], 4),
               "live_rounds": sum(m >= k for m in accepted)}  # rounds that verified draft k after 1..k-1 accepted
        row.update({name: round(float(figures[name][k].mean()), 4) for name in FIGURES})
        row.update(ece=round(ece, 4), reliability=bins)
        rows.append(row)
    return {"chains": int(correct.shape[1]), "rounds": len(accepted),
            "tau": round(mean_accepted_length(accepted, 0.0), 4), "depths": rows}


@torch.no_grad()
def diagnose(target: Target, drafters: dict[str, Drafter], prompt_sets: dict[str, list[list[int]]], depth: int,
             max_new_tokens: int, progress=None) -> dict:
    """Every drafter (all for `target`) on every prompt set: the per-depth figures of the module doc.
    The target answers each prompt once; its states feed every drafter. `progress` is called with one
    line per prompt: each drafter's live acceptance by depth over the set so far."""
    eos_ids = target.config.eos_ids
    collected = {(name, s): ({f: [[] for _ in range(depth)] for f in FIGURES}, [], [])
                 for name in drafters for s in prompt_sets}
    lengths = {s: [len(p) for p in prompts] for s, prompts in prompt_sets.items()}
    for set_name, prompts in prompt_sets.items():
        for done, prompt in enumerate(track(prompts, f"diagnose {set_name}"), 1):
            sequence = list(prompt) + target.generate_greedy(prompt, max_new_tokens + depth)
            states, _ = capture(target, [sequence[:-1]])[0]
            for name, drafter in drafters.items():
                layers = list(drafter.config.resolved_aux_layer_ids(target.config))
                aux = states[:, layers].reshape(1, len(sequence) - 1, -1).to(drafter.fc.weight.dtype)
                figures, correct, accepted = chain_figures(drafter, sequence, aux, len(prompt), max_new_tokens,
                                                           depth, eos_ids)
                per_depth, corrects, rounds = collected[(name, set_name)]
                for f in FIGURES:
                    for k in range(depth):
                        per_depth[f][k].append(figures[f][k])
                corrects.append(correct)
                rounds += accepted
            if progress:
                progress(f"diagnose {set_name}: {done}/{len(prompts)} prompts; live acceptance at depth 1..{depth} "
                         + "; ".join(f"{name} " + " ".join(f"{a:.2f}" for a in acceptance_by_depth(
                             collected[(name, set_name)][2], depth)) for name in drafters))
    report = {"depth": depth, "max_new_tokens": max_new_tokens, "drafters": {}}
    for name, drafter in drafters.items():
        cfg = drafter.config
        entry = {"version": "EAGLE-3.1" if cfg.norm_output or cfg.fc_norm else "EAGLE-3",
                 "norm_output": cfg.norm_output, "fc_norm": cfg.fc_norm, "sets": {}}
        for set_name in prompt_sets:
            per_depth, corrects, rounds = collected[(name, set_name)]
            figures = {f: [torch.cat(per_depth[f][k]) for k in range(depth)] for f in FIGURES}
            table = summarize(figures, torch.cat(corrects, dim=1), rounds, depth)
            entry["sets"][set_name] = {"prompts": len(lengths[set_name]),
                                       "mean_prompt_tokens": round(sum(lengths[set_name]) / len(lengths[set_name]), 1),
                                       **table}
        report["drafters"][name] = entry
    return report


def quantized_copies(target: Target, drafters: dict[str, Drafter], precisions, template: ChatTemplate,
                     calib_prompts: int) -> dict[str, Drafter]:
    """Each drafter quantized with ModelOpt to each precision (lm_head and fc kept, as builds keep
    them), calibrated on the target's aux states for `calib_prompts` ShareGPT conversations (up to 512
    tokens each), as `export-checkpoint` calibrates: named "NAME (PRECISION)"."""
    from ..quantize import quantize as Q

    prompts = list(chat_prompts(template, "sharegpt", calib_prompts, max_tokens=512))
    out = {}
    for name, drafter in drafters.items():
        prepare_pair(target, drafter, passes=())  # the target's aux states for this drafter's calibration
        batches = Q.drafter_calibration_batches(target, prompts)
        for precision in precisions:
            copy = deepcopy(drafter)
            copy.share_embeddings(drafter.embed_tokens)  # the target's table, not a copy of it
            out[f"{name} ({precision})"] = Q.quantize(copy, precision, batches)
    return out


def diagnose_sources(sources, target_dir=None, datasets=("mt-bench",), num_prompts: int = 8, depth: int = 6,
                     max_new_tokens: int = 64, quantize=(), calib_prompts: int = 16, echo=None,
                     allow_changed_sources: bool = False, progress=None) -> dict:
    """`diagnose` on builds or drafter directories (with `target_dir`), in fp32 from their checkpoints
    (a build's sources: refused where they changed since the build, unless `allow_changed_sources`),
    and on each drafter quantized to each of `quantize` (`quantized_copies`); drafters of the same
    target share its answers."""
    if depth < 1 or num_prompts < 1 or max_new_tokens < 1 or calib_prompts < 1:
        raise EagleExportError(f"--depth {depth}, --num-prompts {num_prompts}, --max-new-tokens {max_new_tokens} and "
                               f"--calib-prompts {calib_prompts} must all be 1 or more", "pass positive whole numbers")
    by_target: dict[Path, list[tuple[str, Path]]] = {}
    for source in sources:
        resolved = resolve_source(source, target_dir, allow_changed_sources, "diagnose")
        by_target.setdefault(Path(resolved["target_dir"]).resolve(), []).append(
            (Path(source).name, Path(resolved["drafter_dir"])))
    report = {"depth": depth, "max_new_tokens": max_new_tokens, "drafters": {}}
    for tdir, pairs in by_target.items():
        target = load_target(tdir, dtype="float32")
        drafters = {}
        for name, ddir in pairs:
            while name in drafters or name in report["drafters"]:
                name += "'"
            drafters[name] = load_drafter(ddir, target=target, dtype="float32")
        template = ChatTemplate(tdir)
        if quantize:
            if echo:
                echo(f"diagnose: quantizing {', '.join(drafters)} to {', '.join(quantize)} "
                     f"(calibrated on {calib_prompts} ShareGPT conversations)")
            drafters.update(quantized_copies(target, drafters, quantize, template, calib_prompts))
        sets = {d: list(chat_prompts(template, d, num_prompts)) for d in datasets}
        for d, prompts in sets.items():
            if not prompts:
                raise EagleExportError(f"prompt set {d} gave no prompts", "pass a set or file with prompts in it")
        if echo:
            echo(f"diagnose: {', '.join(drafters)} on {tdir.name}: "
                 + ", ".join(f"{d} ({len(p)} prompts)" for d, p in sets.items()))
        part = diagnose(target, drafters, sets, depth, max_new_tokens, progress)
        for name, entry in part["drafters"].items():
            report["drafters"][name] = {"target": str(tdir), **entry}
    return report


def table(report: dict) -> str:
    """The per-depth figures as text, one block per drafter and prompt set."""
    head = (f"{'k':>2} {'acc tf':>6} {'live':>5} {'rounds':>6} {'h rms':>7} {'out rms':>7} {'sink':>5} {'prefix':>6} "
            f"{'chain':>5} {'entropy':>7} {'conf':>5} {'ece':>5}")
    lines = []
    for name, entry in report["drafters"].items():
        for set_name, s in entry["sets"].items():
            lines.append(f"{name} ({entry['version']}) on {set_name}: {s['prompts']} prompts of {s['mean_prompt_tokens']:.0f} "
                         f"tokens on average, {s['chains']} chains, live tau {s['tau']:.2f} over {s['rounds']} rounds")
            lines.append(head)
            for r in s["depths"]:
                live = "-" if r["acceptance_live"] is None else f"{r['acceptance_live']:.2f}"
                lines.append(f"{r['depth']:>2} {r['acceptance_teacher_forced']:>6.2f} {live:>5} {r['live_rounds']:>6} "
                             f"{r['hidden_rms']:>7.3f} "
                             f"{r['layer_out_rms']:>7.3f} {r['sink_mass']:>5.2f} {r['prefix_mass']:>6.2f} "
                             f"{r['chain_mass']:>5.2f} {r['entropy']:>7.2f} {r['confidence']:>5.2f} {r['ece']:>5.3f}")
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """Hidden-state RMS, sink mass and acceptance (teacher-forced and live) against depth: one
    colour per drafter, one line style per prompt set."""
    from .bench import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("hidden_rms", "RMS of the state entering the step", None),
              ("sink_mass", "attention mass on position 0 (sink)", None),
              ("acceptance_teacher_forced", "acceptance, teacher-forced", (0, 1)),
              ("acceptance_live", f"acceptance, greedy loop (given 1..k-1; {MIN_PLOTTED_ROUNDS}+ rounds)", (0, 1)))
    styles = ("-", "--", ":", "-.")
    depths = list(range(1, report["depth"] + 1))
    for i, (name, entry) in enumerate(report["drafters"].items()):
        color = f"C{i}"
        for j, (set_name, s) in enumerate(entry["sets"].items()):
            for ax, (key, _, _) in zip(axes.flat, panels):
                values = [float("nan") if r[key] is None or (key == "acceptance_live" and
                                                            r["live_rounds"] < MIN_PLOTTED_ROUNDS) else r[key]
                          for r in s["depths"]]
                ax.plot(depths, values, color=color, linestyle=styles[j % len(styles)], marker="o", markersize=3,
                        label=f"{name} ({entry['version']}), {set_name}")
    for ax, (_, title, ylim) in zip(axes.flat, panels):
        ax.set(xlabel="draft depth k", title=title, xticks=depths)
        ax.set_ylim(*(ylim or (0, None)))
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    plt.close(fig)
