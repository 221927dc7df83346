"""Greedy acceptance of the sample drafters: tau and per-depth acceptance at chain depth K = 1..6.

  python eagle_export/samples/eval_acceptance.py generate --out /tmp/eagle-eval --prompts 10 --max-new-tokens 64
  python eagle_export/samples/eval_acceptance.py score --data /tmp/eagle-eval \
      eagle_export/samples/eagle3-smollm2-135m eagle_export/samples/eagle3.1-smollm2-135m

`generate` runs the target alone (greedy) on the first `--prompts` prompts of each set: MT-bench
turn 1, HumanEval, long context (MT-bench after 1.5-3k tokens of ShareGPT history, taken from
conversations the training data does not use) and template perturbation (another system prompt).
It stores each prompt, its greedy continuation (max_new_tokens + 6, not cut at EOS) and the aux
states. `score` replays the greedy draft-verify loop for every depth from that one generation
(`reference.replay_greedy`: greedy output is the target's whatever the drafter proposes, so each
round's accepted count follows from the drafter's chain at a known position), and cross-checks the
replay against the reference loop itself (`reference.speculative_generate`, K=2 and 5) on the first
prompt of the first set.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from eagle_export.builder.build_dir import open_build
from eagle_export.data.prompts import (
    LONG_CONTEXT_SKIP,
    PROMPT_SET_ALIASES,
    ChatTemplate,
    chat_prompts,
    prompt_set_name,
    prompt_sets,
)
from eagle_export.data.sample import sample_target_dir
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.quantize import quantize as Q
from eagle_export.runtime.runtime import GenerationConfig
from eagle_export.speculation.eager import replay_greedy, speculative_generate
from eagle_export.speculation.stats import acceptance_by_depth, mean_accepted_length
from eagle_export.tools.bench import bench

DEPTHS = (1, 2, 3, 4, 5, 6)
AUX_LAYER_IDS = (2, 15, 27)
SETS = ("mt-bench", "humaneval", "long", "perturbed")
SETS_HELP = "prompt sets (mtbench, the spelling of earlier runs, is read as mt-bench)"


@torch.no_grad()
def greedy_with_aux(target, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The prompt and n greedy tokens, and the aux states [1, len-1, A*H] of all but the last token."""
    k_cache, v_cache = target.empty_cache(1, len(prompt) + n)
    ids, length, sequence, aux_parts = prompt, 0, list(prompt), []
    for _ in range(n):
        positions = torch.arange(length, length + len(ids))[None]
        logits, aux, new_k, new_v = target(torch.tensor([ids]), positions, k_cache[:, :, :, :length],
                                           v_cache[:, :, :, :length], torch.tensor([length]))
        k_cache[:, :, :, length:length + len(ids)] = new_k
        v_cache[:, :, :, length:length + len(ids)] = new_v
        length += len(ids)
        aux_parts.append(aux)
        ids = [int(logits[0, -1].argmax())]
        sequence += ids
    return sequence, torch.cat(aux_parts, dim=1)


def generate(args) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = sample_target_dir()
    target = load_target(target_dir, aux_layer_ids=AUX_LAYER_IDS).eval()
    template = ChatTemplate(target_dir)
    sets = prompt_sets(template, args.sets, long_context_skip=LONG_CONTEXT_SKIP)
    for name, prompts in sets.items():
        records, start = [], time.time()
        for prompt in prompts[:args.prompts]:
            sequence, aux = greedy_with_aux(target, prompt, args.max_new_tokens + max(DEPTHS))
            records.append({"prompt_len": len(prompt), "sequence": sequence, "aux": aux.half()})
        torch.save({"max_new_tokens": args.max_new_tokens, "records": records}, out / f"{name}.pt")
        print(f"generate {name}: {len(records)} prompts (mean prompt {sum(r['prompt_len'] for r in records) / len(records):.0f} "
              f"tokens) in {time.time() - start:.0f} s", flush=True)


def score(args) -> None:
    torch.set_num_threads(args.threads)
    data = Path(args.data)
    target = load_target(sample_target_dir(), aux_layer_ids=AUX_LAYER_IDS).eval()
    eos_ids = (target.config.eos_token_id,)
    results = {}
    drafters = []
    for drafter_dir in args.drafters:
        drafter = load_drafter(drafter_dir, target=target, dtype=torch.float32)
        drafters.append((Path(drafter_dir).name, drafter))
        if args.quantize:  # ModelOpt, calibrated on the target's aux states for ShareGPT conversations
            prompts = chat_prompts(ChatTemplate(sample_target_dir()), "sharegpt", 16, max_tokens=384)
            calibration = Q.drafter_calibration_batches(target, list(prompts))
            for precision in args.quantize:
                quantized = Q.quantize(copy.deepcopy(drafter), precision, calibration)
                drafters.append((f"{Path(drafter_dir).name} ({precision})", quantized))
    for name, drafter in drafters:
        results[name] = {}
        for set_name in args.sets:
            saved_file = data / f"{set_name}.pt"
            if not saved_file.exists():  # records of earlier runs carry the old spelling (mtbench.pt)
                saved_file = next((data / f"{old}.pt" for old, new in PROMPT_SET_ALIASES.items()
                                   if new == set_name and (data / f"{old}.pt").exists()), saved_file)
            saved = torch.load(saved_file)
            max_new = saved["max_new_tokens"]
            accepted = {k: [] for k in DEPTHS}
            for i, rec in enumerate(saved["records"]):
                replayed = replay_greedy(drafter, rec["sequence"], rec["aux"].float(), rec["prompt_len"], max_new,
                                         DEPTHS, eos_ids)
                for k in DEPTHS:
                    accepted[k] += replayed[k].accepted
                if i == 0 and set_name == args.sets[0] and args.cross_check and "(" not in name:  # replay == the loop itself
                    for k in (2, 5):
                        loop = speculative_generate(target, drafter, rec["sequence"][:rec["prompt_len"]], max_new, k,
                                                    eos_ids)
                        same = loop.accepted == replayed[k].accepted and loop.tokens == replayed[k].tokens
                        print(f"cross-check {name} {set_name} K={k}: "
                              f"{'identical' if same else f'DIFFERS loop {loop.accepted} replay {replayed[k].accepted}'}",
                              flush=True)
            results[name][set_name] = {
                k: {"tau": round(mean_accepted_length(accepted[k]), 3), "rounds": len(accepted[k]),
                    "acceptance_by_depth": [round(r, 3) for r in acceptance_by_depth(accepted[k], k)]}
                for k in DEPTHS}
            print(name, set_name, {k: v["tau"] for k, v in results[name][set_name].items()}, flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(markdown_tables(results))


def bench_builds(args) -> None:
    """The runtime itself (`eagle_export.tools.bench`, what `eagle-export bench` runs) on each build, over the
    first --prompts prompts of each set, batch 1: live tau, acceptance by depth and speedup."""
    torch.set_num_threads(args.threads)
    sets = prompt_sets(ChatTemplate(sample_target_dir()), args.sets, long_context_skip=LONG_CONTEXT_SKIP)
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.is_file() else {}
    for build in args.builds:
        opened = open_build(build, backend="onnxruntime", threads=args.threads)
        depth = opened.runtime.depth
        for set_name in args.sets:
            config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_ids=opened.eos_ids)
            prompts = sets[set_name][:args.prompts]
            if args.tau_only:  # the fixed-depth loop alone: no autoregressive baseline, no other verify policy
                accepted = [a for p in prompts
                            for a in opened.runtime.generate([p], config, verify_policy="fixed")[0].stats.accepted]
                result = {"depth": depth, "tau": round(mean_accepted_length(accepted), 4), "rounds": len(accepted),
                          "acceptance_by_depth": [round(a, 4) for a in acceptance_by_depth(accepted, depth, 0.0)]}
                fixed = result
            else:
                result = bench({build: opened.runtime}, prompts, 1, config)
                fixed = result["builds"][build]["policies"]["fixed"]
            results.setdefault(build, {})[set_name] = result
            print(f"{build} {set_name}: K={depth} tau {fixed['tau']:.3f} acceptance {fixed['acceptance_by_depth']}"
                  + (f" speedup {fixed['speedup']:.2f}" if "speedup" in fixed else ""), flush=True)
            path.write_text(json.dumps(results, indent=1))


def markdown_tables(results: dict) -> str:
    lines = ["| drafter | set | " + " | ".join(f"K={k}" for k in DEPTHS) + " |",
             "|---|---|" + "---|" * len(DEPTHS)]
    for name, sets in results.items():
        for set_name, by_depth in sets.items():
            lines.append(f"| {name} | {set_name} | " + " | ".join(f"{by_depth[k]['tau']:.2f}" for k in DEPTHS) + " |")
    lines += ["", "Acceptance by depth at K=6 (draft i accepted given drafts 1..i-1 were):", "",
              "| drafter | set | " + " | ".join(f"d{i}" for i in DEPTHS) + " |", "|---|---|" + "---|" * len(DEPTHS)]
    for name, sets in results.items():
        for set_name, by_depth in sets.items():
            rates = by_depth[max(DEPTHS)]["acceptance_by_depth"]
            lines.append(f"| {name} | {set_name} | " + " | ".join(f"{r:.2f}" for r in rates) + " |")
    quantized = [n for n in results if n.endswith(")")]
    if quantized:
        lines += ["", "Quantized drafters: tau at K=4 relative to the same drafter unquantized:", "",
                  "| drafter | " + " | ".join(next(iter(results.values()))) + " |",
                  "|---|" + "---|" * len(next(iter(results.values())))]
        for name in quantized:
            base = results[name.rsplit(" (", 1)[0]]
            lines.append(f"| {name} | " + " | ".join(f"{by_depth[4]['tau'] / base[s][4]['tau']:.3f}"
                                                     for s, by_depth in results[name].items()) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="target-only greedy generations and aux states of each prompt set")
    g.add_argument("--out", required=True)
    g.add_argument("--prompts", type=int, default=10, help="first N prompts of each set")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--sets", nargs="+", default=list(SETS), type=prompt_set_name, choices=SETS, help=SETS_HELP)
    g.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("score", help="tau and acceptance by depth of each drafter")
    s.add_argument("drafters", nargs="+")
    s.add_argument("--data", required=True)
    s.add_argument("--sets", nargs="+", default=list(SETS), type=prompt_set_name, choices=SETS, help=SETS_HELP)
    s.add_argument("--json", default="acceptance.json")
    s.add_argument("--no-cross-check", dest="cross_check", action="store_false")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--quantize", nargs="*", default=[], choices=Q.QUANT_PRESETS,
                   help="also score each drafter quantized with ModelOpt at these precisions (target unquantized)")
    b = sub.add_parser("bench", help="live tau of builds through the runtime (eagle_export.tools.bench), per prompt set")
    b.add_argument("builds", nargs="+", help="build directories (`eagle-export build --depth K`)")
    b.add_argument("--prompts", type=int, default=8, help="first N prompts of each set")
    b.add_argument("--max-new-tokens", type=int, default=48)
    b.add_argument("--sets", nargs="+", default=list(SETS), type=prompt_set_name, choices=SETS, help=SETS_HELP)
    b.add_argument("--json", default="bench.json", help="results, merged into this file by build and set")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--tau-only", action="store_true", help="speculative decoding only (no autoregressive baseline)")
    args = parser.parse_args()
    {"generate": generate, "score": score, "bench": bench_builds}[args.command](args)


if __name__ == "__main__":
    main()
