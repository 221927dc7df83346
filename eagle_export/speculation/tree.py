"""Token trees: the shape of a speculation tree, and the rules that every tree-shaped path shares.

A tree of N draft nodes hangs off the root, the last accepted token (the root is not a node). Nodes
are numbered in topological order: a parent's index is below its children's. `parents[i]` is the
index of node i's parent, or -1 when node i is a child of the root. A chain of K drafts is the tree
with parents (-1, 0, 1, ..., K-2).

A verify call feeds N+1 tokens: row 0 is the root, row i+1 is node i. Node i at depth d sits at
position root + d, and attends to the prefix, the root and its own ancestors (`ancestor_mask`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import EagleExportError
from ..lazy import lazy
from ..models import contract as C

torch = lazy("torch")  # a recipe's or manifest's tree shape is read without it


class Speculation:
    """What one drafter call proposes and one verify call checks: a static tree (`TreeShape`; a chain
    of K drafts is `TreeShape.chain(K)`) or an EAGLE-2 dynamic tree (`DynamicTree`). Every size the
    graphs, profiles and runtime derive from it is a property here, nowhere else:

        num_nodes     drafts per call (K for a chain)
        verify_width  num_nodes + 1: the last accepted token and every draft
        step_rows     the drafter's new K/V rows after its input rows (K - 1 for a chain)
        depth         the drafter graph's unroll depth: the longest root path
        is_chain      every node's parent is the node before it
        can_sample    a sampling graph can be built (a dynamic tree's top-k expansion is greedy only)

    Recipes and manifests hold it as a `speculation` block (`to_block` / `from_block`)."""

    num_nodes: int
    depth: int
    step_rows: int
    is_chain = False
    can_sample = True

    @property
    def verify_width(self) -> int:
        return self.num_nodes + 1

    def to_block(self) -> dict:
        raise NotImplementedError

    @staticmethod
    def from_block(block: dict | None, depth: int | None = None) -> Speculation:
        """A normalized `speculation` block (recipe.py writes them) -> its Speculation. No block means
        a chain of `depth`: manifests written before trees existed hold only their `depth`."""
        if not block:
            if depth is None:
                raise ValueError("a speculation block or a chain depth is needed")
            return TreeShape.chain(depth)
        if block["kind"] == "chain":
            return TreeShape.chain(block["depth"])
        if block["kind"] == "static_tree":
            return TreeShape(tuple(block["parents"]))
        return DynamicTree(block["top_k"], block["depth"], block["nodes"])


def check_depth(depth: int) -> None:
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= C.MAX_DEPTH:
        raise EagleExportError(f"speculation depth {depth!r} is out of range",
                               f"choose a depth K from 1 to {C.MAX_DEPTH}")


def as_tree(speculation: int | Speculation) -> Speculation:
    """The user-facing entry points' coercion (recipes' `depth:`, `--depth`, the Python API): a bare
    int K is the chain `TreeShape.chain(K)`. Inside the package a Speculation is passed as is."""
    if isinstance(speculation, Speculation):
        return speculation
    check_depth(speculation)
    return TreeShape.chain(speculation)


@dataclass(frozen=True)
class TreeShape(Speculation):
    """A static tree: the same parents for every sequence and round."""

    parents: tuple[int, ...]

    def __post_init__(self):
        parents = tuple(self.parents)
        if not parents or any(not isinstance(p, int) or not -1 <= p < i for i, p in enumerate(parents)):
            raise EagleExportError(f"tree parents {list(parents)} are not a tree in topological order",
                                   "give each node's parent index (below its own index), -1 for children of the root")
        object.__setattr__(self, "parents", parents)
        if len(parents) > C.MAX_TREE_NODES or self.depth > C.MAX_DEPTH:
            raise EagleExportError(f"a tree of {len(parents)} nodes and depth {self.depth} is too large",
                                   f"use at most {C.MAX_TREE_NODES} nodes and depth {C.MAX_DEPTH}")

    @classmethod
    def chain(cls, depth: int) -> TreeShape:
        return cls(tuple(range(-1, depth - 1)))

    @classmethod
    def from_branching(cls, branching: list[int]) -> TreeShape:
        """Every node at depth d (and the root for d = 0) gets branching[d] children: its parent's
        top-branching[d] drafts. [4, 2, 2, 1] has 4 + 8 + 16 + 16 nodes."""
        if not branching or any(not isinstance(b, int) or b < 1 for b in branching):
            raise EagleExportError(f"tree branching {branching!r} is not a list of positive widths",
                                   "give the number of children per depth, e.g. [4, 2, 2, 1]")
        parents, frontier = [], [-1]
        for width in branching:
            level = []
            for parent in frontier:
                for _ in range(width):
                    level.append(len(parents))
                    parents.append(parent)
            frontier = level
        return cls(tuple(parents))

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> TreeShape:
        """EAGLE's choice lists: each path is the child ranks from the root, e.g. [[0], [1], [0, 0]]
        (the top draft, the second draft, the top draft after the top draft). Every prefix of a path
        must be a path too. Nodes come out breadth-first, siblings by rank."""
        paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(paths)}
        bad = [list(p) for p in paths
               if not p or any(not isinstance(r, int) or r < 0 for r in p) or (len(p) > 1 and p[:-1] not in index)]
        if bad:
            raise EagleExportError(f"tree paths {bad} are not paths of child ranks whose prefixes are paths too",
                                   "list every node as its ranks from the root, parents included: [[0], [0, 1]]")
        return cls(tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths))

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth: 1 for the children of the root."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Each node's rank among its siblings: which of its parent's top drafts it holds."""
        seen: dict[int, int] = {}
        ranks = []
        for p in self.parents:
            ranks.append(seen.get(p, 0))
            seen[p] = ranks[-1] + 1
        return tuple(ranks)

    @property
    def step_rows(self) -> int:
        """Drafter step rows after step 0: the nodes with children (K-1 for a chain)."""
        return len(set(self.parents) - {-1})

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.num_nodes - 1))

    def to_block(self) -> dict:
        if self.is_chain:
            return {"kind": "chain", "depth": self.depth}
        return {"kind": "static_tree", "parents": list(self.parents), "depth": self.depth, "nodes": self.num_nodes}

    def parent_tensor(self) -> torch.Tensor:
        return torch.tensor(self.parents, dtype=torch.int64)


@dataclass(frozen=True)
class DynamicTree(Speculation):
    """An EAGLE-2 dynamic tree, chosen in the drafter graph per sequence and round within fixed shapes:
    the root's top_k drafts are level 1; each later level expands the top_k drafts of each of the
    previous level's top_k nodes (by joint draft probability, the product along the path) and keeps
    its top_k as the next frontier; after `depth` levels the best `nodes` of all those candidates
    (top_k + (depth - 1) * top_k^2 of them) are the tree, parents re-mapped to node numbers."""

    top_k: int
    depth: int
    nodes: int
    can_sample = False  # EAGLE-2's top-k expansion is a greedy rule

    def __post_init__(self):
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (self.top_k, self.depth, self.nodes))
        if not ints or self.depth > C.MAX_DEPTH or self.nodes > min(C.MAX_TREE_NODES, self.candidates):
            raise EagleExportError(
                f"dynamic tree top_k={self.top_k!r}, depth={self.depth!r}, nodes={self.nodes!r} is out of range",
                f"choose depth 1..{C.MAX_DEPTH}, top_k >= 1 and nodes from 1 to at most {C.MAX_TREE_NODES} and "
                "the candidates it draws (top_k + (depth - 1) * top_k^2)")

    @property
    def candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def step_rows(self) -> int:
        """Drafter step rows after step 0: top_k per level below the last."""
        return (self.depth - 1) * self.top_k

    def to_block(self) -> dict:
        return {"kind": "dynamic_tree", "top_k": self.top_k, "depth": self.depth, "nodes": self.nodes}


def _ancestry(parents: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [..., N, N] one-hot of each node's parent (none for children of the root)."""
    n = parents.shape[-1]
    return parents[..., :, None] == torch.arange(n, device=parents.device)


def remembered_per_tree(fn):
    """`fn(parents)`, remembered per tree for parents on the CPU: the runtime asks for the same few
    trees round after round (a chain's, a static tree's), so callers must not write into the result."""
    @functools.lru_cache(maxsize=256)
    def remembered(shape: tuple[int, ...], data: bytes):
        return fn(torch.frombuffer(bytearray(data), dtype=torch.int64).reshape(shape))

    @functools.wraps(fn)
    def call(parents: torch.Tensor):
        if parents.device.type != "cpu":
            return fn(parents)
        parents = parents.to(torch.int64)
        return remembered(tuple(parents.shape), parents.numpy().tobytes())
    return call


@remembered_per_tree
def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [..., N] -> bool [..., N, N]: mask[i, j] is true when node j is node i or one of its
    ancestors. With P the parent one-hot (P[i, j] = parents[i] == j), P^h[i, j] says j is node i's
    ancestor h hops up, so mask = I | P | P^2 | ... ; P^h vanishes past the tree's depth.
    Remembered per tree (`remembered_per_tree`): callers must not write into the result."""
    step = _ancestry(parents).to(torch.int64)
    n = parents.shape[-1]
    mask = torch.eye(n, dtype=torch.int64, device=parents.device).expand_as(step).clone()
    reach = mask
    for _ in range(n - 1):
        reach = reach @ step  # the ancestor one more hop up
        if not reach.any():
            break
        mask = mask | reach
    return mask.bool()


def verify_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B,N] -> the target's tree_mask [B,N+1,N+1] for a verify call over the root and the N
    nodes: each row sees itself and its ancestors, the root included (row 0, whose only ancestor is
    itself). A chain's is the causal mask."""
    root = parents.new_full((*parents.shape[:-1], 1), -1)
    return ancestor_mask(torch.cat([root, parents + 1], dim=-1))


def random_verify_mask(batch: int, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """The tree_mask of a random token tree of `tokens` rows (the root and tokens-1 nodes; node i's
    parent any node before it, or the root), for checks that must see a tree-masked call."""
    nodes = torch.arange(tokens - 1)
    return verify_mask((torch.rand(batch, tokens - 1, generator=generator) * (nodes + 1)).long() - 1)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [..., N]: 1 for the children of the root; the number of true entries on a node's
    ancestor-mask row."""
    return ancestor_mask(parents).sum(-1)


def greedy_accepted_path(node_ids: torch.Tensor, parents: torch.Tensor | None, greedy: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over a tree: node_ids [B,N], parents [B,N], greedy [B,N+1] (the target's
    argmax at the verify call's rows: row 0 the root, row i+1 node i) -> (accepted [B], path [B,D]).
    parents None: a chain (node i's parent is i-1), answered on the tensors' device without a host
    read: accepted = the number of leading ones of [node_i == greedy_i], path[b, i] = i below it.

    Node i matches when its token equals the target's argmax at its parent's row; it is accepted when
    it and all its ancestors match. The accepted path is the ancestry of the deepest accepted node
    (siblings hold distinct tokens, so at most one node per depth is accepted); path[b, :accepted[b]]
    are its node indices root-first, -1 after. For a chain this is the longest prefix of drafts that
    equals the target's argmax at the same rows."""
    batch, n = node_ids.shape
    if n == 0:  # a plain decoding step: nothing to accept
        return (torch.zeros(batch, dtype=torch.int64, device=greedy.device),
                torch.zeros(batch, 0, dtype=torch.int64, device=greedy.device))
    if parents is None:
        accepted = (node_ids == greedy[:, :n]).cumprod(1).sum(1)
        index = torch.arange(n, device=node_ids.device)
        return accepted, torch.where(index < accepted.view(batch, 1), index, -1)
    parent_rows = (parents + 1).clamp_min(0)
    match = node_ids == greedy.gather(1, parent_rows)                       # [B,N]
    ancestors = ancestor_mask(parents)                                      # [B,N,N]
    accepted_node = (ancestors & ~match[:, None, :]).sum(-1) == 0           # no mismatching ancestor (self included)
    depths = ancestors.sum(-1)
    accepted, deepest = (depths * accepted_node).max(dim=1)                 # depth 0 where not accepted
    on_path = ancestors[torch.arange(batch), deepest] & (accepted > 0)[:, None]   # [B,N]
    # Path entries root-first: an on-path node of depth d goes to column d-1 (the others to a spare
    # last column, dropped).
    max_depth = int(depths.max())
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.int64)
    path.scatter_(1, torch.where(on_path, depths - 1, max_depth), torch.arange(n).expand(batch, -1).contiguous())
    return accepted, path[:, :max_depth]


def rejection_sample_path(p: torch.Tensor, q: torch.Tensor, node_ids: list[int], parents: list[int],
                          generator=None) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling over one sequence's tree (SpecInfer; Miao et al. 2024).

    p [N+1,V]: the target's distribution at each verify row (row 0 the root, row i+1 node i);
    q [N+1,V]: the draft distribution each row's children were drawn from, i.i.d. (target vocabulary).
    -> (the accepted nodes, root first; the token that follows them).

    From the root: try the row's children in order; child x is accepted with probability
    min(1, p(x) / q(x)), and the walk moves to its row; a rejected child turns the row's target
    into the residual p <- norm(max(p - q, 0)) before the next sibling is tried. When no child is
    accepted (or the row has none), the next token is drawn from the row's (residual) p. Each step
    emits a token with exactly p's probability, the chain case's argument applied sibling by
    sibling, so the emitted text has the target's distribution for any tree and any q. A chain is
    the tree whose rows each have one child: then this is Leviathan et al.'s rule, draw for draw."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent + 1, []).append(node)
    path, row = [], 0
    while True:
        target = p[row]
        for node in children.get(row, ()):
            x = node_ids[node]
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if u * q[row, x] <= target[x]:  # q[row, x] > 0: x was drawn from it
                path.append(node)
                row = node + 1
                break
            residual = (target - q[row]).clamp(min=0)
            # an all-zero residual means target == q, and then no child is ever rejected
            target = residual / residual.sum() if residual.sum() > 0 else target
        else:
            return path, int(torch.multinomial(target, 1, generator=generator))


def joint_probs(parents: torch.Tensor, token_probs: torch.Tensor) -> torch.Tensor:
    """[B, N]: each node's probability times its ancestors' (the draft probability of its root path),
    multiplied down the tree one level per step, joint[i] = joint[parent] * p[i], so a child's joint
    probability never exceeds its parent's, in floating point too (fl(a * p) <= a for p <= 1)."""
    joint = token_probs.float()
    has_parent = parents >= 0
    for _ in range(int(node_depths(parents).max()) - 1 if parents.numel() else 0):
        joint = token_probs.float() * torch.where(has_parent, joint.gather(-1, parents.clamp_min(0)), 1)
    return joint


def nested_subtrees(parents: torch.Tensor, token_probs: torch.Tensor, depth: int, by_depth: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The menu a verify policy chooses from: subtrees S_0 (the root alone) within S_1 within ... S_J
    (the whole tree) of each sequence's tree, each closed under ancestors, as keep masks [J+1, B, N],
    and the drafter's estimate, per subtree, of the probability that the accepted path reaches each
    depth: reach [B, J+1, depth] (None by depth). E[tokens | S] = 1 + reach[S].sum(-1).

    Greedy (by_depth False): S_m = the m nodes of highest joint draft probability, m = 0..N, ties to
    the shallower node. A kept node is accepted only if its whole root path is, and at most one node
    of each depth is, so P(the path reaches depth d within S) = the sum over S's nodes of depth d of
    P(node accepted), which the joint draft probability estimates; E[tokens | S] = 1 + the sum over S.
    For a fixed node count m, the ancestor-closed set maximizing that sum is the top-m set, because
    the joint probability never increases along a root path (`joint_probs`): the menu holds the best
    subtree of every size. For a chain S_m is the first m drafts (reach at depth d <= m: the running
    product of their probabilities). The estimate is kept by depth because a policy calibrates the
    drafter by depth (verify_policy.py).

    By depth (sampling, where what is verified must not depend on the drafts): S_k = the nodes of
    depth <= k, k = 0..depth; the policy estimates their yield from earlier rounds."""
    depths = node_depths(parents)
    if by_depth:
        return depths[None] <= torch.arange(depth + 1)[:, None, None], None
    joint = joint_probs(parents, token_probs)
    by_depth_first = torch.sort(depths, dim=-1, stable=True).indices
    order = by_depth_first.gather(-1, torch.sort(-joint.gather(-1, by_depth_first), dim=-1, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order).contiguous())
    keep = rank[None] < torch.arange(order.shape[-1] + 1)[:, None, None]                       # [N+1, B, N]
    # the m-th likeliest node's joint probability, in the column of its depth, summed over m' <= m
    by_rank = torch.zeros(*order.shape, depth).scatter_(-1, (depths.gather(-1, order) - 1)[..., None],
                                                        joint.gather(-1, order)[..., None])
    reach = torch.cat([torch.zeros(len(joint), 1, depth), torch.cumsum(by_rank, dim=1)], dim=1)
    return keep, reach


def chain_reach(token_probs: torch.Tensor) -> torch.Tensor:
    """`nested_subtrees`' reach [B, K+1, K] for a chain of K drafts, in closed form: S_m is the first m
    drafts, so reach[S_m, d] = p_1 ... p_d for d < m, else 0. A few torch calls where the general menu
    takes a sort and a dozen more: host time in every drafted round. The running product is taken
    draft by draft in float32, as `joint_probs` takes it (torch.cumprod accumulates in double on a
    CPU and can differ in the last bit, and the policy's choice follows these numbers)."""
    joint = chain_joint(token_probs)
    return joint[:, None, :] * _first_drafts(joint.shape[-1])


def chain_joint(token_probs: torch.Tensor) -> torch.Tensor:
    """[B, K]: p_1 ... p_d for each depth d of a chain, the whole chain's reach (`chain_reach`'s last
    entry, to the bit: times 1). Elementwise float32 products, one a depth, on the tensors' own device:
    each is correctly rounded on a CPU and a GPU alike, so the device round's and the general round's
    policy read the same numbers."""
    columns = token_probs.float().unbind(-1)
    joint = [columns[0]]
    for p in columns[1:]:
        joint.append(joint[-1] * p)
    return torch.stack(joint, -1)


@functools.lru_cache(maxsize=16)
def _first_drafts(k: int) -> torch.Tensor:
    """[K+1, K]: row m keeps drafts d < m (callers must not write into it)."""
    return torch.arange(k) < torch.arange(k + 1)[:, None]


def subtree(parents: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The nodes `keep` [B,N] marks (closed under ancestors: a kept node's parent is kept), packed to
    the front in their order -> (order [B,n]: original index of each kept node, parents [B,n] re-indexed,
    valid [B,n]). n is the most any sequence keeps; a sequence keeping fewer is padded with invalid
    nodes (children of the root, which the caller must never accept)."""
    if keep.all():  # every node (a fixed depth, or k = the tree's depth)
        return torch.arange(keep.shape[-1]).expand_as(parents), parents, keep
    n = int(keep.sum(-1).max()) if keep.numel() else 0
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[:, :n]
    new_index = torch.cumsum(keep, dim=-1) - 1                                     # [B,N] kept node -> packed
    old_parents = parents.gather(1, order)
    packed = torch.where(old_parents >= 0, new_index.gather(1, old_parents.clamp_min(0)), -1)
    valid = keep.gather(1, order)
    return order, torch.where(valid, packed, -1), valid


def describe(speculation: Speculation) -> str:
    """One line for tables and logs: 'chain K=4', 'static tree depth 2 (12 nodes)', 'dynamic tree
    top_k=8 depth=3 nodes=16'."""
    if isinstance(speculation, DynamicTree):
        return f"dynamic tree top_k={speculation.top_k} depth={speculation.depth} nodes={speculation.nodes}"
    if speculation.is_chain:
        return f"chain K={speculation.depth}"
    return f"static tree depth {speculation.depth} ({speculation.num_nodes} nodes)"
