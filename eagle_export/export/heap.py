"""The C heap's hold on freed memory: what export and build do so that weights they are done with go back
to the system (glibc only; nothing elsewhere). Used by loading, export and build alike."""

from __future__ import annotations

import ctypes
import gc


def release_freed_memory() -> None:
    """Collect unreachable objects and hand the C heap's free pages back to the system (glibc's
    malloc_trim; nothing elsewhere). Serializing a graph frees gigabytes in blocks under glibc's
    (dynamic) mmap threshold, which the heap may keep: measured without it, the process stayed 0.84 GiB
    larger after a 0.94 GiB target.onnx was written than before, under the next graph's export."""
    gc.collect()
    _malloc_trim()


def return_large_blocks_at_once() -> None:
    """Serve every allocation of 1 MiB or more by its own mapping, handed back to the system when freed
    (glibc's M_MMAP_THRESHOLD, fixed; nothing elsewhere). glibc raises that threshold as large blocks
    are freed (up to 32 MiB), after which the weights a model pass replaces (the q/k/v and gate/up it
    fuses) or a save has written stay in the heap: measured, loading a Qwen3-1.7B-shaped fp16 pair
    peaked at 5.67 GiB for 3.77 GiB once trimmed, and a build's export of its target graph at 6.36 GiB
    (5.01 with it). Process-wide: `load_pair` sets it while it loads, `export` and `build` from their
    load to the end of their export, then `keep_large_blocks_in_heap` (forward passes, e.g. a build's
    validation, allocate and free many large blocks)."""
    _set_mmap_threshold(1 << 20)


def keep_large_blocks_in_heap() -> None:
    """Undo `return_large_blocks_at_once` for work that allocates and frees many large blocks (forward
    passes): the threshold becomes 32 MiB, the ceiling glibc's dynamic threshold reaches once a process
    has freed blocks that large, as one that has loaded and freed a model has."""
    _set_mmap_threshold(32 << 20)


def _set_mmap_threshold(nbytes: int) -> None:
    try:
        ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _malloc_trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class TrimEvery:
    """Called with each tensor's size as a save writes it; hands the C heap's free pages back
    (`malloc_trim`, as `release_freed_memory` does) after every `interval` bytes, so the freed
    buffers of the tensors already written do not pile up in the heap across the save."""

    def __init__(self, interval: int = 256 * 2**20):
        self.interval, self.pending = interval, 0

    def __call__(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.interval:
            _malloc_trim()
            self.pending = 0
