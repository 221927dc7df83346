"""The runtime's draft-verify loop: lossless greedy, exact rejection sampling, and its edge cases."""

import statistics

import pytest
import torch
from random_policy import RandomDepth
from random_tree import RandomTrees
from scipy.stats import chisquare
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.builder.recipe import parse_recipe
from eagle_export.engine.engine import engine_profiles
from eagle_export.errors import EagleExportError
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.models import contract as C
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.runtime.backends import TensorRTBackend, TorchBackend, write_into
from eagle_export.runtime.runtime import GenerationConfig, SpeculativeRuntime
from eagle_export.speculation.eager import speculative_generate
from eagle_export.speculation.tree import TreeShape

pytestmark = pytest.mark.usefixtures("no_grad")
PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [42], [3, 3, 3, 3]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "qwen2"), aux_layer_ids=(1, 3, 4))


@pytest.fixture(scope="module", params=["3", "3.1"])
def drafter(request, tmp_path_factory, target):
    return load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("d"), request.param), target=target)


def make_runtime(target, drafter, depth, max_context=256, backend_cls=TorchBackend, verify_policy="goodput",
                 static_cache=None, **kw):
    backend = backend_cls(TargetGraph(target, True), UnrolledDrafter(drafter, depth, False),
                          UnrolledDrafter(drafter, depth, True), **kw)
    return SpeculativeRuntime.for_models(backend, target, drafter, max_context=max_context,
                                         verify_policy=verify_policy, static_cache=static_cache)


class PlantedDrafts(TorchBackend):
    """Replaces the drafter's proposals with the target's true greedy continuation, corrupted at
    random: acceptance is high, so multi-token accepts, commits and rollbacks all get exercised."""

    def __init__(self, *graphs, continuations, error_rate=0.25, seed=0, **kw):
        super().__init__(*graphs, **kw)
        self.continuations, self.error_rate = continuations, error_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.cache_slots = set()  # the cache sizes the drafter was given

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        self.cache_slots.add(feeds[C.PAST_KEY].shape[3])
        out = super().drafter(feeds, sampling, bound)
        first = feeds[C.CACHE_LENS] + feeds[C.NUM_VALID] + 1  # position of draft 1
        drafts = out[C.DRAFT_IDS].clone()
        for b, full in enumerate(self.continuations):
            for i in range(drafts.shape[1]):
                pos = int(first[b]) + i
                if pos < len(full) and torch.rand(1, generator=self.rng) > self.error_rate:
                    drafts[b, i] = full[pos]
        out[C.DRAFT_IDS] = drafts
        return write_into(out, into)  # (its own drafts: the caller's copy of them, `Backend.drafter`)


class RecordedDrafts(TorchBackend):
    """The drafter graph as it is, each call's drafts [B,K] (target ids) recorded."""

    def __init__(self, *graphs, **kw):
        super().__init__(*graphs, **kw)
        self.calls = []

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        out = super().drafter(feeds, sampling, bound, into)
        self.calls.append(out[C.DRAFT_IDS].cpu().clone())
        return out


@pytest.mark.parametrize("batch", [1, 4])
def test_each_rounds_drafts_and_accepted_count_are_the_eager_loops(target, drafter, batch):
    """Greedy output cannot see a wrong drafter cache (a row written at the wrong slot, a length not
    advanced or rolled back right): drafts only get worse. The eager loop (speculation/eager.py)
    keeps the drafter's cache its own plain way, so every round's drafts and accepted count must be
    its own, sequence by sequence, at batch 1 and in a ragged batch."""
    depth, new = 3, 20
    runtime = make_runtime(target, drafter, depth, backend_cls=RecordedDrafts, verify_policy="fixed")
    prompts = PROMPTS[:batch]
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=new))
    calls = runtime.backend.calls
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        eager = speculative_generate(target, drafter, prompt, new, depth)
        assert result.tokens == eager.tokens[:new]
        assert result.stats.accepted == eager.accepted, i
        assert [calls[r][i].tolist() for r in range(eager.rounds)] == eager.drafts, i  # sequence i is in every call
        assert len(set(map(tuple, eager.drafts))) > 1  # the drafts change with what is cached: not vacuous


@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_is_lossless_ragged_batches(target, drafter, depth, batch):
    runtime = make_runtime(target, drafter, depth)
    prompts = PROMPTS[:batch]
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=24))
    for prompt, result in zip(prompts, results):
        assert result.tokens == target.generate_greedy(prompt, 24)
        assert result.finish_reason == "length" and result.stats.new_tokens == 24


@pytest.mark.parametrize("depth", [2, 5])
def test_lossless_with_high_acceptance(target, drafter, depth):
    expected = [p + target.generate_greedy(p, 40) for p in PROMPTS]
    runtime = make_runtime(target, drafter, depth, backend_cls=PlantedDrafts, continuations=expected,
                           verify_policy="fixed")
    results = runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=40))
    for prompt, full, result in zip(PROMPTS, expected, results):
        assert result.tokens == full[len(prompt):]
        assert result.stats.tau > 1.5  # drafts were really accepted, several per round
        rates = result.stats.acceptance_by_depth(depth)
        assert len(rates) == depth and all(0.0 <= r <= 1.0 for r in rates)
    autoregressive = runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=40), speculative=False)
    assert [r.tokens for r in autoregressive] == [r.tokens for r in results]


@pytest.mark.parametrize(("batch", "seed"), [(1, 0), (4, 1)])
def test_lossless_whatever_depth_a_policy_chooses(target, drafter, seed, batch):
    """Random policies: rounds without a drafter call (so the drafter catches up on several plain
    steps' rows at once), k = 0 after drafting, and every k up to K, in random order; the caches
    grow as they go (in steps of 8 slots here)."""
    depth = 4
    prompts = PROMPTS[:batch]
    expected = [p + target.generate_greedy(p, 40) for p in prompts]
    policy = RandomDepth(depth, seed=seed)
    runtime = make_runtime(target, drafter, depth, backend_cls=PlantedDrafts, continuations=expected,
                           error_rate=0.3, seed=seed, verify_policy=policy)
    runtime.cache_step = 8
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=40))
    assert [r.tokens for r in results] == [full[len(p):] for p, full in zip(prompts, expected)]
    assert len(runtime.backend.cache_slots) >= 4 and max(runtime.backend.cache_slots) <= 40 + 11 + depth + 1
    assert {None, 0, depth} <= set(policy.chosen)  # plain steps, k = 0 after drafting, and all K drafts
    for r in results:
        assert len(r.stats.depths) == r.stats.rounds and max(r.stats.accepted) >= 2
        assert all(a <= k for a, k in zip(r.stats.accepted, r.stats.depths))
        assert r.stats.draft_calls == sum(c is not None for c in policy.chosen[:r.stats.rounds])


class TorchTrees(RandomTrees, TorchBackend):
    pass


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize(("batch", "policy"), [(1, "fixed"), (2, "fixed"), (2, "random"), (2, "goodput")])
def test_greedy_trees_are_lossless_whatever_is_proposed(target, drafter, kind, batch, policy):
    """Random trees (static: one shape per round for the batch; dynamic: one per sequence) of 1..12
    nodes, their tokens the target's own greedy tokens or random ones: the output is the target's
    greedy output, and several tokens per round are accepted, along paths through any sibling."""
    depth = 4
    prompts = PROMPTS[1:1 + batch]
    expected = [p + target.generate_greedy(p, 40) for p in prompts]
    runtime = make_runtime(target, drafter, depth, backend_cls=TorchTrees, continuations=expected, kind=kind,
                           seed=batch, verify_policy=RandomDepth(depth, seed=batch) if policy == "random" else policy)
    runtime.cache_step = 8
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=40))
    assert [r.tokens for r in results] == [full[len(p):] for p, full in zip(prompts, expected)]
    assert max(runtime.backend.widths) > depth  # wider than any chain of this depth
    for r in results:
        assert all(a <= k for a, k in zip(r.stats.accepted, r.stats.depths))
        # (goodput, costed at the trees' verify widths, mostly stops drafting for random-confidence trees)
        assert r.stats.tau > 1.5 or policy == "goodput"


def test_eos_inside_an_accepted_draft_ends_the_sequence_there(target, drafter):
    full = PROMPTS[0] + target.generate_greedy(PROMPTS[0], 30)
    eos = full[len(PROMPTS[0]) + 6]  # a token the target emits mid-way
    runtime = make_runtime(target, drafter, 4, backend_cls=PlantedDrafts, continuations=[full], error_rate=0.0,
                           verify_policy="fixed")
    [result] = runtime.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=30, eos_ids=(eos,)))
    generated = full[len(PROMPTS[0]):]
    assert result.tokens == generated[:generated.index(eos) + 1]
    assert result.finish_reason == "eos"
    assert result.stats.accepted and max(result.stats.accepted) >= 2  # the EOS arrived inside a draft


@pytest.mark.parametrize("max_context", [14, 17, 19])
def test_context_limit_reached_mid_round(target, drafter, max_context):
    """Rounds of K+1 stop fitting before the limit; the tail is decoded token by token, exactly."""
    prompt = PROMPTS[1]  # 11 tokens
    full = prompt + target.generate_greedy(prompt, 20)
    runtime = make_runtime(target, drafter, 4, max_context=max_context, backend_cls=PlantedDrafts,
                           continuations=[full], error_rate=0.0,
                           verify_policy="fixed")
    [result] = runtime.generate([prompt], GenerationConfig(max_new_tokens=20))
    assert result.tokens == full[len(prompt):max_context]
    assert result.finish_reason == "context"


class ProfileChecked(TorchBackend):
    """Checks every graph call's dynamic input shapes against the TensorRT profile a TensorRTBackend
    would pick for it: what the runtime feeds must fit the engines the build computes."""

    def __init__(self, *graphs, recipe):
        super().__init__(*graphs)
        self.profiles = {graph: engine_profiles(self.graphs[key][1], recipe.speculation, recipe["profiles"], graph)
                         for graph, key in (("target", None), ("drafter", False))}
        self.past_slots = {0: set(), 1: set()}  # profile -> cache sizes fed
        self.target_tokens = {0: set(), 1: set()}  # profile -> target call widths
        self.verify_width = self.profiles["target"][1][C.INPUT_IDS][2][1]

    def _check(self, graph, feeds):
        index = TensorRTBackend._profile(self, feeds, graph)
        self.past_slots[index].add(feeds[C.PAST_KEY].shape[3])
        if graph == "target":
            self.target_tokens[index].add(feeds[C.INPUT_IDS].shape[1])
        for name, (lo, _, hi) in self.profiles[graph][index].items():
            shape = tuple(feeds[name].shape)
            assert all(a <= s <= b for a, s, b in zip(lo, shape, hi)), \
                f"{graph} profile {index}: {name} {shape} outside {lo}..{hi}"

    def target(self, feeds, need_logits=False, bound=()):
        self._check("target", feeds)
        return super().target(feeds, need_logits, bound)

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        self._check("drafter", feeds)
        return super().drafter(feeds, sampling, bound, into)


@pytest.mark.parametrize("max_context", [40, 70])  # below and above one cache_step (64)
def test_every_call_fits_the_engine_profiles_up_to_the_context_limit(target, drafter, max_context):
    """Prompts up to max_context - 1 tokens: caches grow in cache_step slots up to max_context, and
    every shape, prefill and decode, lies inside the profiles built from profiles.context.max."""
    depth = 4
    recipe = parse_recipe(f"target: t\ndrafter: d\ndepth: {depth}\nprofiles:\n  batch: {{min: 1, opt: 1, max: 2}}\n"
                          f"  context: {{min: 1, opt: 16, max: {max_context}}}\n")
    runtime = make_runtime(target, drafter, depth, max_context=max_context, backend_cls=ProfileChecked,
                           recipe=recipe, verify_policy="fixed")
    longest = [(7 * i) % 90 + 1 for i in range(max_context - 1)]
    results = runtime.generate([longest, PROMPTS[1]], GenerationConfig(max_new_tokens=max_context))
    assert results[0].finish_reason == "context" and results[1].finish_reason == "context"
    assert max_context in runtime.backend.past_slots[0]  # the prefill profile saw a full cache


class ProfileCheckedTrees(RandomTrees, ProfileChecked):
    pass


def test_tree_verify_calls_fit_the_decode_profile_built_for_the_trees_width(target, drafter):
    depth, nodes = 4, 12
    recipe = parse_recipe("target: t\ndrafter: d\nprofiles:\n  batch: {min: 1, opt: 1, max: 2}\n"
                          "  context: {min: 1, opt: 16, max: 64}\n"
                          f"speculation: {{kind: dynamic_tree, top_k: 4, depth: {depth}, nodes: {nodes}}}\n")
    prompts = PROMPTS[:2]
    expected = [p + target.generate_greedy(p, 30) for p in prompts]
    runtime = make_runtime(target, drafter, depth, max_context=64, backend_cls=ProfileCheckedTrees, recipe=recipe,
                           continuations=expected, max_nodes=nodes, verify_policy="fixed")
    results = runtime.generate(prompts, GenerationConfig(max_new_tokens=30))
    assert [r.tokens for r in results] == [full[len(p):] for p, full in zip(prompts, expected)]
    assert max(runtime.backend.target_tokens[1]) > depth + 1  # verify calls wider than a chain's, on profile 1


def test_empty_prompt_and_prompt_past_the_context_are_clear_errors(target, drafter):
    runtime = make_runtime(target, drafter, 2, max_context=16)
    with pytest.raises(EagleExportError, match="prompt 1 is empty"):
        runtime.generate([[1, 2], []], GenerationConfig())
    with pytest.raises(EagleExportError, match="prompt 0 has 16 tokens, the context limit is 16") as e:
        runtime.generate([list(range(16))], GenerationConfig())
    assert "profiles.context.max" in e.value.fix


class LetterTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize("field, value, problem", [
    ("max_new_tokens", -1, "max_new_tokens is -1"), ("max_new_tokens", 0, "max_new_tokens is 0"),
    ("max_new_tokens", 2.5, "max_new_tokens is 2.5"), ("temperature", float("nan"), "temperature is nan"),
    ("temperature", -0.5, "temperature is -0.5"), ("temperature", float("inf"), "temperature is inf"),
    ("top_p", 0.0, "top_p is 0.0"), ("top_p", -1.0, "top_p is -1.0"), ("top_p", 1.5, "top_p is 1.5"),
    ("top_p", float("nan"), "top_p is nan"), ("stop_strings", ("",), "empty string"),
    ("stop_strings", "###", "single string"), ("eos_ids", (-1,), "not token ids"), ("seed", "x", "seed is"),
])
def test_generation_config_refuses_nonsense(field, value, problem):
    with pytest.raises(EagleExportError, match=problem) as err:
        GenerationConfig(**{field: value})
    assert err.value.fix


def test_prompt_ids_outside_the_vocabulary_are_refused(target, drafter):
    runtime = make_runtime(target, drafter, 2)
    vocab = target.config.vocab_size
    for prompt, problem in (([5, -1, 7], "token id -1"), ([5, vocab], f"token id {vocab}"),
                            ([5, 2.0], "not a list of token ids"), ("hello", "not a list of token ids")):
        with pytest.raises(EagleExportError, match=problem):
            runtime.generate([[3, 4], prompt], GenerationConfig(max_new_tokens=2))
    assert len(runtime.generate([[5, vocab - 1]], GenerationConfig(max_new_tokens=2))[0].tokens) == 2


def test_stop_string_inside_an_accepted_draft(target, drafter):
    full = PROMPTS[0] + target.generate_greedy(PROMPTS[0], 30)
    generated = full[len(PROMPTS[0]):]
    stop = LetterTokenizer().decode(generated[7:9])
    runtime = make_runtime(target, drafter, 4, backend_cls=PlantedDrafts, continuations=[full], error_rate=0.0,
                           verify_policy="fixed")
    runtime.tokenizer = LetterTokenizer()
    [result] = runtime.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=30, stop_strings=(stop,)))
    text = LetterTokenizer().decode(generated)
    assert result.finish_reason == "stop"
    assert result.text == text[:text.index(stop)]
    assert LetterTokenizer().decode(result.tokens).endswith(stop)


def test_streaming_yields_the_same_tokens_round_by_round(target, drafter):
    runtime = make_runtime(target, drafter, 3)
    events = list(runtime.stream(PROMPTS, GenerationConfig(max_new_tokens=10)))
    for i, prompt in enumerate(PROMPTS):
        mine = [e for e in events if e.index == i]
        assert sum((e.tokens for e in mine), []) == target.generate_greedy(prompt, 10)
        assert mine[-1].finish_reason == "length" and all(e.finish_reason is None for e in mine[:-1])
        # the last event carries the sequence's stats (there is no runtime.last_stats to read)
        assert mine[-1].stats.new_tokens == 10 and mine[-1].stats.rounds >= 1
        assert all(e.stats is None for e in mine[:-1])
    assert runtime.timings.draft > 0 and runtime.timings.verify > 0 and not hasattr(runtime, "last_stats")


def test_plain_rounds_are_the_rounds_without_a_drafter_call(target, drafter):
    """The runtime times the rounds that call no drafter, so bench can hold a speculative stream's k = 0
    round against a plain decoding step: plain decoding's steps all count, a fixed policy's drafted
    rounds none, and its last steps near the context limit do."""
    runtime = make_runtime(target, drafter, 3)
    runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=10), speculative=False)
    rounds = runtime.timings.plain_round_s
    assert len(rounds) == 9 and min(rounds) > 0  # the prefill gives token 1
    runtime.generate(PROMPTS, GenerationConfig(max_new_tokens=10), verify_policy="fixed")
    assert runtime.timings.plain_round_s == []
    near = make_runtime(target, drafter, 3, max_context=16)  # prompt 1 (11 tokens) has 5 slots: no full round fits
    result = near.generate(PROMPTS[1:2], GenerationConfig(max_new_tokens=10), verify_policy="fixed")
    stats = result[0].stats  # tokens: the prefill's, each drafted round's accepted + 1, one per plain step
    assert len(near.timings.plain_round_s) == stats.new_tokens - 1 - sum(a + 1 for a in stats.accepted) > 0


# ---------------------------------------------------------------- rejection sampling

VOCAB = 6


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("v6")
    target = load_target(write_tiny_target(root / "t", "llama", vocab_size=VOCAB, seed=3), aux_layer_ids=(1, 3, 4))
    with torch.no_grad():  # peaked, distinct distributions, so a wrong sampler is visible
        target.lm_head.weight.mul_(60)
    drafter = load_drafter(write_tiny_drafter(root / "d", "3.1", vocab=VOCAB, draft_vocab=VOCAB, seed=4),
                           target=target)
    return target, drafter


def target_joint(target, prompt, temperature):
    """Exact P(t1, t2 | prompt) under the target at `temperature`."""
    def next_probs(ids):
        k, v = target.empty_cache(1, 0)
        logits, *_ = target(torch.tensor([ids]), torch.arange(len(ids))[None], k, v, torch.zeros(1, dtype=torch.long))
        return torch.softmax(logits[0, -1].double() / temperature, -1)
    p1 = next_probs(prompt)
    return torch.stack([p1[a] * next_probs(prompt + [a]) for a in range(VOCAB)]).flatten()


class AcceptEverything(SpeculativeRuntime):
    def _rejection_sample(self, state, out, nodes, parents, valid, draft_probs, live):  # the planted bug
        p = self._target_probs(state, out[C.LOGITS])
        bonus = torch.multinomial(p[:, self.depth], 1, generator=state.rng)[:, 0]
        path = torch.arange(self.depth).expand(len(nodes), -1)
        return torch.full((len(nodes),), self.depth, dtype=torch.int64), path, bonus


class AcceptFirstChildren(SpeculativeRuntime):
    def _rejection_sample(self, state, out, nodes, parents, valid, draft_probs, live):  # the planted bug, for trees
        p = self._target_probs(state, out[C.LOGITS])
        accepted, path = torch.zeros(len(nodes), dtype=torch.int64), torch.full(nodes.shape, -1)
        bonus = torch.zeros(len(nodes), dtype=torch.int64)
        for i in range(len(nodes)):
            row, taken = 0, []
            kept = parents.shape[1] if valid is None else int(valid[i].sum())  # None: every node is real
            while children := [j for j in range(kept) if parents[i, j] + 1 == row]:
                taken.append(children[0])  # always accepted, whatever p says
                row = children[0] + 1
            accepted[i], path[i, :len(taken)] = len(taken), torch.tensor(taken, dtype=torch.int64)
            bonus[i] = torch.multinomial(p[i, row], 1, generator=state.rng)[0]
        return accepted, path, bonus


class SampledTrees(TorchBackend):
    """A stand-in sampling tree drafter: each round a random tree of up to `max_nodes` nodes (depth <= K)
    for the batch, a random distribution q per row, and each row's children drawn i.i.d. from it, with
    draft_probs (each node's q, its parent row's) as the sampling graph gives them."""

    def __init__(self, *graphs, max_nodes=6, seed=0):
        super().__init__(*graphs)
        self.max_nodes, self.rng = max_nodes, torch.Generator().manual_seed(seed)
        self.verify_width = max_nodes + 1

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        out = super().drafter(feeds, sampling, bound)
        batch, vd = out[C.DRAFT_PROBS].shape[0], out[C.DRAFT_PROBS].shape[2]
        parents, depths = [], []
        for i in range(int(torch.randint(1, self.max_nodes + 1, (1,), generator=self.rng))):
            options = [-1] + [j for j in range(i) if depths[j] < self.depth]
            parents.append(options[int(torch.randint(0, len(options), (1,), generator=self.rng))])
            depths.append(1 if parents[-1] < 0 else depths[parents[-1]] + 1)
        rows = torch.softmax(2 * torch.randn(batch, len(parents) + 1, vd, generator=self.rng), -1)  # q per row
        q = rows[:, [p + 1 for p in parents]]                                                   # [B,N,Vd]
        index = torch.multinomial(q.reshape(-1, vd), 1, generator=self.rng).reshape(batch, len(parents))
        drafter = self.graphs[True][0].drafter
        out[C.DRAFT_IDS] = drafter.to_target_ids(index)
        out[C.DRAFT_PARENTS] = torch.tensor(parents).expand(batch, -1)
        out[C.DRAFT_TOKEN_PROBS] = q.gather(2, index[..., None])[..., 0]
        out[C.DRAFT_PROBS] = q
        return write_into(out, into)


def sample_pairs(runtime_cls, target, drafter, prompt, n, temperature, verify_policy="fixed", backend_cls=TorchBackend,
                 backend=None):
    backend = backend or backend_cls(TargetGraph(target, True), UnrolledDrafter(drafter, 2, False),
                                     UnrolledDrafter(drafter, 2, True))
    runtime = runtime_cls.for_models(backend, target, drafter, max_context=64, verify_policy=verify_policy)
    counts = torch.zeros(VOCAB * VOCAB)
    for seed in range(n // 250):
        results = runtime.generate([prompt] * 250, GenerationConfig(max_new_tokens=2, temperature=temperature,
                                                                    seed=seed))
        for r in results:
            counts[r.tokens[0] * VOCAB + r.tokens[1]] += 1
    return counts


@pytest.mark.slow
def test_rejection_sampling_preserves_the_target_distribution(tiny_vocab_pair):
    target, drafter = tiny_vocab_pair
    prompt, temperature, n = [1, 2, 3], 0.8, 3000
    expected = target_joint(target, prompt, temperature) * n
    observed = sample_pairs(SpeculativeRuntime, target, drafter, prompt, n, temperature)
    keep = expected > 5  # chi-square needs expected counts >= 5; pool the rest
    f_obs = torch.cat([observed[keep], observed[~keep].sum()[None]]).numpy()
    f_exp = torch.cat([expected[keep], expected[~keep].sum()[None]]).numpy()
    assert chisquare(f_obs, f_exp).pvalue > 0.01
    # Verifying a random number of drafts each round (or none) keeps the distribution too.
    policy = RandomDepth(2, seed=1)
    varied = sample_pairs(SpeculativeRuntime, target, drafter, prompt, n, temperature, verify_policy=policy)
    assert {None, 0, 1, 2} <= set(policy.chosen)
    f_var = torch.cat([varied[keep], varied[~keep].sum()[None]]).numpy()
    assert chisquare(f_var, f_exp).pvalue > 0.01
    buggy = sample_pairs(AcceptEverything, target, drafter, prompt, n, temperature)
    f_bug = torch.cat([buggy[keep], buggy[~keep].sum()[None]]).numpy()
    assert chisquare(f_bug, f_exp).pvalue < 0.01  # the test can fail: a sampler that accepts all drafts does


@pytest.mark.slow
def test_tree_rejection_sampling_preserves_the_target_distribution(tiny_vocab_pair):
    """Random trees (siblings drawn i.i.d. from random per-row distributions) through the runtime's
    one accept path: the first two tokens keep the target's joint distribution; accepting every
    first child down the tree instead fails the same test."""
    target, drafter = tiny_vocab_pair
    prompt, temperature, n = [1, 2, 3], 0.8, 3000
    expected = target_joint(target, prompt, temperature) * n
    keep = expected > 5
    f_exp = torch.cat([expected[keep], expected[~keep].sum()[None]]).numpy()
    for runtime_cls, holds in ((SpeculativeRuntime, True), (AcceptFirstChildren, False)):
        observed = sample_pairs(runtime_cls, target, drafter, prompt, n, temperature, backend_cls=SampledTrees)
        f_obs = torch.cat([observed[keep], observed[~keep].sum()[None]]).numpy()
        assert (chisquare(f_obs, f_exp).pvalue > 0.01) == holds


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["torch", "onnxruntime"])
def test_static_tree_sampling_graphs_preserve_the_target_distribution(tiny_vocab_pair, backend_name, tmp_path):
    """The real sampling tree drafter (3 first drafts, 2 children each, drawn i.i.d. by the graph from
    its noise) through the runtime, on torch and on the exported graphs in ONNX Runtime: the first two
    tokens keep the target's joint distribution; accepting every first child down the tree fails."""
    from eagle_export.export.export import export_drafter, export_target
    from eagle_export.runtime.backends import OnnxRuntimeBackend

    target, drafter = tiny_vocab_pair
    shape = TreeShape.from_branching([3, 2])
    if backend_name == "onnxruntime":
        export_target(target, tmp_path / "target.onnx", return_logits=True)
        for sampling, name in ((False, "drafter.onnx"), (True, "drafter_sampling.onnx")):
            export_drafter(drafter, shape, sampling, tmp_path / name)

    def make():
        if backend_name == "torch":
            return TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, shape, False),
                                UnrolledDrafter(drafter, shape, True))
        return OnnxRuntimeBackend(tmp_path / "target.onnx", tmp_path / "drafter.onnx",
                                  tmp_path / "drafter_sampling.onnx", threads=1, speculation=shape)

    prompt, temperature, n = [1, 2, 3], 0.8, 3000
    expected = target_joint(target, prompt, temperature) * n
    keep = expected > 5
    f_exp = torch.cat([expected[keep], expected[~keep].sum()[None]]).numpy()
    for runtime_cls, holds in ((SpeculativeRuntime, True), (AcceptFirstChildren, False)):
        observed = sample_pairs(runtime_cls, target, drafter, prompt, n, temperature, backend=make())
        f_obs = torch.cat([observed[keep], observed[~keep].sum()[None]]).numpy()
        assert (chisquare(f_obs, f_exp).pvalue > 0.01) == holds, runtime_cls.__name__


def test_a_drafter_of_another_dtype_gets_caches_and_aux_rows_in_its_own(tmp_path, target):
    """fp32 target, fp16 drafter (a quantized target's base and its drafter differ alike): the
    drafter's caches are allocated, and the target's aux rows fed, in the drafter's dtype."""
    drafter16 = load_drafter(write_tiny_drafter(tmp_path / "d16", "3.1"), target=target, dtype="fp16")
    runtime = make_runtime(target, drafter16, 3, verify_policy="fixed")
    assert (runtime.backend.model_dtype, runtime.backend.drafter_dtype) == (torch.float32, torch.float16)
    seen = []
    drafter_call = runtime.backend.drafter
    runtime.backend.drafter = lambda feeds, sampling=False, bound=(), into=(): seen.append(
        {n: feeds[n].dtype for n in (C.AUX_HIDDEN, C.PAST_KEY, C.PAST_VALUE)}) or drafter_call(feeds, sampling, bound,
                                                                                              into)
    config = GenerationConfig(max_new_tokens=12)
    results = runtime.generate(PROMPTS[:2], config)
    assert seen and all(set(s.values()) == {torch.float16} for s in seen)
    assert [r.tokens for r in results] == [target.generate_greedy(p, 12) for p in PROMPTS[:2]]


@pytest.mark.slow
def test_a_request_is_decided_the_same_after_another_as_alone(target, drafter):
    """`run --chat A --chat B` once carried A's failed probe into B (B drafted in 1 of 22 rounds where
    alone it drafted in 10 of 10): B's round-by-round decisions must not depend on what came before.
    A's drafts are all wrong, B's right at 0.9 (synthetic), the costs given (the machine's, which do
    carry). Planted: a goodput policy that keeps its state from one stream to the next."""
    from eagle_export.runtime.replay import recorded_costs
    from eagle_export.runtime.verify_policy import GoodputDepth
    from eagle_export.speculation.synthetic import SyntheticDrafts

    config = GenerationConfig(max_new_tokens=24)
    a, b = PROMPTS[1], PROMPTS[0]

    def runtime():
        backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, 3, False))
        return SpeculativeRuntime.for_models(backend, target, drafter, max_context=256, costs=recorded_costs("H200 bf16"))

    def decisions(runtime, prompt, acceptance, policy):
        synthetic = SyntheticDrafts.for_prompts(runtime, [prompt], config, (acceptance,) * 3)
        stats = runtime.generate([prompt], config, verify_policy=policy, synthetic=synthetic)[0].stats
        return stats.draft_calls, stats.accepted, stats.depths, stats.widths

    class Carrying(GoodputDepth):  # the planted bug: a stream continues the last one's estimates
        def start(self, batch):
            if getattr(self, "batch", None) != batch:
                super().start(batch)

    alone = decisions(runtime(), b, 0.9, "goodput")
    assert alone[0] == len(alone[1]) > 3  # B alone drafts every round
    served = runtime()
    decisions(served, a, 0.0, "goodput")
    assert decisions(served, b, 0.9, "goodput") == alone
    carrying, served = Carrying(3, served.costs), runtime()
    decisions(served, a, 0.0, carrying)
    assert decisions(served, b, 0.9, carrying)[0] < alone[0]


class _OnDevice(torch.Tensor):
    """A graph output as if it lived on an accelerator: what is computed from it stays there, and each
    read of it on the host (`.cpu()`, `.tolist()`, `.item()`, bool / int / float) is a device -> host
    synchronization, counted."""

    syncs = 0
    READS = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func not in cls.READS:
            return result
        _OnDevice.syncs += 1
        return result.as_subclass(torch.Tensor) if isinstance(result, torch.Tensor) else result


class _DeviceOutputs(TorchBackend):
    def target(self, feeds, need_logits=False, bound=()):
        return {name: t.as_subclass(_OnDevice) for name, t in super().target(feeds, need_logits, bound).items()}

    def drafter(self, feeds, sampling=False, bound=(), into=()):
        return {name: t.as_subclass(_OnDevice) for name, t in super().drafter(feeds, sampling, bound, into).items()}


class _CountingSyncs(SpeculativeRuntime):
    """Records (drafted, device -> host syncs) for every round."""

    def _round(self, state, live, policy=None, drafted=False):
        before = _OnDevice.syncs
        yield from super()._round(state, live, policy, drafted)
        self.rounds.append((drafted, _OnDevice.syncs - before))


class _GeneralCountingSyncs(_CountingSyncs):
    """The general round for every stream (a fixed-policy chain would otherwise run on the device)."""

    def _device_rounds(self, state):
        return False


class _PolicyReadsTheDevice(_GeneralCountingSyncs):  # planted: the drafts' probabilities reach the policy un-copied
    def _draft(self, state, live):
        nodes, parents, token_probs, draft_probs = super()._draft(state, live)
        return nodes, parents, token_probs.as_subclass(_OnDevice), draft_probs


@pytest.mark.slow
@pytest.mark.parametrize("planted", [False, True], ids=["goodput", "planted"])
def test_goodput_reads_the_device_no_more_often_per_round_than_fixed_or_a_plain_step(target, drafter, planted):
    """Host reads of the graphs' outputs are the syncs that stall a GPU between graph calls: on the general
    round (trees, sampling and other policy objects take it; a greedy chain's goodput and fixed rounds run
    on the device, tests/test_runtime_device_round.py), a goodput round may read the device no more often
    than a fixed-depth round (the accepted counts, the drafts and their probabilities: its menu and
    bookkeeping work on the host copies), and its k = 0 round no more often than a plain decoding step.
    Greedy output stays the target's. Planted: a runtime whose policy reads the drafts' probabilities
    where the drafter left them."""
    from eagle_export.runtime.replay import recorded_costs
    from eagle_export.speculation.synthetic import SyntheticDrafts

    config = GenerationConfig(max_new_tokens=16)
    prompt = PROMPTS[0]

    def rounds(policy, acceptance=None, cls=_CountingSyncs):
        backend = _DeviceOutputs(TargetGraph(target, True), UnrolledDrafter(drafter, 3, False))
        runtime = cls.for_models(backend, target, drafter, max_context=256, costs=recorded_costs("H200 bf16"))
        runtime.rounds = []  # (the synthetic drafts are found by running it too)
        synthetic = None if acceptance is None else SyntheticDrafts.for_prompts(runtime, [prompt], config,
                                                                                (acceptance,) * 3)
        runtime.rounds = []
        result = runtime.generate([prompt], config, speculative=policy is not None, verify_policy=policy,
                                  synthetic=synthetic)[0]
        assert result.tokens == target.generate_greedy(prompt, 16)
        return runtime.rounds

    fixed = [n for drafted, n in rounds("fixed", 0.9, _GeneralCountingSyncs) if drafted]
    goodput = [n for drafted, n in rounds("goodput", 0.9, _PolicyReadsTheDevice if planted else _GeneralCountingSyncs)
               if drafted]
    assert fixed and len(goodput) > 3  # at 0.9 goodput drafts every round
    if planted:
        assert max(goodput) > max(fixed)
        return
    assert max(goodput) <= min(fixed), (goodput, fixed)
    plain = [n for _, n in rounds(None)]
    k0 = [n for drafted, n in rounds("goodput", 0.0, _GeneralCountingSyncs) if not drafted]
    assert k0 and max(k0) <= min(plain), (k0, plain)


class _CountingCalls(SpeculativeRuntime):
    """Records (drafted, torch calls) for every round (the graph calls' own included)."""

    def _round(self, state, live, policy=None, drafted=False):
        from torch.overrides import TorchFunctionMode

        class Counting(TorchFunctionMode):
            calls = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                Counting.calls += 1
                return func(*args, **(kwargs or {}))

        with Counting():
            events = list(super()._round(state, live, policy, drafted))
        self.rounds.append((drafted, Counting.calls))
        yield from events


class _GeneralCountingCalls(_CountingCalls):
    """Goodput on the general round (a chain's would otherwise run on the device), plain decoding on the device."""

    def _device_rounds(self, state):
        return state.policy is None


class _TreePathPlainSteps(_GeneralCountingCalls):  # planted: a k = 0 round through the tree's mask, acceptance, gathers
    @staticmethod
    def _plain_step(state, nodes):
        return False


@pytest.mark.parametrize("planted", [False, True], ids=["goodput", "planted"])
def test_a_goodput_round_without_drafts_makes_the_torch_calls_of_a_plain_step(target, drafter, planted):
    """issue 44: a k = 0 round costs what a plain step costs. Counted in torch calls (each one host time,
    a GPU's included; the target call's own are the same in both) on the general round (trees and
    sampling take it; the device round's are counted in tests/test_runtime_device_round.py): a goodput
    round that calls no drafter makes at most those of a plain decoding step (the device round's) plus
    keeping the drafter's next row (the token and the aux state) and moving its call's inputs to the device
    (`_to`): a few dozen calls. Greedy output stays the target's.
    Planted: the k = 0 round through the tree's path (its mask, acceptance over no drafts, the path's
    gathers), as it was."""
    from eagle_export.runtime.replay import recorded_costs
    from eagle_export.speculation.synthetic import SyntheticDrafts

    config, prompt = GenerationConfig(max_new_tokens=24), PROMPTS[0]
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, 3, False))
    runtime = (_TreePathPlainSteps if planted else _GeneralCountingCalls).for_models(
        backend, target, drafter, max_context=256, costs=recorded_costs("H200 bf16"))
    runtime.rounds = []
    synthetic = SyntheticDrafts.for_prompts(runtime, [prompt], config, (0.0,) * 3)
    counts = {}
    for speculative in (False, True):
        runtime.rounds = []
        result = runtime.generate([prompt], config, speculative=speculative, verify_policy="goodput",
                                  synthetic=synthetic if speculative else None)[0]
        assert result.tokens == target.generate_greedy(prompt, 24)
        counts[speculative] = [n for drafted, n in runtime.rounds if not drafted]
    # (medians: a round that grows the caches makes more, in either stream; on the tiny pair a plain step
    # makes ~1100, the kept row ~9 more, the general round's target call ~7 more: its inputs moved to the
    # device, `_to`, where the device round's feeds are bound once per width; the tree's path ~50 more)
    plain, k0 = statistics.median(counts[False]), statistics.median(counts[True])
    assert len(counts[True]) > 16  # at acceptance 0 goodput settles on k = 0 rounds
    assert (k0 > plain + 24) if planted else (k0 <= plain + 24), (k0, plain)
