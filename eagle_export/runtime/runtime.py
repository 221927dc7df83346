"""The draft-verify loop: what users import.

One round, for a batch of ragged sequences:
  draft   the unrolled drafter consumes each sequence's newly accepted rows and proposes a token
          tree (node ids and parent indices, `tree.py`); a chain of K drafts is the tree whose node
          i has parent i-1, and takes the same path through everything below
  verify  the target scores [last token (the root), nodes..] in one call, each node at the position
          of its depth and seeing only its ancestors (`tree_mask`)
  accept  greedy: the longest root path whose tokens equal the target's argmax at their parents,
          plus the target's next token; sampling: multi-candidate rejection sampling down the tree,
          which preserves the target distribution
  commit  the new K/V rows of the accepted path are gathered and written at each sequence's length
          (their RoPE positions are those slots' already); rejected rows are never written (the
          graphs return only new entries), so rollback is free.
The runtime owns every cache buffer. Cache slot j holds position j; `lens[b]` counts the target
positions in cache; the last emitted token is not yet in it.
Caches grow with the longest sequence, in steps of `cache_step` slots: every call reads the
whole cache it is given, so one allocated at its final length would cost every early call more.
Static mode (`static_cache`, which CUDA graphs need) trades that for fixed shapes and fixed memory,
as vLLM and gpt-fast do: caches are allocated once per batch size at the context limit and reused
by every generate call, and the drafter's input rows are padded to K+1 (with num_valid), so every
decoding call has one of a few shapes: verify T = 1..K+1 tokens, drafter W = K+1 rows. Calls see a
view of the static caches that grows in power-of-two buckets (STATIC_MIN_SLOTS, 512, ... up to the
context limit): reading all max_context slots at every call cost 2-3x on CPU (notes of issue 19).
A drafter call with more rows (its first, over the prompt; a catch-up after plain steps) keeps its
own width.

Depth per round: a verify policy (`verify_policy.py`) decides before each round whether to call the
drafter at all, and after it how many of its K drafts to verify (k in 0..K; the verify call then
has k+1 tokens). A round without a drafter call is a plain decoding step. The drafter's input rows
(token p+1 with the target's aux state at p) that it has not seen yet wait in `pending` rows: every
verify call appends its accepted rows there and the next drafter call consumes them all, so after
plain steps the drafter catches up in one call of more rows. Greedy output is the target's own
whatever k is: the accepted drafts are exactly those equal to the target's argmax.

Every round's state lives on the backend's device (lengths, last tokens, pending drafter rows, cache
writes: whole-batch tensor operations, no per-sequence loop; `rows.py`), and the common case runs the whole
round there (`device_round.py`): greedy decoding of a chain under the fixed or the goodput policy, and plain
decoding, with one host read a round (two in a goodput round that drafts). The other cases (sampling,
trees, other policy objects) take the general round (`_round`), which reads the drafts and the target's
ids on the host.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import EagleExportError
from ..models import contract as C
from ..models.layers import causal_mask
from ..speculation import tree
from ..speculation.stats import acceptance_by_depth, mean_accepted_length
from ..speculation.synthetic import SyntheticDrafts
from ..speculation.tree import greedy_accepted_path
from .backends import Backend
from .costs import CostCache, CostCurves, measure
from .device_round import DeviceRounds
from .generation import GenerationConfig, is_int
from .rows import _new_cache, _PendingRows, _to, _write_rows
from .verify_policy import check_policy, make_policy

STATIC_MIN_SLOTS = 256  # static mode's smallest cache view: few buckets, so few CUDA graphs per width


@dataclass
class SequenceStats:
    prompt_tokens: int
    new_tokens: int = 0
    accepted: list[int] = field(default_factory=list)  # drafts accepted in each round
    depths: list[int] = field(default_factory=list)    # depth of the deepest draft verified each round (0: none;
                                                        # a tree verifies more nodes than that: see widths)
    widths: list[int] = field(default_factory=list)    # tokens of each round's verify call (1: a plain step)
    draft_calls: int = 0                                # rounds that called the drafter

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Mean tokens per round: accepted drafts plus the target's own token (0 before any round)."""
        return mean_accepted_length(self.accepted, empty=0.0)

    def acceptance_by_depth(self, depth: int) -> list[float]:
        """Per depth, the fraction of rounds that accepted it among those that verified it; None where
        no round verified that depth (nothing was measured)."""
        return acceptance_by_depth(self.accepted, depth, unreached=None, verified=self.depths)


@dataclass
class SequenceResult:
    tokens: list[int]
    finish_reason: str  # "eos", "stop", "length" (max_new_tokens) or "context" (the context limit)
    stats: SequenceStats
    text: str | None = None


@dataclass
class Event:
    """Tokens emitted for sequence `index`; its last event carries `finish_reason` and its `stats`."""

    index: int
    tokens: list[int]
    finish_reason: str | None = None
    stats: SequenceStats | None = None


@dataclass
class Timings:
    """Seconds in graph calls (prefill: the target's prompt pass) and in total; host is the rest.
    `plain_round_s` holds the seconds of each round that called no drafter (plain decoding's steps, a
    speculative stream's k = 0 rounds and its last steps near the limit), host work included: what one
    token costs without speculation, measured the same way in both kinds of stream. A device round's
    host read of its outcome waits for the work queued before it (on a GPU: the drafter's graph, the
    target's, acceptance and commits) and that wait is counted as verify: there a drafter call's seconds
    are its launch (and goodput's read of the drafts, which waits for it), and host is the host's own
    work. `synthetic`: the part of host spent making synthetic drafts (a measurement tool's work, not the
    runtime's; the benchmarks report it beside host)."""

    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    total: float = 0.0
    synthetic: float = 0.0
    plain_round_s: list[float] = field(default_factory=list)

    @property
    def host(self) -> float:
        return max(0.0, self.total - self.prefill - self.draft - self.verify)


def request_record(result: SequenceResult, depth: int, timings: Timings) -> dict:
    """One request as JSON (`eagle-export run --json`): its tokens, text and finish reason, its stats,
    and the time split of the `generate` call that served it alone (seconds)."""
    stats = result.stats
    return {
        "tokens": result.tokens, "text": result.text, "finish_reason": result.finish_reason,
        "stats": {"prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens, "rounds": stats.rounds,
                  "tau": round(stats.tau, 4), "accepted_per_round": stats.accepted,
                  "verified_per_round": stats.depths, "verify_width_per_round": stats.widths,
                  "draft_calls": stats.draft_calls,
                  "acceptance_by_depth": [None if a is None else round(a, 4) for a in stats.acceptance_by_depth(depth)],
                  "tokens_per_s": round(stats.new_tokens / timings.total, 2) if timings.total else None,
                  "seconds": {"total": round(timings.total, 4), "prefill": round(timings.prefill, 4),
                              "draft": round(timings.draft, 4), "verify": round(timings.verify, 4),
                              "host": round(timings.host, 4)}},
    }


@dataclass(frozen=True)
class PairShapes:
    """What the runtime allocates and checks for a target-drafter pair: the caches [L,B,Hkv,slots,D]
    of the target (L layers) and of the drafter (one layer), the aux states' width (the target's
    hidden size times the aux layers), the target vocabulary (prompt ids must lie below it; None:
    not checked), and the context limit (max_context slots per sequence)."""

    target_layers: int
    target_kv_heads: int
    target_head_dim: int
    drafter_kv_heads: int
    drafter_head_dim: int
    aux_width: int
    max_context: int
    vocab_size: int | None = None

    @classmethod
    def of_models(cls, target, drafter, max_context: int) -> PairShapes:
        """The shapes of the torch modules' configs."""
        t, d = target.config, drafter.config
        return cls(t.num_layers, t.num_kv_heads, t.head_dim, d.num_kv_heads, d.head_dim, target.aux_width,
                   max_context, t.vocab_size)


class SpeculativeRuntime(DeviceRounds):
    # What a refused --temperature > 0 tells the user to do; `open_build` names the build's own commands.
    cannot_sample_fix = "use --temperature 0, or rebuild with sampling: true in the recipe"

    def __init__(self, backend: Backend, shapes: PairShapes, draft_to_target: torch.Tensor | None = None,
                 tokenizer=None, verify_policy="goodput", costs: CostCurves | None = None,
                 cost_cache: CostCache | None = None, static_cache: bool | None = None):
        self.backend, self.shapes = backend, shapes
        # None: static exactly when the backend replays CUDA graphs (they read the caches they were captured with).
        self.static_cache = backend.cuda_graphs if static_cache is None else static_cache
        if backend.cuda_graphs and not self.static_cache:
            raise EagleExportError("CUDA graphs read the caches they were captured with, so they need static caches",
                                   "leave static_cache unset (or True) with cuda_graphs")
        self._static_caches: dict[int, tuple[torch.Tensor, ...]] = {}  # batch -> caches at max_context
        self._cache_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (batch, slots) -> their views
        self._streaming: set[int] = set()  # static mode: batch sizes whose caches a stream is using
        self.vocab_size = shapes.vocab_size  # prompt ids must lie below it (None: unknown, not checked)
        self.verify_policy = verify_policy
        check_policy(verify_policy)  # an unknown name fails here, not mid-generation
        self._policies = {}  # (policy name, batch) -> the policy its streams share (see _policy)
        self.cost_cache = cost_cache
        self.costs = costs or (cost_cache.load(backend.verify_width, backend.depth + 1) if cost_cache
                               else CostCurves())
        self.depth = backend.depth
        self.target_cache_shape = (shapes.target_layers, shapes.target_kv_heads, shapes.target_head_dim)
        self.drafter_cache_shape = (1, shapes.drafter_kv_heads, shapes.drafter_head_dim)
        self.aux_width, self.max_context = shapes.aux_width, shapes.max_context
        self.draft_to_target = draft_to_target
        self.tokenizer = tokenizer
        self.timings = Timings()
        # Caches grow in steps of this many slots as the sequences do (see _State.reserve).
        self.cache_step = 64
        self._init_device_rounds()

    @classmethod
    def for_models(cls, backend: Backend, target, drafter, max_context: int, tokenizer=None, **kw):
        """A runtime whose cache shapes come from the torch modules' configs."""
        return cls(backend, PairShapes.of_models(target, drafter, max_context), tokenizer=tokenizer,
                   draft_to_target=drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size)), **kw)

    def cost_curves(self, batch: int) -> CostCurves:
        """The measured costs, measuring (and caching) this batch size on its first use."""
        if not self.costs.has(batch):
            self.costs.verify_s[batch], self.costs.draft_s[batch], self.costs.catch_up_s[batch] = measure(self, batch)
            if self.cost_cache is not None:
                self.cost_cache.save(self.costs)
        return self.costs

    def caches(self, batch: int, slots: int) -> tuple[torch.Tensor, ...]:
        """Target K, V and drafter K, V caches [L,B,Hkv,slots,D]: new zeroed tensors, or in static
        mode views of this batch size's caches, allocated once at max_context slots and shared by
        every call (the same memory at every size; stale rows past a sequence's length are masked).
        Each with the sink row past it that `_write_rows` writes uncommitted rows to."""
        full = self._static_caches.get(batch) if self.static_cache else None
        if full is None:
            caches = []
            for shape, dtype in ((self.target_cache_shape, self.backend.model_dtype),
                                 (self.drafter_cache_shape, self.backend.drafter_dtype)):
                layers, heads, dim = shape
                size = (layers, batch, heads, self.max_context if self.static_cache else slots, dim)
                caches += [_new_cache(size, dtype, self.device) for _ in "kv"]
            if not self.static_cache:
                return tuple(caches)
            full = self._static_caches[batch] = tuple(caches)
        if (batch, slots) not in self._cache_views:  # (the same views for every stream: a graph call's key)
            self._cache_views[batch, slots] = tuple(c[:, :, :, :slots] for c in full)
        return self._cache_views[batch, slots]

    def cache_slots(self, needed: int, capacity: int) -> int:
        """How many slots a call's caches show for `needed`: growing mode rounds up to cache_step
        (at most the call's capacity); static mode to a power of two from STATIC_MIN_SLOTS (at most
        max_context), so the view sizes, and the CUDA graphs per width, stay few."""
        if self.static_cache:
            return min(self.max_context, max(STATIC_MIN_SLOTS, 1 << (needed - 1).bit_length()))
        return min(capacity, -(-needed // self.cache_step) * self.cache_step)

    def capacity(self, prompts, max_new_tokens: int) -> int:
        """The cache slots a request ever needs: its longest prompt, the new tokens and one round's
        K+1 rows past them, at most max_context."""
        return min(self.max_context, max(len(p) for p in prompts) + max_new_tokens + self.depth + 1)

    def drafter_width(self, rows: int) -> int:
        """The drafter's input width for `rows` rows: padded to K+1 in static mode (one graph)."""
        return self.depth + 1 if self.static_cache and rows <= self.depth + 1 else rows

    # ------------------------------------------------------------ public API

    def generate(self, prompts: list[list[int]], config: GenerationConfig, speculative: bool = True,
                 verify_policy=None, synthetic: SyntheticDrafts | None = None) -> list[SequenceResult]:
        results = [[] for _ in prompts]
        finished = [None] * len(prompts)
        stream = (self.stream(prompts, config, verify_policy, synthetic) if speculative
                  else self.stream_autoregressive(prompts, config))
        for event in stream:
            results[event.index].extend(event.tokens)
            finished[event.index] = event if event.finish_reason else finished[event.index]
        return [SequenceResult(tokens, last.finish_reason, last.stats, self._decode(tokens, config))
                for tokens, last in zip(results, finished)]

    def stream(self, prompts: list[list[int]], config: GenerationConfig, verify_policy=None,
               synthetic: SyntheticDrafts | None = None) -> Iterator[Event]:
        """Speculative decoding, yielding tokens as each round accepts them. `verify_policy` overrides
        the runtime's for this call ("goodput", "fixed", or a policy object). `synthetic` replaces
        each drafter call's drafts by ones of known quality (`synthetic.py`: a measurement and proof
        tool; the drafter graph still runs)."""
        with self._caches_in_use(len(prompts)):
            state = self._start(prompts, config, verify_policy or self.verify_policy)
            if synthetic is not None and state.sampling:
                raise EagleExportError("synthetic drafts are defined for greedy decoding only",
                                       "use temperature 0 with synthetic drafts")
            state.synthetic = synthetic
            policy = state.policy
            yield from self._prefill(state)
            last_full_round = state.capacity - self.depth - 1  # the longest sequence a full round fits
            while state.live_count:
                if max(state.host_lens) <= last_full_round:  # every round but the last few: all fit
                    drafted = policy.should_draft(state.alive if state.live_as_list else state.active)
                    yield from self._round(state, state.active, policy, drafted)
                    continue
                near_limit = state.active & (torch.tensor(state.host_lens) > last_full_round)
                spec = state.active & ~near_limit
                if spec.any():
                    yield from self._round(state, spec, policy, policy.should_draft(spec))
                if near_limit.any():  # a full round no longer fits: finish token by token, exactly
                    yield from self._round(state, near_limit)
            self.timings.total += time.perf_counter() - state.started

    def stream_autoregressive(self, prompts: list[list[int]], config: GenerationConfig) -> Iterator[Event]:
        """Target-only decoding on the same backend: the baseline `bench` compares against."""
        with self._caches_in_use(len(prompts)):
            state = self._start(prompts, config)
            yield from self._prefill(state, draft=False)
            while state.live_count:
                yield from self._round(state, state.active)
            self.timings.total += time.perf_counter() - state.started

    @contextlib.contextmanager
    def _caches_in_use(self, batch: int):
        """Static mode: one stream at a time per batch size, as every stream of that size writes the
        same caches (a second one would overwrite the first's rows and both would decode garbage).
        Released when the stream ends, is closed or is dropped."""
        if not self.static_cache:
            yield
            return
        if batch in self._streaming:
            raise EagleExportError(f"a stream of batch {batch} started while another of batch {batch} on this "
                                   "runtime is still running: with static caches (CUDA graphs) both would write "
                                   "the same caches",
                                   "finish or close() the first stream before starting the next, or open a second "
                                   "runtime for concurrent streams")
        self._streaming.add(batch)
        try:
            yield
        finally:
            self._streaming.discard(batch)

    # ------------------------------------------------------------ the loop

    def check_requests(self, prompts, config) -> None:
        """Refuse requests this build cannot serve, before anything is measured, cached or generated."""
        if not prompts:
            raise EagleExportError("no prompts given", "pass at least one prompt")
        if config.temperature > 0 and not (self.backend.has_logits and self.backend.has_sampling):
            raise EagleExportError(f"the {self.backend.name} backend of this build cannot sample "
                                   "(it has no logits output or no sampling drafter graph)", self.cannot_sample_fix)
        if not isinstance(config, GenerationConfig):
            raise EagleExportError(f"config is a {type(config).__name__}", "pass an eagle_export.runtime.GenerationConfig")
        for i, p in enumerate(prompts):
            self._check_ids(i, p)
            if len(p) == 0:
                raise EagleExportError(f"prompt {i} is empty: there is nothing to continue",
                                       "pass some text, or use --chat so the chat template adds its tokens")
            if len(p) >= self.max_context:
                raise EagleExportError(
                    f"prompt {i} has {len(p)} tokens, the context limit is {self.max_context}",
                    "shorten the prompt, or build with a larger profiles.context.max")

    def _start(self, prompts, config, verify_policy=None):
        self.check_requests(prompts, config)
        policy = None
        if verify_policy is not None:  # (measuring the costs of a new batch size is not generation time)
            check_policy(verify_policy)
            costs = self.cost_curves(len(prompts)) if verify_policy == "goodput" else None
            policy = self._policy(verify_policy, len(prompts), costs)
            policy.start(len(prompts))
        self.timings = Timings()
        state = _State(self, prompts, config)
        state.policy = policy
        # Bound once: a policy that verifies whole trees (fixed) skips the menu every round, and a chain's
        # menu is the first j drafts, in closed form (`_draft` says whether the drafter gave a chain).
        state.whole_tree = getattr(policy, "verifies_whole_tree", False)
        # The policy's learning from a round's outcome, run after the next round's first launch (the device
        # works meanwhile): goodput's `learn`; None for a policy that learns in `observe` or not at all.
        state.learn = getattr(policy, "learn", None)
        # The policy takes the live mask as the state's Python list (`_State.alive`, which the round has: no
        # torch call to make it), not as a tensor: the built-in ones; a user's object gets the tensor.
        state.live_as_list = getattr(policy, "live_as_list", False)
        state.chain, state.chain_widths = False, list(range(1, self.depth + 2))
        b = len(prompts)
        state.no_nodes = torch.zeros(b, 0, dtype=torch.int64), torch.zeros(b, 0, dtype=torch.int64)
        state.none_accepted, state.plain_mask = torch.zeros(b, dtype=torch.int64), causal_mask(b, 1)  # a plain step's
        state.device_rounds = self._device_rounds(state)
        return state

    def _policy(self, name, batch: int, costs):
        """The verify policy of a stream: a policy object as it is; a named one kept per batch size (its
        `start` forgets the last stream: a request is decided the same whatever came before it)."""
        if not isinstance(name, str):
            return name
        if (name, batch) not in self._policies:
            self._policies[name, batch] = make_policy(name, self.depth, costs)
        return self._policies[name, batch]

    def _check_ids(self, i: int, prompt) -> None:
        """Token ids are whole numbers in [0, vocab): Gather would wrap a negative id silently."""
        if isinstance(prompt, (str, bytes)) or not all(is_int(t) for t in prompt):
            raise EagleExportError(f"prompt {i} is not a list of token ids ({str(prompt)[:60]!r})",
                                   "pass each prompt as a list of ints (the tokenizer's ids)")
        vocab = self.vocab_size
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise EagleExportError(f"prompt {i} holds token id {bad[0]}, outside the vocabulary [0, "
                                   f"{vocab if vocab is not None else 'vocab'})",
                                   "encode the prompt with this build's tokenizer")

    def _prefill(self, state, draft: bool = True):
        b = len(state.prompts)
        width = max(len(p) for p in state.prompts)
        ids = torch.zeros(b, width, dtype=torch.int64)
        for i, p in enumerate(state.prompts):
            ids[i, :len(p)] = torch.tensor(p)
        positions = torch.arange(width).expand(b, -1).contiguous()
        out = self._target(state, ids, positions, state.lens, causal_mask(b, width), need_logits=state.sampling,
                           phase="prefill")
        prompt_lens = torch.tensor([len(p) for p in state.prompts])
        state.write_target(out, prompt_lens, state.active)
        last = prompt_lens - 1
        first = self._pick(state, out, last)
        events = state.emit([[int(t)] for t in first], state.active.tolist())
        state.lens += prompt_lens
        state.host_lens = state.lens.tolist()
        if draft:  # the drafter's rows: token p+1 with aux p, for every prompt position
            shifted = torch.cat([ids[:, 1:], torch.zeros(b, 1, dtype=torch.int64)], dim=1)
            shifted[torch.arange(b), last] = first
            state.pending = _PendingRows(shifted, out[C.AUX_HIDDEN], prompt_lens)
            state.draft_lens = torch.zeros_like(state.pending.count)  # beside num_valid (the pending counts)
        state.last_token = first
        if state.device_rounds:  # the round's state moves into the device round's buffers once
            state.target_feeds = {}  # a device round's target call's feeds by width (`_device_round`)
            depths = torch.arange(1, self.depth + 1).expand(b, -1)
            state.chain_depths = depths - 2, depths  # a chain's parents and depths (synthetic drafts)
            state.buffers = self.round_buffers(b)
            state.buffers.start(state.lens, first, state)
            state.lens = state.buffers.lens
            state.draft_lens = None if state.draft_lens is None else state.buffers.draft_lens
        yield from events

    def _round(self, state, live, policy=None, drafted=False):
        """One target call for the `live` sequences over [last token, the part of the drafter's tree the
        policy keeps] (menu entry j of `tree.nested_subtrees`, chosen after the drafter call); without a
        drafter call (drafted False) a plain step. A chain is the tree whose node i has parent i-1: one
        path serves both. A stream whose rounds all run on the device takes `_device_round` instead."""
        if state.device_rounds:
            yield from self._device_round(state, live, policy, drafted)
            return
        start = time.perf_counter()
        b, alive = len(state.prompts), state.alive if live is state.active else live.tolist()
        told = alive if state.live_as_list else live  # the live mask as the policy takes it
        state.reserve(max(n for n, a in zip(state.host_lens, alive) if a) + self.depth + 1)
        nodes, parents = state.no_nodes
        j, draft_probs, valid = 0, None, None  # valid None: every node kept is a real one
        verified_depth = [0] * b  # the deepest node verified, per sequence
        if drafted:
            nodes, parents, token_probs, draft_probs = self._draft(state, live)
            if state.whole_tree:  # the policy verifies every node: no menu to choose from (nor a j)
                j = None
                verified_depth = ([nodes.shape[1]] * b if state.chain
                                  else tree.node_depths(parents).amax(-1).tolist())
            elif state.chain:  # the menu's S_j is the first j drafts (`tree.chain_reach`)
                j = policy.choose(None if state.sampling else tree.chain_reach(token_probs), told,
                                  state.chain_widths, (nodes, parents))
                nodes, parents, verified_depth = nodes[:, :j], parents[:, :j], [j] * b
                draft_probs = None if draft_probs is None else draft_probs[:, :j]
            else:
                menu, reach = tree.nested_subtrees(parents, token_probs, self.depth, by_depth=state.sampling)
                j = policy.choose(reach, told, (1 + menu.sum(-1).amax(-1)).tolist(), (nodes, parents))
                verified_depth = (tree.node_depths(parents) * menu[j]).amax(-1).tolist()
                order, parents, valid = tree.subtree(parents, menu[j])
                nodes = nodes.gather(1, order)
                draft_probs = None if draft_probs is None else draft_probs[torch.arange(b)[:, None], order]
        plain = self._plain_step(state, nodes)
        if plain:
            verify_ids, rows = state.last_token[:, None], None
            out = self._target(state, verify_ids, state.lens[:, None], state.lens, state.plain_mask, need_logits=False)
            if not drafted and policy is not None and state.learn is not None:
                state.learn()
            accepted, next_token = state.none_accepted, out[C.GREEDY_IDS][:, 0]
            taken = live.long()                                                # rows each sequence keeps
        else:
            verify_ids = torch.cat([state.last_token[:, None], nodes], dim=1)
            mask = tree.verify_mask(parents)
            positions = state.lens[:, None] + mask.sum(-1) - 1                 # the root's, plus each node's depth
            out = self._target(state, verify_ids, positions, state.lens, mask, need_logits=state.sampling)
            if state.sampling:
                accepted, path, next_token = self._rejection_sample(state, out, nodes, parents, valid, draft_probs,
                                                                    live)
            else:  # a padding node (a sequence keeping fewer nodes than the batch's widest) is never accepted
                accepted, path = greedy_accepted_path(nodes if valid is None else torch.where(valid, nodes, -1),
                                                      parents, out[C.GREEDY_IDS])
            rows = torch.cat([torch.zeros(b, 1, dtype=torch.int64), path + 1], dim=1)  # the accepted path's rows
            if not state.sampling:
                next_token = out[C.GREEDY_IDS].gather(1, rows.gather(1, accepted[:, None]))[:, 0]
            taken = torch.where(live, accepted + 1, 0)
        state.write_target(out if rows is None else _gather_rows(out, rows), taken, live)
        # Per-sequence bookkeeping on Python lists: one conversion each, not an indexing call per sequence
        # (each torch call is host time in every round, a GPU's included).
        nexts = next_token.tolist()
        if plain:
            counts, emitted = [0] * b, [[t] for t in nexts]
        else:
            path_ids = verify_ids.gather(1, rows)                                # [root, accepted nodes..]
            counts, ids = accepted.tolist(), path_ids.tolist()
            emitted = [ids[i][1:counts[i] + 1] + [nexts[i]] for i in range(b)]
        if policy is not None:
            state.record(alive, counts, verified_depth, verify_ids.shape[1], drafted)
        events = state.emit(emitted, alive)
        if state.pending is not None:  # the drafter's next rows: the accepted path's tokens, then the new one
            tokens = next_token[:, None] if plain else torch.cat([path_ids[:, 1:], next_token[:, None]], dim=1).scatter(
                1, accepted[:, None], next_token[:, None])
            state.pending.append(tokens, out[C.AUX_HIDDEN], rows, taken)
            state.pending.added([c + 1 if a else 0 for c, a in zip(counts, alive)])
        if policy is not None:
            policy.observe(j, counts, told, drafted, emitted)
        state.lens = state.lens + taken
        state.host_lens = [n + c + 1 if a else n for n, c, a in zip(state.host_lens, counts, alive)]
        state.last_token = torch.where(live, next_token, state.last_token)
        if not drafted:
            self.timings.plain_round_s.append(time.perf_counter() - start)
        yield from events

    @staticmethod
    def _plain_step(state, nodes) -> bool:
        """Whether `_round` verifies the root alone, greedy: no tree to mask, nothing to accept, its next
        token the call's one greedy id (each torch call the tree's path makes is host time in every k = 0
        round of a goodput stream)."""
        return nodes.shape[1] == 0 and not state.sampling

    # ------------------------------------------------------------ graph calls

    def _target(self, state, ids, positions, cache_lens, tree_mask, need_logits, phase="verify", read=True, bound=()):
        """One target call; `read`: its greedy ids (and logits) copied to the host; `bound`: the inputs the
        caller keeps at fixed addresses (`Backend.target`)."""
        device = state.target_k.device
        feeds = {C.INPUT_IDS: _to(ids, device), C.POSITIONS: _to(positions, device),
                 C.PAST_KEY: state.target_k, C.PAST_VALUE: state.target_v, C.CACHE_LENS: _to(cache_lens, device),
                 C.TREE_MASK: _to(tree_mask, device)}
        start = time.perf_counter()
        out = self.backend.target(feeds, need_logits=need_logits, bound=bound)
        # timed to the copy of its ids to the host, which waits for a GPU's queued work: what the call costs
        # (logits only when asked for: a graph that returns them anyway keeps them on the device)
        if read:
            copied = (C.GREEDY_IDS, C.LOGITS) if need_logits else (C.GREEDY_IDS,)
            out = {name: t.cpu() if name in copied else t for name, t in out.items()}
        setattr(self.timings, phase, getattr(self.timings, phase) + time.perf_counter() - start)
        return out

    def _call_drafter(self, state, alive: list[bool], live, into=()):
        """The drafter over every pending row of the live sequences (`live` on the device), its new
        K/V rows committed -> (its outputs, num_valid [B]); `into` as in `Backend.drafter`."""
        ids, aux, num_valid = state.pending.take(alive, live, self.drafter_width)
        # The target's aux states, in the drafter's dtype when the two graphs differ (a quantized target
        # on an fp16 base beside an fp32 drafter).
        dtype = self.backend.drafter_dtype
        feeds = {C.INPUT_IDS: ids, C.AUX_HIDDEN: aux if aux.dtype == dtype else aux.to(dtype), C.NUM_VALID: num_valid,
                 C.PAST_KEY: state.draft_k, C.PAST_VALUE: state.draft_v,
                 C.CACHE_LENS: _to(state.draft_lens, state.draft_k.device)}
        if state.sampling:
            feeds[C.TEMPERATURE] = torch.full((len(ids),), state.config.temperature, device=self.device)
            feeds[C.UNIFORM_NOISE] = torch.rand(len(ids), self.backend.num_nodes, generator=state.rng).to(self.device)
        start = time.perf_counter()
        out = self.backend.drafter(feeds, sampling=state.sampling, into=into)
        self.timings.draft += time.perf_counter() - start
        state.write_drafter(out, num_valid, live, ids.shape[1])
        state.draft_lens = torch.where(live, state.draft_lens + num_valid, state.draft_lens)
        return out, num_valid

    def _draft(self, state, live):
        """The drafter over every pending row of the live sequences -> its tree: node ids [B,N],
        parents [B,N] (a chain graph's are implied: node i's parent is i-1), each node's probability
        under its parent's distribution, and the distributions when sampling."""
        alive = live.tolist()
        out, _ = self._call_drafter(state, alive, state.on_device(alive))
        if state.learn is not None:  # (while the drafter runs)
            state.learn()
        start = time.perf_counter()
        nodes = out[C.DRAFT_IDS].cpu()  # (waits for a GPU's queued work: timed with the call)
        self.timings.draft += time.perf_counter() - start
        state.chain = C.DRAFT_PARENTS not in out  # a chain graph's parents are implied
        parents = _chain(nodes.shape[1]).expand(len(nodes), -1) if state.chain else out[C.DRAFT_PARENTS].cpu()
        token_probs = out[C.DRAFT_TOKEN_PROBS].cpu()
        if state.synthetic is not None:
            nodes, token_probs = self._synthetic(state, parents, tree.node_depths(parents))
        return nodes, parents, token_probs, out.get(C.DRAFT_PROBS)

    def _synthetic(self, state, parents, depths):
        """The synthetic drafts replacing a drafter call's (`SyntheticDrafts.replace`), timed apart."""
        start = time.perf_counter()
        drafts = state.synthetic.replace(parents, depths, [len(g) for g in state.generated])
        self.timings.synthetic += time.perf_counter() - start
        return drafts

    @property
    def device(self):
        return self.backend.device

    # ------------------------------------------------------------ sampling

    def _target_probs(self, state, logits):
        """Target distribution at `config.temperature` with top-p (nucleus) filtering, in fp32."""
        probs = torch.softmax(logits.float() / state.config.temperature, dim=-1)
        if state.config.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < state.config.top_p  # the smallest set reaching top_p
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def _pick(self, state, out, rows):
        """The next token at row `rows[b]` of a target output: argmax, or a sample when sampling."""
        if not state.sampling:
            return out[C.GREEDY_IDS].gather(1, rows[:, None])[:, 0]
        logits = out[C.LOGITS][torch.arange(len(rows)), rows]
        return torch.multinomial(self._target_probs(state, logits), 1, generator=state.rng)[:, 0]

    def _rejection_sample(self, state, out, nodes, parents, valid, draft_probs, live):
        """Multi-candidate rejection sampling over each sequence's tree (`tree.rejection_sample_path`:
        a row's children are tried in turn, each accepted with probability min(1, p/q), the row's p
        turned into norm(max(p - q, 0)) after each rejection; for a chain, Leviathan et al.'s rule).
        draft_probs [B,N,Vd]: the distribution each node was drawn from, its parent row's (siblings
        are drawn i.i.d. from it). Only `live` sequences draw, so what they sample does not depend on
        finished ones. -> (accepted, path [B,N] (-1 padded), next token)."""
        b, n = nodes.shape
        p = self._target_probs(state, out[C.LOGITS])                          # [B,N+1,V]
        q = torch.zeros_like(p)                                               # row r: its children's distribution
        accepted, path = torch.zeros(b, dtype=torch.int64), torch.full((b, n), -1, dtype=torch.int64)
        next_token = torch.zeros(b, dtype=torch.int64)
        for i in torch.nonzero(live)[:, 0].tolist():
            m = n if valid is None else int(valid[i].sum())  # the kept nodes come first; padding nodes are never tried
            if m:
                q[i, (parents[i, :m] + 1)[:, None], self.draft_to_target] = draft_probs[i, :m].cpu().float()
            taken, next_token[i] = tree.rejection_sample_path(p[i], q[i], nodes[i, :m].tolist(),
                                                              parents[i, :m].tolist(), state.rng)
            accepted[i] = len(taken)
            path[i, :len(taken)] = torch.tensor(taken, dtype=torch.int64)
        return accepted, path, next_token

    def _decode(self, tokens, config):
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(tokens)
        for stop in config.stop_strings:
            if stop in text:
                text = text[:text.index(stop)]
        return text


class _State:
    """The per-call state of a batch: caches, lengths, who is still generating, what was emitted."""

    def __init__(self, runtime: SpeculativeRuntime, prompts, config: GenerationConfig):
        self.runtime, self.prompts, self.config = runtime, prompts, config
        b = len(prompts)
        k = runtime.depth
        longest = max(len(p) for p in prompts)
        self.capacity = runtime.capacity(prompts, config.max_new_tokens)
        self.slots = self._slots(longest + k + 1)  # the caches' (see reserve)
        self.target_k, self.target_v, self.draft_k, self.draft_v = runtime.caches(b, self.slots)
        self.lens = torch.zeros(b, dtype=torch.int64)
        self.host_lens = [0] * b  # lens as the host knows it (from each round's read), for what the host decides
        self.draft_lens = None
        self.pending: _PendingRows | None = None  # drafter rows not yet drafted from (None: no drafter)
        self.synthetic: SyntheticDrafts | None = None  # replaces the drafter's drafts (measurement only)
        self.active = torch.ones(b, dtype=torch.bool)
        # `active` as the host knows it, for the round loop: a list (never changed in place: a new one when a
        # sequence finishes, as `active`) and its count (each torch call is host time in every round)
        self.alive, self.live_count = [True] * b, b
        self.sampling = config.temperature > 0
        self.rng = torch.Generator().manual_seed(config.seed)
        self.generated = [[] for _ in prompts]
        self.stats = [SequenceStats(prompt_tokens=len(p)) for p in prompts]
        self.unrecorded = None  # a device round's statistics, recorded after the next round's first launch
        self.started = time.perf_counter()
        self._eos = frozenset(config.eos_ids)  # (emit: a set's membership test, made once)
        self._context_room = [runtime.max_context - len(p) for p in prompts]  # new tokens the context holds
        self._on_device = {}  # live masks copied to the device, by their values

    def on_device(self, alive: list[bool]) -> torch.Tensor:
        """The live mask `alive` as a bool tensor on the device, copied once per distinct mask (a copy to
        a GPU from the host's memory would wait for the queued work, like a read)."""
        key = tuple(alive)
        if key not in self._on_device:
            self._on_device[key] = torch.tensor(key).to(self.runtime.device, non_blocking=True)
        return self._on_device[key]

    def _slots(self, needed):
        return self.runtime.cache_slots(needed, self.capacity)

    def reserve(self, needed: int) -> None:
        """Grow every cache to hold `needed` slots (rounded up to the runtime's cache_step, at most
        capacity). Each graph call reads the whole cache it is given (ONNX Runtime copies it, attention
        spans it), so caches track the longest sequence instead of being allocated at their final length.
        `slots`, the caches' as a Python int: a size `_slots` gave, so needed <= slots needs no growth (the
        common case, every round: no torch call)."""
        if needed <= self.slots:
            return
        slots = self._slots(needed)
        if slots <= self.slots:
            return
        self.slots = slots
        if self.runtime.static_cache:  # wider views of the same memory: nothing to copy
            self.target_k, self.target_v, self.draft_k, self.draft_v = self.runtime.caches(len(self.prompts), slots)
            return
        for name in ("target_k", "target_v", "draft_k", "draft_v"):
            old = getattr(self, name)
            grown = _new_cache((*old.shape[:3], slots, old.shape[4]), old.dtype, old.device)
            grown[:, :, :, :old.shape[3]] = old
            setattr(self, name, grown)

    def write_target(self, out, counts, live):
        _write_rows(self.target_k, self.target_v, out, self.lens, counts, live)

    def write_drafter(self, out, counts, live, rows: int):
        """The drafter's first `counts` rows of its `rows` input rows (the rows after them are its later
        steps', never committed)."""
        out = {name: out[name][:, :, :, :rows] for name in (C.NEW_KEY, C.NEW_VALUE)}
        _write_rows(self.draft_k, self.draft_v, out, self.draft_lens, counts, live)

    def record(self, alive: list[bool], accepted: list[int], depths: list[int], width: int, drafted: bool) -> None:
        """A round's per-sequence statistics (live sequences only): drafts accepted, the deepest node
        verified, the verify call's width, and whether the drafter was called."""
        for stats, a, n, depth in zip(self.stats, alive, accepted, depths):
            if a:
                stats.accepted.append(n)
                stats.depths.append(depth)
                stats.widths.append(width)
                stats.draft_calls += drafted

    def recorded(self) -> None:
        """The statistics a device round left for later (`unrecorded`: `record`'s arguments), recorded now."""
        if self.unrecorded is not None:
            self.record(*self.unrecorded)
            self.unrecorded = None

    def emit(self, tokens_per_seq: list[list[int]], live: list[bool]) -> list[Event]:
        """Apply EOS, stop strings, max_new_tokens and the context limit; deactivate finished sequences.
        A sequence whose tokens stay below both limits and hold no EOS, with no stop strings to test,
        takes them all (every round's common case, tested first: this loop is host time in every round)."""
        events = []
        cfg = self.config
        eos, stops = self._eos, cfg.stop_strings and self.runtime.tokenizer is not None
        for b, tokens in enumerate(tokens_per_seq):
            if not live[b]:
                continue
            generated = self.generated[b]
            room = cfg.max_new_tokens - len(generated)
            context_room = self._context_room[b] - len(generated)
            if len(tokens) < room and len(tokens) < context_room and eos.isdisjoint(tokens) and not stops:
                generated.extend(tokens)
                self.stats[b].new_tokens += len(tokens)
                events.append(Event(b, tokens))
                continue
            reason = None
            if context_room <= len(tokens) and context_room < room:
                tokens, reason = tokens[:context_room], "context"
            if room <= len(tokens):
                tokens, reason = tokens[:room], "length"
            eos_at = next((i for i, t in enumerate(tokens) if t in cfg.eos_ids), None)
            if eos_at is not None:
                tokens, reason = tokens[:eos_at + 1], "eos"
            if cfg.stop_strings and self.runtime.tokenizer is not None:
                tokens, stopped = self._cut_at_stop(b, tokens)
                reason = "stop" if stopped else reason
            self.generated[b].extend(tokens)
            self.stats[b].new_tokens += len(tokens)
            events.append(Event(b, tokens, reason, self.stats[b] if reason is not None else None))
        finished = [e.index for e in events if e.finish_reason is not None]
        if finished:  # a new tensor: the round's `live` may be this one, and must stay what the round began with
            self.active = self.active.clone()
            self.active[finished] = False
            self.alive = [a and i not in finished for i, a in enumerate(self.alive)]
            self.live_count = sum(self.alive)
        return events

    def _cut_at_stop(self, b, tokens):
        """Keep tokens up to the one that completes a stop string (the text is cut before it)."""
        decode = self.runtime.tokenizer.decode
        for i in range(1, len(tokens) + 1):
            text = decode(self.generated[b] + tokens[:i])
            if any(s in text for s in self.config.stop_strings):
                return tokens[:i], True
        return tokens, False


@functools.lru_cache(maxsize=8)
def _chain(k: int) -> torch.Tensor:
    """The parents of a chain of k drafts: node i's is i-1, the first's the root (-1). Kept per k (a
    drafted round's host time): callers must not write into it."""
    return torch.arange(-1, k - 1)


def _gather_rows(out, rows):
    """The new K/V of the verify call's rows `rows` [B,R] (the accepted path, root first), in that
    order: their RoPE positions are already root + depth, the contiguous cache slots they go to."""
    index = rows.to(out[C.NEW_KEY].device)[None, :, None, :, None]
    return {name: out[name].gather(3, index.expand(*out[name].shape[:3], -1, out[name].shape[4]))
            for name in (C.NEW_KEY, C.NEW_VALUE)}
