"""The goodput policy's own host time per round, against an earlier commit's policy and the fixed one, side by side.

The policies are driven by `runtime.replay` on the recorded H200 exact-bf16 cost curves (32 requests of
128 tokens per batch size, a calibrated synthetic drafter) in the runtime's order (should_draft, learn,
choose, observe), every call timed with perf_counter. A round's critical path is should_draft + choose +
observe (a chain's choice through `choose_chain` on lists, as the device round asks it; --general:
`choose` on tensors, as the general round does): on a GPU, the host's work between a round's read and
its next launch. `learn` (the learning from a round's outcome, which the runtime runs after the next
round's first launch, while the device works) is reported apart; a policy older than `learn` learns in
observe. Each figure is the median over the rounds of one replay, then the median over --repeat
replays, old, new and fixed interleaved; the replays' speedups beside them.

--decisions compares decisions only (drafted or not, the menu entry verified, per round; with the trust,
promise and probe interval on random rounds), over a sweep (every recorded card and batch size, catch-up
unpriced and priced, 13 drafters: 11 calibrated acceptances, one over- and one under-confident) and
--random rounds of random trees and chains (random batch, claims, outcomes and finished sequences), both
driven as the runtime drives them, or with --undeferred learning right after observe (the order of a
policy older than `learn`: the same decisions to the bit). --replays: what each policy's decisions are
worth (the sweep test's cells, a drafter that turns wrong, over-confident drafters).

Run: PYTHONPATH=. python scripts/policy_host_time.py [--against REV] [--new REV] [--repeat 5] [--general]
     [--decisions [--undeferred] [--random 4000]] [--replays [--recorded ROUNDS.json ...]]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle_export.runtime.costs import CostCurves
from eagle_export.runtime.replay import DEPTH, RECORDED, compare, recorded_costs, recorded_drafts, replay, sample_cpu_costs
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
    """A policy driven as `replay` drives it, each call timed and the decisions recorded. A round's record:
    drafted, and the seconds of should_draft, choose and observe (the critical path: the host's work
    between the round's read and its next launch, on a GPU) and of `learn` over its outcome, which the
    next round runs after its first launch (deferred: the device is busy meanwhile). A chain's drafted
    round asks `choose_chain` (lists, as the device round does) where the policy has it, unless `general`:
    then `choose` (tensors, as the general round does). `undeferred`: learn right after observe (as the
    policies did before `learn`), on the critical path."""

    def __init__(self, policy, general: bool = False, undeferred: bool = False):
        self.policy, self.verifies_whole_tree, self.undeferred = policy, policy.verifies_whole_tree, undeferred
        self.live_as_list = getattr(policy, "live_as_list", False)  # (the live mask as the runtime passes it)
        self.rounds, self.decisions = [], []
        if not general and hasattr(policy, "choose_chain"):
            self.choose_chain = self._choose_chain
        if hasattr(policy, "learn") and not undeferred:
            self.learn = self._learn

    def start(self, batch):
        self.policy.start(batch)

    def _timed(self, part, call, *args):
        start = time.perf_counter()
        answer = call(*args)
        self.rounds[-1][part] += time.perf_counter() - start
        return answer

    def should_draft(self, live):
        self.rounds.append(dict.fromkeys(("should_draft", "choose", "observe", "learn"), 0.0))
        return self._timed("should_draft", self.policy.should_draft, live)

    def _learn(self):  # (over the last round's outcome: timed as that round's)
        start = time.perf_counter()
        self.policy.learn()
        if len(self.rounds) > 1:
            self.rounds[-2]["learn"] += time.perf_counter() - start

    def choose(self, reach, live, widths, drafts=None):
        return self._timed("choose", self.policy.choose, reach, live, widths, drafts)

    def _choose_chain(self, joint, alive, widths, nodes):
        return self._timed("choose", self.policy.choose_chain, joint, alive, widths, nodes)

    def observe(self, j, accepted, live, drafted, emitted=None):
        self._timed("observe", self.policy.observe, j, accepted, live, drafted, emitted)
        if self.undeferred and hasattr(self.policy, "learn"):
            self._timed("observe", self.policy.learn)
        self.rounds[-1]["drafted"] = drafted
        self.decisions.append(j if drafted else None)

    def us(self, drafted: bool, *parts) -> float:
        """The median over this replay's drafted (or k = 0) rounds of the named parts' sum, in us."""
        got = [sum(r[p] for p in parts) for r in self.rounds[:-1] if r.get("drafted") is drafted]
        return statistics.median(got) * 1e6 if got else float("nan")


def sweep_decisions(classes, undeferred: bool) -> tuple[int, int]:
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
                        timed = Timed(cls(DEPTH, costs), undeferred=undeferred)
                        replay(timed, costs, batch, true, claimed)
                        runs.append(timed.decisions)
                    differ += runs[0] != runs[1]
                    cells += 1
    return differ, cells


def random_decisions(classes, rounds: int, undeferred: bool, seed: int = 0) -> tuple[int, int]:
    """(rounds whose decisions differ, rounds): random streams of random trees (a chain in half of them,
    asked through `choose_chain` in half of those), each round's claims, outcome, emitted tokens and
    finished sequences drawn at random; `learn` run after should_draft, as the runtime runs it (or, where
    `undeferred`, right after observe); the live mask a list to a policy that takes one (`live_as_list`), as
    the runtime passes it, else a tensor."""
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
                learn = getattr(policy, "learn", lambda: None)
                mask = live.tolist() if getattr(policy, "live_as_list", False) else live  # (as the runtime passes it)
                drafted = policy.should_draft(mask)
                if not undeferred:
                    learn()
                if drafted and lists:
                    j = policy.choose_chain(reach[:, -1].tolist(), live.tolist(), widths, nodes.tolist())
                else:
                    j = policy.choose(reach, mask, widths, (nodes, parents)) if drafted else 0
                policy.observe(j, accepted.clamp(max=j).tolist(), mask, drafted, [e if a else [] for e, a in zip(emitted, live)])
                if undeferred:
                    learn()
                seen.append((drafted, j, policy.trust, policy.expected, policy.interval))
            differ += seen[0] != seen[1]
            done += 1
            if torch.rand(1, generator=rng) < 0.05 and live.sum() > 1:
                live = live.clone()
                live[int(torch.nonzero(live)[0, 0])] = False
    return differ, done


def drive(policy, phases) -> list:
    """Batch 1, a greedy chain driven as the device round drives it: phases of (rounds, claims, right): the
    drafter's probabilities say `claims` per draft, its first `right` drafts are the target's own tokens
    (the target emits n + 1 at position n). -> each round's j (None: no drafter call)."""
    live, position, chosen = torch.ones(1, dtype=torch.bool), 0, []
    for rounds, claims, right in phases:
        joint = [math.prod(claims[:d + 1]) for d in range(DEPTH)]
        for _ in range(rounds):
            drafted = policy.should_draft(live)
            getattr(policy, "learn", lambda: None)()
            nodes = [position + d + 1 if d < right else 0 for d in range(DEPTH)]
            j = policy.choose_chain([joint], [True], list(range(1, DEPTH + 2)), [nodes]) if drafted else 0
            accepted = min(j, right)
            policy.observe(j, [accepted], live, drafted, [list(range(position + 1, position + accepted + 2))])
            position += accepted + 1
            chosen.append(j if drafted else None)
    return chosen


def unit_costs(draft: float, slope: float) -> CostCurves:
    """Costs in plain steps: the drafter `draft`, a T-token verify 1 + slope (T - 1) (batch 1)."""
    return CostCurves({1: {t: 1 + slope * (t - 1) for t in range(1, DEPTH + 2)}}, {1: dict.fromkeys(range(1, DEPTH + 2), draft)})


def replays(classes, recorded: list[str]) -> None:
    """What the two policies' decisions are worth, each driven as the runtime drives it: goodput over the
    better of fixed K and plain decoding on every recorded card and batch (catch-up priced) and the
    sample build's CPU costs, at the acceptances of the sweep test; how many rounds a drafter that
    turns wrong after N right ones keeps being drafted (no probe counted); over-confident drafters; a real
    drafter's `recorded` rounds (`scripts/drafter_calibration.py --save` files) at the sample build's CPU
    costs, batch 1 and 4."""
    for path in recorded:
        rounds = recorded_drafts(json.loads(Path(path).read_text()))
        costs = sample_cpu_costs()
        for batch in (1, 4):
            got = [replay(cls(DEPTH, costs), costs, batch, recorded=rounds) for cls in classes.values()]
            print(f"{path}, batch {batch}, speedup over plain decoding (drafted / rounds), old / new: "
                  + " / ".join(f"{r['speedup']:.3f} ({r['drafted']}/{r['rounds']})" for r in got))
    sweep = {**{f"{a}": ((a,) * DEPTH, None) for a in (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.9)},
             "0.73/0.52/0.35/0.25": ((0.73, 0.52, 0.35, 0.25), None),
             "H200 run": ((0.71, 0.60, 0.44, 0.40), (0.73, 0.52, 0.35, 0.25)),
             "deep low": ((0.9,) * DEPTH, (0.9, 0.5, 0.3, 0.2))}
    print("goodput / max(fixed K, plain decoding), old / new (32 requests of 128 tokens, graph time)")
    print("| card | batch | " + " | ".join(sweep) + " |")
    print("|---|---|" + "---|" * len(sweep))
    least = {key: (9.0, None) for key in classes}
    cards = [(card, batch, recorded_costs(card, catch_up=True)) for card in RECORDED for batch in RECORDED[card]]
    for card, batch, costs in cards + [("sample CPU", b, sample_cpu_costs()) for b in (1, 4)]:
        cells = []
        for name, (true, claimed) in sweep.items():
            got = {key: compare(costs, batch, true, claimed, goodput=cls(DEPTH, costs))["vs_best"]
                   for key, cls in classes.items()}
            for key, value in got.items():
                least[key] = min(least[key], (value, f"{card} b{batch} {name}"))
            cells.append(" / ".join(f"{v:.3f}" for v in got.values()))
        print(f"| {card} | {batch} | " + " | ".join(cells) + " |")
    print("least cell: " + "; ".join(f"{key} {v:.3f} ({where})" for key, (v, where) in least.items()))
    print("\na drafter right (0.9 a draft) for N rounds, then wrong in every draft: rounds it is still drafted "
          "(the last drafted round after a drafted one), old / new")
    for costs_name, costs in (("unit, drafter 0.2", unit_costs(0.2, 0.05)), ("sample CPU", sample_cpu_costs())):
        row = []
        for paying in (20, 60, 300):
            lasts = []
            for cls in classes.values():
                policy = cls(DEPTH, costs)
                policy.start(1)
                wrong = drive(policy, [(paying, [0.9] * DEPTH, DEPTH), (400, [0.9] * DEPTH, 0)])[paying:]
                lasts.append(max(i for i in range(1, len(wrong)) if wrong[i] is not None and wrong[i - 1] is not None))
            row.append(f"N = {paying}: {' / '.join(map(str, lasts))}")
        print(f"  {costs_name}: " + ", ".join(row))
    print("\nover-confident drafters, speedup over plain decoding (drafted / rounds), old / new")
    cases = [("sample CPU b1, says 0.9, delivers 0.2", sample_cpu_costs(), 1, (0.2,) * DEPTH, (0.9,) * DEPTH, {}),
             ("sample CPU b4, says 0.9, delivers 0.2", sample_cpu_costs(), 4, (0.2,) * DEPTH, (0.9,) * DEPTH, {}),
             ("unit 0.3/0.1 b1, says 0.9, delivers 0.28, 512 tokens", unit_costs(0.3, 0.1), 1, (0.28,) * DEPTH,
              (0.9,) * DEPTH, {"prompts": 2, "new_tokens": 512}),
             ("H200 fp32 b1, says 0.7/0.35/0.2/0.1, delivers 0.7 (vs best)", recorded_costs("H200 fp32"), 1,
              (0.7,) * DEPTH, (0.7, 0.35, 0.2, 0.1), None)]
    for name, costs, batch, true, claimed, kw in cases:
        got = []
        for cls in classes.values():
            if kw is None:
                got.append(f"{compare(costs, batch, true, claimed, goodput=cls(DEPTH, costs))['vs_best']:.3f}")
                continue
            r = replay(cls(DEPTH, costs), costs, batch, true, claimed, **kw)
            got.append(f"{r['speedup']:.3f} ({r['drafted']}/{r['rounds']})")
        print(f"  {name}: {' / '.join(got)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="d7e84df", help="the commit whose policy is the old one")
    parser.add_argument("--new", help="the commit whose policy is the new one (default: the working tree's)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--card", default="H200 exact bf16")
    parser.add_argument("--general", action="store_true", help="a chain's round through choose on tensors")
    parser.add_argument("--decisions", action="store_true", help="compare decisions only (sweep and random rounds)")
    parser.add_argument("--undeferred", action="store_true",
                        help="with --decisions: learn right after observe (else as the runtime: after should_draft)")
    parser.add_argument("--random", type=int, default=4000, help="random rounds for --decisions")
    parser.add_argument("--replays", action="store_true", help="what the decisions are worth, replayed, old and new")
    parser.add_argument("--recorded", nargs="*", default=[], help="with --replays: recorded rounds files to replay too")
    args = parser.parse_args()
    costs = recorded_costs(args.card)
    from eagle_export.runtime.verify_policy import FixedDepth, GoodputDepth
    classes = {"old": policy_at(args.against), "new": policy_at(args.new) if args.new else GoodputDepth}
    if args.decisions:
        print("sweep cells whose decisions differ: %d of %d" % sweep_decisions(classes, args.undeferred))
        print("random rounds whose decisions differ: %d of %d" % random_decisions(classes, args.random, args.undeferred))
        return
    if args.replays:
        replays(classes, args.recorded)
        return
    path = "choose (tensors, the general round)" if args.general else "choose_chain (lists, the device round)"
    print(f"{args.card}, old = {args.against}, new = {args.new or 'the working tree'}, a chain's round through {path}; "
          f"median us per round over {args.repeat} replays (median of the rounds). Critical path = should_draft "
          "+ choose + observe (the host's work between a round's read and the next launch); learn = the "
          "learning from a round's outcome, run after the next round's first launch (deferred; the old "
          "policy learns in observe); fixed = the fixed policy's should_draft + observe")
    print("| batch | acceptance | drafted rounds | drafted: critical path fixed / old / new | should_draft old / new "
          "| choose old / new | observe old / new | learn (deferred) new | k = 0 rounds | k = 0: critical path "
          "old / new | k = 0: learn new | speedup old / new |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def us(runs, drafted, *parts):  # the median over replays of each replay's median round, in us
        return statistics.median(t.us(drafted, *parts) for t in runs)

    critical = ("should_draft", "choose", "observe")
    for batch in sorted(costs.verify_s):
        for name, true in SWEEP.items():
            runs, speedups = {key: [] for key in (*classes, "fixed")}, {key: [] for key in classes}
            for _ in range(args.repeat):
                for key, make in (*classes.items(), ("fixed", lambda depth, c: FixedDepth(depth))):
                    timed = Timed(make(DEPTH, costs), args.general)
                    result = replay(timed, costs, batch, true)
                    runs[key].append(timed)
                    if key in speedups:
                        speedups[key].append(result["speedup"])
            old, new, fixed = runs["old"], runs["new"], runs["fixed"]
            drafted = sum(d is not None for d in new[0].decisions)
            cells = [f"{us(fixed, True, *critical):.1f} / {us(old, True, *critical):.1f} / {us(new, True, *critical):.1f}"]
            cells += [f"{us(old, True, part):.1f} / {us(new, True, part):.1f}" for part in critical]
            cells += [f"{us(new, True, 'learn'):.1f}", str(len(new[0].decisions) - drafted)]
            cells += [f"{us(old, False, *critical):.1f} / {us(new, False, *critical):.1f}",
                      f"{us(new, False, 'learn'):.1f}",
                      f"{statistics.median(speedups['old']):.3f} / {statistics.median(speedups['new']):.3f}"]
            print(f"| {batch} | {name} | {drafted} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
