"""The reference draft-verify loop: lossless greedy decoding, EOS handling, and rejection sampling
that preserves the target's distribution (a chi-square test that a planted bug fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.speculation import eager
from eagle_export.speculation.eager import parallel_drafts, replay_greedy, speculative_generate

AUX = (1, 3, 4)


pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 17, 3, 9], [1, 2, 3, 4, 5, 6, 7], [11, 0, 23, 7, 7, 19]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    target = load_target(write_tiny_target(root / "target", "smollm2", seed=0, vocab_size=24), aux_layer_ids=AUX)
    drafters = {v: load_drafter(write_tiny_drafter(root / f"drafter{v}", v, seed=1, vocab=24, draft_vocab=12),
                                target=target) for v in ("3", "3.1")}
    return target, drafters


def constant_drafter(drafter, token: int):
    """The same drafter proposing `token` at every step (zero lm_head: draft id 0 wins every argmax),
    so greedy runs of `token` in the target's output are accepted in long chains."""
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
        drafter.d2t[0] = token
    return drafter


def full_sequence(target, prompt, n):
    """The prompt, n target-greedy tokens (no EOS) and the aux states of all but the last token."""
    sequence = prompt + target.generate_greedy(prompt, n)
    k, v = target.empty_cache(1, 0)
    _, aux, _, _ = target(torch.tensor([sequence[:-1]]), torch.arange(len(sequence) - 1)[None], k, v,
                          torch.tensor([0]))
    return sequence, aux


@pytest.mark.parametrize("version", ["3", "3.1"])
def test_greedy_speculative_equals_target_greedy(models, version):
    target, drafters = models
    for prompt in PROMPTS[:2]:
        expected = target.generate_greedy(prompt, 16)
        for depth in range(1, 7):
            result = speculative_generate(target, drafters[version], prompt, 16, depth)
            assert result.tokens == expected, (prompt, depth)
            assert 1 + sum(m + 1 for m in result.accepted) >= len(result.tokens)


@pytest.mark.parametrize("version", ["3", "3.1"])
def test_long_accepted_chains_stay_lossless(models, tmp_path, version):
    """A drafter that proposes the target's own repeated token: chains are accepted whole, so the
    cache bookkeeping after accepted drafts and the bonus token is exercised."""
    target, _ = models
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", version, seed=1, vocab=24, draft_vocab=12), target=target)
    accepted_total = 0
    for prompt in PROMPTS:
        expected = target.generate_greedy(prompt, 24)
        constant_drafter(drafter, max(set(expected), key=expected.count))
        for depth in range(1, 7):
            result = speculative_generate(target, drafter, prompt, 24, depth)
            assert result.tokens == expected, (prompt, depth)
            accepted_total += sum(result.accepted)
    assert accepted_total > 50  # the chains really were accepted


def test_loop_drafts_are_the_drafters_chains(models):
    """Each round's proposed chain equals the drafter's chain computed in one pass over the same
    tokens: the drafter cache, its roll-back and the hidden feedback match the drafting convention."""
    target, drafters = models
    for drafter in drafters.values():
        prompt = PROMPTS[0]
        result = speculative_generate(target, drafter, prompt, 16, 4)
        length = len(prompt)  # target tokens before this round's verified token
        sequence, aux = full_sequence(target, prompt, 40)
        for m, chain in zip(result.accepted, result.drafts):
            # The chain after sequence[:length+1], consuming its own drafts.
            next_ids = torch.tensor([sequence[1:length + 1] + chain[:-1]])
            logits = parallel_drafts(drafter, next_ids, aux[:, :length], 4)
            recomputed = [int(drafter.to_target_ids(lg[0, length - 1].argmax())) for lg in logits]
            assert recomputed == chain
            length += m + 1


@pytest.mark.parametrize("version", ["3", "3.1"])
def test_replay_matches_the_loop(models, tmp_path, version):
    target, drafters = models
    constant = load_drafter(write_tiny_drafter(tmp_path / "d", version, seed=1, vocab=24, draft_vocab=12),
                            target=target)
    for prompt in PROMPTS[:2]:
        sequence, aux = full_sequence(target, prompt, 24)
        for drafter in (drafters[version], constant_drafter(constant, max(set(sequence), key=sequence.count))):
            replayed = replay_greedy(drafter, sequence, aux, len(prompt), 16, (1, 3, 6), eos_ids=(sequence[-3],))
            for depth in (1, 3, 6):
                loop = speculative_generate(target, drafter, prompt, 16, depth, eos_ids=(sequence[-3],))
                assert (loop.tokens, loop.accepted) == (replayed[depth].tokens, replayed[depth].accepted)


def test_eos_inside_accepted_drafts_truncates(models, tmp_path):
    """EOS accepted as a draft ends the output there, even with more drafts accepted after it."""
    target, _ = models
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", "3.1", seed=1, vocab=24, draft_vocab=12), target=target)
    cases = 0
    for prompt in PROMPTS + [[2, 9, 4], [7, 7, 1, 3, 21]]:
        plain = target.generate_greedy(prompt, 24)
        later = [t for t in plain if t != plain[0]]  # an EOS that is not the target's first token
        if not later:
            continue
        eos = later[0]
        constant_drafter(drafter, eos)
        expected = target.generate_greedy(prompt, 24, eos_ids=(eos,))
        for depth in (2, 4, 6):
            result = speculative_generate(target, drafter, prompt, 24, depth, eos_ids=(eos,))
            assert result.tokens == expected and result.tokens[-1] == eos
            emitted_before_last = 1 + sum(m + 1 for m in result.accepted[:-1])
            if len(result.tokens) - emitted_before_last < result.accepted[-1] + 1:
                cases += 1  # the last round accepted drafts past the EOS: they were cut
    assert cases >= 2


def test_max_new_tokens_cuts_an_accepted_chain(models, tmp_path):
    target, _ = models
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", "3", seed=1, vocab=24, draft_vocab=12), target=target)
    expected = target.generate_greedy(PROMPTS[0], 7)
    constant_drafter(drafter, max(set(expected), key=expected.count))
    for n in (1, 2, 5, 7):
        assert speculative_generate(target, drafter, PROMPTS[0], n, 6).tokens == expected[:n]


# --- rejection sampling -------------------------------------------------------------------------

VOCAB, DRAFT_VOCAB, TEMPERATURE, SAMPLES = 8, 5, 0.7, 800


@pytest.fixture(scope="module")
def sampling_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = load_target(write_tiny_target(root / "target", "llama", seed=3, vocab_size=VOCAB,
                                           initializer_range=0.5), aux_layer_ids=AUX)
    drafter = load_drafter(write_tiny_drafter(root / "drafter", "3.1", seed=4, vocab=VOCAB, draft_vocab=DRAFT_VOCAB),
                           target=target)
    return target, drafter


def exact_second_and_third(target, prompt):
    """P(second token, third token) under the target at TEMPERATURE, summed over the first."""
    def probs(ids):
        k, v = target.empty_cache(1, 0)
        logits, _, _, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None], k, v, torch.tensor([0]))
        return torch.softmax(logits[0, -1].double() / TEMPERATURE, -1)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    with torch.no_grad():
        p1 = probs(prompt)
        for a in range(VOCAB):
            p2 = probs(prompt + [a])
            for b in range(VOCAB):
                joint[b] += p1[a] * p2[b] * probs(prompt + [a, b])
    return joint.flatten().numpy()


def chi_square_p_value(target, drafter, prompt, seed):
    expected = exact_second_and_third(target, prompt)
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros(VOCAB * VOCAB)
    for _ in range(SAMPLES):
        tokens = speculative_generate(target, drafter, prompt, 3, 2, temperature=TEMPERATURE,
                                      generator=generator).tokens
        counts[tokens[1] * VOCAB + tokens[2]] += 1
    expected = expected * SAMPLES
    small = expected < 5  # pool rare outcomes so the chi-square approximation holds
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    return chisquare(observed, expected).pvalue


@pytest.mark.slow  # ~30 s on 2 cores
def test_rejection_sampling_preserves_the_target_distribution(sampling_models, monkeypatch):
    target, drafter = sampling_models
    prompt = [3, 1, 4]
    assert chi_square_p_value(target, drafter, prompt, seed=0) > 0.01

    def accept_every_draft(p, q, drafts, generator=None):  # the planted bug
        return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))

    monkeypatch.setattr(eager, "rejection_sample", accept_every_draft)
    assert chi_square_p_value(target, drafter, prompt, seed=0) < 0.01


def test_top_p_keeps_the_nucleus_only():
    probs = eager.target_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, top_p=0.7)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))
    assert eager.target_probs(torch.zeros(4), 1.0, top_p=0.1).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_rejection_sample_never_emits_what_the_target_excludes():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)  # the drafter always proposes token 3
    generator = torch.Generator().manual_seed(0)
    outcomes = {eager.rejection_sample(p, q, [3], generator) for _ in range(200)}
    assert {m for m, _ in outcomes} == {0} and {t for _, t in outcomes} == {1, 2}


def test_acceptance_statistics():
    result = eager.SpeculativeResult(tokens=[], depth=3, accepted=[3, 1, 0, 2])
    assert result.rounds == 4 and result.tau == pytest.approx(2.5)
    assert result.acceptance_by_depth == pytest.approx([3 / 4, 2 / 3, 1 / 2])


# --- the committed sample drafters ----------------------------------------------------------------

SAMPLE_DRAFTERS = ("eagle3-smollm2-135m", "eagle3.1-smollm2-135m")


@pytest.mark.sample
@pytest.mark.slow
def test_sample_drafters_are_lossless_on_the_sample_target(sample_target):
    """Each committed drafter loads against the sample target, and greedy speculative decoding
    reproduces target-only greedy decoding on 8 MT-bench prompts. Losslessness is per round, not per
    prompt: 8 prompts x 16 tokens give each drafter dozens of verify rounds (20 prompts took 150 s
    on 2 cores)."""
    from pathlib import Path

    from eagle_export.data.prompts import ChatTemplate, mtbench_prompts, user_turns

    samples = Path(__file__).resolve().parent.parent / "eagle_export" / "samples"
    target = load_target(sample_target)
    template = ChatTemplate(sample_target)
    eos = (target.config.eos_token_id,)
    prompts = [template.encode_chat(m) for m in user_turns(mtbench_prompts()[:8])]
    expected = [target.generate_greedy(p, 16, eos) for p in prompts]
    for name in SAMPLE_DRAFTERS:
        drafter = load_drafter(samples / name, target=target, dtype=torch.float32)
        assert drafter.config.eagle_version == ("3.1" if "3.1" in name else "3")
        accepted = 0
        for prompt, want in zip(prompts, expected):
            result = speculative_generate(target, drafter, prompt, 16, 4, eos)
            assert result.tokens == want
            accepted += sum(result.accepted)
        assert accepted > 0, f"{name} never had a draft accepted"
