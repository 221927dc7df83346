"""The rows a round moves, on the backend's device, as whole-batch tensor operations without a host read:
new K/V rows committed into the caches (`_write_rows`: the only cache write the runtime does) and the
drafter's input rows that wait for its next call (`_PendingRows`, `_append_rows`). The general round
(`runtime.py`) and the device round (`device_round.py`) both write through these."""

from __future__ import annotations

import functools
import math

import torch

from ..errors import EagleExportError
from ..models import contract as C


class _PendingRows:
    """The drafter's input rows it has not consumed yet, on the device: token ids [B,W], aux states
    [B,W,A] and each sequence's count [B] (its first count rows are real; the rest is padding, which
    an append may overwrite), and the counts as the host knows them (`host`: the drafter's width,
    without a read). Verify calls append; a drafter call takes all rows of the live sequences (the
    others never draft again: they finished or finish token by token, so their rows are never read)."""

    def __init__(self, ids, aux, count):
        self.ids, self.aux = ids.to(aux.device), aux.clone()  # ours to write into
        self.count, self.host = count.to(aux.device).clone(), count.tolist()

    def _fit(self, width):
        if width > self.aux.shape[1]:
            self.ids, self.aux = _grown(self.ids, self.aux, width)

    def append(self, tokens, aux, rows, added):
        """Sequence b's next added[b] rows: tokens[b, i] [B,R], the i-th beside the aux state of the
        verify call's row rows[b, i] (None: row i), the row that predicted it. All R go to the slots
        after its count (past added[b] they are padding): two scatters for the whole batch, no host
        read. The host's counts follow with `added`."""
        self._fit(max(self.host) + tokens.shape[1])
        _append_rows(self.ids, self.aux, self.count, tokens, aux, rows, added)

    def added(self, counts: list[int]) -> None:
        """The host's counts after an append of counts[b] rows to sequence b (what its `added` held; bools
        count 1 and 0: a plain step's live mask)."""
        self.host = [h + n for h, n in zip(self.host, counts)]

    def take(self, alive: list[bool], live, width_for=lambda rows: rows):
        """The live sequences' rows at the width `width_for` gives (padding rows beyond num_valid):
        ids [B,W], aux [B,W,A], num_valid [B] (at least 1: a finished sequence's row is padding).
        alive: the live mask as a list, live: on the device."""
        width = width_for(max(h for h, keep in zip(self.host, alive) if keep))
        self._fit(width)
        num_valid = self.count.clamp(1, width)
        self.count = torch.where(live, 0, self.count)
        self.taken(alive)
        return self.ids[:, :width], self.aux[:, :width], num_valid

    def taken(self, alive: list[bool]) -> None:
        """The host's counts after a drafter call took every row of the live sequences."""
        self.host = [0 if keep else h for h, keep in zip(self.host, alive)]


def _grown(ids, aux, rows: int):
    """Pending rows ids [B,P], aux [B,P,A] with room for `rows` > P a sequence, their rows kept: grown by
    doubling (plain steps and k = 0 rounds add one row at a time)."""
    grow = max(rows, 2 * ids.shape[1]) - ids.shape[1]
    return (torch.cat([ids, ids.new_zeros(len(ids), grow)], dim=1),
            torch.cat([aux, aux.new_zeros(len(aux), grow, aux.shape[2])], dim=1))


def _append_rows(ids, aux_rows, count, tokens, aux, rows, added) -> None:
    """Append to pending rows ids [B,P], aux_rows [B,P,A] with counts count [B], in place: sequence b's
    rows tokens[b, i] [B,R] beside the aux state of the verify call's row rows[b, i] (None: row i), all
    R of them at the slots after its count (past added[b] they are padding), then count += added. Two
    scatters for the whole batch, no host read. A slot past P is clamped into the last one: `_PendingRows`
    grows first so that none is, and a device round's buffers never read a slot that high (see
    _RoundBuffers: only the rows of a sequence that no longer drafts land there)."""
    device, (b, width), a = aux_rows.device, tokens.shape, aux.shape[2]
    slots = (count.view(b, 1) + _arange(width, device)).clamp_(max=ids.shape[1] - 1)
    ids.scatter_(1, slots, _to(tokens, device))
    source = aux[:, :width] if rows is None else aux.gather(1, _to(rows, device).view(b, width, 1).expand(-1, -1, a))
    aux_rows.scatter_(1, slots.view(b, width, 1).expand(-1, -1, a), source)
    count.add_(_to(added, device))


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself where it is already (each torch call, even one that does nothing,
    is host time in every round)."""
    return tensor if tensor.device == device else tensor.to(device)


_RANGES: dict = {}  # device -> the longest arange made there; (n, device) -> its view [0, n)


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """[0, n) on `device`, made once and kept for the process: a CUDA graph captured over it reads its
    memory at every replay without holding it (one evicted from a bounded cache would be freed and
    its memory reused under the graph). Views of one arange a device, regrown by doubling, so all of
    them take at most four times the longest. Callers must not write into it."""
    key = (n, device)
    if key not in _RANGES:
        longest = _RANGES.get(device)
        if longest is None or len(longest) < n:
            longest = _RANGES[device] = torch.arange(max(n, 2 * len(longest) if longest is not None else n),
                                                     device=device)
        _RANGES[key] = longest[:n]
    return _RANGES[key]


def _new_cache(shape, dtype, device) -> torch.Tensor:
    """A zeroed K/V cache [L,B,H,S,D], contiguous, whose memory holds one row of D more past its end:
    the sink `_write_rows` sends the rows it does not commit to (no cache, and no view of one, holds it)."""
    return torch.zeros(math.prod(shape[:4]) + 1, shape[4], dtype=dtype, device=device)[:-1].view(shape)


def _write_rows(keys, values, out, starts, counts, live):
    """Commit the first counts[b] new K/V rows of each live sequence at its cache length: the only
    cache write the runtime does (rejected rows are simply never written). On the caches' device,
    without a host read, in fixed shapes (a CUDA graph holds it): one index_copy_ a cache over the rows
    of its memory (`_rows`: slot s of (l, b, h) is row ((l B + b) H + h) step + s), new row r of
    (l, b, h) to the row of slot starts[b] + r where r < counts[b] and b is live, and every other new
    row (not committed, or of a sequence not live) to the sink, a row past the cache (`_new_cache`)
    that nothing reads. So no other slot is touched and no cache row is read back. The bits are
    copied: the commit is exact. A live sequence's rows lie inside the cache view (`_State.reserve`);
    a slot past it is clamped to its last (a caller's bug then stays in the sequence's own rows)."""
    device, b, r = keys.device, len(starts), out[C.NEW_KEY].shape[3]
    key_rows, step, sink = _rows(keys)
    value_rows, *layout = _rows(values)
    if layout != [step, sink]:
        raise EagleExportError("the K and V caches differ in layout", "allocate caches with the runtime (`_new_cache`)")
    rows = _arange(r, device)
    keep = ((rows < _to(counts, device).view(b, 1)) & _to(live, device).view(b, 1)).view(1, b, 1, r)
    layers, _, heads = keys.shape[:3]
    slot = torch.add((_to(starts, device).view(b, 1) + rows).clamp_(max=keys.shape[3] - 1).view(1, b, 1, r),
                     _arange(layers * b * heads, device).view(layers, b, heads, 1), alpha=step)
    index = torch.where(keep, slot, sink).view(-1)
    for memory, new in ((key_rows, out[C.NEW_KEY]), (value_rows, out[C.NEW_VALUE])):
        memory.index_copy_(0, index, new.reshape(index.shape[0], -1))


def _rows(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A cache [L,B,H,S,D] as rows of the memory it lies in, from its first element: (memory [N,D], row i
    its elements i s3 .. i s3 + D-1 (s_i: the cache's strides); step, so that cache[l, b, h, s] is
    memory[((l B + b) H + h) step + s]; the sink N-1, the memory's last row, past the cache's last:
    `_new_cache` makes caches so). A cache contiguous or a view of one along S (the static caches) is
    laid out so: step = s2 / s3, s1 = H s2, s0 = B s1."""
    shape, stride, offset = cache.shape, cache.stride(), cache.storage_offset()
    n = (cache.untyped_storage().nbytes() // cache.element_size() - offset) // stride[3]
    return cache.as_strided((n, shape[4]), (stride[3], 1), offset), _step(shape, stride, n), n - 1


@functools.lru_cache(maxsize=64)
def _step(shape, stride, n: int) -> int:
    """`_rows`' step for a cache of this layout in a memory of n rows from its first element, once it
    has checked the layout (whole rows, (l, b, h) equally spaced, the last row past the cache's)."""
    layers, batch, heads, slots, dim = shape
    row = stride[3]
    last = sum((size - 1) * st for size, st in zip(shape[:4], stride)) // row
    if (stride[4] != 1 or row < dim or stride[2] % row or stride[1] != heads * stride[2]
            or stride[0] != batch * stride[1] or last >= n - 1):
        raise EagleExportError(f"a K/V cache of shape {tuple(shape)} and strides {stride} is not laid out as the "
                               "runtime's, with a sink row past it", "allocate caches with the runtime (`_new_cache`)")
    return stride[2] // row
