"""The device round (`SpeculativeRuntime._device_round`): a greedy chain under the fixed policy runs its
round on the device with one host read, under the goodput policy with two a drafted round (the drafts
read for its choice, then the outcome) and one a k = 0 round, and gives the general round's tokens,
statistics, policy decisions, drafts and caches, bit for bit, and plain greedy decoding's tokens, with its
bookkeeping run eagerly or replayed from a captured graph (on CPU, a capture that replays eagerly into
the same buffers); the bookkeeping is capturable (no host read, no data-dependent shape), and a captured
round's host work is a few calls."""

import functools
from collections import Counter

import pytest
import torch
from planting import plant
from test_cuda_graphs import _bound_never_copied, _epilogue_skipped, replay_eagerly
from test_runtime import PROMPTS, _DeviceOutputs, _OnDevice
from tiny_models import write_tiny_drafter, write_tiny_target
from torch.overrides import TorchFunctionMode

import eagle_export.runtime.device_round as device_round
import eagle_export.runtime.rows as rows
from eagle_export.errors import EagleExportError
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import TorchBackend, write_into
from eagle_export.runtime.costs import CostCurves
from eagle_export.runtime.cuda_graphs import ShapeGraphs, check_capturable
from eagle_export.runtime.rows import _new_cache
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime
from eagle_export.runtime.verify_policy import GoodputDepth
from eagle_export.speculation.synthetic import SyntheticDrafts

pytestmark = pytest.mark.usefixtures("no_grad")
DEPTH, NEW = 3, 24
GOODPUT_NEW = 40  # (goodput's runs: long enough to stop drafting for 8 rounds and catch up: `Goodput`)


def prompts_for(policy, batch):
    """Ragged prompts; goodput's first is the one whose greedy run has a new token latest (the 20th)."""
    return ([PROMPTS[1], PROMPTS[0], PROMPTS[3]] if policy == "fixed" else [PROMPTS[3], PROMPTS[0], PROMPTS[1]])[:batch]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "qwen2"), aux_layer_ids=(1, 3, 4))
    return target, load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("d"), "3.1"), target=target)


class RightDrafts(TorchBackend):
    """The drafter graph runs; its drafts are replaced by the target's true greedy continuation
    (`continuations`), wrong at every seventh position, so rounds accept 0..K drafts; each call's
    drafts (as verified) and input width are recorded. `confident`: the drafter's probability of each
    draft replaced too, 0.9 where confident(position) holds, else 0.02 (a synthetic profile that makes
    the goodput policy verify fewer drafts, stop drafting and probe again). A call given tensors to write
    its drafts `into` (`Backend.drafter`) is checked to have written the drafter graph's own there (from
    the captured graph's epilogue, or eagerly), which are then replaced there too."""

    def __init__(self, *graphs, continuations, confident=None, **kw):
        super().__init__(*graphs, **kw)
        self.continuations, self.confident, self.calls, self.widths = continuations, confident, [], []

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        return self._replace(super().drafter(feeds, sampling, bound, into), feeds, into)

    def _replace(self, out, feeds, into=()):
        for name, dest in into:
            assert torch.equal(dest, out[name]), f"the drafter call did not write its {name} into the given tensor"
        out = dict(out)
        first = feeds[C.CACHE_LENS] + feeds[C.NUM_VALID] + 1  # the position of draft 1
        drafts, probs = out[C.DRAFT_IDS].clone(), out[C.DRAFT_TOKEN_PROBS].clone()
        for b, full in enumerate(self.continuations):
            for i in range(drafts.shape[1]):
                pos = int(first[b]) + i
                if pos < len(full) and pos % 7 != 0:
                    drafts[b, i] = full[pos]
                if self.confident is not None:
                    probs[b, i] = 0.9 if self.confident(pos) else 0.02
        out[C.DRAFT_IDS], out[C.DRAFT_TOKEN_PROBS] = drafts, probs
        self.calls.append(drafts.clone())
        self.widths.append(feeds[C.INPUT_IDS].shape[1])
        return write_into(out, into)


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


class Goodput(GoodputDepth):
    """The goodput policy probing after 8 plain rounds (not the priced interval, which these costs put at
    PROBE_CEILING: a short stream sees several probes; more than 2(K+1), so a catch-up outgrows the
    first pending buffers), recording every decision: (should_draft, choose) in order."""

    def _probe_interval(self):
        return 8

    def start(self, batch):
        super().start(batch)
        self.decisions = []

    def should_draft(self, live):
        answer = super().should_draft(live)
        self.decisions.append(("draft", answer))
        return answer

    def _choose_greedy(self, *args):
        j = super()._choose_greedy(*args)
        self.decisions.append(("verify", j))
        return j


def costs(batch):
    """Costs where drafting pays when the drafter is confident: a plain step 1, a verify call of T tokens
    1 + (T - 1) / 10, the drafter 0.4 at up to K+1 rows and 0.01 more per row beyond."""
    return CostCurves({batch: {t: 1 + (t - 1) / 10 for t in range(1, DEPTH + 2)}},
                      {batch: {w: 0.4 for w in range(1, DEPTH + 2)}}, {batch: {64: 0.4 + 0.01 * (64 - DEPTH - 1)}})


def confident(position):
    """The synthetic confidence profile of goodput streams: unsure at positions 8-39."""
    return not 8 <= position < 40


def run(pair, prompts, config, general=False, max_context=96, graphs=False, policy="fixed"):
    """(results, drafts per drafter call, the caches at the end, drafter input widths, policy decisions)
    of a stream under `policy` (fixed, or goodput: `Goodput` over `costs` and the profile `confident`),
    on the device round or (general) on the general one; continuations make drafts right at 4 positions
    of 5. graphs: every graph call and the device round's bookkeeping replayed from captures (static
    caches)."""
    target, drafter = pair
    continuations = [p + greedy(target, p, config.max_new_tokens + DEPTH + 2) for p in prompts]
    kw = {"cuda_graphs": True, "capture": replay_eagerly} if graphs else {}
    goodput = policy == "goodput"
    backend = RightDrafts(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                          continuations=continuations, confident=confident if goodput else None, **kw)
    chosen = Goodput(DEPTH, costs(len(prompts))) if goodput else policy
    runtime = (GeneralRounds if general else KeepsCaches).for_models(backend, target, drafter, max_context=max_context,
                                                                     verify_policy=chosen)
    results = runtime.generate(prompts, config)
    state = runtime.state
    return (results, backend.calls, [state.target_k, state.target_v, state.draft_k, state.draft_v], backend.widths,
            getattr(chosen, "decisions", None))


def expected(target, prompt, config):
    """Plain greedy decoding, cut after the first EOS."""
    tokens = greedy(target, prompt, config.max_new_tokens)
    for i, t in enumerate(tokens):
        if t in config.eos_ids:
            return tokens[:i + 1], "eos"
    return tokens, "length"


def eos_config(pair, prompts, policy="fixed"):
    """An EOS that the first sequence reaches mid-run (the first new token of its from the 9th on, the
    20th on for goodput's longer runs, that it has not emitted before), and the others need not."""
    after, new = (8, NEW) if policy == "fixed" else (19, GOODPUT_NEW)
    tokens = greedy(pair[0], prompts[0], new)
    eos = next(t for i, t in enumerate(tokens) if i >= after and t not in tokens[:i])
    return GenerationConfig(max_new_tokens=new, eos_ids=(eos,))


def goodput_stream(pair, cls, batch, backend_cls, max_context):
    """(runtime of class `cls`, its backend of class `backend_cls`, prompts): the tiny pair over the first
    `batch` of three prompts, the drafter right where `confident` says, the goodput policy on `costs`."""
    target, drafter = pair
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]][:batch]
    continuations = [p + greedy(target, p, 64) for p in prompts]
    backend = backend_cls(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                          continuations=continuations, confident=confident)
    runtime = cls.for_models(backend, target, drafter, max_context=max_context,
                             verify_policy=Goodput(DEPTH, costs(batch)))
    return runtime, backend, prompts


def assert_same_stream(device, general):
    """Two runs' (`run`) statistics, policy decisions, drafts per drafter call, drafter widths and whole
    target and drafter caches (rows past a sequence's length included: rejected rows are never written)
    are the same."""
    for result, reference in zip(device[0], general[0]):
        assert result.stats.accepted == reference.stats.accepted
        assert result.stats.depths == reference.stats.depths and result.stats.widths == reference.stats.widths
        assert result.stats.draft_calls == reference.stats.draft_calls
    assert device[4] == general[4] and device[3] == general[3]
    assert len(device[1]) == len(general[1]) and all(torch.equal(a, b) for a, b in zip(device[1], general[1]))
    for mine, theirs in zip(device[2], general[2]):
        assert torch.equal(mine, theirs)


def assert_goodput_skips_and_resumes(device):
    """A goodput run (`run`) that is not vacuous: it verified fewer than K drafts in some drafted round,
    ran k = 0 rounds and drafted again after them, catching up on more than 2(K+1) rows (the pending
    buffers' first size)."""
    decisions, widths = device[4], device[3]
    drafts = [answer for kind, answer in decisions if kind == "draft"]
    assert False in drafts and any(not a and b for a, b in zip(drafts, drafts[1:])), decisions
    assert min(j for kind, j in decisions if kind == "verify") < DEPTH, decisions
    assert max(widths[1:]) > 2 * (DEPTH + 1), widths  # (the first call reads the prompt)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_device_round_equals_the_general_round_and_plain_greedy(pair, batch, graphs, policy):
    """Ragged prompts, an EOS inside the run: tokens, finish reasons, accepted counts per round, the
    policy's decisions, every drafter call's drafts and the whole target and drafter caches equal the
    general round's (`assert_same_stream`), and the tokens plain greedy decoding's; with the graphs
    captured, the general round's through the same graphs. Goodput over a confidence profile that makes
    it verify fewer drafts, skip drafting and catch up when it drafts again."""
    prompts = prompts_for(policy, batch)
    config = eos_config(pair, prompts, policy)
    device = run(pair, prompts, config, graphs=graphs, policy=policy)
    general = run(pair, prompts, config, general=True, graphs=graphs, policy=policy)
    for prompt, result, reference in zip(prompts, device[0], general[0]):
        tokens, reason = expected(pair[0], prompt, config)
        assert (result.tokens, result.finish_reason) == (tokens, reason)
        assert (reference.tokens, reference.finish_reason) == (tokens, reason)
    assert_same_stream(device, general)
    assert "eos" in {r.finish_reason for r in device[0]}
    assert len({a for r in device[0] for a in r.stats.accepted}) >= 2  # accepts of several lengths: not vacuous
    if policy == "goodput":
        assert_goodput_skips_and_resumes(device)


class _RecordsAfterItsEvents(SpeculativeRuntime):  # planted: a finishing round's statistics left for later too
    @staticmethod
    def _finished(state):
        pass


@pytest.mark.parametrize("cls", [SpeculativeRuntime, _RecordsAfterItsEvents], ids=["device round", "planted"])
def test_a_final_event_carries_every_round_of_its_sequence(pair, cls):
    """A device round's statistics are recorded after the next round's first launch (`_after_launch`), but
    a sequence's last event carries its statistics, so a round that finishes a sequence records them before
    its events are yielded: at each final event, as a streaming consumer sees it, the statistics are the
    ones at the stream's end, and their rounds account for every token but the prompt pass's (a round
    emits its accepted drafts and one more; the last one's may be cut). Ragged finishes: an EOS one
    sequence meets mid-run. Planted: the finishing round's statistics left for the next round's launch."""
    target, drafter = pair
    prompts = prompts_for("fixed", 3)
    config = eos_config(pair, prompts)
    backend = RightDrafts(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                          continuations=[p + greedy(target, p, config.max_new_tokens + DEPTH + 2) for p in prompts])
    runtime = cls.for_models(backend, target, drafter, max_context=96, verify_policy="fixed")
    seen = {}
    for event in runtime.stream(prompts, config):
        if event.finish_reason is not None:
            s = event.stats
            seen[event.index] = (s, list(s.accepted), list(s.widths), s.new_tokens)
    assert len(seen) == 3 and len({s.rounds for s, *_ in seen.values()}) > 1  # (finished in different rounds)
    kept = all(accepted == s.accepted and widths == s.widths and sum(a + 1 for a in accepted) >= n - 1
               for s, accepted, widths, n in seen.values())
    assert kept is (cls is SpeculativeRuntime), seen


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_device_round_near_the_context_limit(pair, graphs, policy):
    """The last rounds near the context limit are plain steps on the device: the general round's tokens,
    statistics, decisions, drafts and caches."""
    prompts = [PROMPTS[1], PROMPTS[0]]
    config = GenerationConfig(max_new_tokens=40)
    device, general = (run(pair, prompts, config, general, max_context=32, graphs=graphs, policy=policy)
                       for general in (False, True))
    assert [(r.tokens, r.finish_reason) for r in device[0]] == [(r.tokens, r.finish_reason) for r in general[0]]
    assert {r.finish_reason for r in device[0]} == {"context"}
    assert_same_stream(device, general)


def _off_by_one_accept(monkeypatch):
    """Planted: the chain's accepted count one more than matched (capped at K)."""
    def wrap(original):
        def accept(nodes, parents, greedy):
            accepted, path = original(nodes, parents, greedy)
            return (accepted + 1).clamp(max=nodes.shape[1]) if parents is None else accepted, path
        return accept
    plant(monkeypatch, "greedy_accepted_path", wrap)


def _one_row_too_many(monkeypatch):
    """Planted: every commit writes one row past the accepted ones."""
    plant(monkeypatch, "_write_rows", lambda original: lambda keys, values, out, starts, counts, live: original(
        keys, values, out, starts, counts + 1, live))


def _drafter_row_short(monkeypatch):
    """Planted: the drafter's next rows miss the newest one (the target's own token) each round."""
    plant(monkeypatch, "_append_rows", lambda original: lambda ids, aux_rows, count, tokens, aux, rows, added: original(
        ids, aux_rows, count, tokens, aux, rows, (added - 1).clamp(min=0)))


def _no_room(monkeypatch):
    """Planted: the pending rows never grow, so a catch-up's rows past 2(K+1) are lost."""
    monkeypatch.setattr(device_round._RoundBuffers, "fit", lambda self, rows, pending: None)


def _reversed(monkeypatch):
    """Planted: the joint probabilities read deepest first."""
    original = device_round.tree.chain_joint
    monkeypatch.setattr(device_round.tree, "chain_joint", lambda token_probs: original(token_probs).flip(-1))


def _not_told(monkeypatch):
    """Planted: the policy not told the tokens a round emitted (its hindsight then learns nothing)."""
    original = GoodputDepth.observe
    monkeypatch.setattr(GoodputDepth, "observe", lambda self, j, accepted, live, drafted, emitted=None: original(
        self, j, accepted, live, drafted, None))


@pytest.mark.parametrize(("plant", "policy"), [(_off_by_one_accept, "fixed"), (_one_row_too_many, "fixed"),
                                               (_drafter_row_short, "fixed"), (_off_by_one_accept, "goodput"),
                                               (_no_room, "goodput"), (_reversed, "goodput"),
                                               (_not_told, "goodput")],
                         ids=["accepted off by one", "one cache row too many", "drafter row missing",
                              "goodput: accepted off by one", "goodput: no room to catch up",
                              "goodput: joint probabilities reversed", "goodput: emitted tokens not told"])
def test_planted_device_round_bugs_fail_the_comparison(pair, monkeypatch, plant, policy):
    """Each planted bug changes what the comparison above checks: the tokens, statistics, decisions,
    drafts or caches."""
    prompts = prompts_for(policy, 3)
    config = eos_config(pair, prompts, policy)
    general = run(pair, prompts, config, general=True, policy=policy)
    plant(monkeypatch)
    device = run(pair, prompts, config, policy=policy)
    with pytest.raises(AssertionError):
        assert [r.tokens for r in device[0]] == [r.tokens for r in general[0]]
        assert_same_stream(device, general)


class _CountingReads(SpeculativeRuntime):
    """(drafted, device -> host reads) per round, the graphs' outputs standing for a GPU's."""

    def _round(self, state, live, policy=None, drafted=False):
        before = _OnDevice.syncs
        yield from super()._round(state, live, policy, drafted)
        self.rounds.append((drafted, _OnDevice.syncs - before))


class _ReadsTheDrafts(_CountingReads):  # planted: the drafts read on the host, as the general round does
    def _call_drafter(self, state, alive, live, into=()):
        out, num_valid = super()._call_drafter(state, alive, live, into)
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


class _RightOnDevice(RightDrafts):
    """`RightDrafts` whose outputs stand for a GPU's (`_OnDevice`: their reads are counted)."""

    def target(self, feeds, need_logits=False, bound=()):
        return {name: t.as_subclass(_OnDevice) for name, t in super().target(feeds, need_logits, bound).items()}

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        return {name: t.as_subclass(_OnDevice) for name, t in super().drafter(feeds, sampling, bound, into).items()}


class _ReadsTheProbabilities(_CountingReads):  # planted: the probabilities read apart from the drafts
    def _chosen(self, state, out, policy, alive, replayed):
        out[C.DRAFT_TOKEN_PROBS].tolist()
        return super()._chosen(state, out, policy, alive, replayed)


@pytest.mark.parametrize(("cls", "batch"), [(_CountingReads, 1), (_CountingReads, 3), (_ReadsTheProbabilities, 1)],
                         ids=["batch 1", "batch 3", "planted"])
def test_a_goodput_device_round_reads_the_device_twice_at_most(pair, cls, batch):
    """A goodput stream over the confidence profile (drafted rounds, k = 0 rounds, catch-ups, plain steps
    near the limit): a drafted round reads the device twice (its drafts with their probabilities for the
    policy's choice, then the outcome), a round without a drafter call once; greedy output stays the
    target's. Planted: a round that also reads the probabilities on their own."""
    target, _ = pair
    runtime, backend, prompts = goodput_stream(pair, cls, batch, _RightOnDevice, max_context=48)
    runtime.rounds = []
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=48))
    assert [r.tokens for r in results] == [greedy(target, p, len(r.tokens)) for p, r in zip(prompts, results)]
    assert {r.finish_reason for r in results} == {"context"}
    drafted, plain = [n for d, n in runtime.rounds if d], [n for d, n in runtime.rounds if not d]
    assert len(drafted) > 3 and len(plain) > 3 and max(backend.widths[1:]) > DEPTH + 1  # (catch-ups: not vacuous)
    if cls is _ReadsTheProbabilities:
        assert max(drafted) > 2
    else:
        assert max(drafted) == 2 and max(plain) == 1, runtime.rounds


class _LoggedLaunches(_RightOnDevice):
    """`_RightOnDevice` logging each graph call as it starts, with the device reads so far (`_OnDevice.syncs`)."""

    def target(self, feeds, need_logits=False, bound=()):
        self.log.append(("target", _OnDevice.syncs))
        return super().target(feeds, need_logits, bound)

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        self.log.append(("drafter", _OnDevice.syncs))
        return super().drafter(feeds, sampling, bound, into)


class _LoggedLearning(Goodput):
    """`Goodput` logging each learning from an outcome (a `learn` with one pending: the runtime's call, or
    the one choose or observe makes where the runtime has not), with the device reads so far; a probe's,
    learned at once in its own observe, apart."""

    def start(self, batch):
        super().start(batch)
        self.probe = False

    def observe(self, j, accepted, live, drafted, emitted=None):
        self.probe = drafted and self._probing()
        super().observe(j, accepted, live, drafted, emitted)
        self.probe = False

    def learn(self):
        if self._pending is not None:
            self.log.append(("probe learned" if self.probe else "learn", _OnDevice.syncs))
        super().learn()


class _LoggedRounds(SpeculativeRuntime):
    def _round(self, state, live, policy=None, drafted=False):
        self.log.append(("round", _OnDevice.syncs))
        yield from super()._round(state, live, policy, drafted)


class _LearnsFirst(_LoggedRounds):  # planted: the learning before the round's first launch (the critical path)
    def _device_round(self, state, live, policy=None, drafted=False):
        if policy is not None:
            state.learn()
        yield from super()._device_round(state, live, policy, drafted)


class _NeverCallsLearn(_LoggedRounds):  # planted: learn never called (choose and observe learn, after a read)
    def _start(self, *args, **kw):
        state = super()._start(*args, **kw)
        state.learn = None
        return state


@pytest.mark.parametrize("cls", [_LoggedRounds, _LearnsFirst, _NeverCallsLearn],
                         ids=["goodput", "planted: learning first", "planted: never called"])
def test_the_device_round_learns_after_its_first_launch_and_before_its_read(pair, cls):
    """On a GPU the host's work between a round's read and its next launch leaves the device idle: the
    goodput policy learns from a round's outcome (`learn`) in the next round, right after its first launch
    (the drafter's; the target's in a k = 0 round) and before any read of the device. Logged in order over
    a goodput stream (the confidence profile: drafted rounds, k = 0 rounds, probes): each round's start,
    each graph call, each learning from an outcome, with the device reads so far (the graphs' outputs
    stand for a GPU's, `_OnDevice`; a probe's outcome is learned at once, by design, and logged apart).
    Planted: the learning before the round's first launch; never called by the runtime (the next choice
    learns after the read of the drafts, observe after the round's read)."""
    target, drafter = pair
    prompts, log = [PROMPTS[1]], []
    backend = _LoggedLaunches(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                              continuations=[PROMPTS[1] + greedy(target, PROMPTS[1], 64)], confident=confident)
    policy = _LoggedLearning(DEPTH, costs(1))
    backend.log = policy.log = log
    runtime = cls.for_models(backend, target, drafter, max_context=96, verify_policy=policy)
    runtime.log = log
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=36))
    assert [r.tokens for r in results] == [greedy(target, p, 36) for p in prompts]
    rounds = []
    for event in log:
        if event[0] == "round":
            rounds.append([])
        elif rounds:
            rounds[-1].append(event)
    learning = [r for r in rounds if any(kind == "learn" for kind, _ in r)]
    launched_first = {r[0][0] for r in learning}
    placed = all(r[0][0] in ("drafter", "target") and r[1] == ("learn", r[0][1]) for r in learning)
    if cls is not _LoggedRounds:
        assert not placed
        return
    assert placed and launched_first == {"drafter", "target"} and len(learning) > 5, rounds
    assert any(kind == "probe learned" for kind, _ in log)


# ------------------------------------------------------------ the bookkeeping, captured

_SETTLE_CALLS = {}


def settle_calls(pair, prompts, max_context=28):
    """The inputs of `_settle_round`'s calls in a fixed-policy stream that ends near the context limit
    (clones, as they were before the call): a drafted round's and a plain step's (kept per prompts)."""
    key = (id(pair[1]), tuple(map(tuple, prompts)))
    if key not in _SETTLE_CALLS:
        _SETTLE_CALLS[key] = _settle_calls(pair, prompts, max_context)
    return [cloned(feeds) for feeds in _SETTLE_CALLS[key]]


CACHES = ("target_k", "target_v", "draft_k", "draft_v")


def cloned(feeds):
    """Copies of `_settle_round`'s feeds, the caches with the sink row a commit writes past them."""
    return {name: _new_cache(t.shape, t.dtype, t.device).copy_(t) if name in CACHES else t.clone()
            for name, t in feeds.items()}


def _settle_calls(pair, prompts, max_context):
    calls = []
    original = device_round._settle_round

    def recording(**feeds):
        calls.append(cloned(feeds))
        return original(**feeds)

    target, drafter = pair
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False))
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=max_context, verify_policy="fixed")
    device_round._settle_round = recording
    try:
        runtime.generate(prompts, GenerationConfig(max_new_tokens=40))
    finally:
        device_round._settle_round = original
    drafted = next(c for c in calls if "draft_new_key" in c)
    plain = next(c for c in calls if c["greedy"].shape[1] == 1)
    return drafted, plain


def other_data(feeds, seed):
    """The same inputs with other values where a round's data varies: which drafts match, who is live."""
    g = torch.Generator().manual_seed(seed)
    feeds = cloned(feeds)
    feeds["greedy"] = torch.where(torch.rand(feeds["greedy"].shape, generator=g) < 0.5, feeds["greedy"], 0)
    feeds["live"] = torch.rand(feeds["live"].shape, generator=g) < 0.5
    return feeds


def capturable(fn, feeds):
    names = list(feeds)
    return check_capturable(lambda *inputs: fn(**dict(zip(names, inputs))), list(feeds.values()),
                            [list(other_data(feeds, seed).values()) for seed in (1, 2)])


def _reads_the_count(**feeds):  # planted: a host read inside
    out = device_round._settle_round(**feeds)
    return out, int(out[:, 0].max())


def _nonzero_accept(**feeds):  # planted: the accepted drafts found by nonzero (a data-dependent shape)
    drafts, greedy = feeds["verify_ids"][:, 1:feeds["greedy"].shape[1]], feeds["greedy"]
    torch.nonzero(drafts != greedy[:, :drafts.shape[1]])
    return device_round._settle_round(**feeds)


def _mask_index(**feeds):  # planted: the live sequences' lengths picked by a boolean mask
    feeds["lens"][feeds["live"]] += 0
    return device_round._settle_round(**feeds)


def _host_tensor(**feeds):  # planted: a tensor made from host data inside
    feeds["lens"].add_(torch.tensor([0] * len(feeds["lens"])))
    return device_round._settle_round(**feeds)


@pytest.mark.parametrize("plant", [None, _reads_the_count, _nonzero_accept, _mask_index, _host_tensor],
                         ids=["bookkeeping", "planted item", "planted nonzero", "planted mask index",
                              "planted host tensor"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_round_bookkeeping_is_capturable(pair, batch, plant):
    """`_settle_round` on its real inputs (a drafted round's, with the drafter's rows to commit, and a
    plain step's near the limit), and on other data of the same shapes, issues only ops a CUDA graph
    holds (no host read, no data-dependent shape, no host data) and the same ops whatever the data.
    Each planted variant fails the check, naming its op."""
    for feeds in settle_calls(pair, PROMPTS[:batch]):
        if plant is None:
            ops = capturable(device_round._settle_round, feeds)
            assert {"index_copy_", "scatter_", "add_"} <= set(ops)  # it ran the real bookkeeping (commits, appends)
            assert ("cumprod" in ops) is ("draft_new_key" in feeds)  # (a plain step accepts no draft)
        else:
            with pytest.raises(EagleExportError, match="cannot be captured in a CUDA graph"):
                capturable(plant, feeds)


def _commit_one_slot_late(keys, values, out, starts, counts, live):  # planted: every row one slot late
    rows._write_rows(keys, values, out, starts + 1, counts, live)


def _commit_the_dead(keys, values, out, starts, counts, live):  # planted: a sequence not live written too
    rows._write_rows(keys, values, out, starts, counts, torch.ones_like(live))


def _commit_every_row(keys, values, out, starts, counts, live):  # planted: the uncommitted rows written too
    rows._write_rows(keys, values, out, starts, torch.full_like(counts, out[C.NEW_KEY].shape[3]), live)


def _commit_per_row(keys, values, out, starts, counts, live):
    """The commit's semantics, row by row on the host: row r < counts[b] of each live sequence b at starts[b] + r."""
    for b in range(len(starts)):
        for r in range(int(counts[b]) if live[b] else 0):
            for cache, name in ((keys, C.NEW_KEY), (values, C.NEW_VALUE)):
                cache[:, b, :, int(starts[b]) + r] = out[name][:, b, :, r]


@pytest.mark.parametrize("plant", [None, _commit_one_slot_late, _commit_the_dead, _commit_every_row],
                         ids=["commit", "planted: one slot late", "planted: a dead sequence written",
                              "planted: uncommitted rows written"])
@pytest.mark.parametrize("static", [False, True], ids=["contiguous", "view along S"])
def test_the_cache_commit_writes_the_committed_rows_and_nothing_else(static, plant):
    """`_write_rows` into caches made by the runtime (contiguous, or a view along S of a longer buffer as
    the static caches are), of new rows given as a view (as the drafter's are), equals the row-by-row
    commit bit for bit: rows < counts[b] of the live sequences at starts[b] on, every other slot as it was,
    slots past the view included, those of a dead sequence whose rows would run past the view too; and it
    runs the same ops, none a host read, whatever the data (a CUDA graph holds it). A cache without the
    sink row is refused before anything is written. Planted: a row one slot late, a dead sequence's rows
    or the uncommitted rows written; each fails the comparison."""
    g = torch.Generator().manual_seed(0)
    slots, width = 12, 5
    buffers = [_new_cache((2, 4, 3, 2 * slots if static else slots, 8), torch.float32, "cpu") for _ in "kv"]
    for full in buffers:
        full.normal_(generator=g)
    caches = [full[:, :, :, :slots] for full in buffers]
    out = {name: torch.randn(2, 4, 3, width + 3, 8, generator=g)[:, :, :, :width] for name in (C.NEW_KEY, C.NEW_VALUE)}
    starts, counts = torch.tensor([0, slots - width, 3, slots - 2]), torch.tensor([width, 2, 0, 3])
    live = torch.tensor([True, True, True, False])  # the dead one's rows would run past the view
    want = [full.clone() for full in buffers]
    _commit_per_row(*(w[:, :, :, :slots] for w in want), out, starts, counts, live)
    (plant or rows._write_rows)(*caches, out, starts, counts, live)
    assert all(torch.equal(full, w) for full, w in zip(buffers, want)) is (plant is None)
    if plant is None:
        check_capturable(rows._write_rows, [*caches, out, starts, counts, live],
                         [[*caches, out, starts, counts.flip(0), torch.tensor([False, True, True, False])]])
        plain = [torch.zeros(2, 4, 3, slots, 8) for _ in "kv"]
        with pytest.raises(EagleExportError, match="sink row"):
            rows._write_rows(*plain, out, starts, counts, live)
        assert not any(cache.any() for cache in plain)


def _keeps_its_ranges(arange) -> bool:
    """Whether [0, 5) stays the same tensor (the same memory) after 64 other lengths were asked for."""
    device = torch.device("cpu")
    first = arange(5, device)
    for n in range(1000, 1064):
        arange(n, device)
    return arange(5, device) is first


def test_the_ranges_a_captured_graph_reads_stay_alive():
    """A CUDA graph reads `_arange`'s tensors (the commit's rows, the next positions) by address without
    holding them, and eager calls (a drafter call over a prompt) ask for other lengths between its
    replays: every range stays made, at its address. Planted: a bounded cache (as before) lets one go."""
    assert _keeps_its_ranges(rows._arange)
    assert not _keeps_its_ranges(functools.lru_cache(maxsize=32)(lambda n, device: torch.arange(n, device=device)))


def _reads_the_first_id(nodes, token_probs):  # planted: the first draft's id read on the host
    out = device_round._drafts_read(nodes, token_probs)
    return out, int(nodes[0, 0])


@pytest.mark.parametrize("plant", [None, _reads_the_first_id], ids=["drafts read", "planted"])
def test_the_read_of_the_drafts_is_capturable_and_exact(plant):
    """`_drafts_read` (what goodput's choice reads) issues only ops a CUDA graph holds, and carries the
    joint probabilities (`tree.chain_reach`'s whole chain, to the bit) and the drafts' ids exactly, ids
    past 2^24 included (float32 would round them). Planted: a host read inside fails the check."""
    g = torch.Generator().manual_seed(0)
    nodes = torch.randint(0, 1 << 40, (3, DEPTH), generator=g)
    probs = torch.rand(3, DEPTH, generator=g)
    if plant is not None:
        with pytest.raises(EagleExportError, match="cannot be captured in a CUDA graph"):
            check_capturable(plant, [nodes, probs])
        return
    check_capturable(device_round._drafts_read, [nodes, probs], [[nodes.flip(0), probs.flip(1)]])
    read = device_round._drafts_read(nodes, probs).tolist()
    assert [row[:DEPTH] for row in read] == device_round.tree.chain_reach(probs)[:, -1].tolist()
    assert [[int(t) for t in row[DEPTH:]] for row in read] == nodes.tolist()


class _Counting(TorchFunctionMode):
    """Counts torch calls (every one is host time: an op's launch, a tensor's shape or address alike);
    a graph's replay counts as one, the work it replays eagerly on CPU as none: a GPU's host spends
    one launch on it."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))

    def capture(self, fn, inputs, warmup=None):
        with torch._C.DisableTorchFunction():
            replay, outputs = replay_eagerly(fn, inputs, warmup)
        self.captures = getattr(self, "captures", 0) + 1

        def counted():
            self.calls["replay"] += 1
            with torch._C.DisableTorchFunction():  # (uncounted, and fast)
                replay()
        return counted, outputs


class _CountingCalls(SpeculativeRuntime):
    """(drafted, torch calls) of every round that captured nothing."""

    def _round(self, state, live, policy=None, drafted=False):
        counting = self.backend.capture.__self__
        counting.calls.clear()
        captures = getattr(counting, "captures", 0)
        with counting:
            events = list(super()._round(state, live, policy, drafted))
        if getattr(counting, "captures", 0) == captures:
            self.rounds.append((drafted, Counter(counting.calls)))
        yield from events


class _EagerBookkeeping(_CountingCalls):  # planted: the bookkeeping run eagerly beside the captured graphs
    def _settle(self, state, out, drafter_rows, **kw):
        capture, self.backend.capture = self.backend.capture, None
        try:
            return super()._settle(state, out, drafter_rows, **kw)
        finally:
            self.backend.capture = capture


# Measured: 3 replays and the read, nothing else; a round that finishes a sequence 2 more (the live mask cloned and
# written, `_State.emit`). Was 24-25, with 9 copies, before the graphs read the round's buffers in place
# (`device_round.TARGET_BOUND`); 16, with 1 copy, before the drafter's graph wrote its drafts into the verify
# call's ids (`_RoundBuffers.into`); 15 before the live mask's list was the state's (`_State.alive`) and the
# 10 attribute reads went (`.device` in `_to`, the inputs' width in `TorchBackend._run`, `aux.dtype`, the
# caches' and buffers' addresses in `ShapeGraphs._feed`: a quiet call is its replay alone, `ShapeGraphs.quiet`).
CALLS_PER_DRAFTED_ROUND = 4
# Measured: what a drafted goodput round adds to a fixed one: the replay and the read of its drafts for
# the choice (`_chosen`). Was 3 before the policy took the live mask as the state's list (`live_as_list`:
# it read it from the tensor in observe).
GOODPUT_EXTRA_CALLS = 2


def _first_capture_binds(monkeypatch):
    """Planted: every call binds all its inputs, so the graphs read whatever tensors their first call had (the
    cost measurement's) and the round's buffers are copied into them."""
    original = ShapeGraphs.__call__
    monkeypatch.setattr(ShapeGraphs, "__call__", lambda self, feeds, bound=(), into=(): original(
        self, feeds, tuple(self.input_names), into))


def _copied_after_the_replay(monkeypatch):
    """Planted: the drafts copied into the verify call's ids by the host after the drafter's replay, as before."""
    original = ShapeGraphs.__call__

    def call(self, feeds, bound=(), into=()):
        outputs = original(self, feeds, bound)
        for name, dest in into:
            dest.copy_(outputs[self.output_names.index(name)])
        return outputs
    monkeypatch.setattr(ShapeGraphs, "__call__", call)


@pytest.mark.parametrize(("cls", "batch", "plant"), [(_CountingCalls, 1, None), (_CountingCalls, 3, None),
                                                     (_EagerBookkeeping, 1, None), (_CountingCalls, 1, _first_capture_binds),
                                                     (_CountingCalls, 1, _copied_after_the_replay)],
                         ids=["batch 1", "batch 3", "planted eager bookkeeping", "planted first capture binds",
                              "planted drafts copied after the replay"])
def test_a_captured_device_round_costs_the_host_a_few_calls(pair, monkeypatch, cls, batch, plant):
    """Host work of a drafted device round with its graphs captured, counted as torch calls at the Python
    level: three replays (drafter, target, bookkeeping), no copy (the drafter's graph writes its drafts
    into the verify call's ids, `_RoundBuffers.into`; the graphs read the round's buffers in place, bound
    by reference, even where the cost measurement's calls of the same shapes were captured first), one
    read; at most CALLS_PER_DRAFTED_ROUND, whatever the batch (171 before the bookkeeping was captured, 24
    before the buffers were bound, 16 with the drafts' copy, 15 with the live mask's read and 10 attribute reads). Rounds that
    captured a graph are not counted. Planted: the bookkeeping run eagerly; every call binding all its
    inputs (the first capture's tensors win: the measurement's); the drafts copied by the host after the
    drafter's replay."""
    if plant is not None:
        plant(monkeypatch)
    target, drafter = pair
    counting = _Counting()
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False), cuda_graphs=True,
                           capture=counting.capture)
    runtime = cls.for_models(backend, target, drafter, max_context=256, verify_policy="fixed")
    runtime.cost_curves(batch)  # (the measurement's calls first: graphs of every width over fresh tensors)
    runtime.rounds = []
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]][:batch]  # (their greedy tokens are made once for the file)
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=NEW))
    assert [r.tokens for r in results] == [greedy(target, p, NEW) for p in prompts]
    drafted = [calls for d, calls in runtime.rounds if d]
    assert len(drafted) > 5
    worst = max(drafted, key=lambda calls: sum(calls.values()))
    totals = sorted(sum(calls.values()) for calls in drafted)
    if cls is _EagerBookkeeping:
        assert sum(worst.values()) > 2 * CALLS_PER_DRAFTED_ROUND
        return
    if plant is _first_capture_binds:
        assert totals[len(totals) // 2] > CALLS_PER_DRAFTED_ROUND + 2 and backend.captured[None].copied_bound, totals
        return

    def few_calls():
        assert totals[len(totals) // 2] <= CALLS_PER_DRAFTED_ROUND and totals[-1] <= CALLS_PER_DRAFTED_ROUND + 2, worst
        assert worst["replay"] == 3 and worst["tolist"] == 1 and worst["copy_"] == 0, worst  # (the read)
    if plant is _copied_after_the_replay:
        with pytest.raises(AssertionError, match="copy_"):
            few_calls()
        return
    few_calls()
    assert all(g.copied_bound == 0 for g in backend.captured.values())
    writing = [dests for *_, dests in backend.captured[False].graphs.values() if dests]  # (the measurement's: none)
    assert len(writing) == 1 and writing[0][0] is runtime._round_buffers[batch].drafts


@pytest.mark.parametrize("plant", [None, _bound_never_copied], ids=["copied in", "planted: not copied in"])
def test_two_runtimes_over_one_backend_copy_their_own_buffers_in(pair, monkeypatch, plant):
    """Two runtimes over one backend's graphs, in turn: each has its own caches and round buffers, so the
    second's bound inputs are other tensors than the graphs were captured over, copied in (counted), and
    every stream decodes plain greedy decoding's tokens. Planted: a bound input given as another tensor
    than at capture not copied in (the graphs read the first runtime's stale buffers)."""
    if plant is not None:
        monkeypatch.setattr(ShapeGraphs, "_feed", plant)
    target, drafter = pair
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False), cuda_graphs=True,
                           capture=replay_eagerly)
    first, second = (SpeculativeRuntime.for_models(backend, target, drafter, max_context=96, verify_policy="fixed")
                     for _ in range(2))
    config = GenerationConfig(max_new_tokens=16)
    runs = [(first, [PROMPTS[1], PROMPTS[0]]), (second, [PROMPTS[3], PROMPTS[1]]), (first, [PROMPTS[0], PROMPTS[3]])]
    tokens = [[r.tokens for r in runtime.generate(prompts, config)] for runtime, prompts in runs]
    expected = [[greedy(target, p, 16) for p in prompts] for _, prompts in runs]
    if plant is not None:
        assert tokens != expected
        return
    assert tokens == expected
    assert all(g.copied_bound > 0 for g in backend.captured.values())


def test_a_drafter_graph_that_leaves_the_verify_ids_stale_fails_the_drafts_check(pair, monkeypatch):
    """The captured streams above (`run` with graphs) check at every drafter call that the verify call's ids
    hold the drafter graph's drafts (`RightDrafts`): stale drafts would still decode the target's tokens (a
    wrong draft is rejected), so the check is what sees them. Planted: the graph's copy into them not
    captured: the check fails at the first replay."""
    monkeypatch.setattr(ShapeGraphs, "_capture", _epilogue_skipped(ShapeGraphs._capture))
    prompts = prompts_for("fixed", 3)
    with pytest.raises(AssertionError, match="did not write"):
        run(pair, prompts, eos_config(pair, prompts), graphs=True)


def _drafts_detached(monkeypatch):
    """Planted: the host's drafts copied where the verify call does not read them."""
    original = device_round._RoundBuffers.__init__

    def init(self, *args):
        original(self, *args)
        self.drafts = self.drafts.clone()
    monkeypatch.setattr(device_round._RoundBuffers, "__init__", init)


@pytest.mark.parametrize("plant", [None, _drafts_detached], ids=["synthetic", "planted: drafts detached"])
def test_captured_rounds_verify_the_hosts_synthetic_drafts(pair, monkeypatch, plant):
    """Synthetic drafts are the host's: with the graphs captured, the drafter's call writes nothing into the
    verify call's ids (no `into`), the host's drafts are copied there and goodput reads its choice from
    them on the host: every round accepts all the oracle's drafts it verifies (K under the fixed policy),
    and the tokens are plain decoding's. Planted: the host's drafts copied elsewhere."""
    if plant is not None:
        plant(monkeypatch)
    target, drafter = pair
    prompts, config = [PROMPTS[1], PROMPTS[0]], GenerationConfig(max_new_tokens=12)
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False), cuda_graphs=True,
                           capture=replay_eagerly)
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=96, verify_policy="fixed")
    runtime.costs.verify_s[2], runtime.costs.draft_s[2] = ({n: cost for n in range(1, DEPTH + 2)} for cost in (1, 0.1))
    plain = [greedy(target, p, 12 + DEPTH + 1) for p in prompts]  # (the continuations: fp32, exact at any width)
    for policy in ("fixed", "goodput"):
        results = runtime.generate(prompts, config, verify_policy=policy,
                                   synthetic=SyntheticDrafts("oracle", plain, runtime.vocab_size))
        assert [r.tokens for r in results] == [tokens[:12] for tokens in plain]
        accepted = [(a, d) for r in results for a, d in zip(r.stats.accepted, r.stats.depths)]
        if plant is not None:
            assert {a for a, _ in accepted} != {DEPTH}
            return
        if policy == "fixed":
            assert {a for a, _ in accepted} == {DEPTH}
        else:  # (goodput drafts: the oracle's drafts pay on these costs)
            assert all(a == d for a, d in accepted) and max(accepted)[0] > 1


@pytest.mark.cuda
def test_the_captured_bookkeeping_on_a_gpu_gives_the_eager_tokens(pair):
    """On a GPU, the bookkeeping captured in a real CUDA graph beside the target's and the drafter's: the
    tokens of the eager device round on the same kernels (torch's: exact mode would bind the shared
    models to its kernels for the rest of the module), ragged batches of 1 and 3, two streams each (the
    second replays the first's graphs over the same buffers), under the fixed and the goodput policy (the
    tiny drafter's own low probabilities: k = 0 rounds, probes and catch-ups); no captured input of the
    bookkeeping's, nor of the target's and the drafter's, copied in (each is a buffer the graph was
    captured over, or the static caches: `device_round.TARGET_BOUND`)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    target, drafter = (m.to("cuda") for m in pair)
    try:
        for batch, policy in ((1, "fixed"), (3, "fixed"), (1, "goodput"), (3, "goodput")):
            prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]][:batch]
            tokens = {}
            for graphs in (False, True):
                backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                                       device="cuda", cuda_graphs=graphs, exact=False)
                chosen = Goodput(DEPTH, costs(batch)) if policy == "goodput" else policy
                runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=128,
                                                        verify_policy=chosen, static_cache=True)
                tokens[graphs] = [[r.tokens for r in runtime.generate(prompts, GenerationConfig(max_new_tokens=24))]
                                  for _ in range(2)]
            assert tokens[True] == tokens[False] and tokens[True][0] == tokens[True][1]
            assert all(len(t) == 24 for t in tokens[True][0])
            assert runtime._settle_graphs and all(g.copied_bound == 0 for g in runtime._settle_graphs.values())
            assert all(g.copied_bound == 0 for g in backend.captured.values())
    finally:
        for m in pair:
            m.to("cpu")


class _UncountedDrafts(RightDrafts):
    """`RightDrafts` whose replacing of the drafts (the test's work, not the runtime's) is not counted,
    and writes into the graph's own outputs (a captured drafter returns the same tensors every call);
    the drafter call itself is counted."""

    def _replace(self, out, feeds, into=()):
        with torch._C.DisableTorchFunction(), torch.inference_mode():  # (the backend's outputs are inference tensors)
            replaced = super()._replace(out, feeds, into)
            for name in (C.DRAFT_IDS, C.DRAFT_TOKEN_PROBS):
                out[name].copy_(replaced[name])
        return out


class _GeneralCountingCalls(_CountingCalls):  # planted: goodput on the general round
    def _device_rounds(self, state):
        return state.policy is None


@pytest.mark.parametrize("cls", [_CountingCalls, _GeneralCountingCalls], ids=["goodput", "planted general round"])
def test_a_captured_goodput_round_costs_the_host_what_a_fixed_one_does(pair, cls):
    """Host work of goodput's device rounds, graphs captured, in torch calls (`_Counting`): a drafted round
    (a confident drafter: every round drafts) makes a fixed round's and GOODPUT_EXTRA_CALLS more (the
    replay and read of its drafts for the choice, from the verify call's ids; 6 against 4 at batch 1 (7 while
    the policy read the live mask itself), 18 against 15 before the calls of `CALLS_PER_DRAFTED_ROUND` went, 248 on
    the general round); a k = 0 round (the confidence profile) a plain decoding step's (3: 2 replays, the read).
    Medians over the rounds that captured nothing. Planted: goodput on the general round."""
    target, drafter = pair
    prompts = [PROMPTS[1]]
    continuations = [p + greedy(target, p, 64) for p in prompts]

    def rounds(policy, profile, speculative=True, runtime_cls=_CountingCalls):
        counting = _Counting()
        backend = _UncountedDrafts(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                                   continuations=continuations, confident=profile, cuda_graphs=True,
                                   capture=counting.capture)
        runtime = runtime_cls.for_models(backend, target, drafter, max_context=256, verify_policy=policy)
        runtime.rounds = []
        results = runtime.generate(prompts, GenerationConfig(max_new_tokens=40), speculative=speculative)
        assert [r.tokens for r in results] == [greedy(target, p, 40) for p in prompts]
        read = [inputs[0] for g in runtime._read_graphs.values() for inputs, *_ in g.graphs.values()]
        if isinstance(policy, Goodput) and runtime_cls is _CountingCalls:  # (the drafts in the verify ids)
            assert read and all(nodes is runtime._round_buffers[1].drafts for nodes in read)
        return runtime.rounds

    def median(rounds, drafted):
        totals = sorted(sum(calls.values()) for d, calls in rounds if d is drafted)
        assert len(totals) > 3
        return totals[len(totals) // 2]

    always = lambda position: True  # noqa: E731
    fixed = median(rounds("fixed", always), True)
    goodput = median(rounds(Goodput(DEPTH, costs(1)), always, runtime_cls=cls), True)
    if cls is _GeneralCountingCalls:
        assert goodput > fixed + 5 * GOODPUT_EXTRA_CALLS, (goodput, fixed)
        return
    assert goodput <= fixed + GOODPUT_EXTRA_CALLS, (goodput, fixed)
    plain = median(rounds(None, always, speculative=False), False)
    k0 = median(rounds(Goodput(DEPTH, costs(1)), confident), False)
    assert k0 <= plain, (k0, plain)


class _CountingEagerCalls(SpeculativeRuntime):
    """(drafted, torch calls) of every round, eager (no graphs): the target's and the drafter's own calls
    included (the same in a plain step and a k = 0 round: one target call of one token)."""

    def _round(self, state, live, policy=None, drafted=False):
        counting = _Counting()
        with counting:
            events = list(super()._round(state, live, policy, drafted))
        self.rounds.append((drafted, sum(counting.calls.values())))
        yield from events


class _RowsAppendedEachRound(_CountingEagerCalls):  # planted: each k = 0 round appends its drafter row itself
    def _defers_rows(self, state, policy, drafted):
        return False


@pytest.mark.parametrize("cls", [_CountingEagerCalls, _RowsAppendedEachRound], ids=["goodput", "planted"])
@pytest.mark.parametrize("batch", [1, 3])
def test_an_eager_k0_round_makes_the_torch_calls_of_a_plain_step(pair, cls, batch):
    """issue 44: a k = 0 round costs what a plain step costs. Without CUDA graphs (the CPU) the device
    round's bookkeeping runs eagerly, op by op; a goodput k = 0 round's drafter row (the target's greedy id
    and aux state) waits by reference and is appended with the other k = 0 rounds' in one batch before the
    rows are next read (`DeviceRounds._defers_rows`), so the round makes no more torch calls than a plain
    decoding step on the device round (medians over the rounds; a round that grows the caches makes more,
    in either stream). Greedy output stays the target's. Planted: each k = 0 round appending its own row
    in the bookkeeping, as it did (17 calls more on the tiny pair)."""
    target, _ = pair
    runtime, _, prompts = goodput_stream(pair, cls, batch, RightDrafts, max_context=256)
    medians = {}
    for speculative in (False, True):
        runtime.rounds = []
        results = runtime.generate(prompts, GenerationConfig(max_new_tokens=40), speculative=speculative)
        assert [r.tokens for r in results] == [greedy(target, p, 40) for p in prompts]
        plain = sorted(n for drafted, n in runtime.rounds if not drafted)
        assert len(plain) >= 8  # (the confidence profile: k = 0 rounds between probes, 8 apart)
        medians[speculative] = plain[len(plain) // 2]
    plain, k0 = medians[False], medians[True]
    assert (k0 > plain + 8) if cls is _RowsAppendedEachRound else (k0 <= plain), (k0, plain)


class _CountingSettle(SpeculativeRuntime):
    """Torch calls of each eager bookkeeping call (`_settle`) of a call of the root alone (width 1)."""

    def _settle(self, state, out, drafter_rows, **kw):
        counting = _Counting()
        with counting:
            settled = super()._settle(state, out, drafter_rows, **kw)
        if out[C.GREEDY_IDS].shape[1] == 1:
            self.settles.append(sum(counting.calls.values()))
        return settled


def _accepting_over_no_drafts(monkeypatch):
    """Planted: the plain step's bookkeeping as it was, acceptance's ops over no drafts and the read
    [accepted, greedy] made by a concatenation."""
    original = device_round._settle_round

    def settle(**feeds):
        b = len(feeds["lens"])
        accepted = device_round.greedy_accepted_path(feeds["verify_ids"][:, 1:1], None, feeds["greedy"])[0]
        torch.where(feeds["live"].view(b, 1), accepted.view(b, 1) + 1, 0).view(b)
        out = original(**feeds)
        return torch.cat([accepted.view(b, 1), out], dim=1)[:, 1:]
    monkeypatch.setattr(device_round, "_settle_round", settle)


# Measured: an eager plain step's bookkeeping at batch 3, 49 (50 the first): the feeds' attribute reads, the
# target's commit (_write_rows: 39 calls, 8 of them ops, the others views and reads of the caches' layout; its
# gather + where + scatter form made 26, 12 of them ops, and took longer: scripts/bench_write_rows.py), lens,
# the next root and positions; 64 with acceptance's ops over no drafts and the concatenated read, as before.
PLAIN_SETTLE_CALLS = 50


@pytest.mark.parametrize("plant", [None, _accepting_over_no_drafts], ids=["plain step", "planted"])
def test_an_eager_plain_steps_bookkeeping_runs_no_acceptance(pair, monkeypatch, plant):
    """A call of the root alone accepts nothing: its eager bookkeeping (a plain decoding step's, a k = 0
    round's) makes at most PLAIN_SETTLE_CALLS torch calls, none of them acceptance's, and its read is the
    greedy ids alone. Greedy output stays the target's. Planted: acceptance's ops over no drafts and the
    concatenated read, as before."""
    if plant is not None:
        plant(monkeypatch)
    target, drafter = pair
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False))
    runtime = _CountingSettle.for_models(backend, target, drafter, max_context=256)
    runtime.settles = []
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]]
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=16), speculative=False)
    assert [r.tokens for r in results] == [greedy(target, p, 16) for p in prompts]
    assert len(runtime.settles) >= 15
    if plant is not None:
        assert max(runtime.settles) > PLAIN_SETTLE_CALLS + 5, runtime.settles
    else:
        assert max(runtime.settles) <= PLAIN_SETTLE_CALLS, runtime.settles
