"""The unrolled drafter equals K explicit single-step Drafter.forward calls, sequence by sequence."""

import pytest
import torch
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.errors import EagleExportError
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.models.layers import causal_mask
from eagle_export.speculation import eager
from eagle_export.speculation.tree import verify_mask

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "llama"), aux_layer_ids=(1, 3, 4))


@pytest.fixture(scope="module", params=["3", "3.1", "3.1-window3"])
def drafter(request, tmp_path_factory, target):
    version, _, window = request.param.partition("-window")
    extra = {"layer_types": ["sliding_attention"], "sliding_window": int(window)} if window else {}
    path = write_tiny_drafter(tmp_path_factory.mktemp("d"), version, seed=7, **extra)
    return load_drafter(path, target=target)


def oracle(drafter, input_ids, aux, num_valid, past_key, past_value, cache_lens, depth,
           temperature=None, noise=None):
    """Per sequence, the reference's chain of single Drafter steps over exactly its valid cache and rows."""
    ids, probs, dists, keys, values = [], [], [], [], []
    for b in range(input_ids.shape[0]):
        n, c = int(num_valid[b]), int(cache_lens[b])

        def distribution(logits):
            return torch.softmax(logits.float() / (1.0 if temperature is None else float(temperature[b])), -1)

        def choose(logits, step):
            p = distribution(logits[0])
            if temperature is None:
                return p.argmax()[None]
            return torch.clamp(torch.searchsorted(p.cumsum(-1), noise[b, step], right=True), max=p.numel() - 1)[None]

        chain = eager.draft_chain(drafter, input_ids[b:b + 1, :n], aux[b:b + 1, :n], depth,
                                      past_key[:, b:b + 1, :, :c], past_value[:, b:b + 1, :, :c], choose)
        p = distribution(chain.logits[0])  # [depth, Vd]
        ids.append(chain.drafts[0].tolist())
        probs.append(p.gather(-1, chain.indices[0, :, None])[:, 0].tolist())
        dists.append(p)
        keys.append(chain.new_key[:, 0])  # the n step-0 entries, then one per later step
        values.append(chain.new_value[:, 0])
    return torch.tensor(ids), torch.tensor(probs), torch.stack(dists), keys, values


def random_inputs(drafter, num_valid, cache_lens, depth, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    batch, width = len(num_valid), depth + 1
    past = max(cache_lens) + 3  # slots past each cache_len hold garbage the mask must hide
    shape = (1, batch, cfg.num_kv_heads, past, cfg.head_dim)
    return (torch.randint(0, cfg.vocab_size, (batch, width), generator=g),
            torch.randn(batch, width, cfg.num_aux * cfg.target_hidden_size, generator=g),
            torch.tensor(num_valid), torch.randn(shape, generator=g), torch.randn(shape, generator=g),
            torch.tensor(cache_lens))


CASES = {  # depth -> (num_valid, cache_lens) at batch 1 and at batch 3, ragged
    1: [([2], [4]), ([1, 2, 2], [5, 0, 3])],
    4: [([3], [6]), ([5, 1, 3], [2, 7, 0])],
    8: [([9], [3]), ([4, 9, 1], [0, 6, 11])],
}


@pytest.mark.parametrize("depth", [1, 4, 8])
@pytest.mark.parametrize("case", [0, 1], ids=["batch1", "batch3"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_unrolled_equals_single_steps(drafter, depth, case, sampling):
    num_valid, cache_lens = CASES[depth][case]
    inputs = random_inputs(drafter, num_valid, cache_lens, depth, seed=depth + case)
    extra, temperature, noise = (), None, None
    if sampling:
        g = torch.Generator().manual_seed(11)
        temperature = torch.rand(len(num_valid), generator=g) + 0.5
        noise = torch.rand(len(num_valid), depth, generator=g)
        extra = (temperature, noise)
    out = UnrolledDrafter(drafter, depth, sampling)(*inputs, *extra)
    ids, probs, dists, keys, values = oracle(drafter, *inputs, depth, temperature, noise)
    width = depth + 1
    assert out[0].shape == (len(num_valid), depth) and out[0].dtype == torch.int64
    assert torch.equal(out[0], ids)
    assert (out[1] - probs).abs().max() <= 1e-5
    if sampling:
        assert out[2].shape == dists.shape and (out[2] - dists).abs().max() <= 1e-5
    new_key, new_value = out[-2], out[-1]
    assert new_key.shape == (1, len(num_valid), drafter.config.num_kv_heads, width + depth - 1,
                             drafter.config.head_dim)
    for b, n in enumerate(num_valid):
        got_k = torch.cat([new_key[:, b, :, :n], new_key[:, b, :, width:]], 2)
        got_v = torch.cat([new_value[:, b, :, :n], new_value[:, b, :, width:]], 2)
        assert (got_k - keys[b]).abs().max() <= 1e-5 and (got_v - values[b]).abs().max() <= 1e-5


def test_sampling_follows_the_noise(drafter):
    """u near 0 picks the first index with mass, near 1 the last: the inverse CDF, not argmax."""
    inputs = random_inputs(drafter, [2], [3], 1)
    graph = UnrolledDrafter(drafter, 1, sampling=True)
    hot = torch.tensor([100.0])  # nearly uniform over the draft vocabulary
    low = graph(*inputs, hot, torch.tensor([[1e-6]]))
    high = graph(*inputs, hot, torch.tensor([[1 - 1e-6]]))
    assert int(low[0]) == int(drafter.to_target_ids(torch.tensor(0)))
    assert int(high[0]) == int(drafter.to_target_ids(torch.tensor(drafter.config.draft_vocab_size - 1)))


def test_target_graph_fuses_argmax(target):
    k, v = target.empty_cache(2, 3)
    args = (torch.randint(0, 320, (2, 5)), torch.arange(3, 8).expand(2, -1), k.normal_(), v.normal_(),
            torch.tensor([3, 1]))
    greedy, logits, aux, nk, nv = TargetGraph(target, return_logits=True)(*args, causal_mask(2, 5))
    ref_logits, ref_aux, ref_k, ref_v = target(*args)  # no tree mask: causal, the calls before trees
    assert torch.equal(greedy, ref_logits.argmax(-1)) and torch.equal(logits, ref_logits)
    assert torch.equal(aux, ref_aux) and torch.equal(nk, ref_k) and torch.equal(nv, ref_v)
    assert len(TargetGraph(target, return_logits=False)(*args, causal_mask(2, 5))) == 4


def test_tree_masked_call_scores_every_node_as_its_own_root_path(target):
    """A tree verify call (root + nodes, each row seeing the cache and its ancestors, at position
    cache_len + depth) gives each row what a causal call over its root path alone gives its last row."""
    gen = torch.Generator().manual_seed(3)
    nodes = 7
    k, v = target.empty_cache(2, 4)
    k, v = torch.randn(k.shape, generator=gen), torch.randn(v.shape, generator=gen)
    lens = torch.tensor([4, 2])
    parents = torch.stack([torch.randint(-1, i, (2,), generator=gen) for i in range(nodes)], dim=1)
    mask = verify_mask(parents)                                          # [2, 8, 8]
    ids = torch.randint(0, 320, (2, nodes + 1), generator=gen)
    positions = lens[:, None] + mask.sum(-1) - 1
    greedy, logits, aux, nk, nv = TargetGraph(target, return_logits=True)(ids, positions, k, v, lens, mask)
    for b in range(2):
        for r in range(nodes + 1):
            path = torch.nonzero(mask[b, r])[:, 0]                       # root-first: topological order
            ref_logits, ref_aux, ref_k, ref_v = target(ids[b:b + 1, path], lens[b] + torch.arange(len(path))[None],
                                                       k[:, b:b + 1], v[:, b:b + 1], lens[b:b + 1])
            assert torch.allclose(logits[b, r], ref_logits[0, -1], atol=1e-5)
            assert torch.allclose(aux[b, r], ref_aux[0, -1], atol=1e-5)
            assert torch.allclose(nk[:, b, :, r], ref_k[:, 0, :, -1], atol=1e-5)
            assert torch.allclose(nv[:, b, :, r], ref_v[:, 0, :, -1], atol=1e-5)
    assert not torch.equal(mask, causal_mask(2, nodes + 1))              # a real tree, not a chain


@pytest.mark.parametrize("depth", [0, 9])
def test_depth_out_of_range_is_refused(drafter, depth):
    with pytest.raises(EagleExportError, match="depth"):
        UnrolledDrafter(drafter, depth, sampling=False)
