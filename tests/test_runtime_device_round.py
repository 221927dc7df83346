"""The device round (`SpeculativeRuntime._device_round`): a greedy chain under the fixed policy runs its
round on the device with one host read, and gives the general round's tokens, statistics, drafts and
caches, bit for bit, and plain greedy decoding's tokens, with its bookkeeping run eagerly or replayed
from a captured graph (on CPU, a capture that replays eagerly into the same buffers); the bookkeeping is
capturable (no host read, no data-dependent shape), and a captured round's host work is a few calls."""

from collections import Counter

import pytest
import torch
from test_cuda_graphs import replay_eagerly
from test_runtime import PROMPTS, _DeviceOutputs, _OnDevice
from tiny_models import write_tiny_drafter, write_tiny_target
from torch.overrides import TorchFunctionMode

import eagle_export.runtime.runtime as runtime_module
from eagle_export.errors import EagleExportError
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import TorchBackend
from eagle_export.runtime.cuda_graphs import check_capturable
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


def run(pair, prompts, config, general=False, max_context=96, graphs=False):
    """(results, drafts per drafter call, the caches at the end) of a fixed-policy stream, on the device
    round or (general) on the general one; continuations make drafts right at 4 positions of 5.
    graphs: every graph call and the device round's bookkeeping replayed from captures (static caches)."""
    target, drafter = pair
    continuations = [p + greedy(target, p, NEW + DEPTH + 2) for p in prompts]
    kw = {"cuda_graphs": True, "capture": replay_eagerly} if graphs else {}
    backend = RightDrafts(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                          continuations=continuations, **kw)
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


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("batch", [1, 3])
def test_device_round_equals_the_general_round_and_plain_greedy(pair, batch, graphs):
    """Ragged prompts, an EOS inside the run: tokens, finish reasons, accepted counts per round, every
    drafter call's drafts and the whole target and drafter caches (rows past a sequence's length
    included: rejected rows are never written) equal the general round's, and the tokens plain
    greedy decoding's; with the graphs captured, the general round's through the same graphs."""
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]][:batch]
    config = eos_config(pair, prompts)
    device = run(pair, prompts, config, graphs=graphs)
    general = run(pair, prompts, config, general=True, graphs=graphs)
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


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "captured"])
def test_device_round_near_the_context_limit(pair, graphs):
    """The last rounds near the context limit are plain steps on the device: the general round's tokens."""
    prompts = [PROMPTS[1], PROMPTS[0]]
    config = GenerationConfig(max_new_tokens=40)
    device, general = (run(pair, prompts, config, general, max_context=32, graphs=graphs)[0]
                       for general in (False, True))
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


# ------------------------------------------------------------ the bookkeeping, captured

_SETTLE_CALLS = {}


def settle_calls(pair, prompts, max_context=28):
    """The inputs of `_settle_round`'s calls in a fixed-policy stream that ends near the context limit
    (clones, as they were before the call): a drafted round's and a plain step's (kept per prompts)."""
    key = (id(pair[1]), tuple(map(tuple, prompts)))
    if key not in _SETTLE_CALLS:
        _SETTLE_CALLS[key] = _settle_calls(pair, prompts, max_context)
    return [{name: t.clone() for name, t in feeds.items()} for feeds in _SETTLE_CALLS[key]]


def _settle_calls(pair, prompts, max_context):
    calls = []
    original = runtime_module._settle_round

    def recording(**feeds):
        calls.append({name: t.clone() for name, t in feeds.items()})
        return original(**feeds)

    target, drafter = pair
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False))
    runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=max_context, verify_policy="fixed")
    runtime_module._settle_round = recording
    try:
        runtime.generate(prompts, GenerationConfig(max_new_tokens=40))
    finally:
        runtime_module._settle_round = original
    drafted = next(c for c in calls if "draft_new_key" in c)
    plain = next(c for c in calls if c["greedy"].shape[1] == 1)
    return drafted, plain


def other_data(feeds, seed):
    """The same inputs with other values where a round's data varies: which drafts match, who is live."""
    g = torch.Generator().manual_seed(seed)
    feeds = {name: t.clone() for name, t in feeds.items()}
    feeds["greedy"] = torch.where(torch.rand(feeds["greedy"].shape, generator=g) < 0.5, feeds["greedy"], 0)
    feeds["live"] = torch.rand(feeds["live"].shape, generator=g) < 0.5
    return feeds


def capturable(fn, feeds):
    names = list(feeds)
    return check_capturable(lambda *inputs: fn(**dict(zip(names, inputs))), list(feeds.values()),
                            [list(other_data(feeds, seed).values()) for seed in (1, 2)])


def _reads_the_count(**feeds):  # planted: a host read inside
    out = runtime_module._settle_round(**feeds)
    return out, int(out[:, 0].max())


def _nonzero_accept(**feeds):  # planted: the accepted drafts found by nonzero (a data-dependent shape)
    drafts, greedy = feeds["verify_ids"][:, 1:feeds["greedy"].shape[1]], feeds["greedy"]
    torch.nonzero(drafts != greedy[:, :drafts.shape[1]])
    return runtime_module._settle_round(**feeds)


def _mask_index(**feeds):  # planted: the live sequences' lengths picked by a boolean mask
    feeds["lens"][feeds["live"]] += 0
    return runtime_module._settle_round(**feeds)


def _host_tensor(**feeds):  # planted: a tensor made from host data inside
    feeds["lens"].add_(torch.tensor([0] * len(feeds["lens"])))
    return runtime_module._settle_round(**feeds)


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
            ops = capturable(runtime_module._settle_round, feeds)
            assert {"scatter_", "gather", "cat"} <= set(ops)  # it ran the real bookkeeping
            assert ("cumprod" in ops) is ("draft_new_key" in feeds)  # (a plain step accepts no draft)
        else:
            with pytest.raises(EagleExportError, match="cannot be captured in a CUDA graph"):
                capturable(plant, feeds)


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
    def _settle(self, state, out, drafter_rows):
        capture, self.backend.capture = self.backend.capture, None
        try:
            return super()._settle(state, out, drafter_rows)
        finally:
            self.backend.capture = capture


# Measured: 9 copies, 3 replays, the read, the live mask's, 11 attribute reads; a round that finishes a
# sequence 2 more (the live mask cloned and written, `_State.emit`).
CALLS_PER_DRAFTED_ROUND = 25


@pytest.mark.parametrize(("cls", "batch"), [(_CountingCalls, 1), (_CountingCalls, 3), (_EagerBookkeeping, 1)],
                         ids=["batch 1", "batch 3", "planted eager bookkeeping"])
def test_a_captured_device_round_costs_the_host_a_few_calls(pair, cls, batch):
    """Host work of a drafted device round with its graphs captured, counted as torch calls at the Python
    level: three replays (drafter, target, bookkeeping), the copies of the small inputs into the graphs'
    static ones and of the drafts into the verify call's ids, one read, and attribute reads; at most
    CALLS_PER_DRAFTED_ROUND, whatever the batch (171 before the bookkeeping was captured). Rounds that
    captured a graph are not counted. Planted: the bookkeeping run eagerly."""
    target, drafter = pair
    counting = _Counting()
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False), cuda_graphs=True,
                           capture=counting.capture)
    runtime = cls.for_models(backend, target, drafter, max_context=256, verify_policy="fixed")
    runtime.rounds = []
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]][:batch]  # (their greedy tokens are made once for the file)
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=NEW))
    assert [r.tokens for r in results] == [greedy(target, p, NEW) for p in prompts]
    drafted = [calls for d, calls in runtime.rounds if d]
    assert len(drafted) > 5
    worst = max(drafted, key=lambda calls: sum(calls.values()))
    if cls is _EagerBookkeeping:
        assert sum(worst.values()) > 2 * CALLS_PER_DRAFTED_ROUND
        return
    totals = sorted(sum(calls.values()) for calls in drafted)
    assert totals[len(totals) // 2] <= CALLS_PER_DRAFTED_ROUND and totals[-1] <= CALLS_PER_DRAFTED_ROUND + 2, worst
    assert worst["replay"] == 3 and worst["tolist"] == 2, worst  # (the live mask's, on the host, and the read)


@pytest.mark.cuda
def test_the_captured_bookkeeping_on_a_gpu_gives_the_eager_tokens(pair):
    """On a GPU, the bookkeeping captured in a real CUDA graph beside the target's and the drafter's: the
    tokens of the eager device round on the same kernels (torch's: exact mode would bind the shared
    models to its kernels for the rest of the module), ragged batches of 1 and 3, two streams each (the
    second replays the first's graphs over the same buffers); no captured input copied in (every one is
    a buffer the graph was captured with)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA GPU")
    target, drafter = (m.to("cuda") for m in pair)
    try:
        for batch in (1, 3):
            prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]][:batch]
            tokens = {}
            for graphs in (False, True):
                backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, DEPTH, False),
                                       device="cuda", cuda_graphs=graphs, exact=False)
                runtime = SpeculativeRuntime.for_models(backend, target, drafter, max_context=128,
                                                        verify_policy="fixed", static_cache=True)
                tokens[graphs] = [[r.tokens for r in runtime.generate(prompts, GenerationConfig(max_new_tokens=24))]
                                  for _ in range(2)]
            assert tokens[True] == tokens[False] and tokens[True][0] == tokens[True][1]
            assert all(len(t) == 24 for t in tokens[True][0])
            assert runtime._settle_graphs and all(g.copied_bound == 0 for g in runtime._settle_graphs.values())
    finally:
        for m in pair:
            m.to("cpu")
