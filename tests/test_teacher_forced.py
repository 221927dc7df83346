"""T1/T2 of the lossless contract (`teacher_forced.py`) on a tiny pair whose target is given a planted
width noise: a call wider than one token breaks every near-tie (top-2 margin below NOISE) the
other way, as a quantized target's rounding may. Speculative output then parts from plain decoding,
stays equal to greedy decoding at the verify width (T1), and each divergence is explained (T2).
(A planted cache bug failing T2 on a quantized build: tests/test_build.py.)"""

import pytest
import torch
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.builder.teacher_forced import explain_divergence, margin_shift, measure_delta, position_variance
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import TorchBackend
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime
from eagle_export.speculation.synthetic import SyntheticDrafts

pytestmark = pytest.mark.usefixtures("no_grad")
NOISE = 0.3      # near-ties below this margin flip in a wide call
PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [42, 3]]
CONFIG = GenerationConfig(max_new_tokens=24)


def prefer_second_at_near_ties(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits whose near-ties (top-2 margin below NOISE) are broken the other way."""
    logits = logits.clone()
    top = logits.topk(2, dim=-1)
    tie = (top.values[..., 0] - top.values[..., 1]) < NOISE
    second = top.indices[..., 1:2]
    raised = logits.gather(-1, top.indices[..., :1]) + 1e-3
    return logits.scatter_(-1, second, torch.where(tie[..., None], raised, logits.gather(-1, second)))


def prefer_third_at_near_ties(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits whose third choice is raised over the top where it is within NOISE of it: width
    noise as large as a near-tie's neighbours (the NVFP4 sample build's)."""
    logits = logits.clone()
    top = logits.topk(3, dim=-1)
    tie = (top.values[..., 0] - top.values[..., 2]) < NOISE
    third = top.indices[..., 2:3]
    raised = top.values[..., :1] + 1e-3
    return logits.scatter_(-1, third, torch.where(tie[..., None], raised, logits.gather(-1, third)))


class WidthNoise(TorchBackend):
    """A target whose calls of more than one token prefer the second choice at every near-tie."""

    first_noisy_row = 0
    noise = staticmethod(prefer_second_at_near_ties)

    def target(self, feeds, need_logits=False, bound=()):
        out = dict(super().target(feeds, need_logits=True, bound=bound))
        if feeds[C.INPUT_IDS].shape[1] > 1:
            logits = out[C.LOGITS].clone()
            rows = slice(self.first_noisy_row, None)
            logits[:, rows] = self.noise(logits[:, rows])
            out[C.LOGITS], out[C.GREEDY_IDS] = logits, logits.argmax(-1)
        return out


class RowNoise(WidthNoise):
    """A target whose rows after the first of a wide call prefer the second choice at every near-tie:
    a kernel whose result depends on the row's place in the call."""

    first_noisy_row = 1


class ThirdChoiceNoise(WidthNoise):
    """A target whose calls of more than one token prefer the third choice where it is within NOISE
    of the top."""

    noise = staticmethod(prefer_third_at_near_ties)


def noisy_runtime(tmp_path_factory, backend_class):
    target = load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "llama"), aux_layer_ids=(1, 3, 4))
    drafter = load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("d"), "3.1"), target=target)
    backend = backend_class(TargetGraph(target, True), UnrolledDrafter(drafter, 3, False))
    return SpeculativeRuntime.for_models(backend, target, drafter, max_context=256, verify_policy="fixed")


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    return noisy_runtime(tmp_path_factory, WidthNoise)


def shape(runtime):
    return runtime.target_cache_shape


def test_margin_shift_is_the_change_of_the_narrow_top2_gap():
    narrow = torch.tensor([[3.0, 1.0, 0.0]])
    wide = torch.tensor([[2.5, 1.5, 9.0]])  # the same two tokens 1.0 apart instead of 2.0
    assert margin_shift(narrow, wide).tolist() == [1.0]


def test_delta_bounds_the_planted_width_noise(runtime):
    prompts = [list(range(3 + i, 40 + i)) for i in range(4)]
    delta = measure_delta(runtime.backend, shape(runtime), prompts, runtime.backend.verify_width)
    assert delta["argmax_flips"] > 0 and delta["positions"] == 4 * 24  # the noise did flip near-ties
    assert 0 < delta["delta"] <= NOISE + 1e-3 + 1e-5


def test_speculative_output_is_greedy_at_the_verify_width_and_its_divergences_are_explained(runtime):
    results = runtime.generate(PROMPTS, CONFIG)
    spec = [r.tokens for r in results]
    plain = [r.tokens for r in runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=27), speculative=False)]
    anti = [r.tokens for r in runtime.generate(PROMPTS, CONFIG, synthetic=SyntheticDrafts("anti", plain, 320))]
    assert spec == anti  # T1
    explained = [explain_divergence(runtime.backend, shape(runtime), p, r.tokens, a[:24], NOISE + 2e-3,
                                    r.stats.accepted, r.stats.widths) for p, r, a in zip(PROMPTS, results, plain)]
    assert any(e["d"] is not None for e in explained)  # the noise made speculative output part from plain
    for e in explained:
        assert e["explained"], e
        if e["d"] is not None:
            assert e["margin"] < NOISE and e["identical_prefix"] == e["d"] / 24


def test_t2_recomputes_the_divergence_at_the_row_that_verified_it(tmp_path_factory):
    """Where only rows after the first break near-ties (a row-dependent kernel), speculative output
    parts from plain decoding at a row > 0 of its round: (a) holds at that row, not at row 0 of a
    call (which the T1 reference, and T2 before this check, recompute)."""
    runtime = noisy_runtime(tmp_path_factory, RowNoise)
    plain = [r.tokens for r in runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=27), speculative=False)]
    results = runtime.generate(PROMPTS, CONFIG, synthetic=SyntheticDrafts("oracle", plain, 320))  # drafts accepted
    explained = [explain_divergence(runtime.backend, shape(runtime), p, r.tokens, a[:24], NOISE + 2e-3,
                                    r.stats.accepted, r.stats.widths) for p, r, a in zip(PROMPTS, results, plain)]
    assert any(e["d"] is not None for e in explained)
    assert all(e["explained"] for e in explained), explained
    # row 0 of a call is noise-free here, so it gives plain decoding's token, never the speculative one
    rows0 = [explain_divergence(runtime.backend, shape(runtime), p, r.tokens, a[:24], NOISE + 2e-3,
                                [0] * 30, [runtime.backend.verify_width] * 30)
             for p, r, a in zip(PROMPTS, results, plain)]
    assert all(e["argmax_at_verify_width"] is False for e in rows0 if e["d"] is not None)


def test_t2_explains_a_third_choice_within_delta_and_fails_a_gap_beyond_it(tmp_path_factory):
    """(c) asks that the width noise can explain swapping the width-1 top r and the speculative token
    s: l1[r] - l1[s] <= delta, whatever s's rank. A third choice within delta passes; the same
    divergence judged against a delta between its top-2 margin and its gap fails (c) alone."""
    runtime = noisy_runtime(tmp_path_factory, ThirdChoiceNoise)
    plain = [r.tokens for r in runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=27), speculative=False)]
    results = runtime.generate(PROMPTS, CONFIG)

    def explain(delta):
        return [explain_divergence(runtime.backend, shape(runtime), p, r.tokens, a[:24], delta,
                                   r.stats.accepted, r.stats.widths) for p, r, a in zip(PROMPTS, results, plain)]

    parted = {i: e for i, e in enumerate(explain(NOISE + 2e-3)) if e["d"] is not None}
    assert parted and all(e["explained"] and e["width1_rank"] == 3 for e in parted.values()), parted
    assert all(e["margin"] <= e["gap_to_top"] < NOISE for e in parted.values())
    i = max(parted, key=lambda i: parted[i]["gap_to_top"] - parted[i]["margin"])
    judged = explain((parted[i]["margin"] + parted[i]["gap_to_top"]) / 2)[i]
    assert judged["argmax_at_verify_width"] and judged["margin_below_delta"]
    assert not judged["within_delta_of_top"] and not judged["explained"]


def probe(runtime, view=None):
    """position_variance along each prompt's first 12 greedy tokens (as validate runs it on T1's)."""
    backend = runtime.backend
    tokens = [r.tokens for r in runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=12), speculative=False)]
    return position_variance(backend, shape(runtime), list(zip(PROMPTS, tokens)), backend.verify_width, view)


def test_position_variance_is_zero_for_a_width_only_noise_and_found_for_a_row_dependent_kernel(runtime, monkeypatch):
    """T1 is exact only where a row's bits do not depend on its place within the call; validate
    records T1 as not applicable where this probe finds they do."""
    backend = runtime.backend
    # the torch backend on CPU is width-invariant (layers.width_invariant: layers.attend, row_linear): no row differs
    found = probe(runtime)
    assert found["rows"] == sum(12 for _ in PROMPTS) * backend.verify_width - 3 * sum(range(backend.verify_width))
    assert found["differing"] == 0 and found["max_logit_difference"] == 0 and found["max_kv_difference"] == 0
    target = backend.target

    def row_dependent(feeds, need_logits=False, bound=()):
        out = dict(target(feeds, need_logits, bound))
        rows = torch.arange(out[C.LOGITS].shape[1], dtype=out[C.LOGITS].dtype)
        out[C.LOGITS] = out[C.LOGITS] + 1e-3 * rows[None, :, None]
        return out

    monkeypatch.setattr(backend, "target", row_dependent)
    assert probe(runtime)["max_logit_difference"] >= 1e-3


def test_position_variance_reads_the_runtimes_cache_views_and_the_new_kv(runtime, monkeypatch):
    """The layout T1 depends on includes the cache view's masked slots, and a row's K/V: a kernel
    that changes only the last row's new K/V, only when the cache view shows masked slots, leaves
    every logit of its call as it was, is invisible with exact views, and is found with the runtime's."""
    backend = runtime.backend
    target = backend.target

    def last_row_kv_under_masked_slots(feeds, need_logits=False, bound=()):
        out = dict(target(feeds, need_logits, bound))
        if feeds[C.PAST_KEY].shape[3] > int(feeds[C.CACHE_LENS].max()) and feeds[C.INPUT_IDS].shape[1] > 1:
            out[C.NEW_KEY] = out[C.NEW_KEY].clone()
            out[C.NEW_KEY][:, :, :, -1] += 0.25
        return out

    monkeypatch.setattr(backend, "target", last_row_kv_under_masked_slots)
    exact = probe(runtime)
    assert exact["max_kv_difference"] < 1e-4 and exact["view_slots"] == [2, 22]
    found = probe(runtime, view=lambda past, width: runtime.cache_slots(past + width, 256))
    assert found["max_kv_difference"] >= 0.25 and found["max_logit_difference"] < 1e-4
    assert found["differing"] > 0 and found["view_slots"] == [64, 64]


def test_a_target_graph_without_logits_is_probed_on_its_greedy_ids_and_new_kv(runtime, monkeypatch):
    """A build's target graph may return no logits (return_logits false, a hand-made graph): the T1
    probe compares what it does return, bit for bit, and still finds a row-dependent kernel there;
    the checks that need margins (delta, T2) say so instead of failing on a missing output."""
    from eagle_export.builder.teacher_forced import TargetCalls
    from eagle_export.errors import EagleExportError

    backend = runtime.backend
    with_logits = backend.target

    def without_logits(feeds, need_logits=False, bound=()):
        return {k: v for k, v in with_logits(feeds, need_logits, bound).items() if k != C.LOGITS}

    monkeypatch.setattr(backend, "target", without_logits)
    found = probe(runtime)
    assert found["differing"] == 0 and found["max_logit_difference"] is None and found["rows"] > 0
    with pytest.raises(EagleExportError, match="returns no logits") as refused:
        TargetCalls(backend, shape(runtime))(PROMPTS[0])
    assert "rebuild" in refused.value.fix

    def second_row_other_id(feeds, need_logits=False, bound=()):  # planted: a row's greedy id depends on its place
        out = without_logits(feeds, need_logits, bound)
        if feeds[C.INPUT_IDS].shape[1] > 1:
            out[C.GREEDY_IDS] = out[C.GREEDY_IDS].clone()
            out[C.GREEDY_IDS][:, 1] += 1
        return out

    monkeypatch.setattr(backend, "target", second_row_other_id)
    found = probe(runtime)
    assert found["differing"] > 0 and found["argmax_flips"] == found["differing"]
