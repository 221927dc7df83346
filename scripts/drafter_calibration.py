"""How well a build's drafter knows its own acceptance, and what the goodput policy makes of it (greedy,
batch 1). The measurement behind the goodput policy's trust (runtime/verify_policy.py).

For each prompt, plain decoding gives the target's continuation; then a speculative run calls the drafter
at every position and verifies none of its drafts (every round advances one token, so every position is
seen), recording the drafter's expected tokens for each menu entry (E[tokens | S_j]) and how many of its
chain's drafts were right. Greedy output does not depend on the policy, and the drafter's input rows at a
position are the same whichever rounds came before, so each policy can then be replayed offline over
the same positions at the build's measured cost curves:
  calibration    accepted / promised drafts per menu entry j, and by the first draft's probability
  replay         tokens per second over plain decoding: the goodput policy as shipped, the same policy
                 reading the drafter at face value (trust 1), and hindsight (draft exactly where it paid)

Run: python scripts/drafter_calibration.py BUILD [--dataset humaneval] [--num-prompts 16] [--max-new-tokens 128]
     [--save ROUNDS.json]
A chain drafter; ONNX Runtime (or --backend torch). --save writes the recorded rounds (per prompt, `record`'s
list) for `runtime.replay.recorded_drafts`, which replays any policy over them at any costs and batch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle_export.builder.build_dir import open_build
from eagle_export.data.prompts import chat_prompts
from eagle_export.runtime.runtime import GenerationConfig
from eagle_export.runtime.verify_policy import GoodputDepth


class RecordEveryPosition:
    """A verify policy that calls the drafter every round and verifies none of its drafts."""

    name, verifies_whole_tree = "record", False

    def __init__(self, rounds):
        self.rounds = rounds

    def start(self, batch):
        pass

    def should_draft(self, live):
        return True

    def choose(self, reach, live, widths, drafts=None):
        self.rounds[-1]["reach"] = reach[0].tolist()
        self.rounds[-1]["expected"] = (1 + reach[0].sum(-1)).tolist()
        return 0

    def observe(self, *args):
        pass


def record(runtime, prompt, config) -> list[dict]:
    """[{n: tokens emitted, reach: the drafter's reach per depth for each S_j, expected: E[tokens | S_j] for
    j = 0..K, right: drafts right in a row}]."""
    continuation = runtime.generate([prompt], config, speculative=False)[0].tokens
    rounds, draft = [], runtime._draft

    def drafting(state, live):  # the drafts themselves, beside what the policy is shown
        nodes, *rest = draft(state, live)
        n, drafts = len(state.generated[0]), nodes[0].tolist()
        right = 0
        while right < len(drafts) and n + right < len(continuation) and drafts[right] == continuation[n + right]:
            right += 1
        rounds.append({"n": n, "right": right})
        return (nodes, *rest)

    runtime._draft = drafting
    try:
        again = runtime.generate([prompt], config, verify_policy=RecordEveryPosition(rounds))[0].tokens
    finally:
        runtime._draft = draft
    assert again == continuation, "the recording run left plain decoding's output"
    return [dict(r, end=len(continuation)) for r in rounds]


def replay(prompts_rounds, costs, depth, policy=None) -> float:
    """Tokens per second over plain decoding of one policy (None: hindsight) over the recorded positions."""
    verify = [costs.verify(1, t) for t in range(1, depth + 2)]
    draft, live = costs.draft(1), torch.ones(1, dtype=torch.bool)
    spent = plain = 0.0
    for rounds in prompts_rounds:
        at = {r["n"]: r for r in rounds}
        n = min(at)
        if policy is not None:
            policy.start(1)
        while n in at:
            r = at[n]
            if policy is None:  # verify the j that paid best in hindsight, or none
                j = max(range(depth + 1), key=lambda j: (1 + min(r["right"], j)) / (draft + verify[j]))
                drafted = (1 + min(r["right"], j)) / (draft + verify[j]) > 1 / verify[0]
            else:
                drafted = policy.should_draft(live)
                drafts = (torch.tensor([[n + 1 + d if d < r["right"] else -1 for d in range(depth)]]),
                          torch.arange(-1, depth - 1)[None])  # the right ones as the positions they fill
                j = policy.choose(torch.tensor([r["reach"]]), live, list(range(1, depth + 2)), drafts) if drafted else 0
            accepted = min(r["right"], j, r["end"] - n - 1) if drafted else 0
            if policy is not None:  # tokens as their positions, as the drafts above are
                policy.observe(j, [accepted], live, drafted, [list(range(n + 1, n + accepted + 2))])
            spent += draft + verify[j] if drafted else verify[0]
            plain += (accepted + 1) * verify[0]
            n += accepted + 1
    return plain / spent


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--save", help="write the recorded rounds here (JSON)")
    args = parser.parse_args()
    opened = open_build(args.build, backend=args.backend)
    runtime, depth = opened.runtime, opened.runtime.depth
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_ids=opened.eos_ids)
    prompts_rounds = [record(runtime, p, config)
                      for p in chat_prompts(opened.chat_template(), args.dataset, args.num_prompts)]
    if args.save:
        Path(args.save).write_text(json.dumps(prompts_rounds))
    rounds = [r for rs in prompts_rounds for r in rs]
    print(f"{args.dataset}: {len(rounds)} positions, drafts right in a row {sum(r['right'] for r in rounds) / len(rounds):.3f}")
    for j in range(1, depth + 1):
        promised = sum(r["expected"][j] - 1 for r in rounds)
        accepted = sum(min(r["right"], j) for r in rounds)
        print(f"  verifying {j} draft(s): promised {promised / len(rounds):.3f}, accepted {accepted / len(rounds):.3f} "
              f"per position: accepted / promised {accepted / promised:.3f}")
    bins = {}
    for r in rounds:  # the first draft's probability is E[tokens | S_1] - 1
        p = r["expected"][1] - 1
        b = bins.setdefault(min(int(p * 5), 4), [0, 0.0, 0])
        b[0], b[1], b[2] = b[0] + 1, b[1] + p, b[2] + (r["right"] > 0)
    print("  first draft, by its probability: " + ", ".join(
        f"{k / 5:.1f}-{(k + 1) / 5:.1f}: {n} positions, said {p / n:.2f}, right {hit / n:.2f}"
        for k, (n, p, hit) in sorted(bins.items())))
    costs = runtime.cost_curves(1)

    class FaceValue(GoodputDepth):
        def _learn(self, reached, promised, seen):  # the trust held at 1: the drafter read at face value
            pass

    print(f"  replayed at the measured costs (plain step {1e3 * costs.verify(1, 1):.1f} ms, drafter "
          f"{1e3 * costs.draft(1):.1f} ms): goodput {replay(prompts_rounds, costs, depth, GoodputDepth(depth, costs)):.3f}x, "
          f"at face value {replay(prompts_rounds, costs, depth, FaceValue(depth, costs)):.3f}x, "
          f"hindsight {replay(prompts_rounds, costs, depth):.3f}x of plain decoding (graph time only)")


if __name__ == "__main__":
    main()
