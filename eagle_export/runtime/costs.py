"""The measured cost model: seconds per target call of T tokens and per drafter call, on this machine.

The verify policy trades tokens against time, so it needs what the calls cost here, not FLOPs: on a
CPU a 5-token verify may cost barely more than a 1-token step (the weights are read once either
way), on a GPU at batch 16 it may cost 3x. The curves are measured on the backend itself, batch
by batch as batch sizes come into use:
    verify[B][T]   the target graph over T = 1..K+1 new tokens (T = 1 is a plain decoding step)
    draft[B][W]    the unrolled drafter over W = 1..K+1 input rows (it always proposes K)
    catch_up[B]    the drafter over CATCH_UP_ROWS rows: after plain steps it catches up on every row it
                   has not seen in one call, which costs more than a K+1-row call (0.28 ms more per row
                   at batch 4 on the sample build, 6.8 ms fixed), and the policy prices its probes by it
each the median of REPS calls taken in turn (T = 1, 2, ..., K+1, then again), after a warm-up, with
a cache of PAST valid slots. They are cached per backend and machine in the build directory
(`costs.json`; in the user cache when the build directory is read-only), so a build pays for the
measurement once per machine; a cache that is unreadable or outside its schema (COSTS_SCHEMA: a time
that is zero, negative or NaN, a width missing) is measured again, said in one line, and replaced.
"""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import Const, Map, Number, Record, Text, cache_root, read_cache, say, write_cache
from ..environment import package_version, tensorrt_version
from ..lazy import lazy
from ..models import contract as C

torch = lazy("torch")  # the manifest (read by `inspect BUILD`) names COSTS_FILE; measuring needs torch

COSTS_FILE = "costs.json"
COSTS_FORMAT = 2  # 2: catch_up_s
REPS = 5
PAST = 256  # valid cache slots during the measurement (the verify cost grows slowly with it)
CATCH_UP_ROWS = 64  # a drafter call after this many plain steps (the policy's probes are 16 to 1024 apart)


@dataclass
class CostCurves:
    """Measured seconds per call; batch sizes are measured as they come into use."""

    verify_s: dict[int, dict[int, float]] = field(default_factory=dict)   # batch -> tokens -> s
    draft_s: dict[int, dict[int, float]] = field(default_factory=dict)    # batch -> rows -> s
    catch_up_s: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> {CATCH_UP_ROWS: s}

    def has(self, batch: int) -> bool:
        return batch in self.verify_s and batch in self.draft_s

    def verify(self, batch: int, tokens: int) -> float:
        return self.verify_s[batch][tokens]

    def draft(self, batch: int, rows: int | None = None) -> float:
        """A drafter call over `rows` input rows (None: K+1, the widest of the curve), any number: the
        curve within it; beyond it, the line through its widest call and the catch-up call, extended past
        that (a call's cost is affine in its rows once they fill the machine). Without a catch-up
        measurement, the widest call's cost."""
        curve, point = self.draft_s[batch], self.catch_up_s.get(batch)
        widest = max(curve)
        if rows is None:
            return curve[widest]
        if rows in curve:
            return curve[rows]
        if rows < widest:  # fewer rows than any measured
            return curve[min(curve)]
        if not point:
            return curve[widest]
        (far, far_s), = point.items()
        slope = max(0.0, (far_s - curve[widest]) / (far - widest)) if far > widest else 0.0
        return curve[widest] + slope * (rows - widest)

    def in_ms(self, batch: int) -> dict:
        """One batch size's curves in milliseconds, as bench and the GPU kit report them."""
        return {"verify_ms": {t: round(1000 * s, 3) for t, s in self.verify_s[batch].items()},
                "draft_ms": {w: round(1000 * s, 3) for w, s in self.draft_s[batch].items()},
                "catch_up_ms": {w: round(1000 * s, 3) for w, s in self.catch_up_s.get(batch, {}).items()}}

    def to_json(self) -> dict:
        return {"verify_s": {str(b): {str(t): s for t, s in c.items()} for b, c in self.verify_s.items()},
                "draft_s": {str(b): {str(w): s for w, s in c.items()} for b, c in self.draft_s.items()},
                "catch_up_s": {str(b): {str(w): s for w, s in c.items()} for b, c in self.catch_up_s.items()}}

    @classmethod
    def from_json(cls, data: dict) -> CostCurves:
        def curves(d):  # caches written before curves were made monotone are read as they are now
            return {int(b): monotone({int(t): float(s) for t, s in c.items()}) for b, c in d.items()}
        return cls(curves(data.get("verify_s", {})), curves(data.get("draft_s", {})), curves(data.get("catch_up_s", {})))


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """The running maximum c'(n) = max over m <= n of c(m): a call over more tokens (rows) does at least
    the work of one over fewer, so a curve that dips (T=6 483 ms, T=7 239 ms, under a neighbour's load)
    is measuring noise, and a policy reading a dip would favour a width for nothing."""
    out, highest = {}, 0.0
    for n in sorted(curve):
        highest = max(highest, curve[n])
        out[n] = highest
    return out


def disagreement(a: dict[int, float], b: dict[int, float]) -> tuple[int, float] | None:
    """(width, ratio) where two curves of the same graph differ most (ratio = larger / smaller, >= 1),
    over the widths both have; None when they share none."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    return max(((n, max(a[n], b[n]) / min(a[n], b[n])) for n in common), key=lambda nr: nr[1])


def machine_id(device: str) -> str:
    """What the costs depend on: the processor (model and usable cores) or the GPU."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def cost_key(backend, threads: int | None, static_cache: bool | None = None) -> str:
    """Costs hold for one backend, library version, thread setting, cache mode, kernel set and machine."""
    version = {"onnxruntime": package_version("onnxruntime") or package_version("onnxruntime-gpu"),
               "tensorrt": tensorrt_version(), "torch": torch.__version__}.get(backend.name)
    mode = " with CUDA graphs" if backend.cuda_graphs else " with static caches" if static_cache else ""
    mode += " (exact kernels)" if getattr(backend, "exact", False) else ""
    return f"{backend.name} {version}{mode} on {machine_id(backend.device)}, threads {threads or 'default'}"


# costs.json: {"format": 2, "entries": {key: {"verify_s"|"draft_s"|"catch_up_s": {batch: {width: seconds}}}}}.
# A time is above 0 and at most an hour (a call that took longer was not measured: it was stopped).
SECONDS = Number(0, 3600, above=True)
WIDTH = Number(1, 1 << 20, whole=True)
CURVES = Map(WIDTH, Map(WIDTH, SECONDS, max_items=4096))  # batch -> width -> seconds
COSTS_SCHEMA = Record({"format": Const(COSTS_FORMAT),
                       "entries": Map(Text(), Record({"verify_s": CURVES, "draft_s": CURVES,
                                                      "catch_up_s": Map(WIDTH, Map(WIDTH, SECONDS, max_items=1))}))})


class CostCache:
    """costs.json: one CostCurves per key (backend, its settings, machine), read and written through
    the cache module (a bad file is measured again, a failed write says so and leaves nothing)."""

    def __init__(self, path: Path | None, key: str):
        self.path, self.key = path, key

    def load(self, verify_width: int | None = None, draft_rows: int | None = None) -> CostCurves:
        """The cached curves; a batch size whose curves do not cover the calls this runtime makes
        (verify T = 1..verify_width, drafter W = 1..draft_rows) is dropped, to be measured again."""
        data = read_cache(self.path, COSTS_SCHEMA) if self.path is not None else None
        curves = CostCurves.from_json(data["entries"].get(self.key, {}) if data else {})
        for batch in sorted(set(curves.verify_s) | set(curves.draft_s)):
            for name, curve, widest in (("verify", curves.verify_s, verify_width), ("drafter", curves.draft_s, draft_rows)):
                if widest is not None and batch in curve and sorted(curve[batch]) != list(range(1, widest + 1)):
                    say(f"{self.path}: batch {batch} ignored and measured again: its {name} curve has widths "
                        f"{sorted(curve[batch])[:12]}, this build calls 1..{widest}")
                    for c in (curves.verify_s, curves.draft_s, curves.catch_up_s):
                        c.pop(batch, None)
                    break
        return curves

    def save(self, curves: CostCurves) -> None:
        if self.path is None:
            return
        data = read_cache(self.path, COSTS_SCHEMA, report=False)  # another process's entries are kept
        entries = data["entries"] if data else {}
        entries[self.key] = curves.to_json()
        write_cache(self.path, {"format": COSTS_FORMAT, "entries": entries})


def cache_path(build_dir: Path, manifest) -> Path:
    """The build directory's costs.json, or one in the user cache when the build is read-only."""
    if os.access(build_dir, os.W_OK):
        return build_dir / COSTS_FILE
    stamp = (manifest.created or "") + "".join(a["sha256"][:8] for a in manifest.artifacts.values())
    return cache_root() / "costs" / f"{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"


def measure(runtime, batch: int, reps: int = REPS, past: int = PAST
            ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per-call seconds of the runtime's target (T = 1..the verify width, K+1 for a chain), drafter
    (W = 1..K+1) and drafter catching up ({CATCH_UP_ROWS: s}, empty where the context cannot hold
    that many rows past the cache) at `batch`."""
    from ..models.layers import causal_mask

    k = runtime.depth
    past = max(1, min(past, runtime.max_context - 2 * (k + 1)))
    catch_up = min(CATCH_UP_ROWS, runtime.max_context - past)
    capacity = past + 2 * (k + 1)
    device = runtime.device
    # The runtime's own caches: in static mode those its calls (and CUDA graphs) will use.
    target_k, target_v, draft_k, draft_v = runtime.caches(batch, runtime.cache_slots(capacity, capacity))
    lens = torch.full((batch,), past, dtype=torch.int64, device=device)

    def target_feeds(t):
        return {C.INPUT_IDS: torch.ones(batch, t, dtype=torch.int64, device=device),
                C.POSITIONS: (lens[:, None] + torch.arange(t, device=device)).contiguous(),
                C.PAST_KEY: target_k, C.PAST_VALUE: target_v, C.CACHE_LENS: lens,
                C.TREE_MASK: causal_mask(batch, t, device)}

    def draft_feeds(w):
        width = runtime.drafter_width(w)  # padded as the runtime pads it
        return {C.INPUT_IDS: torch.ones(batch, width, dtype=torch.int64, device=device),
                C.AUX_HIDDEN: torch.zeros(batch, width, runtime.aux_width, dtype=runtime.backend.drafter_dtype,
                                          device=device),
                C.NUM_VALID: torch.full((batch,), w, dtype=torch.int64, device=device),
                C.PAST_KEY: draft_k, C.PAST_VALUE: draft_v, C.CACHE_LENS: lens}

    def timed(call, feeds):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call(feeds)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    # A tree's verify calls are wider than its drafter's input rows (the root and its nodes).
    verify, draft = {t: [] for t in range(1, runtime.backend.verify_width + 1)}, {w: [] for w in range(1, k + 2)}
    wide = {catch_up: []} if catch_up > k + 1 else {}
    for rep in range(reps + 1):  # the first pass is a warm-up
        for n in range(1, max(len(verify), len(draft)) + 1):  # in turn, as the loop calls them: drafter, verify
            if n in draft:
                d = timed(runtime.backend.drafter, draft_feeds(n))
                draft[n] += [d] if rep else []
            if n in verify:
                v = timed(runtime.backend.target, target_feeds(n))
                verify[n] += [v] if rep else []
        for w in wide:
            d = timed(runtime.backend.drafter, draft_feeds(w))
            wide[w] += [d] if rep else []
    return (monotone({t: statistics.median(s) for t, s in verify.items()}),
            monotone({w: statistics.median(s) for w, s in draft.items()}),
            {w: statistics.median(s) for w, s in wide.items()})
