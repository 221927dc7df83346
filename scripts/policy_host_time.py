"""The goodput policy's own host time per round, against an earlier commit's policy, side by side.

Both policies are driven by `runtime.replay` on the recorded H200 exact-bf16 cost curves (32 requests of
128 tokens per batch size, a calibrated synthetic drafter), every call to should_draft, choose and
observe timed with perf_counter. A drafted round's bookkeeping is should_draft + choose + observe (a
chain's choice through `choose_chain` on lists, as the device round asks it; --general: `choose` on
tensors, as the general round does), each also reported alone; a k = 0 round's is should_draft +
observe. Each figure is the median over the rounds of one replay, then the median over --repeat
replays, old and new interleaved. The decisions of the two (drafted or not, the menu entry verified, per
round) are compared as well: they must be the same. --decisions compares them
only, over a sweep (every recorded card and batch size, catch-up unpriced and priced, 13 drafters: 11
calibrated acceptances, one over- and one under-confident) and --random rounds of random trees and
chains (random batch, claims, outcomes and finished sequences), driven as the runtime drives them.

Run: PYTHONPATH=. python scripts/policy_host_time.py [--against REV] [--new REV] [--repeat 5] [--general]
     [--decisions [--random 4000]]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle_export.runtime.replay import DEPTH, RECORDED, recorded_costs, replay
from eagle_export.speculation.tree import nested_subtrees

ROOT = Path(__file__).resolve().parent.parent
SWEEP = {"0": (0.0,) * DEPTH, "0.4": (0.4,) * DEPTH, "0.73/0.52/0.35/0.25": (0.73, 0.52, 0.35, 0.25)}


def policy_at(rev: str):
    """The goodput policy class of commit `rev`, loaded beside the working tree's."""
    source = subprocess.run(["git", "show", f"{rev}:eagle_export/runtime/verify_policy.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    name = "eagle_export.runtime._policy_at_" + rev.replace("~", "_").replace("^", "_")
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "eagle_export.runtime"
    sys.modules[name] = module
    exec(compile(source, f"{rev}:verify_policy.py", "exec"), module.__dict__)
    return module.GoodputDepth


class Timed:
    """A policy whose calls are timed per round and whose decisions are recorded. A chain's drafted round
    asks `choose_chain` (lists, as the device round does) where the policy has it, unless `general`:
    then `choose` (tensors, as the general round does)."""

    def __init__(self, policy, general: bool = False):
        self.policy, self.verifies_whole_tree = policy, policy.verifies_whole_tree
        self.drafted_s, self.plain_s, self.decisions, self._round = [], [], [], []
        self.parts = ([], [], [])  # a drafted round's should_draft, choose, observe
        if not general and hasattr(policy, "choose_chain"):
            self.choose_chain = self._choose_chain

    def start(self, batch):
        self.policy.start(batch)

    def should_draft(self, live):
        start = time.perf_counter()
        answer = self.policy.should_draft(live)
        self._round = [time.perf_counter() - start]
        return answer

    def choose(self, reach, live, widths, drafts=None):
        start = time.perf_counter()
        j = self.policy.choose(reach, live, widths, drafts)
        self._round.append(time.perf_counter() - start)
        return j

    def _choose_chain(self, joint, alive, widths, nodes):
        start = time.perf_counter()
        j = self.policy.choose_chain(joint, alive, widths, nodes)
        self._round.append(time.perf_counter() - start)
        return j

    def observe(self, j, accepted, live, drafted, emitted=None):
        start = time.perf_counter()
        self.policy.observe(j, accepted, live, drafted, emitted)
        self._round.append(time.perf_counter() - start)
        (self.drafted_s if drafted else self.plain_s).append(sum(self._round))
        if drafted:
            for into, took in zip(self.parts, self._round):
                into.append(took)
        self.decisions.append(j if drafted else None)


def sweep_decisions(classes) -> tuple[int, int]:
    """(cells where the policies' decisions differ, cells) over the sweep the module names."""
    drafters = [((a,) * DEPTH, None) for a in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)]
    drafters += [((0.2,) * DEPTH, (0.9,) * DEPTH), ((0.9,) * DEPTH, (0.9, 0.5, 0.3, 0.2))]
    differ = cells = 0
    for card in RECORDED:
        for catch_up in (False, True):
            costs = recorded_costs(card, catch_up)
            for batch in RECORDED[card]:
                for true, claimed in drafters:
                    runs = []
                    for cls in classes.values():
                        timed = Timed(cls(DEPTH, costs))
                        replay(timed, costs, batch, true, claimed)
                        runs.append(timed.decisions)
                    differ += runs[0] != runs[1]
                    cells += 1
    return differ, cells


def random_decisions(classes, rounds: int, seed: int = 0) -> tuple[int, int]:
    """(rounds whose decisions differ, rounds): random streams of random trees (a chain in half of them,
    asked through `choose_chain` in half of those), each round's claims, outcome, emitted tokens and
    finished sequences drawn at random."""
    rng = torch.Generator().manual_seed(seed)
    costs = recorded_costs("H200 exact bf16", True)
    differ = done = 0
    while done < rounds:
        batch = [1, 4, 16][int(torch.randint(3, (1,), generator=rng))]
        chain = bool(torch.randint(2, (1,), generator=rng))
        lists = chain and bool(torch.randint(2, (1,), generator=rng))  # a chain asked as the device round asks
        policies = [cls(DEPTH, costs) for cls in classes.values()]
        for policy in policies:
            policy.start(batch)
        live = torch.ones(batch, dtype=torch.bool)
        for _ in range(64):
            n = DEPTH  # (the recorded curves price verify calls of up to DEPTH + 1 tokens)
            if chain:
                parents = torch.arange(-1, DEPTH - 1).expand(batch, -1)
            else:
                parents = torch.stack([torch.tensor([int(torch.randint(i + 1, (1,), generator=rng)) - 1
                                                     for i in range(n)]) for _ in range(batch)])
            probs = torch.rand(batch, n, generator=rng) ** 0.5
            nodes = torch.randint(50, (batch, n), generator=rng)
            menu, reach = nested_subtrees(parents, probs, DEPTH, by_depth=False)
            widths = (1 + menu.sum(-1).amax(-1)).tolist()
            accepted = torch.randint(DEPTH + 1, (batch,), generator=rng)
            emitted = [torch.randint(50, (int(a) + 1,), generator=rng).tolist() for a in accepted]
            seen = []
            for policy in policies:
                drafted = policy.should_draft(live)
                if drafted and lists:
                    j = policy.choose_chain(reach[:, -1].tolist(), live.tolist(), widths, nodes.tolist())
                else:
                    j = policy.choose(reach, live, widths, (nodes, parents)) if drafted else 0
                policy.observe(j, accepted.clamp(max=j).tolist(), live, drafted, [e if a else [] for e, a in zip(emitted, live)])
                seen.append((drafted, j, policy.trust, policy.expected, policy.interval))
            differ += seen[0] != seen[1]
            done += 1
            if torch.rand(1, generator=rng) < 0.05 and live.sum() > 1:
                live = live.clone()
                live[int(torch.nonzero(live)[0, 0])] = False
    return differ, done


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="d0726d3", help="the commit whose policy is the old one")
    parser.add_argument("--new", help="the commit whose policy is the new one (default: the working tree's)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--card", default="H200 exact bf16")
    parser.add_argument("--general", action="store_true", help="a chain's round through choose on tensors")
    parser.add_argument("--decisions", action="store_true", help="compare decisions only (sweep and random rounds)")
    parser.add_argument("--random", type=int, default=4000, help="random rounds for --decisions")
    args = parser.parse_args()
    costs = recorded_costs(args.card)
    from eagle_export.runtime.verify_policy import GoodputDepth
    classes = {"old": policy_at(args.against), "new": policy_at(args.new) if args.new else GoodputDepth}
    if args.decisions:
        print("sweep cells whose decisions differ: %d of %d" % sweep_decisions(classes))
        print("random rounds whose decisions differ: %d of %d" % random_decisions(classes, args.random))
        return
    path = "choose (tensors, the general round)" if args.general else "choose_chain (lists, the device round)"
    print(f"{args.card}, old = {args.against}, new = {args.new or 'the working tree'}, a chain's round through {path}; "
          f"median us per round over "
          f"{args.repeat} replays (median of the rounds); drafted round = should_draft + choose + observe")
    print("| batch | acceptance | drafted rounds | drafted round: old / new | should_draft | choose | observe "
          "| k = 0 rounds | k = 0 round: old / new | decisions |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def us(runs):  # the median over replays of each replay's median round, in us
        return statistics.median(statistics.median(got) * 1e6 if got else float("nan") for got in runs)

    for batch in sorted(costs.verify_s):
        for name, true in SWEEP.items():
            runs = {key: [] for key in classes}
            for _ in range(args.repeat):
                for key, cls in classes.items():
                    timed = Timed(cls(DEPTH, costs), args.general)
                    replay(timed, costs, batch, true)
                    runs[key].append(timed)
            old, new = runs["old"], runs["new"]
            same = "same" if all(a.decisions == b.decisions for a, b in zip(old, new)) else "DIFFER"
            drafted = sum(d is not None for d in new[0].decisions)
            cells = [f"{us(t.drafted_s for t in old):.1f} / {us(t.drafted_s for t in new):.1f}"]
            cells += [f"{us(t.parts[i] for t in old):.1f} / {us(t.parts[i] for t in new):.1f}" for i in range(3)]
            print(f"| {batch} | {name} | {drafted} | {' | '.join(cells)} | {len(new[0].decisions) - drafted} | "
                  f"{us(t.plain_s for t in old):.1f} / {us(t.plain_s for t in new):.1f} | {same} |")

if __name__ == "__main__":
    main()
