"""How many drafts each round verifies: a fixed K, or the k in 0..K that maximizes tokens per second.

A round costs one drafter call (it always proposes K: the graph is unrolled) plus one target call
over k+1 tokens (a tree's: the root and its nodes up to depth k); its expected yield is 1 + sum over
i <= k of P(drafts 1..i all accepted). Plain decoding yields 1 token per target call of 1 token.
With the measured costs (`costs.CostCurves`):

    before the drafter call   draft iff  E[tokens of a drafted round] / (c_draft + c_verify(k+1))
                                         > MARGIN * 1 / c_verify(1)
                              else the round is a plain decoding step (k = 0, no drafter call);
    after it                  k = argmax_k  E[tokens | k] / (c_draft + c_verify(k+1)),  k = 0 allowed.

E[tokens | k] comes from the drafter's own confidence for this round: P(the accepted path reaches
depth i) ~ the sum of the draft probabilities of the tree's root paths to depth i (`tree.reach_by_depth`;
for a chain, the product of the greedy drafts' probabilities `draft_token_probs` up to draft i), the
quantity before the call from a decayed running estimate of what drafted rounds promised. When
drafting stops paying, the policy probes every PROBE_EVERY rounds, doubling the interval (up to
PROBE_MAX) while probes keep failing, so a drafter that never helps costs at most about
c_draft / (PROBE_MAX * c_verify(1)) of plain decoding.

Sampling: the number of drafts verified must not depend on the drafts being verified (rejection
sampling stays exact only if the decision to check draft i is made before draft i is seen), so
with `token_probs=None` k comes from the running per-depth acceptance of earlier rounds instead.

A batch shares one k and one drafter decision per round: every sequence's verify call has the same
T (the target graph's [B, T] input), and a sequence that could stop earlier loses nothing from
being verified further, since the call's cost is paid for the batch anyway.
"""

from __future__ import annotations

import torch

from .costs import CostCurves
from .errors import EagleExportError

POLICIES = ("goodput", "fixed")


class FixedDepth:
    """Draft every round and verify all K drafts (the behaviour before the goodput policy)."""

    name = "fixed"

    def __init__(self, depth: int):
        self.depth = depth

    def start(self, batch: int) -> None:
        pass

    def should_draft(self, live: torch.Tensor) -> bool:
        return True

    def choose(self, reach: torch.Tensor | None, live: torch.Tensor, widths: list[int] | None = None) -> int:
        return self.depth

    def observe(self, depth: int, accepted: torch.Tensor, live: torch.Tensor, drafted: bool) -> None:
        pass


class GoodputDepth:
    name = "goodput"
    DECAY = 0.7          # weight of the past in the running estimates (about 3 rounds of memory)
    PROBE_EVERY = 16     # plain rounds before the drafter is tried again
    PROBE_MAX = 64       # the probe interval doubles up to this while probes keep failing
    MARGIN = 1.03        # drafting must promise 3% more tokens/s than plain decoding (estimates run high)
    PRIOR = 0.5          # per-depth acceptance before any round was verified (sampling only)

    def __init__(self, depth: int, costs: CostCurves):
        self.depth, self.costs = depth, costs

    def start(self, batch: int) -> None:
        self.batch = batch
        self.expected = torch.ones(batch)                        # tokens a drafted round promises, per sequence
        self.acceptance = torch.full((batch, self.depth), self.PRIOR)
        self.widths = list(range(1, self.depth + 2))             # verify width per k (a chain's until a round says)
        self.round_cost = self._round_cost(self.depth)
        self.interval = self.since_draft = self.PROBE_EVERY      # so the first round probes
        self._promised, self._sampling = None, False

    def _round_cost(self, k: int) -> float:
        return self.costs.draft(self.batch) + self.costs.verify(self.batch, self.widths[k])

    def _best(self, reach: torch.Tensor, live: torch.Tensor, at_least: int = 0):
        """(k maximizing the round's expected tokens per second, each sequence's expected tokens at k)
        from reach [B,K], P(the accepted path reaches depth i)."""
        expected = torch.cat([torch.ones(len(reach), 1), 1 + torch.cumsum(reach, dim=1)], dim=1)  # [B,K+1]
        totals = expected[live].sum(0)
        k = max(range(at_least, self.depth + 1), key=lambda k: float(totals[k]) / self._round_cost(k))
        return k, expected[:, k]

    def _probing(self) -> bool:
        return self.since_draft >= self.interval

    def should_draft(self, live: torch.Tensor) -> bool:
        if self._probing():
            return True
        drafted_rate = float(self.expected[live].sum()) / self.round_cost
        plain_rate = int(live.sum()) / self.costs.verify(self.batch, 1)
        return drafted_rate > self.MARGIN * plain_rate

    def choose(self, reach: torch.Tensor | None, live: torch.Tensor, widths: list[int] | None = None) -> int:
        """k for this round; `reach` [B,K] is the drafter's P(the accepted path reaches depth i) (None:
        sampling); widths[k] the verify call's tokens when verifying to depth k (a tree's root and its
        nodes up to depth k; a chain's k+1 when not given)."""
        self.widths = widths or list(range(1, self.depth + 2))
        self._sampling = reach is None
        if self._sampling:  # a probe checks one draft at least, or the running acceptance could never rise
            k, self._promised = self._best(self._reach(), live, at_least=int(self._probing()))
        else:
            k, self._promised = self._best(reach.float().cpu(), live)
        return k

    def _reach(self) -> torch.Tensor:
        return torch.cumprod(self.acceptance.clamp(0, 1), dim=1)  # P(drafts 1..i all accepted)

    def observe(self, depth: int, accepted: torch.Tensor, live: torch.Tensor, drafted: bool) -> None:
        if not drafted:
            self.since_draft += 1
            return
        probe = self._probing()
        self.since_draft = 0
        d = 0.0 if probe else self.DECAY  # a probe replaces the stale estimates; other rounds blend in
        for i in range(depth):  # draft i+1 was checked where drafts 1..i were accepted
            checked = live & (accepted >= i)
            hit = (accepted > i).float()
            self.acceptance[:, i] = torch.where(checked, d * self.acceptance[:, i] + (1 - d) * hit,
                                                self.acceptance[:, i])
        if depth < self.depth:  # all k accepted: draft k+1, never checked, drifts back to the prior
            full = live & (accepted == depth)
            self.acceptance[:, depth] = torch.where(full, self.DECAY * self.acceptance[:, depth]
                                                    + (1 - self.DECAY) * self.PRIOR, self.acceptance[:, depth])
        if self._sampling:  # what drafting promises now, from the updated acceptance
            _, self._promised = self._best(self._reach(), live)
        self.expected = torch.where(live, d * self.expected + (1 - d) * self._promised, self.expected)
        self.round_cost = d * self.round_cost + (1 - d) * self._round_cost(depth)
        if probe:
            self.interval = self.PROBE_EVERY if self.should_draft(live) else min(self.PROBE_MAX, 2 * self.interval)


def check_policy(name) -> None:
    if isinstance(name, str) and name not in POLICIES:
        raise EagleExportError(f"unknown depth policy {name!r}", f"choose one of {', '.join(POLICIES)}")


def make_policy(name, depth: int, costs: CostCurves | None):
    """A policy by name; an object with the same methods (start, should_draft, choose, observe) is
    used as it is (tests drive the loop with random ones)."""
    check_policy(name)
    if not isinstance(name, str):
        return name
    return FixedDepth(depth) if name == "fixed" else GoodputDepth(depth, costs)
