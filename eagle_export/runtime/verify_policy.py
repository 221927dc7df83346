"""How much of the drafted tree each round verifies: all of it, or the part that maximizes tokens per second.

A round costs one drafter call (it always proposes its whole chain or tree: the graph is unrolled)
plus one target call over the root and the nodes kept; plain decoding yields 1 token per target
call of 1 token. The runtime offers a menu of nested subtrees S_0 (the root alone: k = 0) within
S_1 within ... S_J (everything), each closed under ancestors (`tree.nested_subtrees`), with the verify
width of each and, greedy, the drafter's estimate of its expected tokens: 1 + the sum of the joint
draft probabilities of its nodes, S_m being the m likeliest nodes (for a chain, the first m drafts).
With the measured costs (`costs.CostCurves`):

    before the drafter call   draft iff  E[tokens of a drafted round] / (c_draft + c_verify(width))
                                         > MARGIN * 1 / c_verify(1)
                              else the round is a plain decoding step (no drafter call);
    after it                  j = argmax_j  E[tokens | S_j] / (c_draft + c_verify(width_j)),  j = 0 allowed.

So a wide tree on a machine where verify cost grows with width keeps its few likeliest nodes, and
keeps all of them where a wide call costs what a narrow one does. The quantity before the call is a
decayed running estimate of what drafted rounds promised (DECAY), replaced by a probe's promise and by
that of a round whose drafts, read through the trust, were worth verifying none (j = 0): that is the
text at hand saying drafting does not pay, and blending it in over ~3 rounds cost a drafter call
each (the sample drafter on humaneval knows a request's opening, then not: replayed over its recorded
claims at batch 4, 25 -> 12 drafter calls in 500 rounds, 0.993x -> 1.002x of plain decoding; batch 1
1.022x -> 1.037x). When drafting stops paying, the policy
probes: a drafter call after `interval` plain rounds, which first catches up on every row those
rounds added (c_draft(rows), measured beyond K+1 rows too) and verifies one draft at least. The
interval is the shortest I (at least PROBE_EVERY; PROBE_CEILING where none up to it is) whose failed
probe costs at most PROBE_BUDGET of the plain steps before it,

    c_draft(I + 1) + c_verify(2) - c_verify(1)  <=  PROBE_BUDGET * I * c_verify(1),

every probe held to it but the stream's first round's (it is how a request finds out whether drafting
pays at all, and its catch-up over the prompt is what any drafting pays first), so a drafter that never
helps costs at most about PROBE_BUDGET of plain decoding. Catching up is the larger part where the
batch is wide (the sample build at batch 4: 6.8 ms + 0.28 ms per row beside a 37 ms step, 79 rounds
and more); where a row alone costs more than PROBE_BUDGET of a step (the recorded GPU curves' bound at
batch 16), probes are PROBE_CEILING apart. The interval used to start at PROBE_EVERY and double after
each failed probe up to this one: its early probes, 16, 32 and 64 rounds apart, cost what they cost
(replayed on the recorded GPU curves with catch-up priced, `replay.py`: the H100's batch 16 at
acceptance 0.2 0.961x of plain decoding, the H200 exact kernels' batch 16 at 0.5 0.971x; priced from
the first, 0.972x and 0.984x, and no cell of the sweep below 0.972x of the better of fixed K and plain
decoding). Nor does a probe that finds drafting paying shorten the next interval (it used to halve it):
a batch whose drafter pays only now and then (the sample drafter at batch 4, below break-even) would
draft in runs that lose after lucky probes, a static batch finishing with its slowest sequence, so one
sequence's accepted drafts in a sporadic round rarely shorten it; the priced interval is at least what
halving from the doubled one gave.

A batch of B sequences: one verify call serves them all, so a round is worth what it advances the
batch, and a static batch finishes with its slowest sequence. Where the slowest stays slowest (its text
is harder throughout), the batch advances at its rate: B times the least of the sequences' expected
tokens; where they differ by chance from round to round, the lead changes hands and the batch advances
at about their mean: the sum. The policy takes the middle of the two,

    batch tokens(S_j) = (sum over live b of E_b[tokens | S_j] + B_live * min over live b of E_b[tokens | S_j]) / 2

(the sum alone drafted at batch 4 in rounds where one sequence's drafts would be accepted and the
others' not, shortening nothing: replayed over the recorded claims of the sample drafter, with probes
priced, 0.985x -> 0.990x humaneval, 0.979x -> 0.988x MT-bench; calibrated simulated drafters at 0.4 /
0.5 / 0.6: 0.973x -> 0.985x, 1.054x -> 1.041x, 1.241x -> 1.232x; the least alone fell to 0.99x at 0.5,
where drafting pays 1.05x). At batch 1 both are the sequence's own.

Every estimate is per request: `start` forgets the last stream, and only what is measured of the
machine (the cost curves, which the runtime keeps) carries. Carried, a request's decisions depended on
the one before (`run --chat A --chat B`: B drafted in 1 of 22 rounds after A's failed probe, in 10 of 10
alone), and the drafter's calibration is no constant to carry either: it follows the text (the sample
drafter kept 0.84-0.95 of its promise on humaneval, 0.73-0.87 on MT-bench). The price is that every
request learns it afresh (a drafter that says 0.9 and delivers 0.28: 0.97x of plain decoding over
512-token requests, replayed; 0.94x before the deep depths' prior was the depth above's trust); a
calibration measured once per build on fixed prompts, as the costs are once per machine, would be an
order-independent prior.

Greedy, the drafter's estimates are read through its measured calibration, per depth. With A_d and P_d
the decayed sums (TRUST_DECAY a round), over the drafted trees whose outcome is known and whose path
reached depth d - 1, of [the path reached depth d] and of the conditional probability the drafter gave
that (reach_d / reach_{d-1}; for a chain, draft d's own), N_d their count, and TRUST_PRIOR trees at the
depth above's trust mixed in (m = P_d / N_d, t_0 = 1):

    t_d = max(A' / P', min(1, (A' + Z sqrt(A_d + 1)) / P')),   A' = A_d + TRUST_PRIOR m t_{d-1},  P' = P_d + TRUST_PRIOR m
    reach'[S_j, d] = min(1, t_1 ... t_d reach[S_j, d]),         E'[tokens | S_j] = 1 + sum over d of reach'[S_j, d]

(t_d = t_{d-1} where no tree reached depth d - 1). The prior was at ratio 1: the path seldom reaches the
deep depths of a drafter that over-promises, so their claims were read at face value while the first
depth's were already discounted (a drafter saying 0.9 per draft and delivering 0.2, at the sample
build's CPU costs, `replay.SAMPLE_CPU`: 0.861x -> 0.918x of plain decoding at batch 1, 0.949x -> 0.972x
at batch 4, drafted rounds 80 -> 52 and 10 -> 7 a request).

The same sums decayed by RECENT_DECAY (~10 rounds: A_r, P_r, N_r) say when the drafter stopped
delivering: where they fall RECENT_Z deviations short of what the older trees' ratio expects of them
(A - A_r, P - P_r: each tree weighed TRUST_DECAY^age - RECENT_DECAY^age, so the recent ones hardly),

    r_o P_r - A_r  >  RECENT_Z sqrt(r_o P_r),   r_o = (A - A_r + TRUST_PRIOR m t_{d-1}) / (P - P_r + TRUST_PRIOR m),

the older trees are forgotten (A, P, N := A_r, P_r, N_r, and every deeper depth's sums cleared: its
trees were drawn under the old regime). A drafter right for 20 / 60 / 300 rounds and then wrong in
every draft stopped being drafted after 106-126 / 167-191 / 227-254 rounds, the trust's memory
(TRUST_DECAY), and now after 28-36 / 24-28 / 24-28 (unit costs with a drafter of 0.2 steps, and the sample build's
CPU costs); a calibrated drafter near the break-even acceptance, whose outcomes scatter around the
trust, is decided exactly as without the test on the recorded GPU curves (18 of 18 replays: the
Poisson deviation is wider than the binomial scatter of the few trees of a round).

The outcome is read in hindsight: the target's own tokens, emitted in this round and the next ones, say
how deep they follow a root path of the drafted tree, whatever depth was verified. So a policy that
settled on depth 1 still measures depths 2..K in every drafted round, and finds a drafter whose deep
probabilities run low (replayed on the H200's fp32 costs, `replay.py`: a drafter saying 0.7/0.35/0.2/0.1
and delivering 0.7 at every depth reaches 0.97 of fixed K=4's 1.32x; learning from the verified depths
alone it never left depth 1: 0.81). A ratio above 1 is read as measured (the drafter under-promises);
below 1 optimistically (Z standard deviations of A, counted as Poisson), because samples come only from
the rounds it lets draft: a streak of failures would otherwise stop a drafter that pays, and nothing
would measure it again but probes (a probe verifies one draft at least, and the plain rounds after it
resolve its tree, which re-reads what drafting promises). For a calibrated drafter t_d stays ~1. A
drafter's own probabilities run high where it has not learned the target or the text (the sample
drafter's, replayed at every position of 16 prompts: accepted / promised 0.84-0.95 on humaneval,
0.73-0.87 on MT-bench; a quantized or off-domain drafter's can be far lower), and read at face value they
make it draft in rounds that lose.

When it learns: on a GPU whatever the host does between a round's read and the next round's first
launch leaves the device idle. So `observe` does only what the next decision needs (the rounds since the
last drafter call; a drafted round's `expected`, blended with what its choice promised, and its cost),
and keeps the outcome; `learn` does the rest (the trees resolved in hindsight, the trust, what drafting
promises re-read through it and `expected` blended again from the estimates before the round: the same
numbers as learning at once, to the bit). The runtime calls it right after the next round's first launch
(the drafter call, or the target call of a k = 0 round; `device_round`), so it overlaps the device's
work; where a caller does not, the next choose or observe runs it first, so the outcomes are learned in
order whoever drives the policy, and `start` drops one still waiting. The choice always sees the fresh
trust; only should_draft of the round right after is one round stale, which on its own drafted a second
round after probes whose outcome said stop (replayed on the recorded GPU curves: H200 exact bf16 batch 16
at 0.6, 1.000x -> 0.976x of the better of fixed K and plain decoding), so a probe's outcome is learned at
once: probes are at least PROBE_EVERY rounds apart. Replayed so (`scripts/policy_host_time.py
--replays`), the sweep's 110 cells average 1.0075x as before, the least is 0.972x as before, the largest
drop 0.987x -> 0.975x (the same card and batch at 0.5, near break-even); a drafter that turns wrong is
stopped after as many rounds; the sample drafter's recorded claims give the same speedups (humaneval,
MT-bench, batch 1 and 4). The host's work between a drafted round's read and the next launch
(should_draft, choose, observe) on the replay: 32.9 -> 12.7 us at batch 1, 56.3 -> 22.8 at batch 4,
103.2 -> 38.2 at batch 16 (the deferred learning 23-69 us; shared 2-core VM).

Sampling: what is verified must not depend on the drafts being verified (rejection sampling stays
exact only if the decision to check a draft is made before it is seen), so the menu is by depth
(S_k = the nodes of depth <= k) and E[tokens | S_k] comes from the running per-depth acceptance of
earlier rounds instead.

A batch shares one choice and one drafter decision per round (valued as above): every sequence's verify
call has the same T (the target graph's [B, T] input), and a sequence that could stop earlier loses
nothing from being verified further, since the call's cost is paid for the batch anyway.
"""

from __future__ import annotations

import itertools
import math
import operator

import torch

from ..errors import EagleExportError
from .costs import CostCurves

POLICIES = ("goodput", "fixed")


class FixedDepth:
    """Draft every round and verify the whole chain or tree."""

    name = "fixed"
    verifies_whole_tree = True  # the runtime skips the menu of subtrees (`choose` is never asked)
    live_as_list = True  # the runtime passes its live mask as its Python list (see GoodputDepth)

    def __init__(self, depth: int):
        self.depth = depth

    def start(self, batch: int) -> None:
        pass

    def should_draft(self, live: torch.Tensor | list[bool]) -> bool:
        return True

    def choose(self, reach: torch.Tensor | None, live: torch.Tensor | list[bool], widths: list[int], drafts=None) -> int:
        return len(widths) - 1

    def observe(self, j: int, accepted: list[int], live: torch.Tensor | list[bool], drafted: bool,
                emitted: list[list[int]] | None = None) -> None:
        pass


class GoodputDepth:
    name = "goodput"
    verifies_whole_tree = False
    # The live mask, wherever a method takes one (`live`), is a bool tensor [B] or a Python list of B bools, the
    # same decisions from either: the runtime passes its own list (`_State.alive`: a round's host already has
    # it, and each .tolist() is host time between a round's read and the next launch). A list is kept as it is
    # (the learning it waits for reads it later): the caller makes a new one rather than change it in place.
    live_as_list = True
    DECAY = 0.7          # weight of the past in the running estimates (about 3 rounds of memory)
    PROBE_EVERY = 16     # plain rounds before the drafter is tried again, at the shortest
    PROBE_BUDGET = 0.01  # what a failed probe may cost, as a share of the plain steps before it (see the module)
    PROBE_CEILING = 1024  # the longest interval: where catching up alone costs more than the budget per row
    MARGIN = 1.03        # drafting must promise 3% more tokens/s than plain decoding (estimates run high)
    PRIOR = 0.5          # per-depth acceptance before any round was verified (sampling only)
    TRUST_DECAY = 0.99   # the drafter's calibration changes slowly: about 100 drafted rounds of memory
    TRUST_PRIOR = 2.0    # each depth's trust starts at the depth above's (the first at 1), weighing this many trees
    TRUST_Z = 1.0        # trust is read optimistically up to face value (see the module)
    RECENT_DECAY = 0.9   # the recent sums, which say when the drafter stopped delivering: about 10 rounds
    RECENT_Z = 2.0       # ... when they fall this many deviations short of what the trust expects (see the module)
    DEEP_PRIOR = True    # a depth's prior trees at the depth above's trust (False: at 1, kept for the tests)
    HINDSIGHT = True     # calibrate every drafted depth against the tokens emitted later (see the module)

    def __init__(self, depth: int, costs: CostCurves):
        self.depth, self.costs = depth, costs

    def start(self, batch: int) -> None:
        """A stream (a request) of `batch` sequences begins: everything the policy learns starts afresh,
        so a request is decided the same whatever was served before it. Only what is measured of the
        machine carries (the cost curves, which the runtime keeps)."""
        self.batch = batch
        self._sampling = False
        self.expected = [1.0] * batch                            # tokens a drafted round promises, per sequence
        self.acceptance = torch.full((batch, self.depth), self.PRIOR)
        self.widths = list(range(1, self.depth + 2))             # verify width per menu entry (a chain's until a round says)
        self._menu_costs = None                                  # (widths, each entry's round cost): see _round_costs
        self._draft_memo = None                                  # should_draft's last inputs and answer
        self.round_cost = self._round_costs()[self.depth]
        self._plain_step = self.costs.verify(batch, 1)
        self.interval = self.since_draft = self._probe_interval()  # (so the first round probes)
        # Decayed sums, per depth, of how often the accepted (or, in hindsight, the target's own) path
        # reached it, of how often the drafter promised it would, and of the trees seen (see the module):
        # Python floats, D of each, as everything the policy works from them is (the trust, the menu
        # read through it, the round's value: a torch call per step of that arithmetic on a few numbers
        # was host time in every drafted round).
        self._sums = [[0.0] * self.depth for _ in range(6)]
        self._trust = [1.0] * self.depth
        self._trust_path = [1.0] * self.depth  # t_1 ... t_d, updated with the trust
        self._waiting = [[] for _ in range(batch)]  # per sequence: drafted trees whose outcome is not yet known
        self._drafts = self._promised_from = None
        self._pending = None  # the last round's outcome, not yet learned from (`learn`)

    def _probe_interval(self) -> int:
        """The shortest interval I (at least PROBE_EVERY) whose failed probe costs at most PROBE_BUDGET of
        the I plain steps before it (see the module), or PROBE_CEILING where none up to it does: found
        by doubling from PROBE_EVERY, then bisecting between the last interval that costs more and the
        first that does not (beyond K+1 rows a drafter call's cost is affine in its rows, `costs.draft`,
        so a failed probe's cost less the budget is affine in I there: one crossing)."""
        step = self.costs.verify(self.batch, 1)
        probe_extra = self.costs.verify(self.batch, 2) - step  # a probe verifies one draft at least

        def over(interval: int) -> bool:
            return self.costs.draft(self.batch, interval + 1) + probe_extra > self.PROBE_BUDGET * interval * step

        low = high = self.PROBE_EVERY
        while over(high):
            if high >= self.PROBE_CEILING:
                return self.PROBE_CEILING
            low, high = high, min(2 * high, self.PROBE_CEILING)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if over(middle) else (low, middle)
        return high

    def _round_costs(self) -> list[float]:
        """c_draft + c_verify(widths[j]) for every menu entry j, from a table kept while the menu's widths
        stay the same (a chain's always do): a drafted round reads it for every entry."""
        memo = self._menu_costs
        if memo is None or (memo[0] is not self.widths and memo[0] != self.widths):
            draft = self.costs.draft(self.batch)
            self._menu_costs = (self.widths, [draft + self.costs.verify(self.batch, w) for w in self.widths])
        return self._menu_costs[1]

    @staticmethod
    def _batch_tokens(expected: list, alive: list[bool]):
        """What a drafted round is worth to the batch, in tokens, from each sequence's expected tokens
        (expected[b]: a number, or one per menu entry): halfway between the live sequences' sum and
        their count times the least of them (see the module; at batch 1, the sequence's own)."""
        if len(alive) == 1 and alive[0]:  # (batch 1, every drafted round: the sequence's own, as below)
            return expected[0]
        mine = [e for e, a in zip(expected, alive) if a]
        if not mine:
            return 0.0 if not expected or not isinstance(expected[0], list) else [0.0] * len(expected[0])
        if len(mine) == 1:  # the sequence's own, as the formula gives it (0.5 * (x + 1 * x) is x exactly)
            return mine[0]
        if not isinstance(mine[0], list):
            return 0.5 * (sum(mine) + len(mine) * min(mine))
        return [0.5 * (sum(column) + len(mine) * min(column)) for column in zip(*mine)]

    def _best(self, expected: list[list[float]], alive: list[bool], at_least: int = 0):
        """(the menu entry j maximizing the round's expected tokens per second, each sequence's
        expected tokens at j) from expected[b][j]."""
        totals, costs = self._batch_tokens(expected, alive), self._round_costs()
        rates = list(map(operator.truediv, totals, costs))  # (mapped: host time in every choice)
        j = rates.index(max(rates[at_least:]), at_least)  # the first of the best, as a max over j takes it
        return j, [e[j] for e in expected]

    def _probing(self) -> bool:
        return self.since_draft >= self.interval

    def should_draft(self, live: torch.Tensor | list[bool]) -> bool:
        """Whether the round calls the drafter (see the module). Remembered while its inputs stay (the
        rounds between probes, where nothing the policy knows changes: a k = 0 round costs what a plain
        step does; the runtime's live mask is then the very list the answer was worked from)."""
        if self.since_draft >= self.interval:  # (`_probing`, inline: every round asks)
            return True
        alive = _listed(live)
        memo = self._draft_memo
        if (memo is None or memo[0] is not self.expected or memo[1] != self.round_cost
                or (memo[2] is not alive and memo[2] != alive)):
            drafted_rate = self._batch_tokens(self.expected, alive) / self.round_cost
            plain_rate = sum(alive) / self._plain_step
            memo = self._draft_memo = (self.expected, self.round_cost, alive, drafted_rate > self.MARGIN * plain_rate)
        return memo[3]

    def choose(self, reach: torch.Tensor | None, live: torch.Tensor | list[bool], widths: list[int], drafts=None) -> int:
        """The menu entry to verify this round; `reach` [B,J+1,D] is the drafter's estimate, per menu
        entry, of the probability that the accepted path reaches each depth (`tree.nested_subtrees`;
        None: sampling, a menu by depth), widths[j] the verify call's tokens for it, `drafts` the
        drafted (nodes [B,N], parents [B,N]) that hindsight checks against the tokens emitted later."""
        alive = _listed(live)
        if reach is None:
            self.widths, self._sampling = widths, True
            # A probe checks one draft at least, or an estimate that fell could never rise again.
            j, self._promised = self._best(self._expected().tolist(), alive, int(self._probing()))
            return j
        drafts = None if drafts is None else [t.tolist() for t in drafts]
        # A chain's menu entry j is its first j drafts (`tree.chain_reach`): its whole reach [B][D] says
        # every entry's, a read of B x D numbers where the menu's is B x (K+1) x D.
        chain = list(range(-1, len(drafts[1][0]) - 1)) if drafts is not None else None
        is_chain = chain is not None and all(p == chain for p in drafts[1])
        return self._choose_greedy((reach[:, -1] if is_chain else reach).tolist(), alive, widths, drafts, is_chain)

    def choose_chain(self, joint: list[list[float]], alive: list[bool], widths: list[int],
                     nodes: list[list[int]]) -> int:
        """`choose` for a greedy chain, from Python lists: joint[b][d-1] = p_1 ... p_d (`tree.chain_joint`:
        the chain's reach, which says every menu entry's) and nodes[b] its drafts' ids (ints, or floats that
        hold them exactly: hindsight compares them by value, `_followed`; the device round passes its read's
        float64 as they are, its conversion host time before the verify launch). The device round reads
        both in one transfer right after the drafter call (the policy decides on this round's drafts) and
        asks here: the same decision as `choose` on the tensors, without a torch call."""
        return self._choose_greedy(joint, alive, widths, (nodes, None), True)

    def _choose_greedy(self, reach: list, alive: list[bool], widths: list[int], drafts, chain: bool) -> int:
        """`choose`, greedy: reach [B][J+1][D] (a chain's: [B][D]), drafts (nodes, parents) as lists or None.
        The last round's outcome is learned from first, where the caller has not (`learn`)."""
        if self._pending is not None:
            self.learn()
        self.widths, self._sampling = widths, False
        at_least = int(self._probing())  # (see choose)
        self._drafts, self._chain, self._reach = drafts, chain, reach
        j, self._promised = self._best(self._calibrated(), alive, at_least)
        self._promised_from = None if at_least else (self._trust_path, alive)  # what _promised was read with
        self._verified = j  # (what it claimed is read from _reach when the outcome is)
        return j

    def _calibrated(self) -> list[list[float]]:
        """[B][J+1]: the last drafted round's menu, its expected tokens read through the trust by depth.
        A chain's entry j sums its first j depths: the running sum, added in the order the whole sum of
        entry j's reach (zero beyond j) adds them, so the same numbers to the bit."""
        path = self._trust_path
        if self._chain:  # (a loop on floats: min(1, t r) as `x if x < 1.0 else 1.0`, the same value, NaN too)
            menu = []
            for row in self._reach:
                total, entry = 0.0, [1.0]
                for t, r in zip(path, row):
                    x = t * r
                    total += x if x < 1.0 else 1.0
                    entry.append(1 + total)
                menu.append(entry)
            return menu
        one = itertools.repeat(1.0)  # (min(1, t r) over the D depths, mapped: host time)
        return [[1 + sum(map(min, one, map(operator.mul, path, entry))) for entry in menu] for menu in self._reach]

    def _entry(self, j: int) -> list[list[float]]:
        """[B][D]: the reach of the last drafted round's menu entry j (-1: the whole tree)."""
        if not self._chain:
            return [menu[j] for menu in self._reach]
        return [row[:j] + [0.0] * (len(row) - j) for row in self._reach] if j >= 0 else self._reach

    @property
    def trust(self) -> list[float]:
        """[D]: per depth, how often the path reached it per time the drafter's probabilities promised it
        would (greedy; see the module), with TRUST_PRIOR observations at the depth above's trust mixed
        in: the ratio where it exceeds 1, else an upper bound (TRUST_Z standard deviations, the reached
        count taken as Poisson) of at most 1; over the recent trees alone where they fell short (`_learn`)."""
        return self._trust

    def _learn(self, reached: list[float], promised: list[float], seen: list[float]) -> None:
        """The decayed sums A, P, N and the recent ones A_r, P_r, N_r (see the module) take one round's
        outcomes, and the trust per depth and its running product t_1 ... t_d are worked from them, in
        one pass over the depths (each step of it is host time in every drafted round)."""
        # (max(a, b) written `b if b > a else a` and min(a, b) `b if b < a else a`, the same values, NaN
        # too: a call to either cost more than the rest of the arithmetic)
        decay, recent, weight, z, zr, sqrt = (self.TRUST_DECAY, self.RECENT_DECAY, self.TRUST_PRIOR, self.TRUST_Z,
                                              self.RECENT_Z, math.sqrt)
        deep = self.DEEP_PRIOR
        sum_a, sum_p, sum_n, recent_a, recent_p, recent_n = sums = [[] for _ in range(6)]
        trust, path, running, above, changed = [], [], 1.0, 1.0, False
        for a, p, n, ar, pr, nr, da, dp, dn in zip(*self._sums, reached, promised, seen):
            a, p, n = decay * a + da, decay * p + dp, decay * n + dn
            ar, pr, nr = recent * ar + da, recent * pr + dp, recent * nr + dn
            if changed:  # the path changed below a depth above: what this depth saw before says nothing now
                a = p = n = ar = pr = nr = 0.0
            t = above
            while n > 0:
                prior = weight * p / (1e-9 if 1e-9 > n else n)  # the prior trees' claims, at the depth above's ratio
                top, bottom = a + above * prior, p + prior
                bottom = 1e-9 if 1e-9 > bottom else bottom
                ratio, optimistic = top / bottom, (top + z * sqrt(a + 1)) / bottom
                optimistic = 1.0 if 1.0 < optimistic else optimistic
                t = optimistic if optimistic > ratio else ratio
                if changed:
                    break
                older = p - pr + prior  # the older trees (each weighed TRUST_DECAY^age - RECENT_DECAY^age)
                expect = (a - ar + above * prior) / (1e-9 if 1e-9 > older else older) * pr  # at their ratio
                if expect - ar <= zr * sqrt(expect):
                    break
                changed, a, p, n = True, ar, pr, nr  # they fell short: the older trees forgotten, t read again
            sum_a.append(a)
            sum_p.append(p)
            sum_n.append(n)
            recent_a.append(ar)
            recent_p.append(pr)
            recent_n.append(nr)
            trust.append(t)
            running *= t
            path.append(running)
            above = t if deep else 1.0
        self._sums, self._trust, self._trust_path = sums, trust, path

    def _expected(self) -> torch.Tensor:
        """[B,K+1]: expected tokens when verifying to depth k, from the running per-depth acceptance."""
        reach = torch.cumprod(self.acceptance.clamp(0, 1), dim=1)  # P(drafts 1..i all accepted)
        return torch.cat([torch.ones(len(reach), 1), 1 + torch.cumsum(reach, dim=1)], dim=1)

    def observe(self, j: int, accepted: list[int], live: torch.Tensor | list[bool], drafted: bool,
                emitted: list[list[int]] | None = None) -> None:
        """After a round that verified menu entry j (a depth when sampling) and accepted `accepted[b]`
        drafts of sequence b (Python ints, as the round read them: no torch call to make them), each
        having emitted `emitted[b]` (its accepted drafts and the target's next token): what the next
        decision needs, at once (the rounds since the last drafter call; a drafted round's `expected`,
        blended with what the choice promised, and `round_cost`). The learning from the outcome waits
        (`learn`; a probe's is learned at once): the caller runs it while the device works on the next
        round, else the next choose or observe runs it first. `emitted`, `accepted` and `live` are kept
        until then, unchanged."""
        if self._pending is not None:
            self.learn()
        if not drafted:
            self.since_draft += 1
            if any(self._waiting):  # its tokens may resolve the trees waiting in hindsight
                self._pending = (j, accepted, live, False, emitted, None, 0.0)
            return
        alive = _listed(live)
        probe = self._probing()
        self.since_draft = 0
        d = self._past_weight(probe, j)  # a probe replaces the stale estimates; other rounds blend in
        if self._sampling:  # the per-depth acceptance, which only sampling reads; there j is the depth
            accepted, live = torch.tensor(accepted), torch.tensor(alive)
            for i in range(j):  # draft i+1 was checked where drafts 1..i were accepted
                checked = live & (accepted >= i)
                hit = (accepted > i).float()
                self.acceptance[:, i] = torch.where(checked, d * self.acceptance[:, i] + (1 - d) * hit,
                                                    self.acceptance[:, i])
            if j < self.depth:  # all j accepted: draft j+1, never checked, drifts back to the prior
                full = live & (accepted == j)
                self.acceptance[:, j] = torch.where(full, self.DECAY * self.acceptance[:, j]
                                                    + (1 - self.DECAY) * self.PRIOR, self.acceptance[:, j])
            _, self._promised = self._best(self._expected().tolist(), alive)  # what drafting promises now
        else:  # (the estimates before this round kept: `learn` blends them again if the promise moves)
            self._pending = (j, accepted, alive, True, emitted, self.expected, d)
        self.expected = self._blended(self.expected, d, alive)
        self.round_cost = d * self.round_cost + (1 - d) * self._round_costs()[j]
        if probe:  # (learned at once: whether the stream drafts again; probes are rare, see the module)
            self.learn()

    def learn(self) -> None:
        """Greedy: learn from the last observed round's outcome (hindsight over the trees waiting, the
        trust per depth), re-read what drafting promises through the new trust, and correct `expected`
        by it: in a drafted round the blend of the estimates before it (kept by `observe`) with the new
        promise, as `observe` would have made it had it learned first (the same numbers, to the bit);
        in a plain round that resolved a tree, the promise itself. Nothing when there is nothing to learn
        (a plain round with no tree waiting; sampling, whose estimates `observe` updates at once). The
        device round calls it right after the next round's first launch (see the module)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        j, accepted, alive, drafted, emitted, before, d = pending
        if not drafted:
            alive = _listed(alive)
        if not self._calibrate(j, accepted, alive, drafted, emitted or [[] for _ in range(self.batch)]):
            return
        # What drafting promises, re-read through what was just learned: evidence on a probe's drafts
        # arrives in the plain rounds after it, and waiting for the next probe would waste it.
        if self._promised_from != (self._trust_path, alive):  # (a trust pinned at 1 changes nothing)
            _, self._promised = self._best(self._calibrated(), alive)
            self._promised_from = (self._trust_path, alive)
            if drafted:
                self.expected = self._blended(before, d, alive)
        if not drafted:
            self.expected = [p if a else e for p, e, a in zip(self._promised, self.expected, alive)]

    def _blended(self, before: list, d: float, alive: list[bool]) -> list:
        """A drafted round's `expected`: the estimates before it (weight d) and what drafting promises, per
        live sequence."""
        return [d * e + (1 - d) * p if a else e for e, p, a in zip(before, self._promised, alive)]

    def _past_weight(self, probe: bool, j: int) -> float:
        """The weight of the past in what a drafted round promises (`expected`) and costs: none after a
        probe (its estimates are stale) or, greedy, after a round whose drafts, read through the trust,
        were worth verifying none (j = 0: the text at hand says drafting does not pay, and blending it
        in over ~3 rounds cost a drafter call each; see the module); else DECAY."""
        return 0.0 if probe or (j == 0 and not self._sampling) else self.DECAY

    def _calibrate(self, j, accepted, alive, drafted, emitted) -> bool:
        """Greedy: update the per-depth trust from the drafted trees whose outcome is now known (True
        when one was). In
        hindsight (HINDSIGHT) a tree's outcome is how deep the target's own tokens, emitted in this and
        later rounds, follow a root path of the tree, whatever depth was verified. Without it (the
        variant that cannot recover, kept for the tests) only the depths this round verified say anything."""
        if not (drafted and self._drafts is not None) and not any(self._waiting):  # nothing to learn
            self._drafts = None
            return False
        outcomes = []  # (a tree's reach per depth, how deep the target's path followed it, depths checked)
        if not self.HINDSIGHT:
            if drafted and self._drafts is not None:
                claims, counts = self._entry(self._verified), accepted
                for b in (b for b in range(self.batch) if alive[b]):
                    verified = sum(c > 0 for c in claims[b])
                    outcomes.append((claims[b], counts[b], min(counts[b] + 1, verified)))
            self._drafts = None
        else:
            if drafted and self._drafts is not None:
                (nodes, parents), chain, claims = self._drafts, self._chain, self._entry(-1)  # the whole tree's promise
                for b, waiting in enumerate(self._waiting):
                    if alive[b]:  # [nodes, parents, claim, how deep the target's tokens since follow it, the node]
                        waiting.append([nodes[b], None if chain else parents[b], claims[b], 0, -1])
                self._drafts = None
            depth = self.depth
            for waiting, a, new in zip(self._waiting, alive, emitted):
                if not waiting:
                    continue
                if not a:  # it left the policy's rounds (finished, or finishing token by token)
                    waiting.clear()
                    continue
                keep = []
                for entry in waiting:
                    # A tree still waiting was followed by every token emitted since it was drafted: only
                    # the new ones can say how deep (`_followed`, resumed where it stopped).
                    tokens, parents, claim, before, node = entry
                    deepest, node = _followed(tokens, parents, new, before, node)
                    if deepest == before + len(new) and deepest < depth:
                        entry[3], entry[4] = deepest, node
                        keep.append(entry)  # the target's path still follows the tree: not known yet
                    else:
                        outcomes.append((claim, deepest, deepest + 1 if deepest < depth else depth))
                waiting[:] = keep
        if not outcomes:
            return False
        reached, promised, seen = _count(outcomes, self.depth)
        if not any(seen):
            return False
        self._learn(reached, promised, seen)
        return True


def _listed(live) -> list[bool]:
    """A live mask as a Python list: the caller's list as it is (no torch call), a tensor's values."""
    return live if type(live) is list else live.tolist()


def _count(outcomes: list[tuple[list[float], int, int]], depth: int) -> tuple[list, list, list]:
    """Per depth d + 1 (of `depth`), over the trees' outcomes (reach, deepest, checked) in order: how many
    the target's path reached (d < deepest), what the drafter promised (reach[d] / reach[d - 1], the
    conditional its reach per depth implies; for a chain, draft d's own) and how many checked it (d <
    checked: the path reached depth d)."""
    reached, promised, seen = [0.0] * depth, [0.0] * depth, [0.0] * depth
    for reach, deepest, checked in outcomes:
        before = 1.0
        for d in range(checked):
            now = reach[d]
            if before > 0:
                if d < deepest:
                    reached[d] += 1
                promised[d] += now / before
                seen[d] += 1
            before = now
    return reached, promised, seen


def _followed(tokens: list[int], parents: list[int] | None, seen: list[int], depth: int = 0,
              node: int = -1) -> tuple[int, int]:
    """(how deep the target's tokens follow a root path of the drafted tree (nodes `tokens`, `parents`;
    None: a chain), the node reached) where the tokens before `seen` followed it to `node` at `depth`
    (0, -1: the root): 0 when the first differs from every child of the root."""
    if parents is None:
        for token in seen:
            if depth >= len(tokens) or tokens[depth] != token:
                break
            depth += 1
        return depth, node
    for token in seen:
        child = next((i for i, (p, t) in enumerate(zip(parents, tokens)) if p == node and t == token), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth, node


def drafted_acceptance(accepted: list[int], verified: list[int]) -> tuple[int, int]:
    """(drafts accepted, drafts checked) over the rounds that verified drafts. A draft is checked where
    every draft before it on its path was accepted, so a round that accepted m of the k it verified
    checked min(m + 1, k); accepted / checked is the maximum-likelihood per-draft acceptance of a
    geometric model."""
    rounds = [(m, k) for m, k in zip(accepted, verified) if k > 0]
    return sum(m for m, _ in rounds), sum(min(m + 1, k) for m, k in rounds)


def round_speedup(costs: CostCurves, batch: int, tokens: float, width: int) -> float:
    """A drafted round's speed over plain decoding, as the cost model sees it: `tokens` expected per
    round from one drafter call and one verify call of `width` tokens, against one token per plain
    step:   tokens * c_verify(1) / (c_draft + c_verify(width))."""
    return tokens * costs.verify(batch, 1) / (costs.draft(batch) + costs.verify(batch, width))


def break_even_acceptance(costs: CostCurves, batch: int, depth: int,
                          margin: float = GoodputDepth.MARGIN) -> tuple[float, int] | None:
    """(a, j): the lowest per-draft acceptance a at which a drafted round verifying j drafts of one path
    beats a plain step as the goodput policy judges it, minimized over j = 1..depth:

        round_speedup(tokens = 1 + a + ... + a^j, width = j + 1)  =  margin

    (the round's expected tokens rise in a from 1 to j + 1; solved by bisection). None where no
    acceptance pays, not even 1.0."""
    best = None
    for j in range(1, depth + 1):
        if round_speedup(costs, batch, j + 1, j + 1) < margin:
            continue
        low, high = 0.0, 1.0
        for _ in range(40):
            a = (low + high) / 2
            paying = round_speedup(costs, batch, sum(a ** i for i in range(j + 1)), j + 1) >= margin
            low, high = (low, a) if paying else (a, high)
        if best is None or high < best[0]:
            best = (high, j)
    return best


def explain(policy: str, stats, costs: CostCurves | None, depth: int) -> str:
    """One line for `eagle-export run`: why this request did or did not speculate (batch 1)."""
    if policy == "fixed":
        return f"speculation: fixed, the drafter called every round and all {depth} drafts verified (--verify-policy fixed)"
    took, checked = drafted_acceptance(stats.accepted, stats.depths)
    unverified = stats.draft_calls - sum(k > 0 for k in stats.depths)
    found = [f"drafter called in {stats.draft_calls} of {stats.rounds} rounds"]
    if checked:
        found.append(f"its drafts accepted {took} of {checked} checked ({took / checked:.2f})")
    if unverified:
        found.append(f"{unverified} drafted round(s) verified no draft (what the drafts promised was worth less "
                     "than a plain step)")
    pays = break_even_acceptance(costs, 1, depth) if costs is not None and costs.has(1) else None
    if pays is None:
        verdict = "drafting cannot pay on this machine even at acceptance 1.0 (a plain step is too cheap beside a drafter call)"
    else:
        a, j = pays
        verdict = (f"drafting pays here from acceptance {a:.2f} (plain step {1e3 * costs.verify(1, 1):.0f} ms; "
                   f"drafter {1e3 * costs.draft(1):.0f} ms + verify of {j + 1} tokens {1e3 * costs.verify(1, j + 1):.0f} ms)")
    return (f"speculation (goodput): {'; '.join(found)}; {verdict}. "
            "`eagle-export bench --acceptance-sweep BUILD` shows the speedup at each acceptance")


def check_policy(name) -> None:
    if isinstance(name, str) and name not in POLICIES:
        raise EagleExportError(f"unknown verify policy {name!r}", f"choose one of {', '.join(POLICIES)}")


def make_policy(name, depth: int, costs: CostCurves | None):
    """A policy by name; an object with the same methods (start, should_draft, choose, observe) is
    used as it is (tests drive the loop with random ones). One that also has `choose_chain` (goodput)
    has a greedy chain's rounds run on the device (`runtime._device_round`); one that has `learn` (goodput)
    is asked to learn from a round's outcome right after the next round's first launch."""
    check_policy(name)
    if not isinstance(name, str):
        return name
    return FixedDepth(depth) if name == "fixed" else GoodputDepth(depth, costs)
