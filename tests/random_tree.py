"""A stand-in tree drafter for tests: any tree the runtime must survive, with planted tokens."""

import torch

from eagle_export.models import contract as C
from eagle_export.runtime.backends import write_into
from eagle_export.speculation.tree import TreeShape


class RandomTrees:
    """Mix into a backend class: its drafter call runs the real graph (so the drafter's cache and
    rows stay as the runtime keeps them), then proposes a random tree of up to the graph's depth
    instead of its chain. static: one random shape per call shared by the batch; dynamic: each
    sequence its own parents. Each node's token is the target's true greedy token at its depth
    (from `continuations`, the prompt plus the target's own greedy output) with probability
    1 - error_rate, else a random token: siblings often agree or are all wrong, and the accepted
    path often runs through a later sibling, so path gathers, rollbacks and multi-token accepts are
    all exercised. Losslessness must hold whatever is proposed."""

    def __init__(self, *graphs, continuations, kind="dynamic", error_rate=0.4, max_nodes=12, seed=0, vocab=320,
                 **kw):
        super().__init__(*graphs, **kw)
        self.vocab, self.continuations, self.kind = vocab, continuations, kind
        self.error_rate, self.max_nodes = error_rate, max_nodes
        self.rng = torch.Generator().manual_seed(seed)
        # What a build of such trees records: a tree of max_nodes nodes at the graph's depth (the cost model
        # measures verify calls up to its width), not a chain (a chain's greedy rounds run on the device).
        self.speculation = TreeShape(tuple(range(-1, self.depth - 1)) + (-1,) * (max_nodes - self.depth))
        self.verify_width = self.speculation.verify_width
        self.widths = []  # nodes proposed per call

    def _parents(self, n):
        """Random topological parents with depth <= self.depth."""
        parents, depths = [], []
        for i in range(n):
            options = [-1] + [j for j in range(i) if depths[j] < self.depth]
            p = options[int(torch.randint(0, len(options), (1,), generator=self.rng))]
            parents.append(p)
            depths.append(1 if p < 0 else depths[p] + 1)
        return TreeShape(tuple(parents))

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        out = super().drafter(feeds, sampling, bound)
        batch = len(feeds[C.INPUT_IDS])
        n = int(torch.randint(1, self.max_nodes + 1, (1,), generator=self.rng))
        shapes = [self._parents(n)] * batch if self.kind == "static" else [self._parents(n) for _ in range(batch)]
        first = (feeds[C.CACHE_LENS] + feeds[C.NUM_VALID] + 1).cpu()  # the position of a depth-1 node
        ids = torch.randint(0, self.vocab, (batch, n), generator=self.rng)
        for b, (shape, full) in enumerate(zip(shapes, self.continuations)):
            for i, d in enumerate(shape.depths):
                pos = int(first[b]) + d - 1
                if pos < len(full) and torch.rand(1, generator=self.rng) > self.error_rate:
                    ids[b, i] = full[pos]
        self.widths.append(n)
        out[C.DRAFT_IDS] = ids.to(out[C.DRAFT_IDS].device)
        out[C.DRAFT_PARENTS] = torch.stack([s.parent_tensor() for s in shapes]).to(out[C.DRAFT_IDS].device)
        out[C.DRAFT_TOKEN_PROBS] = torch.rand(batch, n, generator=self.rng).to(out[C.DRAFT_IDS].device)
        return write_into(out, into)
