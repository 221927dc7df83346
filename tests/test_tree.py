"""Tree shapes and greedy tree acceptance, against obvious per-node loops."""

import functools

import pytest
import torch

from eagle_export.errors import EagleExportError
from eagle_export.models import contract as C
from eagle_export.models.layers import causal_mask
from eagle_export.speculation.tree import TreeShape, ancestor_mask, greedy_accepted_path, node_depths, verify_mask


def ancestors_of(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]  # root-first, self last


def test_branching_and_paths_build_the_same_tree():
    shape = TreeShape.from_branching([2, 2, 1])
    assert shape.parents == (-1, -1, 0, 0, 1, 1, 2, 3, 4, 5)
    assert shape.depths == (1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
    assert shape.ranks == (0, 1, 0, 1, 0, 1, 0, 0, 0, 0)
    assert shape.num_nodes == 10 and shape.depth == 3 and not shape.is_chain
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]
    assert TreeShape.from_paths(paths[::-1]) == shape  # order-free, breadth-first out
    assert TreeShape.chain(4).parents == (-1, 0, 1, 2) and TreeShape.chain(4).is_chain
    assert TreeShape.from_branching([1, 1, 1]) == TreeShape.chain(3)


@pytest.mark.parametrize("bad", [dict(parents=(0,)), dict(parents=(-1, 2, 0)), dict(parents=()),
                                 dict(parents=(-1,) * (C.MAX_TREE_NODES + 1)),
                                 dict(parents=tuple(range(-1, C.MAX_DEPTH)))])
def test_bad_trees_are_refused_with_a_fix(bad):
    with pytest.raises(EagleExportError) as err:
        TreeShape(**bad)
    assert err.value.fix


def test_bad_paths_and_branching_are_refused():
    with pytest.raises(EagleExportError, match="prefixes"):
        TreeShape.from_paths([[0], [1, 0]])  # [1] missing
    with pytest.raises(EagleExportError, match="branching"):
        TreeShape.from_branching([2, 0])


def test_ancestor_mask_and_depths_match_the_parent_walk():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 20, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
        mask = ancestor_mask(torch.tensor(parents))
        for i in range(n):
            assert set(torch.nonzero(mask[i])[:, 0].tolist()) == set(ancestors_of(parents, i))
        assert node_depths(torch.tensor(parents)).tolist() == [len(ancestors_of(parents, i)) for i in range(n)]


def accepted_path_by_walk(ids, parents, greedy):
    """The oracle: from the root, repeatedly step to the child whose token is the target's argmax."""
    path, row = [], 0
    while True:
        child = [i for i, p in enumerate(parents) if p + 1 == row and ids[i] == greedy[row]]
        if not child:
            return path
        path.append(child[0])
        row = child[0] + 1


def test_greedy_accepted_path_matches_the_walk_on_random_trees():
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        shape = TreeShape.from_branching([int(torch.randint(1, 4, (1,), generator=gen))
                                          for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))])
        batch, n = 3, shape.num_nodes
        greedy = torch.randint(0, 3, (batch, n + 1), generator=gen)
        # siblings hold distinct tokens, as a drafter's top-k does: rank r holds token (r + offset) % vocab
        parents = shape.parent_tensor().expand(batch, -1)
        offset = torch.randint(0, 3, (batch, n + 1), generator=gen).gather(1, parents + 1)  # one per sibling group
        ids = (torch.tensor(shape.ranks) + offset) % 3
        accepted, path = greedy_accepted_path(ids, parents, greedy)
        for b in range(batch):
            want = accepted_path_by_walk(ids[b].tolist(), shape.parents, greedy[b].tolist())
            assert accepted[b] == len(want)
            assert path[b, :len(want)].tolist() == want and (path[b, len(want):] == -1).all()


def test_a_chain_accepts_what_greedy_accepted_does():
    gen = torch.Generator().manual_seed(2)
    for k in range(1, 6):
        drafts = torch.randint(0, 2, (8, k), generator=gen)
        greedy = torch.randint(0, 2, (8, k + 1), generator=gen)
        parents = TreeShape.chain(k).parent_tensor().expand(8, -1)
        accepted, path = greedy_accepted_path(drafts, parents, greedy)
        assert torch.equal(accepted, (drafts == greedy[:, :k]).int().cumprod(dim=1).sum(dim=1))  # the prefix rule
        for b in range(8):
            assert path[b, :accepted[b]].tolist() == list(range(int(accepted[b])))


def test_per_sequence_parents_for_dynamic_trees():
    # two sequences, different trees: row 0 a chain of 3, row 1 a root with three children
    parents = torch.tensor([[-1, 0, 1], [-1, -1, -1]])
    ids = torch.tensor([[5, 6, 7], [4, 5, 6]])
    greedy = torch.tensor([[5, 6, 9, 0], [6, 1, 2, 3]])
    accepted, path = greedy_accepted_path(ids, parents, greedy)
    assert accepted.tolist() == [2, 1]
    assert path[0].tolist()[:2] == [0, 1] and path[1].tolist()[0] == 2


# ------------------------------------------------------------------ sampling over trees

V = 4  # a small vocabulary, so every two-token outcome is counted often enough


@functools.lru_cache(maxsize=None)
def dist(context: tuple, salt: int) -> torch.Tensor:
    """A fixed, context-dependent distribution over V tokens (salt 0: the target, 1: the drafter)."""
    gen = torch.Generator().manual_seed(hash((context, salt)) % 2**31)
    return torch.softmax(2 * torch.randn(V, generator=gen, dtype=torch.float64), -1)


def sample_two_tokens(shape: TreeShape, gen: torch.Generator, sampler) -> tuple[int, int]:
    """Speculate rounds over `shape` (children drawn i.i.d. from the drafter at their parent's
    context) until two tokens are out; return them."""
    out: list[int] = []
    while len(out) < 2:
        ids, contexts = [], []
        for parent in shape.parents:
            context = tuple(out) + (tuple(ids[i] for i in _path_to(shape.parents, parent)) if parent >= 0 else ())
            ids.append(int(torch.multinomial(dist(context, 1), 1, generator=gen)))
            contexts.append(context + (ids[-1],))
        rows = [tuple(out)] + contexts
        p = torch.stack([dist(c, 0) for c in rows])
        q = torch.stack([dist(c, 1) for c in rows])
        path, token = sampler(p, q, ids, list(shape.parents), gen)
        out += [ids[n] for n in path] + [token]
    return out[0], out[1]


def _path_to(parents, node):
    return ancestors_of(list(parents), node)


def two_token_p_value(shape, sampler, trials=6000, seed=0):
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        a, b = sample_two_tokens(shape, gen, sampler)
        counts[a, b] += 1
    first = dist((), 0)
    expected = torch.stack([first[a] * dist((a,), 0) for a in range(V)]) * trials
    keep = expected.flatten() >= 5
    observed, expected = counts.flatten()[keep], expected.flatten()[keep]
    return chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy()).pvalue


def test_tree_rejection_sampling_preserves_the_target_distribution():
    from eagle_export.speculation.tree import rejection_sample_path

    tree = TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    assert two_token_p_value(tree, rejection_sample_path) > 0.01
    assert two_token_p_value(TreeShape.chain(2), rejection_sample_path, seed=1) > 0.01


def test_planted_sibling_bug_fails_the_distribution_test():
    """The same sampler without the residual update between siblings: the test must catch it."""

    def no_residual(p, q, node_ids, parents, generator):
        path, row = [], 0
        while True:
            kids = [n for n, par in enumerate(parents) if par + 1 == row]
            for node in kids:
                x = node_ids[node]
                if torch.rand((), generator=generator, dtype=torch.float64) * q[row, x] <= p[row, x]:
                    path.append(node)
                    row = node + 1
                    break
            else:
                residual = (p[row] - q[row]).clamp(min=0) if kids else p[row]
                return path, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))

    tree = TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    assert two_token_p_value(tree, no_residual) < 0.01


def test_verify_mask_is_causal_for_a_chain_and_the_root_path_for_a_tree():
    assert torch.equal(verify_mask(TreeShape.chain(5).parent_tensor()[None]), causal_mask(1, 6))
    shape = TreeShape.from_branching([3, 2, 1])
    mask = verify_mask(shape.parent_tensor().expand(2, -1))
    assert mask.shape == (2, shape.num_nodes + 1, shape.num_nodes + 1) and torch.equal(mask[0], mask[1])
    assert mask[0, 0].tolist() == [True] + [False] * shape.num_nodes  # the root sees itself only
    for i in range(shape.num_nodes):
        rows = [0] + [a + 1 for a in ancestors_of(shape.parents, i)]
        assert torch.nonzero(mask[0, i + 1])[:, 0].tolist() == rows
