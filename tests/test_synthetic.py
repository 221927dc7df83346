"""Synthetic drafts (`synthetic.py`): the real drafter runs, its drafts are replaced by ones of known
quality. Oracle accepts everything, anti nothing, a requested acceptance is realised within binomial
tolerance, and the output is plain decoding's in every case: the T0 tier of the contract."""

import math
import re

import pytest
import torch
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.errors import EagleExportError
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import TorchBackend
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime
from eagle_export.speculation.synthetic import SyntheticDrafts, label, parse_acceptance
from eagle_export.speculation.tree import DynamicTree, TreeShape

pytestmark = pytest.mark.usefixtures("no_grad")
PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [42]]
CONFIG = GenerationConfig(max_new_tokens=20)  # no EOS: every sequence runs to its limit


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "llama"), aux_layer_ids=(1, 3, 4))
    drafter = load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("d"), "3.1"), target=target)
    return target, drafter


def runtime_for(pair, speculation):
    target, drafter = pair
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, speculation, False))
    return SpeculativeRuntime.for_models(backend, target, drafter, max_context=256, verify_policy="fixed")


SPECULATIONS = {"chain": 4, "static tree": TreeShape.from_branching([3, 2, 1]),
                "dynamic tree": DynamicTree(top_k=3, depth=3, nodes=8)}


@pytest.mark.parametrize("kind", list(SPECULATIONS))
@pytest.mark.parametrize("batch", [1, 3])
def test_oracle_anti_and_random_give_plain_decoding_and_the_tau_they_imply(pair, kind, batch):
    runtime = runtime_for(pair, SPECULATIONS[kind])
    prompts = PROMPTS[:batch]
    plain = [r.tokens for r in runtime.generate(prompts, CONFIG, speculative=False)]
    for mode in ("oracle", "anti", "random"):
        drafts = SyntheticDrafts.for_prompts(runtime, prompts, CONFIG, mode)
        results = runtime.generate(prompts, CONFIG, synthetic=drafts)
        assert [r.tokens for r in results] == plain, mode
        accepted = [a for r in results for a in r.stats.accepted]
        if mode == "oracle":  # every round accepts as deep as its tree goes (a chain: tau = K+1 exactly)
            assert accepted == [d for r in results for d in r.stats.depths]
            assert kind == "dynamic tree" or set(accepted) == {runtime.depth}
        elif mode == "anti":
            assert set(accepted) == {0}


def realised(results, depth):
    """(reached, accepted) per draft depth, over every round (the fixed policy verifies all)."""
    accepted = [a for r in results for a in r.stats.accepted]
    return [(sum(a >= d - 1 for a in accepted), sum(a >= d for a in accepted)) for d in range(1, depth + 1)]


@pytest.mark.parametrize("kind", ["chain", "static tree"])
def test_requested_acceptance_is_realised_within_binomial_tolerance(pair, kind):
    runtime = runtime_for(pair, SPECULATIONS[kind])
    acceptance = (0.8, 0.6, 0.4, 0.3)[:runtime.depth]
    config = GenerationConfig(max_new_tokens=100)
    drafts = SyntheticDrafts.for_prompts(runtime, PROMPTS, config, acceptance, seed=3)
    results = runtime.generate(PROMPTS, config, synthetic=drafts)
    assert [r.tokens for r in results] == [r.tokens for r in runtime.generate(PROMPTS, config, speculative=False)]
    for d, ((reached, hits), a) in enumerate(zip(realised(results, runtime.depth), acceptance), 1):
        assert reached > 20, d
        sigma = math.sqrt(a * (1 - a) / reached)
        assert abs(hits / reached - a) <= 4 * sigma + 1e-9, (d, hits, reached, a)


def test_a_planted_off_by_one_continuation_fails_the_realised_acceptance(pair):
    """The oracle's drafts read one token late: nothing is accepted, and the check says so."""
    runtime = runtime_for(pair, SPECULATIONS["chain"])
    drafts = SyntheticDrafts.for_prompts(runtime, PROMPTS, CONFIG, "oracle")
    drafts.continuations = [c[1:] for c in drafts.continuations]
    results = runtime.generate(PROMPTS, CONFIG, synthetic=drafts)
    assert {a for r in results for a in r.stats.accepted} != {runtime.depth}


def test_the_goodput_policy_drafts_for_the_oracle_and_not_for_anti(pair):
    runtime = runtime_for(pair, SPECULATIONS["chain"])
    # a machine where a verify call costs what a plain step does: the oracle's rounds always pay
    runtime.costs.verify_s[1] = {t: 1.0 for t in range(1, 6)}
    runtime.costs.draft_s[1] = {w: 0.1 for w in range(1, 6)}
    prompts = PROMPTS[:1]
    for mode, drafted in (("oracle", True), ("anti", False)):
        drafts = SyntheticDrafts.for_prompts(runtime, prompts, CONFIG, mode)
        [result] = runtime.generate(prompts, CONFIG, verify_policy="goodput", synthetic=drafts)
        calls = result.stats.draft_calls / result.stats.rounds
        assert (calls > 0.9) if drafted else (calls < 0.2), (mode, calls)


def test_the_synthetic_probabilities_say_nothing_of_what_was_drawn():
    """The spine carries a_d whether or not its draw came out right, so the policy learns nothing
    a calibrated drafter would not tell it."""
    drafts = SyntheticDrafts((0.5, 0.5, 0.5), [list(range(100))], vocab_size=320, seed=1)
    parents = torch.tensor([[-1, 0, 1]])
    depths = torch.tensor([[1, 2, 3]])
    seen = set()
    for _ in range(20):
        ids, probs = drafts.replace(parents, depths, [5])
        assert probs.tolist() == [[0.5, 0.5, 0.5]]
        seen.add(tuple(ids[0].tolist()))
    assert len(seen) > 1  # and the drafts themselves did vary


@pytest.mark.parametrize(("text", "problem"), [("1.5", "outside [0, 1]"), ("-0.1", "outside [0, 1]"),
                                               ("nan", "outside [0, 1]"), ("0.5,x", "not a number"),
                                               ("0.9,0.8,0.7,0.6,0.5", "drafts to depth 4")])
def test_bad_acceptance_is_refused_with_a_fix(text, problem):
    with pytest.raises(EagleExportError, match=re.escape(problem)):
        parse_acceptance(text, 4)  # (match is a regex)


def test_acceptance_pads_to_the_depth_and_labels_itself():
    assert parse_acceptance("0.7", 3) == (0.7, 0.7, 0.7)
    assert parse_acceptance("0.7,0.5", 3) == (0.7, 0.5, 0.5)
    assert label((0.7, 0.7)) == "0.7" and label((0.73, 0.52)) == "0.73/0.52" and label("oracle") == "oracle"


def test_sampling_with_synthetic_drafts_is_refused(pair):
    runtime = runtime_for(pair, SPECULATIONS["chain"])
    with pytest.raises(EagleExportError, match="greedy"):
        SyntheticDrafts.for_prompts(runtime, PROMPTS, GenerationConfig(temperature=0.7), 0.5)


def _replace_node_by_node(self, parents, depths, emitted):
    """The rule as first written, one sequence and one node at a time: the oracle for `replace`."""
    b, n = parents.shape
    a = self.probabilities(int(depths.max()) if n else 0)
    draws = torch.rand(b, n, generator=self.generator)
    right_ids = torch.zeros(b, n, dtype=torch.int64)
    for s in range(b):
        cont = self.continuations[s] if s < len(self.continuations) else []
        for i in range(n):
            at = emitted[s] + int(depths[s, i]) - 1
            right_ids[s, i] = cont[at] if at < len(cont) else 0
    height = torch.zeros(b, n, dtype=torch.int64)
    for i in reversed(range(n)):
        p = parents[:, i]
        has = p >= 0
        height[has, p[has]] = torch.maximum(height[has, p[has]], height[has, i] + 1)
    spine = torch.zeros(b, n, dtype=torch.bool)
    for s in range(b):
        node = -1
        while True:
            children = (parents[s] == node).nonzero()[:, 0]
            if not len(children):
                break
            node = int(children[height[s, children].argmax()])
            spine[s, node] = True
    right = torch.zeros(b, n, dtype=torch.bool)
    for i in range(n):
        p = parents[:, i]
        parent_right = torch.where(p >= 0, right.gather(1, p.clamp_min(0)[:, None])[:, 0], True)
        right[:, i] = spine[:, i] & parent_right & (draws[:, i] < a[depths[:, i] - 1])
    probs = torch.where(spine, a[(depths - 1).clamp_min(0)], 0.0)
    wrong = (right_ids + 1 + torch.arange(n)) % self.vocab_size
    return torch.where(right, right_ids, wrong), probs


@pytest.mark.parametrize("seed", range(6))
def test_the_batched_replacement_equals_the_node_by_node_rule(seed):
    """`replace` works on whole batches (it runs inside every timed round); it must draw exactly what
    the node-by-node rule draws, on chains and on random trees of ragged depth, with continuations
    that run out and a sequence that has none."""
    from eagle_export.speculation.tree import node_depths

    gen = torch.Generator().manual_seed(seed)
    b, n = 3, [4, 6, 9, 12, 16, 5][seed]
    parents = (torch.arange(n) - 1).expand(b, -1).clone() if seed == 0 else \
        (torch.rand(b, n, generator=gen) * (torch.arange(n) + 1)).long() - 1
    depths = node_depths(parents)
    continuations = [torch.randint(0, 50, (int(L),), generator=gen).tolist() for L in (30, 4)]  # the third has none
    for acceptance in ((0.8, 0.6, 0.5, 0.9, 0.7, 0.3, 0.95, 0.2, 0.4, 0.6, 0.1, 0.9, 0.5, 0.5, 0.5, 0.5), "oracle", "anti"):
        ours, theirs = (SyntheticDrafts(acceptance, continuations, 50, seed=seed) for _ in range(2))
        for emitted in ([1, 2, 1], [7, 3, 5], [20, 1, 9]):
            got, want = ours.replace(parents, depths, emitted), _replace_node_by_node(theirs, parents, depths, emitted)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (acceptance, emitted)
