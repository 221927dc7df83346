"""The device round (`SpeculativeRuntime._device_round`): a greedy chain under the fixed policy runs its
round on the device with one host read, and gives the general round's tokens, statistics, drafts and
caches, bit for bit, and plain greedy decoding's tokens."""

import pytest
import torch
from test_runtime import PROMPTS, _DeviceOutputs, _OnDevice
from tiny_models import write_tiny_drafter, write_tiny_target

import eagle_export.runtime.runtime as runtime_module
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import TorchBackend
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime

pytestmark = pytest.mark.usefixtures("no_grad")
DEPTH, NEW = 3, 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "qwen2"), aux_layer_ids=(1, 3, 4))
    return target, load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("d"), "3.1"), target=target)


class RightDrafts(TorchBackend):
    """The drafter graph runs; its drafts are replaced by the target's true greedy continuation
    (`continuations`), wrong at every seventh position, so rounds accept 0..K drafts; each call's
    drafts (as verified) are recorded."""

    def __init__(self, *graphs, continuations, **kw):
        super().__init__(*graphs, **kw)
        self.continuations, self.calls = continuations, []

    def drafter(self, feeds, sampling=False):
        out = super().drafter(feeds, sampling)
        first = feeds[C.CACHE_LENS] + feeds[C.NUM_VALID] + 1  # the position of draft 1
        drafts = out[C.DRAFT_IDS].clone()
        for b, full in enumerate(self.continuations):
            for i in range(drafts.shape[1]):
                pos = int(first[b]) + i
                if pos < len(full) and pos % 7 != 0:
                    drafts[b, i] = full[pos]
        out[C.DRAFT_IDS] = drafts
        self.calls.append(drafts.clone())
        return out


class KeepsCaches(SpeculativeRuntime):
    """Keeps the last stream's caches."""

    def _start(self, *args, **kw):
        self.state = super()._start(*args, **kw)
        return self.state


class GeneralRounds(KeepsCaches):
    """The general round (`_round`) for every stream: the reference the device round must equal."""

    def _device_rounds(self, state):
        return False


_GREEDY = {}


def greedy(target, prompt, n):
    """Plain greedy decoding's first n tokens after `prompt`, decoded once per prompt."""
    key = (id(target), tuple(prompt))
    if len(_GREEDY.get(key, ())) < n:
        _GREEDY[key] = target.generate_greedy(prompt, max(n, 64))
    return _GREEDY[key][:n]


def run(pair, prompts, config, general=False, max_context=96):
    """(results, drafts per drafter call, the caches at the end) of a fixed-policy stream, on the device
    round or (general) on the general one; continuations make drafts right at 4 positions of 5."""
    target, drafter = pair
    continuations = [p + greedy(target, p, NEW + DEPTH + 2) for p in prompts]
    backend = RightDrafts(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                          continuations=continuations)
    runtime = (GeneralRounds if general else KeepsCaches).for_models(backend, target, drafter, max_context=max_context,
                                                                     verify_policy="fixed")
    results = runtime.generate(prompts, config)
    state = runtime.state
    return results, backend.calls, [state.target_k, state.target_v, state.draft_k, state.draft_v]


def expected(target, prompt, config):
    """Plain greedy decoding, cut after the first EOS."""
    tokens = greedy(target, prompt, config.max_new_tokens)
    for i, t in enumerate(tokens):
        if t in config.eos_ids:
            return tokens[:i + 1], "eos"
    return tokens, "length"


def eos_config(pair, prompts):
    """An EOS that the first sequence reaches mid-run (the first new token of its from the 9th on that
    it has not emitted before), and the others need not."""
    tokens = greedy(pair[0], prompts[0], NEW)
    eos = next(t for i, t in enumerate(tokens) if i >= 8 and t not in tokens[:i])
    return GenerationConfig(max_new_tokens=NEW, eos_ids=(eos,))


@pytest.mark.parametrize("batch", [1, 3])
def test_device_round_equals_the_general_round_and_plain_greedy(pair, batch):
    """Ragged prompts, an EOS inside the run: tokens, finish reasons, accepted counts per round, every
    drafter call's drafts and the whole target and drafter caches (rows past a sequence's length
    included: rejected rows are never written) equal the general round's, and the tokens plain
    greedy decoding's."""
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]][:batch]
    config = eos_config(pair, prompts)
    device = run(pair, prompts, config)
    general = run(pair, prompts, config, general=True)
    for prompt, result, reference in zip(prompts, device[0], general[0]):
        tokens, reason = expected(pair[0], prompt, config)
        assert (result.tokens, result.finish_reason) == (tokens, reason)
        assert (reference.tokens, reference.finish_reason) == (tokens, reason)
        assert result.stats.accepted == reference.stats.accepted
        assert result.stats.depths == reference.stats.depths and result.stats.widths == reference.stats.widths
    assert "eos" in {r.finish_reason for r in device[0]}
    assert len({a for r in device[0] for a in r.stats.accepted}) >= 2  # accepts of several lengths: not vacuous
    assert len(device[1]) == len(general[1]) and all(torch.equal(a, b) for a, b in zip(device[1], general[1]))
    for mine, theirs in zip(device[2], general[2]):
        assert torch.equal(mine, theirs)


def test_device_round_near_the_context_limit(pair):
    """The last rounds near the context limit are plain steps on the device: the general round's tokens."""
    prompts = [PROMPTS[1], PROMPTS[0]]
    config = GenerationConfig(max_new_tokens=40)
    device, general = (run(pair, prompts, config, general, max_context=32)[0] for general in (False, True))
    assert [(r.tokens, r.finish_reason) for r in device] == [(r.tokens, r.finish_reason) for r in general]
    assert {r.finish_reason for r in device} == {"context"}


def _off_by_one_accept(monkeypatch):
    """Planted: the chain's accepted count one more than matched (capped at K)."""
    original = runtime_module.greedy_accepted_path

    def accept(nodes, parents, greedy):
        accepted, path = original(nodes, parents, greedy)
        return (accepted + 1).clamp(max=nodes.shape[1]) if parents is None else accepted, path
    monkeypatch.setattr(runtime_module, "greedy_accepted_path", accept)


def _one_row_too_many(monkeypatch):
    """Planted: every commit writes one row past the accepted ones."""
    original = runtime_module._write_rows
    monkeypatch.setattr(runtime_module, "_write_rows", lambda keys, values, out, starts, counts, live: original(
        keys, values, out, starts, counts + 1, live))


def _drafter_row_short(monkeypatch):
    """Planted: the drafter's next rows miss the newest one (the target's own token) each round."""
    original = runtime_module._append_rows
    monkeypatch.setattr(runtime_module, "_append_rows", lambda ids, aux_rows, count, tokens, aux, rows, added: original(
        ids, aux_rows, count, tokens, aux, rows, (added - 1).clamp(min=0)))


@pytest.mark.parametrize("plant", [_off_by_one_accept, _one_row_too_many, _drafter_row_short],
                         ids=["accepted off by one", "one cache row too many", "drafter row missing"])
def test_planted_device_round_bugs_fail_the_comparison(pair, monkeypatch, plant):
    """Each planted bug changes what the comparison above checks: the tokens, the caches or the drafts."""
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]]
    config = eos_config(pair, prompts)
    general = run(pair, prompts, config, general=True)
    plant(monkeypatch)
    device = run(pair, prompts, config)
    same_tokens = [r.tokens for r in device[0]] == [r.tokens for r in general[0]]
    same_drafts = len(device[1]) == len(general[1]) and all(torch.equal(a, b) for a, b in zip(device[1], general[1]))
    same_caches = all(torch.equal(a, b) for a, b in zip(device[2], general[2]))
    assert not (same_tokens and same_drafts and same_caches)


class _CountingReads(SpeculativeRuntime):
    """(drafted, device -> host reads) per round, the graphs' outputs standing for a GPU's."""

    def _round(self, state, live, policy=None, drafted=False):
        before = _OnDevice.syncs
        yield from super()._round(state, live, policy, drafted)
        self.rounds.append((drafted, _OnDevice.syncs - before))


class _ReadsTheDrafts(_CountingReads):  # planted: the drafts read on the host, as the general round does
    def _call_drafter(self, state, alive, live):
        out, num_valid = super()._call_drafter(state, alive, live)
        out[C.DRAFT_IDS].tolist()
        return out, num_valid


@pytest.mark.parametrize(("cls", "batch"), [(_CountingReads, 1), (_CountingReads, 3), (_ReadsTheDrafts, 1)],
                         ids=["batch 1", "batch 3", "planted"])
def test_a_device_round_reads_the_device_once(pair, cls, batch):
    """Every round of a fixed-policy chain stream (drafted, and the plain steps near the limit) reads the
    device once: `.cpu()`, `.tolist()`, `.item()`, bool / int / float of anything the graphs computed
    are counted. Planted: a round that also reads the drafts."""
    target, drafter = pair
    backend = _DeviceOutputs(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False))
    runtime = cls.for_models(backend, target, drafter, max_context=28, verify_policy="fixed")
    runtime.rounds = []
    prompts = PROMPTS[:batch]
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=40))
    assert [r.tokens for r in results] == [target.generate_greedy(p, len(r.tokens)) for p, r in zip(prompts, results)]
    drafted = [n for d, n in runtime.rounds if d]
    assert len(drafted) > 3 and any(not d for d, _ in runtime.rounds)  # near the limit: plain steps too
    if cls is _ReadsTheDrafts:
        assert max(drafted) > 1
    else:
        assert max(n for _, n in runtime.rounds) == 1, runtime.rounds
