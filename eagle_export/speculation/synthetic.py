"""Synthetic drafts: the real drafter call runs, then its drafts are replaced by ones of known quality.

A measurement and proof tool, never a generation mode. Each round the runtime calls the real drafter
graph (so the round costs what a real round costs: same graph, same shapes) and then hands its tree
to `SyntheticDrafts.replace`, which rewrites the node tokens and the draft probabilities:

    right token at depth d   c[n + d - 1], where c is the sequence's greedy continuation through
                             the verify graph at its full width (a pass with random drafts and the
                             fixed policy over the same prompts, first) and n the tokens the
                             sequence has emitted (the last one is c[n-1])
    a node is right          iff it is on the spine, its parent is the root or right, and a
                             uniform draw falls below a_d; the spine runs from the root through,
                             at each node, the child with the deepest subtree (ties: the lowest
                             index), so it reaches the tree's full depth (a chain is all spine)
    every other node         a certainly wrong token: (right + 1 + i) mod V for node i, distinct
                             from its siblings and from the right token

The continuation is decoded at the verify width, not one token at a time, because that is the width
a speculative round's argmax is computed at: where the target's kernels round differently at width 1
and at width K+1, a width-1 continuation parts from the speculative text at the first near-tie, and
every later synthetic draft is wrong. That removes the width's rounding, not a row's dependence on
its place in the call: in bf16 on an H200 (`eagle-export gpu-kit`) the text still parted once drafts
were accepted, which is why the kit sweeps in fp32. Where rows are invariant (fp32; every CPU test)
both continuations equal plain decoding.

So, greedy, draft d of a chain is accepted with probability exactly a_d given drafts 1..d-1 were
(`acceptance` a_1..a_K, one value for every depth when given one), and a tree's level d is reached
likewise: only spine nodes can be right, so a tree gains nothing over its spine. `oracle` is a = 1
(tau = K+1), `anti` a = 0 (tau = 1), `random` uniform random tokens.
The draft probabilities become a_d on the spine and 0 elsewhere: what a calibrated
drafter would say, so the goodput policy judges the synthetic drafter as it would a real one of
that quality. Greedy output stays the target's own whatever the drafts are, which every caller
checks. Past the end of a continuation the right token is unknown and every node is a guess.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..errors import EagleExportError
from .tree import ancestor_mask, remembered_per_tree

MODES = ("oracle", "anti", "random")


def verify_width_continuations(runtime, prompts, config, seed: int = 0) -> list[list[int]]:
    """Greedy decoding through the verify graph at its full width: random drafts (accepted only
    where one happens to be the argmax), the fixed policy, so every round is one call of width K+1
    (a tree's nodes + 1). `runtime.depth` tokens longer than `config` asks, so a round near the end
    still knows its right tokens."""
    longer = dataclasses.replace(config, max_new_tokens=config.max_new_tokens + runtime.depth)
    random = SyntheticDrafts("random", [], runtime.vocab_size, seed)
    return [r.tokens for r in runtime.generate(prompts, longer, verify_policy="fixed", synthetic=random)]


def parse_probabilities(text: str, option: str, example: str) -> list[float]:
    """An option's comma-separated acceptance probabilities (`--acceptance`, `gpu-kit --sweep`), each
    in [0, 1]; `example` completes the fix's "give e.g. ..."."""
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise EagleExportError(f"{option} {text!r} is not a number or a comma-separated list of numbers",
                               f"give e.g. {example}") from None
    if not values or any(not math.isfinite(v) or not 0 <= v <= 1 for v in values):
        raise EagleExportError(f"{option} {text!r} holds a value outside [0, 1]",
                               "give conditional acceptance probabilities between 0 and 1")
    return values


def parse_acceptance(text: str, depth: int) -> tuple[float, ...]:
    """`--acceptance` as given: one probability for every depth, or one per depth (at most `depth`
    values; depths beyond the last given take the last). Refused outside [0, 1]."""
    values = parse_probabilities(text, "--acceptance", "--acceptance 0.7 or --acceptance 0.73,0.52,0.35")
    if len(values) > depth:
        raise EagleExportError(f"--acceptance gives {len(values)} values, but the build drafts to depth {depth}",
                               "give one value for every depth, or no more values than the build has draft depths")
    return tuple(values + [values[-1]] * (depth - len(values)))


def label(acceptance) -> str:
    """How a synthetic setting reads in tables: 'oracle', '0.7', '0.73/0.52/0.35/0.25'."""
    if isinstance(acceptance, str):
        return acceptance
    values = sorted(set(acceptance))
    return f"{values[0]:g}" if len(values) == 1 else "/".join(f"{a:g}" for a in acceptance)


@dataclass
class SyntheticDrafts:
    """Drafts of known quality for one batch of prompts. `acceptance`: a_1..a_K, or a mode name."""

    acceptance: tuple[float, ...] | str
    continuations: list[list[int]]   # target-only greedy tokens after each prompt (random: unused)
    vocab_size: int
    seed: int = 0
    generator: torch.Generator = field(init=False)
    _padded: tuple | None = field(init=False, default=None, repr=False)  # (table, lengths): see _table

    def __post_init__(self):
        if isinstance(self.acceptance, str) and self.acceptance not in MODES:
            raise EagleExportError(f"unknown synthetic drafter {self.acceptance!r}", f"choose one of {', '.join(MODES)}")
        self.generator = torch.Generator().manual_seed(self.seed)

    @classmethod
    def for_prompts(cls, runtime, prompts, config, acceptance, seed: int = 0) -> SyntheticDrafts:
        """The continuation from a pass over `prompts` on `runtime` itself at the verify width."""
        if config.temperature > 0:
            raise EagleExportError("synthetic drafts are defined for greedy decoding only",
                                   "use temperature 0 (the default) with synthetic acceptance")
        return cls(acceptance, [] if acceptance == "random" else verify_width_continuations(runtime, prompts, config),
                   runtime.vocab_size, seed)

    def probabilities(self, depth: int) -> torch.Tensor:
        """[depth]: a_d for d = 1..depth."""
        if self.acceptance == "random":
            return torch.full((depth,), 1.0 / self.vocab_size)
        if isinstance(self.acceptance, str):
            return torch.full((depth,), 1.0 if self.acceptance == "oracle" else 0.0)
        return torch.tensor(self.acceptance[:depth], dtype=torch.float32)

    def replace(self, parents: torch.Tensor, depths: torch.Tensor, emitted: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """parents, depths [B,N] of the drafted tree; emitted[b] tokens sequence b has emitted ->
        (node ids [B,N] in the target vocabulary, each node's draft probability [B,N]).
        A few whole-batch tensor operations, no loop over sequences or nodes: this runs inside every
        timed round of a synthetic benchmark, so its cost is part of what the benchmark reports."""
        b, n = parents.shape
        a = self.probabilities(int(depths.max()) if n else 0)
        draws = torch.rand(b, n, generator=self.generator)
        if self.acceptance == "random":
            ids = torch.randint(self.vocab_size, (b, n), generator=self.generator)
            return ids, torch.full((b, n), 1.0 / self.vocab_size)
        table, lengths = self._table(b)
        at = torch.as_tensor(emitted, dtype=torch.int64)[:, None] + depths - 1  # c[n + d - 1]
        right_ids = torch.where(at < lengths[:, None], table.gather(1, at.clamp(0, table.shape[1] - 1)), 0)
        # A node is right iff every node on its root path (itself included) is on the spine and drew
        # below its depth's a_d: the topological rule "spine, parent right, draw" unrolled.
        spine, node_a = _spine(parents), a[(depths - 1).clamp_min(0)]          # node_a: a_d at each node's depth
        right = ~(ancestor_mask(parents) & ~(spine & (draws < node_a))[:, None, :]).any(-1)
        # The probabilities say a_d on the whole spine whatever was drawn, so they tell the policy no
        # more than a calibrated drafter would.
        probs = torch.where(spine, node_a, 0.0)
        wrong = (right_ids + 1 + torch.arange(n)) % self.vocab_size
        return torch.where(right, right_ids, wrong), probs

    def _table(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The continuations as one zero-padded [batch, W] tensor and their lengths (a sequence
        without one has length 0: every node a guess), made once."""
        if self._padded is None or len(self._padded[0]) != batch:
            width = max([len(c) for c in self.continuations[:batch]] + [1])
            table = torch.zeros(batch, width, dtype=torch.int64)
            lengths = torch.zeros(batch, dtype=torch.int64)
            for s, c in enumerate(self.continuations[:batch]):
                table[s, :len(c)] = torch.as_tensor(c, dtype=torch.int64)
                lengths[s] = len(c)
            self._padded = (table, lengths)
        return self._padded


@remembered_per_tree
def _spine(parents: torch.Tensor) -> torch.Tensor:
    """[B,N] -> [B,N] bool: the path from the root through, at each node, the child whose subtree
    is deepest (ties: the lowest index). With the ancestor mask (j is i or an ancestor of i): a
    node's height is the deepest descendant's depth minus its own; a node is its parent's best child
    when its key (height, then the lower index) is the largest among its siblings'; the spine is the
    set of nodes whose whole root path is made of best children."""
    b, n = parents.shape
    ancestors = ancestor_mask(parents)                                         # [B,N,N]
    depths = ancestors.sum(-1)                                                 # [B,N]
    height = (ancestors * depths[:, :, None]).amax(1) - depths                 # max over descendants i of j
    key = height * (n + 1) + (n - torch.arange(n))                             # > 0, unique among siblings
    siblings = parents[:, :, None] == parents[:, None, :]                      # [B,N,N]
    best = key == (siblings * key[:, None, :]).amax(-1)
    return ~(ancestors & ~best[:, None, :]).any(-1)
