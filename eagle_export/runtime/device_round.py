"""The device round: a whole decoding round on the backend's device, with one host read.

Which streams take it (`DeviceRounds._device_rounds`): greedy decoding, and plain decoding (no policy), a
chain under the fixed policy (every round drafts and verifies all K drafts: nothing about the drafts is
decided on the host) or under a policy that decides a chain's round from numbers read once after the
drafter call (`choose_chain`: goodput). Sampling, trees and other policy objects take the general round
(`runtime.SpeculativeRuntime._round`), and the device round gives its tokens, statistics, policy decisions,
drafts and caches bit for bit (tests/test_runtime_device_round.py).

What runs on the device: the drafter call (which writes its drafts into the verify call's ids), the target
call over [last token, d_1..d_j], and the round's bookkeeping, `_settle_round`: acceptance (a = the leading
i <= j with d_i == g_{i-1}, g the target's argmax at the call's rows), the target's cache commit of rows
0..a at each sequence's length, the drafter's commit of the rows it consumed, the drafter's next rows
(g_0..g_a beside the call's aux states, as they are: a + 1 of them valid), the lengths, the next root g_a
and the next positions.
What the host reads, per round: ONE transfer, [accepted count, the target's greedy ids] per sequence,
which it needs to emit tokens and test EOS, stop strings and the limits (a finished sequence changes the
live mask, the only host value the device round is given back, copied only when it changes). A goodput
round that drafts reads once more, right after the drafter call: the drafts and their joint
probabilities, [B, 2K] numbers in one transfer (`_drafts_read`), from which `choose_chain` picks j.
Why: on a GPU every read waits for the queued work and every torch call is host time (5-10 us a launch),
so the host's work a round is kept to the calls themselves.

When the policy learns: what the host does between a round's read and the next round's first launch
leaves the device idle, so the policy's `observe` does there only what the next decision needs, and its
learning from the outcome (`learn`: hindsight over the drafted trees, the trust, what drafting promises
re-read through it) runs in the next round right after its first launch (the drafter call, or the target
call of a k = 0 round), before that round's read: on a GPU it overlaps the device's work. The choice
(`choose_chain`, after the read of the drafts) then sees the fresh trust; only `should_draft` of the
round right after is one round stale (a probe's outcome is learned at once: `verify_policy`). A policy
without `learn` (fixed, a user's object) learns in `observe` or not at all; the general round calls
`learn` at the same point of its round, so the two rounds drive a policy alike. The round's statistics
(`_State.record`) wait there too (`_after_launch`), but for a round that finishes a sequence, whose last
event carries them; so does a k = 0 round's room for its pending row (`_RoundBuffers.fit`: the target
call reads none of them). The built-in policies take the live mask as the state's list (`live_as_list`:
no .tolist() on that path), and a chain's drafts' ids as read (floats holding them exactly).

Invariants:
  - the round's state lives in tensors of fixed shapes made once (per batch size in static mode),
    `_RoundBuffers`, which the graphs read and `_settle_round` writes in place: a CUDA graph replays the
    addresses it was captured with;
  - `_settle_round` is tensor ops of fixed shapes with no host read, no host data and no data-dependent
    shape (`cuda_graphs.check_capturable` proves it on CPU), so where the backend captures CUDA graphs it
    is one more graph beside the target's and the drafter's: a drafted round costs the host three replays
    and the read, no copy (the graphs read their inputs in place, `TARGET_BOUND`, `DRAFTER_BOUND`, and
    the drafter's writes its drafts into the verify call's ids, `_RoundBuffers.into`: the copy captured
    with the call; a backend that replays nothing copies them after its call);
  - a sequence not live changes nothing that is read later (its rows go to the caches' sink row,
    its appended rows are padding past its count): the capture warms up with no sequence live (`_dry`);
  - a goodput stream's k = 0 rounds are plain steps whose rows wait in the pending rows (`_RoundBuffers.fit`
    makes room) for the next drafter call, which catches up on all of them (`_device_draft`); where the
    bookkeeping runs eagerly (no CUDA graphs) a k = 0 round's row waits by reference instead, appended with
    the others' in one batch before the rows are next read (`_defers_rows`), so that the round makes the
    torch calls of a plain step (each is host time: issue 44 asks a k = 0 round to cost what a plain step
    costs);
  - a call of the root alone (a plain step, a k = 0 round) accepts nothing: its bookkeeping runs none of
    acceptance's ops and its read is the greedy ids alone.
"""

from __future__ import annotations

import functools
import time

import torch

from ..models import contract as C
from ..models.layers import causal_mask
from ..speculation import tree
from ..speculation.tree import greedy_accepted_path
from .cuda_graphs import ShapeGraphs
from .rows import _append_rows, _arange, _grown, _PendingRows, _write_rows
from .verify_policy import FixedDepth

# The graph inputs a device round feeds from the runtime's own tensors at fixed addresses, bound by reference
# where the backend replays CUDA graphs (`Backend.target`), so a steady-state round copies none of them in:
# the verify call's ids and positions (views of `_RoundBuffers.verify_ids` and `positions`, made once per
# width), its cache lengths (`lens`) and its mask (`_chain_mask`, made once per batch and width); the
# drafter's rows (views of the pending rows, made once per width; regrown by `fit`: graphs of their own),
# its aux states unless converted to its dtype (a new tensor every call), num_valid and draft_lens. Each is
# kept by the runtime (static mode, which CUDA graphs need, keeps the buffers per batch size) or, regrown,
# by the graphs captured over it, and is written only between calls, on the device's stream.
TARGET_BOUND = (C.INPUT_IDS, C.POSITIONS, C.CACHE_LENS, C.TREE_MASK)
DRAFTER_BOUND = {True: (C.INPUT_IDS, C.AUX_HIDDEN, C.NUM_VALID, C.CACHE_LENS),
                 False: (C.INPUT_IDS, C.NUM_VALID, C.CACHE_LENS)}


class DeviceRounds:
    """`SpeculativeRuntime`'s device round (a mixin: its methods use the runtime's graph calls, `_target`,
    `_call_drafter`, `_synthetic`, and the stream's `_State`)."""

    def _init_device_rounds(self) -> None:
        self._chain_masks = {}  # (batch, width) -> a chain verify call's mask (_chain_mask)
        self._round_buffers: dict[int, _RoundBuffers] = {}  # static mode: batch -> its device rounds' buffers
        self._settle_graphs: dict[tuple[str, ...], ShapeGraphs] = {}  # _settle_round's inputs -> its graphs
        self._read_graphs: dict[tuple[str, ...], ShapeGraphs] = {}  # _drafts_read's (see _replayed)

    def _device_rounds(self, state) -> bool:
        """Whether every round of this stream runs on the device (`_device_round`): greedy, and plain
        decoding (no policy), or a chain under the fixed policy (every round drafts and verifies all K
        drafts: nothing about the drafts is decided on the host) or under a policy that decides a chain's
        round from numbers read once after the drafter call (`choose_chain`: goodput). The general round
        keeps sampling (rejection sampling walks the drafts' distributions on the host), trees (the menu of
        subtrees and the walk down a tree are the host's) and other policy objects (a `choose` on tensors)."""
        policy = state.policy
        return not state.sampling and (policy is None or (self.backend.speculation.is_chain and (
            type(policy) is FixedDepth or hasattr(policy, "choose_chain"))))

    def _device_round(self, state, live, policy=None, drafted=False):
        """`_round` for a greedy chain under the fixed or the goodput policy, or a plain step, on the device:
        one drafter call, one target call over [last token, the K drafts], the round's bookkeeping (`_settle_round`:
        one graph replay where the backend captures CUDA graphs) and one host read of [accepted, greedy
        ids] per sequence. With the drafts d_1..d_K and the target's argmax g_0..g_K at the call's rows, a
        is the number of leading i with d_i == g_{i-1}; the sequence emits g_0..g_a (the accepted drafts
        are g_0..g_{a-1}, then the target's own token g_a), its cache takes the call's rows 0..a at its
        length, its next root is g_a, and the drafter's next rows are (g_i, the call's aux state at row
        i) for i <= a: the call's outputs as they are, a + 1 rows valid. The state lives in buffers of
        fixed shapes (`_RoundBuffers`) that the graphs read and the bookkeeping writes in place, so the
        host's work a round is the calls themselves: the graph calls (which read the buffers in place,
        `TARGET_BOUND`, the drafter's writing its drafts into the verify call's ids, `_RoundBuffers.into`),
        and the read. Near the context limit the stream's plain steps come here too (those sequences never
        draft again).
        The goodput policy decides on this round's drafts, so its drafted round reads the device twice:
        right after the drafter call, the drafts and their joint probabilities p_1 ... p_d (`_chosen`), from
        which `choose_chain` picks j in 0..K; the target call is then over [last token, d_1..d_j] (width
        j + 1: graphs per width) and the same bookkeeping accepts among those j (a = the leading i <= j with
        d_i == g_{i-1}). Its k = 0 rounds (no drafter call) are plain steps whose rows wait in the pending
        rows (`_RoundBuffers.fit` makes room; by reference where the bookkeeping is eager: `_defers_rows`)
        for the next drafter call, which catches up on all of them (`_device_draft`). The policy is told
        what the general round tells it: j, the accepted counts and the tokens emitted, from the read."""
        start = time.perf_counter()
        b, alive = len(state.prompts), state.alive if live is state.active else live.tolist()
        buffers, pending = state.buffers, state.pending
        defer = self._defers_rows(state, policy, drafted)
        if buffers.deferred and (not defer or alive != buffers.alive):
            buffers.flush()  # (before the live mask changes: the deferred rounds' mask)
        buffers.set_live(alive, state)
        state.reserve(max(n for n, a in zip(state.host_lens, alive) if a) + self.depth + 1)
        drafter_rows, j = None, 0
        learn = state.learn if policy is not None else None  # the policy's learning from the last round
        if drafted:
            out, drafter_rows = self._device_draft(state, alive)
            self._after_launch(state, learn)  # (while the drafter runs: before the read of its drafts)
            j = self._chosen(state, out, policy, alive, replayed=drafter_rows is not None)
        feeds = state.target_feeds.get(j + 1)
        if feeds is None or feeds[C.PAST_KEY] is not state.target_k:  # (made once per width and cache view)
            ids, positions = buffers.views[j + 1]
            feeds = state.target_feeds[j + 1] = {
                C.INPUT_IDS: ids, C.POSITIONS: positions, C.PAST_KEY: state.target_k, C.PAST_VALUE: state.target_v,
                C.CACHE_LENS: buffers.lens, C.TREE_MASK: self._chain_mask(b, j + 1)}
        call = time.perf_counter()
        out = self.backend.target(feeds, need_logits=False, bound=TARGET_BOUND)
        self.timings.verify += time.perf_counter() - call
        if not drafted:  # (while the target runs: before the round's read)
            if pending is not None:  # (the pending rows: the bookkeeping's, not the target's)
                if policy is not None:  # a goodput k = 0 round: room for its row and, where a later round's
                    # append (K+1 rows at most) finds it not live, for that append's padding past its count
                    buffers.fit(max(h for h, a in zip(pending.host, alive) if a) + self.depth + 2, pending)
                if not buffers.adopted:  # (near the limit from the start: no drafter call yet)
                    buffers.adopt(pending)
            self._after_launch(state, learn)
        settled = self._settle(state, out, drafter_rows, keep_rows=not defer)
        if defer:
            buffers.deferred.append((out[C.GREEDY_IDS], out[C.AUX_HIDDEN]))
        read = time.perf_counter()  # the one host read: it waits for everything queued above
        rows = settled.tolist()
        self.timings.verify += time.perf_counter() - read
        if j == 0:  # (a call of the root alone reads its greedy ids alone: nothing accepted, a token each)
            emitted, counts, added = rows, [0] * b, alive  # (a live sequence adds a row: True counts 1)
        else:
            emitted, counts = [row[1:row[0] + 2] for row in rows], [row[0] for row in rows]
            added = [c + 1 if a else 0 for c, a in zip(counts, alive)]
        for i, a in enumerate(alive):
            if a:
                state.host_lens[i] += counts[i] + 1
        if pending is not None:
            pending.added(added)
        if policy is not None:  # (its statistics recorded after the next round's first launch: `_after_launch`)
            state.unrecorded = (alive, counts, [j] * b, j + 1, drafted)
        live_count = state.live_count
        events = state.emit(emitted, alive)
        if state.live_count != live_count:
            self._finished(state)
        if policy is not None and not state.whole_tree:  # (the fixed policy learns nothing: it is not told)
            policy.observe(j, counts, alive if state.live_as_list else live, drafted, emitted)
        if not drafted:
            self.timings.plain_round_s.append(time.perf_counter() - start)
        yield from events

    @staticmethod
    def _after_launch(state, learn) -> None:
        """What the last round left for after this round's first launch (the drafter call, or the target
        call of a round that drafts nothing), so that the device works while the host does it: the last
        round's statistics (`_State.record`; recorded at once in a round that finishes a sequence, whose
        last event carries them) and the policy's learning from its outcome (`learn`). Neither is read
        before then, so they are the same as done at once."""
        state.recorded()
        if learn is not None:
            learn()

    @staticmethod
    def _finished(state) -> None:
        """A device round finished a sequence: its last event carries its statistics, so the round's are
        recorded now, before the events are yielded (not after the next round's first launch)."""
        state.recorded()

    def _defers_rows(self, state, policy, drafted: bool) -> bool:
        """Whether this round's drafter row (the target's greedy id and aux state) waits by reference in
        `_RoundBuffers.deferred` instead of being appended to the pending rows in the bookkeeping: a goodput
        k = 0 round whose bookkeeping runs eagerly. Its append is then one batched append of all such rounds'
        rows before the rows are next read, so the round itself makes a plain step's torch calls. Not with
        CUDA graphs: there the append is inside the bookkeeping's graph (free for the host), and a graph's
        outputs are overwritten by its next replay, while a backend that replays nothing returns new output
        tensors every call (which is what keeping them by reference needs)."""
        return not drafted and policy is not None and state.pending is not None and self.backend.capture is None

    def _device_draft(self, state, alive: list[bool]):
        """A device round's drafter call -> (its outputs, its new K/V rows for `_settle_round` to commit;
        None when committed here). The stream's first call reads every prompt row (a call wider than
        K+1 rows, run eagerly) and commits at once; then the pending rows move into the round's buffers,
        and every later call reads its rows from them: at most K+1 after a drafted round (its accepted
        path and the target's token), more after a goodput stream's k = 0 rounds (a catch-up: one row
        each). A call wider than K+1 rows runs eagerly (the backend captures calls of at most K+1) and
        is committed here, as `_settle_round` commits a K+1-row call's (`_commit_drafter`): a settle graph
        per catch-up width would be captured for one use."""
        buffers, pending = state.buffers, state.pending
        into = buffers.into if state.synthetic is None else ()  # (synthetic drafts are the host's: `_chosen`)
        if not buffers.adopted:
            out, _ = self._call_drafter(state, alive, buffers.live, into)
            buffers.draft_lens.copy_(state.draft_lens)
            state.draft_lens = buffers.draft_lens
            buffers.adopt(pending)
            return out, None
        width = self.drafter_width(max(h for h, a in zip(pending.host, alive) if a))
        ids, aux = buffers.drafter_rows(width)
        if width != self.depth + 1:  # (a catch-up; or growing caches, whose rows are not padded to K+1)
            torch.clamp(buffers.count, 1, width, out=buffers.num_valid)
        same = buffers.aux_dtype == self.backend.drafter_dtype  # (else converted: a new tensor every call, not bound)
        feeds = {C.INPUT_IDS: ids, C.AUX_HIDDEN: aux if same else aux.to(self.backend.drafter_dtype),
                 C.NUM_VALID: buffers.num_valid, C.PAST_KEY: state.draft_k, C.PAST_VALUE: state.draft_v,
                 C.CACHE_LENS: buffers.draft_lens}
        start = time.perf_counter()
        out = self.backend.drafter(feeds, bound=DRAFTER_BOUND[same], into=into)
        self.timings.draft += time.perf_counter() - start
        pending.taken(alive)
        if width > self.depth + 1:
            new_rows = {name: out[name][:, :, :, :width] for name in (C.NEW_KEY, C.NEW_VALUE)}
            _commit_drafter(state.draft_k, state.draft_v, new_rows, buffers.draft_lens, buffers.num_valid,
                            buffers.live, buffers.count)
            return out, None
        return out, buffers.new_rows(out, width)

    def _chosen(self, state, out, policy, alive: list[bool], replayed: bool) -> int:
        """A drafted device round's drafts, in the verify call's ids (`_RoundBuffers.drafts`: the drafter
        call wrote them there, `into`; synthetic drafts, the host's, are copied in here) -> j, how many it
        verifies: all K under the fixed policy; else the policy's choice (`choose_chain`), from [B, 2K]
        numbers read in one transfer: the joint probabilities p_1 ... p_d (`tree.chain_joint`, computed on
        the device) and the drafts, as float64 (float32 values and ids below 2^53: both exact). The read
        waits for the drafter's work, and is timed as the drafter's (as the general round's read of its
        drafts is). Its few ops are replayed from a graph of their own over the drafts' buffer and the
        probabilities a drafter call of at most K+1 rows outputs (`replayed`: the same static tensors every
        round), eagerly after a wider call (the first, a catch-up: fresh tensors a graph would copy in).
        Synthetic drafts and their probabilities (the host's) are copied into the round's buffers and read
        through the same graph over those (the products are elementwise: the same bits on the host and the
        device; eagerly, the read is a dozen torch calls of host time a round)."""
        buffers = state.buffers
        if state.synthetic is not None:  # host-made drafts, queued to the device without waiting for it
            nodes, probs = self._synthetic(state, *state.chain_depths)
            buffers.drafts.copy_(nodes.to(self.device, non_blocking=True))
            if not state.whole_tree:
                buffers.probs.copy_(probs.to(self.device, non_blocking=True))
            nodes, probs, replayed = buffers.drafts, buffers.probs, True
        else:  # (the drafter call wrote its drafts there: `_RoundBuffers.into`)
            nodes, probs = buffers.drafts, out[C.DRAFT_TOKEN_PROBS]
        if state.whole_tree:
            return self.depth
        start = time.perf_counter()
        if replayed:
            read = self._replayed(self._read_graphs, _drafts_read, {"nodes": nodes, "token_probs": probs}).tolist()
        else:
            read = _drafts_read(nodes, probs).tolist()
        self.timings.draft += time.perf_counter() - start
        k = self.depth  # (the drafts' ids as read, floats holding them exactly: `choose_chain`)
        return policy.choose_chain([row[:k] for row in read], alive, state.chain_widths, [row[k:] for row in read])

    def _settle(self, state, out, drafter_rows, keep_rows: bool = True) -> torch.Tensor:
        """`_settle_round` over the round's buffers and the graphs' outputs -> [accepted, greedy ids] [B,1+T]
        (T = 1: the greedy ids alone): through a graph captured per set of input shapes (`ShapeGraphs`, every
        input bound by reference:
        they are the runtime's own buffers and the graphs' static outputs) where the backend captures
        CUDA graphs, eagerly otherwise."""
        buffers = state.buffers
        feeds = {"lens": buffers.lens, "verify_ids": buffers.verify_ids, "positions": buffers.positions,
                 "live": buffers.live, "target_k": state.target_k, "target_v": state.target_v,
                 "greedy": out[C.GREEDY_IDS], "aux": out[C.AUX_HIDDEN], "new_key": out[C.NEW_KEY],
                 "new_value": out[C.NEW_VALUE]}
        if state.pending is not None and keep_rows:  # (else the round's rows wait: `_defers_rows`)
            feeds.update(pending_ids=buffers.ids, pending_aux=buffers.aux, pending_count=buffers.count,
                         num_valid=buffers.num_valid)
        if drafter_rows is not None:
            feeds.update(draft_lens=buffers.draft_lens, draft_k=state.draft_k, draft_v=state.draft_v,
                         draft_new_key=drafter_rows[C.NEW_KEY], draft_new_value=drafter_rows[C.NEW_VALUE])
        return self._replayed(self._settle_graphs, _settle_round, feeds, warmup=_dry)

    def _replayed(self, graphs: dict, fn, feeds: dict[str, torch.Tensor], warmup=None) -> torch.Tensor:
        """fn(**feeds), a function of the runtime's own with one output: through a graph captured per set of
        input shapes and addresses (`ShapeGraphs` kept in `graphs` by input names, every input bound by
        reference: they are the runtime's buffers and the graphs' static outputs, which the bookkeeping
        writes in place, so never copied in: a regrown buffer, or a drafter graph's outputs over one, get a
        graph of their own; `warmup(names, inputs)` the warm-up's inputs) where the backend captures CUDA
        graphs, eagerly otherwise."""
        if self.backend.capture is None:
            return fn(**feeds)
        names = tuple(feeds)
        if names not in graphs:
            graphs[names] = ShapeGraphs(lambda *inputs: (fn(**dict(zip(names, inputs))),), list(names), names,
                                        self.backend.capture,
                                        warmup=None if warmup is None else functools.partial(warmup, names),
                                        by_address=True)
        return graphs[names](feeds)[0]

    def round_buffers(self, batch: int) -> _RoundBuffers:
        """A device round's buffers for `batch` sequences: new ones, or in static mode this batch size's,
        made once and reused by every stream (a captured graph writes the tensors it was captured with)."""
        if not self.static_cache:
            return _RoundBuffers(batch, self.depth, self.aux_width, self.backend.model_dtype, self.device)
        if batch not in self._round_buffers:
            self._round_buffers[batch] = _RoundBuffers(batch, self.depth, self.aux_width, self.backend.model_dtype,
                                                       self.device)
        return self._round_buffers[batch]

    def _chain_mask(self, batch: int, width: int) -> torch.Tensor:
        """A chain's verify call of `width` tokens: its tree_mask (causal), on the device, made once per
        (batch, width), and dense: a graph reads it in place (`TARGET_BOUND`), and one captured over another
        runtime's copies it in, which an expanded tensor's shared elements refuse."""
        if (batch, width) not in self._chain_masks:
            self._chain_masks[batch, width] = causal_mask(batch, width, self.device).contiguous()
        return self._chain_masks[batch, width]


class _RoundBuffers:
    """A device round's state on the device, in tensors of fixed shapes made once (per batch size in
    static mode) that the graphs read and `_settle_round` writes in place: a CUDA graph replays the
    addresses it was captured with. lens [B] (target positions in cache); verify_ids [B,K+1], the next
    verify call's ids (column 0 its root, the last emitted token; then the drafts, `drafts`) and positions
    [B,K+1] (lens + 0..K); live [B] (the round's live mask, copied in when it changes); with a drafter:
    draft_lens [B], num_valid [B] (the next drafter call's valid rows) and the pending rows (ids [B,P],
    aux [B,P,A], count [B], `_PendingRows`'s), P = 2(K+1) to begin with: after a drafted round a
    sequence that drafts has at most K+1 pending, which a drafter call reads, and a row appended past
    them (a sequence that no longer drafts: finished, or near the context limit) lands at or past slot
    K+1, read by no call. A goodput stream's k = 0 rounds add a row each until its next drafter call
    catches up: `fit` grows P for them."""

    def __init__(self, batch: int, depth: int, aux_width: int, aux_dtype: torch.dtype, device):
        w, zeros = depth + 1, functools.partial(torch.zeros, dtype=torch.int64, device=device)
        self.lens, self.verify_ids, self.positions = zeros(batch), zeros(batch, w), zeros(batch, w)
        self.live = torch.zeros(batch, dtype=torch.bool, device=device)
        self.draft_lens, self.num_valid, self.count = zeros(batch), zeros(batch), zeros(batch)
        self.ids = zeros(batch, 2 * w)
        self.aux = torch.zeros(batch, 2 * w, aux_width, dtype=aux_dtype, device=device)
        self.aux_dtype = aux_dtype  # (aux's, kept: a tensor's dtype is a torch call, in every drafted round)
        self.room = 2 * w  # P
        self.drafts = self.verify_ids[:, 1:]
        self.probs = torch.zeros(batch, depth, device=device)  # synthetic drafts' probabilities (`_chosen`)
        self.into = ((C.DRAFT_IDS, self.drafts),)  # a drafter call's drafts, written here (`Backend.drafter`)
        # Views made once (each slicing is a torch call, host time in every round): a verify call's
        # (ids, positions) by its width (a plain step: 1, a drafted round: j+1, K+1 under the fixed policy),
        # the drafter's rows by theirs.
        self.views = {t: (self.verify_ids[:, :t], self.positions[:, :t]) for t in range(1, w + 1)}
        self._rows = {}
        self.alive, self.adopted = None, False
        self.deferred = []  # eager k = 0 rounds' drafter rows, not yet appended: (greedy [B,1], aux [B,1,A])

    def start(self, lens, first, state) -> None:
        """A stream's state after its prompt pass: cache lengths, the first token (the first root), the
        live mask; no drafter rows yet (`adopt` takes the prompt's after the first drafter call)."""
        self.lens.copy_(lens)
        self.verify_ids[:, 0].copy_(first)
        self.positions.copy_(self.lens.view(-1, 1) + _arange(self.positions.shape[1], self.lens.device))
        self.draft_lens.zero_()
        self.alive, self.adopted, self.deferred = None, False, []
        self.set_live(state.alive, state)

    def set_live(self, alive: list[bool], state) -> None:
        """The round's live mask into `live` (a copy on the device, only when it changed)."""
        if alive != self.alive:
            self.live.copy_(state.on_device(alive))
            self.alive = alive

    def flush(self) -> None:
        """Append the deferred rows (`DeviceRounds._defers_rows`: R k = 0 rounds under one live mask, `live`)
        to the pending rows, as the R rounds' bookkeeping would have one by one: a live sequence's count grows
        by R, its rows the rounds' in order; a sequence not live writes padding past its count (never read).
        One append for the R rounds (two concatenations, two scatters) and num_valid made for the next call."""
        greedy, aux = zip(*self.deferred)
        self.deferred = []
        _append_rows(self.ids, self.aux, self.count, torch.cat(greedy, dim=1), torch.cat(aux, dim=1), None,
                     self.live * len(greedy))
        torch.clamp(self.count, 1, self.verify_ids.shape[1], out=self.num_valid)

    def adopt(self, pending: _PendingRows) -> None:
        """Move the pending rows into these buffers (the first P of each sequence: see the class) and
        make `pending` use them."""
        p = min(self.ids.shape[1], pending.ids.shape[1])
        self.ids.zero_()
        self.aux.zero_()
        self.ids[:, :p], self.aux[:, :p] = pending.ids[:, :p], pending.aux[:, :p]
        self.count.copy_(pending.count)
        torch.clamp(self.count, 1, self.verify_ids.shape[1], out=self.num_valid)
        pending.ids, pending.aux, pending.count = self.ids, self.aux, self.count
        self.adopted = True

    def fit(self, rows: int, pending: _PendingRows) -> None:
        """Room for `rows` pending rows a sequence (a goodput stream's k = 0 rounds add one each, and its
        next drafter call catches up on them all): the rows' buffers grow by doubling, their rows kept.
        The settle graphs captured over the old buffers keep them (a geometric series: at most as much
        again), and new ones are captured over these (a graph per set of shapes)."""
        if rows <= self.room:  # (a Python int: a tensor's shape is a torch call, in every k = 0 round)
            return
        self.ids, self.aux = _grown(self.ids, self.aux, rows)
        self.room = self.ids.shape[1]
        self._rows.clear()
        if self.adopted:
            pending.ids, pending.aux = self.ids, self.aux

    def drafter_rows(self, width: int):
        """The drafter's input rows (ids [B,W], aux [B,W,A]): views of the pending rows, kept for the
        widths of calls after a drafted round (a catch-up's width is rarely seen twice)."""
        if width in self._rows:
            return self._rows[width]
        rows = self.ids[:, :width], self.aux[:, :width]
        if width <= self.verify_ids.shape[1]:
            self._rows[width] = rows
        return rows

    def new_rows(self, out, width: int) -> dict[str, torch.Tensor]:
        """The new K/V of a drafter call's `width` input rows (its later steps' rows follow), as views
        made once per output tensor: a graph's outputs are the same tensors at every replay."""
        key = (width, C.NEW_KEY)
        if self._rows.get(key, (None,))[0] is not out[C.NEW_KEY]:
            self._rows[key] = out[C.NEW_KEY], {name: out[name][:, :, :, :width] for name in (C.NEW_KEY, C.NEW_VALUE)}
        return self._rows[key][1]


def _settle_round(lens, verify_ids, positions, live, target_k, target_v, greedy, aux, new_key, new_value,
                  pending_ids=None, pending_aux=None, pending_count=None, num_valid=None,
                  draft_lens=None, draft_k=None, draft_v=None, draft_new_key=None, draft_new_value=None):
    """A device round's bookkeeping, from the verify call's outputs to what the host reads: everything
    in place on the round's buffers (`_RoundBuffers`) and the caches, tensor ops of fixed shapes with no
    host read, so that one CUDA graph holds it (`cuda_graphs.check_capturable` proves it on CPU) ->
    [accepted, greedy ids] [B,1+T], the one read (T = 1: the greedy ids alone, [B,1]). In order:
      the drafter call of this round (given its new K/V rows): its first num_valid rows committed at
      draft_lens, draft_lens += num_valid, its pending rows consumed (count = 0), live sequences only;
      accepted = the leading drafts verify_ids[:, 1:T] equal to greedy (0 in a plain step, T = 1, where
      none of acceptance's ops run: each is host time in an eager round);
      the target's rows 0..accepted committed at lens; the drafter's next rows (greedy, aux) appended,
      accepted + 1 of them valid; lens += accepted + 1; the root becomes greedy[accepted]; positions
      and num_valid made for the next round.
    A sequence not live changes nothing that is read later (its rows go to the caches' sink row,
    its appended rows are padding past its count): the capture's warm-up runs with no sequence live
    (`_dry`)."""
    b, width = greedy.shape
    if draft_new_key is not None:
        _commit_drafter(draft_k, draft_v, {C.NEW_KEY: draft_new_key, C.NEW_VALUE: draft_new_value}, draft_lens,
                        num_valid, live, pending_count)
    if width == 1:  # a plain step (or a drafted round verifying no draft): nothing to accept, nothing to add
        accepted, taken, next_root = None, live.long(), greedy.view(b)
    else:
        accepted = greedy_accepted_path(verify_ids[:, 1:width], None, greedy)[0].view(b, 1)
        taken = torch.where(live.view(b, 1), accepted + 1, 0).view(b)
        next_root = greedy.gather(1, accepted).view(b)
    _write_rows(target_k, target_v, {C.NEW_KEY: new_key, C.NEW_VALUE: new_value}, lens, taken, live)
    if pending_ids is not None:
        _append_rows(pending_ids, pending_aux, pending_count, greedy, aux, None, taken)
        torch.clamp(pending_count, 1, verify_ids.shape[1], out=num_valid)
    lens.add_(taken)
    root = verify_ids[:, 0]
    torch.where(live, next_root, root, out=root)
    torch.add(lens.view(b, 1), _arange(positions.shape[1], lens.device), out=positions)
    return greedy if accepted is None else torch.cat([accepted, greedy], dim=1)


def _drafts_read(nodes, token_probs) -> torch.Tensor:
    """What the goodput policy's choice reads of a chain's drafts, [B, 2K] float64 for one transfer: the
    joint probabilities p_1 ... p_d (`tree.chain_joint`, float32 values) beside the drafts' ids (below
    2^53): both exact in float64."""
    return torch.cat([tree.chain_joint(token_probs).double(), nodes.double()], dim=1)


def _commit_drafter(draft_k, draft_v, new_rows, draft_lens, num_valid, live, pending_count) -> None:
    """A drafter call's input rows consumed, live sequences only, in place and without a host read: the
    first num_valid of its new K/V rows committed at draft_lens, draft_lens += num_valid, the pending
    rows' count = 0 (`_settle_round` for a K+1-row call, `_device_draft` for a catch-up)."""
    _write_rows(draft_k, draft_v, new_rows, draft_lens, num_valid, live)
    draft_lens.add_(torch.where(live, num_valid, 0))
    pending_count.masked_fill_(live, 0)


def _dry(names, inputs):
    """`_settle_round`'s inputs with no sequence live: what its capture warms up on (see its docstring)."""
    return [torch.zeros_like(t) if name == "live" else t for name, t in zip(names, inputs)]
