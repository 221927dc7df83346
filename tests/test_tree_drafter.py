"""A token tree from one drafter launch equals single drafter steps along each node's path.

The oracle walks each node's path from the root with eager.draft_chain, choosing at every step
the draft of the path node's rank (its parent's rank-r draft), over exactly the sequence's valid cache
and rows; the graph batches each tree level into one drafter step with an ancestor mask."""

import math

import pytest
import torch
from test_export import declared_shapes
from test_unrolled import random_inputs
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.errors import EagleExportError
from eagle_export.export.export import export_graph
from eagle_export.export.unrolled import UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import run_graph
from eagle_export.speculation import eager
from eagle_export.speculation.tree import DynamicTree, TreeShape


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "llama"), aux_layer_ids=(1, 3, 4))


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, target):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("d"), "3.1", seed=7), target=target)


def walk(drafter, inputs, b, ranks):
    """Drafts along one path of child ranks from the root, for sequence b: (target ids, the
    probability of each under the distribution it was chosen from)."""
    input_ids, aux, num_valid, past_key, past_value, cache_lens = inputs
    n, c = int(num_valid[b]), int(cache_lens[b])
    chain = eager.draft_chain(drafter, input_ids[b:b + 1, :n], aux[b:b + 1, :n], len(ranks),
                                  past_key[:, b:b + 1, :, :c], past_value[:, b:b + 1, :, :c],
                                  lambda logits, k: logits[0].topk(ranks[k] + 1).indices[ranks[k]][None])
    probs = torch.softmax(chain.logits[0].float(), -1).gather(-1, chain.indices[0, :, None])[:, 0]
    return chain.drafts[0].tolist(), probs.tolist()


def path_of(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


SHAPES = [TreeShape.from_branching([2, 2, 1]), TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
          TreeShape.chain(3)]


@pytest.mark.parametrize("shape", SHAPES, ids=["branching-2-2-1", "paths", "chain"])
@pytest.mark.parametrize("num_valid, cache_lens", [([3], [5]), ([4, 1, 2], [2, 6, 0])], ids=["batch1", "batch3"])
def test_static_tree_equals_walks_along_each_path(drafter, shape, num_valid, cache_lens):
    inputs = random_inputs(drafter, num_valid, cache_lens, shape.depth, seed=3)
    out = dict(zip(C.drafter_graph(drafter.config, shape, False).output_names,
                   UnrolledDrafter(drafter, shape, False)(*inputs)))
    assert out[C.DRAFT_IDS].shape == (len(num_valid), shape.num_nodes)
    if not shape.is_chain:
        assert (out[C.DRAFT_PARENTS] == shape.parent_tensor()).all()
    for b in range(len(num_valid)):
        for node in range(shape.num_nodes):
            path = path_of(shape.parents, node)
            ids, probs = walk(drafter, inputs, b, [shape.ranks[i] for i in path])
            assert int(out[C.DRAFT_IDS][b, node]) == ids[-1]
            assert abs(float(out[C.DRAFT_TOKEN_PROBS][b, node]) - probs[-1]) <= 1e-5
            if not shape.is_chain:
                assert abs(float(out[C.DRAFT_JOINT_PROBS][b, node]) - math.prod(probs)) <= 1e-5


def dynamic_oracle(drafter, inputs, b, tree: DynamicTree):
    """EAGLE-2 by enumeration: every candidate (a rank path) with its log joint probability; each level
    keeps the top_k candidates as the frontier; the tree is the best `nodes` candidates overall."""
    candidates, frontier = {}, [()]
    for _ in range(tree.depth):
        level = {}
        for path in frontier:
            for r in range(tree.top_k):
                ids, probs = walk(drafter, inputs, b, list(path) + [r])
                level[path + (r,)] = (tuple(ids), sum(math.log(p) for p in probs))
        candidates.update(level)
        frontier = sorted(level, key=lambda p: -level[p][1])[:tree.top_k]
    best = sorted(candidates, key=lambda p: -candidates[p][1])[:tree.nodes]
    return {candidates[p][0]: math.exp(candidates[p][1]) for p in best}  # token path -> joint probability


@pytest.mark.parametrize("tree", [DynamicTree(top_k=2, depth=3, nodes=6), DynamicTree(top_k=3, depth=2, nodes=8)],
                         ids=["k2-d3-n6", "k3-d2-n8"])
def test_dynamic_tree_keeps_the_best_nodes_by_joint_probability(drafter, tree):
    num_valid, cache_lens = [3, 1], [4, 0]
    inputs = random_inputs(drafter, num_valid, cache_lens, tree.depth, seed=5)
    out = dict(zip(C.drafter_graph(drafter.config, tree, False).output_names,
                   UnrolledDrafter(drafter, tree, False)(*inputs)))
    for b in range(len(num_valid)):
        parents = out[C.DRAFT_PARENTS][b].tolist()
        assert all(-1 <= p < i for i, p in enumerate(parents))  # topological
        got = {tuple(int(out[C.DRAFT_IDS][b, i]) for i in path_of(parents, node)): float(out[C.DRAFT_JOINT_PROBS][b, node])
               for node in range(tree.nodes)}
        want = dynamic_oracle(drafter, inputs, b, tree)
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) <= 1e-5 for k in want)


def sampling_inputs(batch: int, nodes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """temperature [B] in [0.5, 1.5) and uniform noise [B,N] for a sampling drafter graph."""
    generator = torch.Generator().manual_seed(seed)
    return 0.5 + torch.rand(batch, generator=generator), torch.rand(batch, nodes, generator=generator)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=["branching-2-2-1", "paths"])
def test_static_sampling_tree_draws_each_node_from_its_parents_distribution(drafter, shape):
    """The sampling graph: node i is the inverse-CDF draw of its own noise under its parent's draft
    distribution at the temperature (siblings: independent draws from one distribution), and later
    levels continue from the drawn tokens. The oracle walks each path with eager.draft_chain,
    drawing at every step with the path node's noise."""
    num_valid, cache_lens = [4, 1, 2], [2, 6, 0]
    inputs = random_inputs(drafter, num_valid, cache_lens, shape.depth, seed=5)
    temperature, noise = sampling_inputs(len(num_valid), shape.num_nodes, seed=11)
    out = dict(zip(C.drafter_graph(drafter.config, shape, True).output_names,
                   UnrolledDrafter(drafter, shape, True)(*inputs, temperature, noise)))
    input_ids, aux, _, past_key, past_value, _ = inputs
    for b in range(len(num_valid)):
        n, c = num_valid[b], cache_lens[b]
        for node in range(shape.num_nodes):
            path = path_of(shape.parents, node)

            def draw(logits, k):
                probs = torch.softmax(logits[0].float() / temperature[b], -1)
                return (probs.cumsum(-1)[:-1] <= noise[b, path[k]]).sum()[None]

            chain = eager.draft_chain(drafter, input_ids[b:b + 1, :n], aux[b:b + 1, :n], len(path),
                                          past_key[:, b:b + 1, :, :c], past_value[:, b:b + 1, :, :c], draw)
            dist = torch.softmax(chain.logits[0, -1].float() / temperature[b], -1)
            assert int(out[C.DRAFT_IDS][b, node]) == int(chain.drafts[0, -1])
            assert (out[C.DRAFT_PROBS][b, node] - dist).abs().max() <= 1e-5
            assert abs(float(out[C.DRAFT_TOKEN_PROBS][b, node]) - float(dist[chain.indices[0, -1]])) <= 1e-5
    siblings = [i for i, p in enumerate(shape.parents) if p == -1]
    assert all(torch.equal(out[C.DRAFT_PROBS][:, i], out[C.DRAFT_PROBS][:, siblings[0]]) for i in siblings)


@pytest.mark.parametrize(("speculation", "sampling"), [(TreeShape.from_branching([2, 2, 1]), False),
                                                       (TreeShape.from_branching([2, 2, 1]), True),
                                                       (DynamicTree(top_k=2, depth=3, nodes=6), False)],
                         ids=["static", "static-sampling", "dynamic"])
def test_tree_graphs_export_and_match_torch_in_onnx_runtime(drafter, speculation, sampling, tmp_path):
    graph = UnrolledDrafter(drafter, speculation, sampling).eval()
    spec = C.drafter_graph(drafter.config, speculation, sampling)
    extra = (lambda batch, seed: sampling_inputs(batch, speculation.num_nodes, seed)) if sampling else (lambda *_: ())
    example = random_inputs(drafter, [3, 1], [4, 0], speculation.depth, seed=1) + extra(2, 2)
    export_graph(graph, example, spec, tmp_path / "drafter.onnx")
    inputs = random_inputs(drafter, [2, 4, 1], [5, 1, 7], speculation.depth, seed=9) + extra(3, 3)  # other sizes
    want = dict(zip(spec.output_names, graph(*inputs)))
    got = run_graph(tmp_path / "drafter.onnx", spec.feeds(inputs))
    for name in (C.DRAFT_IDS, C.DRAFT_PARENTS):
        assert torch.equal(got[name], want[name]), name
    for name in (C.DRAFT_TOKEN_PROBS, C.DRAFT_JOINT_PROBS, C.DRAFT_PROBS):
        if name in want:
            assert (got[name] - want[name]).abs().max() <= 1e-5, name
    assert sampling == (C.DRAFT_PROBS in got)
    # declared as the contract says (the exporter named a dynamic tree's node count after a TopK)
    assert declared_shapes(tmp_path / "drafter.onnx") == {t.name: t.shape for t in spec.outputs}


def test_trees_out_of_range_are_refused(drafter):
    with pytest.raises(EagleExportError, match="out of range"):
        DynamicTree(top_k=4, depth=2, nodes=30)  # only 4 + 16 candidates
    with pytest.raises(EagleExportError, match="greedily"):
        UnrolledDrafter(drafter, DynamicTree(top_k=2, depth=2, nodes=4), sampling=True)


@pytest.mark.parametrize("speculation", [TreeShape.from_branching([3, 2, 1]), DynamicTree(top_k=3, depth=3, nodes=8)],
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("batch", [1, 2])
def test_drafted_trees_verified_in_one_call_are_lossless(target, drafter, speculation, batch):
    """The whole loop on the real tree graph: drafts from the tree drafter, one tree-masked verify
    call per round, the accepted path committed; greedy output equals the target's own."""
    from eagle_export.export.unrolled import TargetGraph
    from eagle_export.runtime.backends import TorchBackend
    from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

    prompts = [[5, 17, 33, 101, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]][:batch]
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, speculation, False))
    assert backend.verify_width == speculation.num_nodes + 1
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=128, verify_policy="fixed")
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=24))
    assert [r.tokens for r in results] == [target.generate_greedy(p, 24) for p in prompts]
    # every round verifies the whole tree: its deepest node (a dynamic tree's best nodes may all be shallow)
    static = isinstance(speculation, TreeShape)
    assert all(d == speculation.depth if static else 1 <= d <= speculation.depth for r in results for d in r.stats.depths)


@pytest.fixture(scope="module")
def sample_pair(sample_target):
    """The sample pair (SmolLM2-135M and the shipped EAGLE-3.1 drafter), 3 MT-bench prompts and the
    target's own greedy output for each: loaded and decoded once for both trees (the tests only read them)."""
    from pathlib import Path

    from eagle_export.data.prompts import ChatTemplate, mtbench_prompts, user_turns

    target = load_target(sample_target)
    drafter = load_drafter(Path(__file__).resolve().parent.parent / "eagle_export" / "samples" / "eagle3.1-smollm2-135m",
                           target=target, dtype=torch.float32)
    template = ChatTemplate(sample_target)
    eos = (target.config.eos_token_id,)
    prompts = [template.encode_chat(m) for m in user_turns(mtbench_prompts()[:3])]
    return target, drafter, prompts, eos, [target.generate_greedy(p, 24, eos) for p in prompts]


@pytest.mark.sample
@pytest.mark.slow
@pytest.mark.parametrize("speculation", [TreeShape.from_branching([4, 2, 1]), DynamicTree(top_k=8, depth=3, nodes=16)],
                         ids=["static", "dynamic"])
def test_trees_on_the_sample_pair_are_lossless_at_batch_1_and_2(sample_pair, speculation):
    """The sample pair with tree graphs, whole trees verified every round: greedy output equals the
    target's own, alone and in a batch of two."""
    from eagle_export.export.unrolled import TargetGraph
    from eagle_export.runtime.backends import TorchBackend
    from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

    target, drafter, prompts, eos, expected = sample_pair
    backend = TorchBackend(TargetGraph(target, False), UnrolledDrafter(drafter, speculation, False))
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=512, verify_policy="fixed")
    config = GenerationConfig(max_new_tokens=24, eos_ids=eos)
    results = runtime.generate(prompts[:1], config) + runtime.generate(prompts[1:], config)
    assert [r.tokens for r in results] == expected
    assert sum(sum(r.stats.accepted) for r in results) > 0
