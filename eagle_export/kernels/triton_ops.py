"""The width-invariant kernels (Triton). Each computes a row with arithmetic fixed by the layer's
shape alone: no tile size, split or reduction order is chosen from the call's rows (M = batch x
tokens), so a row's bits are the same at every call width, batch size and place in the call.

    linear     one tile configuration (linear_config: from the layer's shape and the card) for every
               M, fp32 accumulation along K in one fixed order; no split-K chosen by M (a layer with few
               output tiles splits K into a fixed number of parts, added in split order by the
               tile's last program to finish: _last_arrival). Rows of one tile never mix: an
               output element is a dot product of its own row. Its prologue, on each
               x tile as it is read (the weight still read once), can be an RMSNorm (`norm`: each row's
               rstd over all of K first, in every program and K split, then x * rstd rounded, times
               the gain, rounded) or the MLP's activation (`up`: silu(x) rounded, times up, rounded):
               the RMSNorm or SiLU-mul before q/k/v, gate/up, lm_head or down without a launch of its
               own, bit for bit the standalone kernel's output (the same @triton.jit helpers).
    rms_norm   a fixed number of rows per program (1 on a GPU); each row's sum of squares in an order
               fixed by its length alone (_rstd: NORM_BLOCK lanes, each adding its columns' squares in
               turn, then added pairwise), never by a tl.sum's layout, which differs between kernels;
               x * rstd rounded to the dtype, times the gain, rounded (torch's two roundings).
    silu_mul   elementwise: silu(gate) rounded to the dtype, times up, rounded (torch's two roundings).
    attention  each query row reduces over its *own* visible keys, compacted in key order: the
               cache slots it sees, then the call's new keys it sees (its ancestors and itself in a
               tree). That is the cache-first layout (the call's K/V at the slots after the cache,
               each row over its prefix) read through an index: a row of a verify call over past
               p - j and the one-token step over past p read the same keys at the same logical
               places, and masked keys are never visited, so they change no sum. The keys are cut
               into splits of a fixed SIZE (SPLIT_SIZE keys, not a fixed number of splits), each
               reduced in ATTN_BLOCK blocks in order with an online softmax; the splits holding the
               row's keys are combined in split order (a split past them is never read) by the last
               split program of the (row, KV head) to finish, for its G query heads (_last_arrival).
    rope       q and k in one launch, a program per (rows, head), each element its own x * cos +
               rotated * sin with torch's roundings (each product, then the sum), FMA contraction off.
    argmax     one program per row, blocks in order, ties to the lowest index.

A reduction over programs (linear's K splits, attention's key splits) runs in the launch that made
its partials, not in a second kernel (a launch and a round trip of the partials saved, 96 launches a
plain step on the Llama-3.1-8B shape): each program writes its partial, then counts itself in on its
output tile's counter (an atomic add), and the program that finds all the others counted (whichever
it is) reads every partial back and adds them in split order, exactly as the second kernel did: the
same bits whatever order the programs finish in. What a GPU needs for that (_last_arrival): a barrier
before the count (a scalar atomic runs on one thread; the barrier puts every thread's partial stores
before its release, as Triton's own lock test and CUTLASS's split-K semaphore do), the count acq_rel
(the others' stores released by their adds, acquired by the last one's before its reads; the reads
also go through L2, `.cg`, though PTX makes that a hint only), and the last program setting the
counter back to 0, so the next launch, or a CUDA graph's replay, finds zeros. The counters are one
zeroed int32 buffer a device (_counters), made once outside any graph capture and reused; launches
sharing it must not run at the same time on two streams (the runtime runs one). Under the
interpreter programs run one after another, so there only the protocol's bookkeeping is checked (the
tests also run the programs in shuffled orders); its memory ordering is proven only natively, by
scripts/gpu_exact.sh (tests/test_kernel_reductions.py: fused against the two-kernel path bit for bit, 20 calls
a case, and replayed from a CUDA graph). `_FUSED = False` (EAGLE_EXPORT_TWO_KERNEL_REDUCTIONS=1) runs
the two kernels: the tests' reference, the GPU probe's A/B, and what that script measures on if the
fused path fails there.

Programmatic dependent launch (PDL; compute capability 9.0 and later: _pdl). A kernel launched with it
may begin while the kernel before it in the stream still runs; its gdc_wait (griddepcontrol.wait)
returns once that kernel has ended and its memory is visible. What a decode step loses at batch 1 is
mostly per kernel (~200 a step): the gap between launches and each layer's ramp-up; with PDL the next
kernel's programs are resident when this one ends, and a linear layer's weights already stream:
    the wait  in every kernel, in its top-level block, before its first access to anything another
              kernel writes (activations, the residual, `up`, split partials, the counters, K/V, the
              key index, outputs); before it only the layer's constant parameters may be read: the
              linear kernel prefetches the first lines of its weight slice into L2 (_prefetch_lines).
              Every program waits, also one with nothing to do: a kernel then ends only after the one
              before it, so a later kernel's wait covers all earlier ones (a program skipping it could
              let its kernel end first).
    the trigger  gdc_launch_dependents right after the wait. The next kernel launches once every
              program of this one has called it or exited: all of this grid is then resident or done
              (its last wave has started), so the next one's programs take only what this grid leaves
              free, never a slot it still needs; they trigger nothing before their own wait, which
              returns when this grid ends, so at most one kernel runs ahead. No deadlock with the
              last-arrival reductions: they never spin, and the counters are touched only after the
              wait (the launch that used them before has ended and reset them). An earlier trigger
              would pile kernels up two deep, waiting; a later one (after a linear's K loop) would
              leave the SMs of a grid's partial last wave idle.
Nothing else changes: the same arithmetic after the wait, bit for bit (width invariance untouched).
Inside a CUDA graph capture a PDL launch becomes a programmatic edge (CUDA 12.3 and later); torch's own
kernels between ours launch plainly (they wait for the whole previous kernel, and ours after them
launch when they end). Checked on a CPU by tests/test_kernel_pdl.py (the kernels compiled for sm_90,
TTIR and PTX); its speed is measured only on a GPU (scripts/gpu_probe.py pdl). `_PDL = False`
(EAGLE_EXPORT_NO_PDL=1) launches plainly: the probe's A/B, and scripts/gpu_exact.sh's fallback when
the native tests fail with PDL.

FMA contraction is chosen per launch, not left to Triton's default (on through Triton 3.9, off from
3.10): on in linear, rms_norm, silu_mul, argmax and _sum_splits (as every GPU run so far measured them: an
RMSNorm's sum of squares contracts), off in rope and attention (torch's roundings, each product then the
sum). Either way a row's arithmetic is the same at every width; pinned, it is also the same under every
Triton.

Under TRITON_INTERPRET=1 (the CPU interpreter, CI) tl.dot's operands are upcast to fp32 first: the
interpreter's bf16 dot is wrong (DESIGN.md, "Width invariance"); on a GPU bf16/fp16 run on tensor
cores with fp32 accumulation, fp32 in IEEE precision (no TF32).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from . import MAX_HEAD_DIM

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# One configuration per kernel, whatever the call. The interpreter runs each program in Python, so
# there tiles hold more rows (fewer programs); the property does not depend on which fixed values.
BLOCK_M, BLOCK_N, BLOCK_K = (16, 64, 128) if not INTERPRETED else (64, 256, 128)  # linear's tile
SHARED_BYTES = 200 * 1024  # what the pipeline's stages may hold (an H100/H200 SM has 227 KB)
ROWS = 1 if not INTERPRETED else 64      # rows per program of rms_norm, silu_mul, rope and argmax
ATTN_BLOCK = 16 if not INTERPRETED else 128  # keys per attention block (the interpreter: fewer, wider steps)
SPLIT_SIZE = 64 if not INTERPRETED else 1024  # keys per attention split (the tests pass small ones)
ATTN_WARPS = 2  # warps of an attention split's program: 2 beat 4 in 5 of 6 cells at the 8B shape (H200, gpu_probe attention)
COMBINE_BLOCK = 16  # attention splits the combine reduces at a time (a power of 2: _halves' tree); 64 // GP past 4
# query heads a KV head, so its [GP, DP, SB] block holds no more than a split's [GP, 16 keys, DP] (G = 8 spilled)
ARGMAX_BLOCK = 1024
NORM_BLOCK = 256  # columns a step of an RMSNorm's sum of squares (_rstd): a power of 2, one for every kernel
ARGMAX_CHUNK = 4096 if not INTERPRETED else 1 << 30  # columns a program of argmax's first pass
# Reductions over programs by the last to finish; False: a second kernel (the tests' reference, the probe's A/B,
# and scripts/gpu_exact.sh's fallback when the fused path fails its native tests).
_FUSED = os.environ.get("EAGLE_EXPORT_TWO_KERNEL_REDUCTIONS") != "1"
# Programmatic dependent launch where the card and Triton have it (_pdl); False: plain launches (the GPU probe's
# A/B, and scripts/gpu_exact.sh's fallback when the kernels' native tests fail with it).
_PDL = os.environ.get("EAGLE_EXPORT_NO_PDL") != "1"


def _device(fn):
    """A device function the kernels call (_round, _epilogue, _rstd, _normed, _silu_mul): @triton.jit,
    and under the interpreter the plain Python function, the same source and arithmetic. The interpreter
    re-patches triton.language (scanning its modules) on every nested @jit call: a fifth of the kernels'
    CPU test time went there."""
    return fn if INTERPRETED else triton.jit(fn)


@_device
def _round(x, ty: tl.constexpr, RNE: tl.constexpr):
    """fp32 x rounded to ty, to nearest even as torch rounds. RNE: bf16 rounded by hand first (add
    half an ulp of bf16, ties to even, drop the low 16 bits): the interpreter's fp32 -> bf16 cast
    truncates, a GPU's rounds to nearest even; fp16 and fp32 casts are right in both."""
    if RNE and ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x, w, bias, res, y, part, count, gain, up, M, N, K, K_SPLIT, sxm, sxk, swn, swk, sym, syn, srm, eps,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, HAS_GAIN: tl.constexpr,
                   GATED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                   RNE: tl.constexpr, FUSED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   NB: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_STEP: tl.constexpr):
    """Program (M tile, N tile, K split): its rows' dot products over K[s*K_SPLIT, (s+1)*K_SPLIT) in BK
    steps, in order; one split writes y (_epilogue), several write fp32 partials [SPLIT, M, N], added
    in split order (_sum_splits) by the tile's last program to finish (FUSED: `count` holds a counter
    a tile) or by _sum_splits_kernel after it. The prologue, on each x tile before the dot (the weight
    is still read once): NORM, the rows RMS-normalized (_normed, with each row's rstd over all of K
    from _rstd first, whatever the split); GATED, x is the MLP's gate and the dot's operand
    silu(x) * up (_silu_mul). PDL: the first PF_LINES 128-byte lines (PF_STEP elements each) of each of
    its weight rows' K slice prefetched into L2 before the wait (_pdl), while the previous kernel ends."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    ty = x.dtype.element_ty
    if PDL:
        if PF_LINES > 0:  # addresses clamped into the weight: a row or line past it prefetches its last one again
            lines = tl.minimum(k_lo + tl.arange(0, PF_LINES) * PF_STEP, k_hi - 1)
            _prefetch_l2(w + tl.minimum(rn, N - 1)[:, None] * swn + lines[None, :] * swk)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        rstd = _rstd(x, rm, sxm, sxk, M, K, eps, BM, NB)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + rk
        inside = (rm < M)[:, None] & (kk < k_hi)[None, :]
        a = tl.load(x + rm[:, None] * sxm + kk[None, :] * sxk, mask=inside, other=0.0)
        if NORM:
            a = _normed(a, rstd, gain, kk, k_hi, ty, ty, HAS_GAIN, RNE)
        if GATED:  # gate * 1.0 (a row inside the call) is exact, and it keeps the activation in the layout
            # the tile is loaded in: without it Triton computes it in the dot operand's, where each of the 4
            # warps repeats the whole tile (compiled for sm_90: 4x the exp and divide, 254 registers, not 206)
            a = _silu_mul(a.to(tl.float32) * tl.where(rm < M, 1.0, 0.0)[:, None],
                          tl.load(up + rm[:, None] * sxm + kk[None, :] * sxk, mask=inside, other=0.0), ty, RNE)
        b = tl.load(w + rn[None, :] * swn + kk[:, None] * swk, mask=(rn < N)[None, :] & (kk < k_hi)[:, None], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    inside = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT == 1:
        out = _epilogue(acc, bias, res, rm, rn, M, N, srm, y.dtype.element_ty, HAS_BIAS, HAS_RES, RNE)
        tl.store(y + rm[:, None] * sym + rn[None, :] * syn, out, mask=inside)
    else:
        tl.store(part + (tl.program_id(2) * M + rm[:, None]) * N + rn[None, :], acc, mask=inside)
        if FUSED:
            if _last_arrival(count + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLIT):
                out = _epilogue(_sum_splits(part, rm, rn, M, N, SPLIT), bias, res, rm, rn, M, N, srm,
                                y.dtype.element_ty, HAS_BIAS, HAS_RES, RNE)
                tl.store(y + rm[:, None] * sym + rn[None, :] * syn, out, mask=inside)


@_device
def _prefetch_l2(pointers):
    """The 128-byte line of each pointer fetched into L2 (PTX prefetch.global.L2: nothing waits for it,
    no register is written; the asm's output is a dummy Triton requires)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [pointers], dtype=tl.int32,
                              is_pure=False, pack=1)


@_device
def _last_arrival(counter, n):
    """Whether this program is the last of the n sharing `counter` (an int32, 0 before the first) to
    arrive here, after writing its partial; the last one sets the counter back to 0 (nobody else of the
    launch touches it again). The barrier first: a scalar atomic runs on one thread, and every thread's
    stores must come before its release. acq_rel: the others' partials, released by their own adds,
    are visible to the last one's reads."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel") == n - 1
    tl.store(counter, 0, mask=last)
    return last


@_device
def _sum_splits(part, rows, cols, M, N, SPLIT: tl.constexpr):
    """fp32 partials [SPLIT, M, N] at [rows, cols] added in split order (loaded `.cg`: through L2, where
    the other programs' stores went)."""
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    acc = tl.load(part + rows[:, None] * N + cols[None, :], mask=inside, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part + (s * M + rows[:, None]) * N + cols[None, :], mask=inside, other=0.0, cache_modifier=".cg")
    return acc


@_device
def _halves(x, R: tl.constexpr, C: tl.constexpr):
    """x [R, C] summed along C (a power of 2) in a tree fixed by C: neighbours added pairwise, log2(C)
    times. Each step adds two numbers (the same bits in either order), so nothing is left to the
    compiler's layout of a tl.sum, which differs between kernels."""
    for level in tl.static_range(1, C.bit_length()):
        left, right = tl.split(tl.reshape(x, [R, C >> level, 2]))
        x = left + right
    return tl.reshape(x, [R])


@_device
def _epilogue(acc, bias, res, rows, cols, M, N, srm, ty: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_RES: tl.constexpr, RNE: tl.constexpr):
    """fp32 sums [rows, cols] + bias, rounded to ty once (a GEMM epilogue's one rounding); with a
    residual, res + that, rounded again: torch's `x + linear(h)` bit for bit, without a launch of its own."""
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = _round(acc, ty, RNE)
    if HAS_RES:
        r = tl.load(res + rows[:, None] * srm + cols[None, :], mask=(rows < M)[:, None] & (cols < N)[None, :], other=0.0)
        out = _round(out.to(tl.float32) + r.to(tl.float32), ty, RNE)
    return out


@_device
def _rstd(x, rows, sxm, sxk, M, K, eps, R: tl.constexpr, NB: tl.constexpr):
    """1 / sqrt(mean of squares + eps) of each of x's rows [R] over its K columns, fp32, in an order fixed
    by K alone: lane j of NB adds the squares of columns j, j + NB, j + 2NB, ... in turn (one fma each),
    then the NB lanes are added pairwise (_halves): rms_norm and linear's norm prologue share this and get
    the same bits, at every M, row place and K split."""
    cols = tl.arange(0, NB)
    acc = tl.zeros([R, NB], tl.float32)
    for k0 in range(0, K, NB):
        v = tl.load(x + rows[:, None] * sxm + (k0 + cols)[None, :] * sxk,
                    mask=(rows < M)[:, None] & (k0 + cols < K)[None, :], other=0.0).to(tl.float32)
        acc = tl.fma(v, v, acc)
    return tl.math.rsqrt(_halves(acc, R, NB) / K + eps)


@_device
def _normed(v, rstd, gain, cols, K, ty: tl.constexpr, out: tl.constexpr, HAS_GAIN: tl.constexpr, RNE: tl.constexpr):
    """RMSNorm's rounding of x's columns `cols` [R, C]: x * rstd rounded to ty (x's dtype), then with a
    gain, gain * that rounded to `out` (torch's `weight * normed`)."""
    normed = _round(v.to(tl.float32) * rstd[:, None], ty, RNE)
    if HAS_GAIN:
        normed = _round(tl.load(gain + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :] * normed.to(tl.float32),
                        out, RNE)
    return normed


@_device
def _silu_mul(g, u, ty: tl.constexpr, RNE: tl.constexpr):
    """silu(g) = g / (1 + exp(-g)) rounded to ty, times u, rounded again: torch's F.silu(gate) * up."""
    g = g.to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), ty, RNE).to(tl.float32)
    return _round(silu * u.to(tl.float32), ty, RNE)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part, bias, res, y, M, N, sym, srm, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                       RNE: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, N block): the K splits' partial sums added in split order, then _epilogue (the
    two-kernel path, _FUSED = False)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0) + tl.zeros([1], tl.int32)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    out = _epilogue(_sum_splits(part, row, cols, M, N, SPLIT), bias, res, row, cols, M, N, srm, y.dtype.element_ty,
                    HAS_BIAS, HAS_RES, RNE)
    tl.store(y + row[:, None] * sym + cols[None, :], out, mask=(cols < N)[None, :])


_COUNTER_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on `device` for _last_arrival: one buffer a device, made once
    and reused by every launch (each leaves its counters at 0), so a CUDA graph captures a pointer to
    it and no allocation or memset of its own per call or replay. A larger grid than any before gets a
    larger buffer (doubling; a grid's worth of ints, 256 KB to start, covers a decoding step's
    grids), made outside capture (a capture's eager warm-up calls meet it first); the smaller one is
    kept alive, since a graph captured earlier still points into it."""
    held = _COUNTER_BUFFERS.setdefault(torch.device(device), [])
    if not held or held[-1].numel() < n:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernels: {n} reduction counters needed first inside a CUDA graph capture: "
                               "run the captured function eagerly first (a warm-up)")
        held.append(torch.zeros(max(n, 2 * held[-1].numel() if held else 1 << 16), dtype=torch.int32, device=device))
    return held[-1]


def _pdl(device: torch.device) -> dict:
    """The launch options of a kernel on `device`: {"PDL": bool, "launch_pdl": bool}, programmatic
    dependent launch on where it runs (the module's docstring): natively, on a CUDA card of compute
    capability 9.0 or later, with a Triton that has gdc_wait; and with _PDL (EAGLE_EXPORT_NO_PDL unset)."""
    on = (_PDL and not INTERPRETED and device.type == "cuda"
          and _pdl_card(device.index if device.index is not None else torch.cuda.current_device()))
    return {"PDL": on, "launch_pdl": on}


def launch_path(device: torch.device) -> dict:
    """How the kernels launch on `device`, for a report: the reductions over programs ("fused": by the
    last program to finish; "two kernels") and programmatic dependent launch (on or off)."""
    return {"reductions": "fused" if _FUSED else "two kernels", "pdl": _pdl(torch.device(device))["PDL"]}


@functools.lru_cache(maxsize=None)
def _pdl_card(index: int) -> bool:
    """Whether CUDA device `index` and this Triton can launch with PDL."""
    return torch.cuda.get_device_capability(index) >= (9, 0) and hasattr(tl.extra.cuda, "gdc_wait")


def _prefetch_lines(bk: int, stages: int, weight: torch.Tensor) -> int:
    """128-byte lines of each weight row a linear program prefetches into L2 before its PDL wait: the
    pipeline's first loads (stages - 1 BK steps, what it requests before its first dot), at most 1 KB,
    rounded down to a power of 2 (a tl.arange); 0 for a weight whose rows are not dense. A program's
    prefetch is then at most BLOCK_N KB and no more than its stages' shared memory, so all the programs
    resident at once prefetch no more than the card's shared memory holds (~8 MB at the 8B shape's
    configurations on an H200, a sixth of its 50 MB L2)."""
    lines = min(max(1, stages - 1) * bk * weight.element_size() // 128, 1024 // 128)
    return 1 << (lines.bit_length() - 1) if lines and weight.stride(-1) == 1 else 0


@functools.lru_cache(maxsize=None)
def linear_config(n: int, k: int, device=None) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, K splits, warps, stages) of a linear layer with weight [n, k]: chosen
    from the layer's shape and the card (its count of SMs), never from the call's rows. Decode GEMMs
    stream their weight once and are bandwidth-bound: a layer with many N tiles takes long BLOCK_K
    steps, one with fewer than half an N tile per SM splits K into 4 fixed parts (each a whole number
    of BLOCK_K steps) so every SM streams. Measured on an H200 at Llama-3.1-8B's shapes
    (scripts/gpu_probe.py): within a few percent of the fastest of 35 configurations per shape, and
    of cuBLAS, at 1 and 16 rows. (At 80 rows each 16-row tile re-reads the weight: 2.2-2.9x cuBLAS.)"""
    if INTERPRETED:
        return BLOCK_M, BLOCK_N, BLOCK_K, 1, 4, 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = triton.cdiv(n, BLOCK_N)
    if tiles >= 2 * sms:
        return BLOCK_M, BLOCK_N, 256, 1, 4, 3
    if 2 * tiles >= sms or k < 16 * BLOCK_K:
        return BLOCK_M, BLOCK_N, BLOCK_K, 1, 4, 6
    return BLOCK_M, BLOCK_N, BLOCK_K, 4, 4, 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int, int, int, int] | None = None, residual: torch.Tensor | None = None,
           norm: tuple[torch.Tensor | None, float] | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N] in x's dtype; with `residual` [..., N],
    residual + that (the decoder layer's skip connection, fused). `norm` (gain [K] in x's dtype or
    None, eps): the rows of rms_norm(x, gain, eps) in place of x, bit for bit, normalized inside the
    K loop (the RMSNorm before q/k/v, gate/up or lm_head, without a launch or a pass over memory of its
    own); `up` [..., K]: x is the MLP's gate and the product's input silu_mul(x, up), bit for bit (the
    down projection's activation, fused). `config`: linear_config's tuple (the tests and the GPU probe
    pass their own)."""
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    n = weight.shape[0]
    gain = None if norm is None else norm[0]
    if (norm is not None and up is not None) or (gain is not None and (gain.dtype != x.dtype or gain.shape != (k,))):
        raise ValueError(f"linear: a norm or an up operand, not both; a norm's gain [{k}] in x's dtype {x.dtype}")
    if up is not None:
        up = up.reshape(m, k)
        if up.stride() != rows.stride():  # gate and up read through one pair of strides
            rows, up = rows.contiguous(), up.contiguous()
    res = None if residual is None else residual.reshape(m, n)
    if res is not None and res.stride(-1) != 1:
        res = res.contiguous()
    bm, bn, bk, split, warps, stages = config or linear_config(n, k, x.device.index)
    stages = max(1, min(stages, SHARED_BYTES // ((bn + bm) * bk * x.element_size())))  # fp32: fewer stages
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    flags = dict(HAS_BIAS=bias is not None, HAS_RES=res is not None, RNE=INTERPRETED)
    bias, res = (bias if bias is not None else weight), (res if res is not None else y)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    fused = _FUSED and split > 1
    pdl = _pdl(x.device)
    _linear_kernel[grid](
        rows, weight, bias, res, y, part, _counters(x.device, grid[0] * grid[1]) if fused else y,
        gain if gain is not None else rows, up if up is not None else rows,
        m, n, k, k_split, rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        res.stride(0), norm[1] if norm is not None else 0.0, NORM=norm is not None, HAS_GAIN=gain is not None,
        GATED=up is not None, UPCAST=INTERPRETED, IEEE=x.dtype == torch.float32, SPLIT=split, FUSED=fused, BM=bm,
        BN=bn, BK=bk, NB=NORM_BLOCK, PF_LINES=_prefetch_lines(bk, stages, weight) if pdl["PDL"] else 0,
        PF_STEP=128 // weight.element_size(), num_warps=warps, num_stages=stages, enable_fp_fusion=True, **flags, **pdl)
    if split > 1 and not fused:
        block = 1024 if not INTERPRETED else 4096
        _sum_splits_kernel[(m, triton.cdiv(n, block))](part, bias, res, y, m, n, y.stride(0), res.stride(0),
                                                         SPLIT=split, BLOCK=block, enable_fp_fusion=True, **flags, **pdl)
    return y.view(*x.shape[:-1], n)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x, w, y, M, H, sx, sy, eps, HAS_WEIGHT: tl.constexpr, RNE: tl.constexpr, R: tl.constexpr,
                     NB: tl.constexpr, PDL: tl.constexpr):
    """Program (R rows): each row's rstd (_rstd), then the row in NB-column steps through _normed."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rstd = _rstd(x, rows, sx, 1, M, H, eps, R, NB)
    for c0 in range(0, H, NB):
        cols = c0 + tl.arange(0, NB)
        inside = (rows < M)[:, None] & (cols < H)[None, :]
        v = tl.load(x + rows[:, None] * sx + cols[None, :], mask=inside, other=0.0)
        out = _normed(v, rstd, w, cols, H, x.dtype.element_ty, y.dtype.element_ty, HAS_WEIGHT, RNE)
        tl.store(y + rows[:, None] * sy + cols[None, :], out, mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (also Qwen3's qk-norm over head_dim), one program per row."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    h = rows.shape[1]
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], ROWS),)](
        rows, weight if weight is not None else rows, y, rows.shape[0], h, rows.stride(0), y.stride(0), eps,
        HAS_WEIGHT=weight is not None, RNE=INTERPRETED, R=ROWS, NB=NORM_BLOCK, enable_fp_fusion=True,
        **_pdl(x.device))
    return y.view(x.shape)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(g, u, y, M, width, sg, su, sy, RNE: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (rows < M)[:, None] & (cols < width)[None, :]
    a = tl.load(g + rows[:, None] * sg + cols[None, :], mask=inside, other=0.0)
    b = tl.load(u + rows[:, None] * su + cols[None, :], mask=inside, other=0.0)
    tl.store(y + rows[:, None] * sy + cols[None, :], _silu_mul(a, b, y.dtype.element_ty, RNE), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate and up may be strided views (the halves of a fused gate_up output)."""
    g, u = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    y = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(triton.cdiv(g.shape[0], ROWS), triton.cdiv(g.shape[1], block))](
        g, u, y, g.shape[0], g.shape[1], g.stride(0), u.stride(0), y.stride(0), RNE=INTERPRETED, R=ROWS, BLOCK=block,
        enable_fp_fusion=True, **_pdl(g.device))
    return y.view(gate.shape)


@triton.jit(do_not_specialize=["M", "T"])
def _rope_kernel(q, k, cos, sin, qw, kw, qo, ko, M, T, HQ, HKV, sqb, sqh, sqt, skb, skh, skt, scb, sct, ssb, sst, eps,
                 NORM: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, RNE: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (R of the B*T rows, one head of [q's heads ; k's heads]): that head's rows of D
    rotated, x * cos + rotated * sin with rotated = [-x[D/2:], x[:D/2]], each product rounded to the
    dtype before the add and the sum once more, as torch computes apply_rope (fp32: the same ops,
    launched without FMA contraction). NORM (Qwen3's qk-norm): x is first the head's row RMS-normalized
    and times its gain (qw or kw), rounded as RMSNorm rounds, the whole row being in the program."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)  # 64-bit: b * sqb can pass 2^31 in a long prefill
    h = tl.program_id(1)
    b, t = rows // T, rows % T
    if h < HQ:
        src = q + b * sqb + h * sqh + t * sqt
        dst = qo + (rows * HQ + h) * D
        gain = qw
    else:
        src = k + b * skb + (h - HQ) * skh + t * skt
        dst = ko + (rows * HKV + h - HQ) * D
        gain = kw
    d = tl.arange(0, DP)
    first = d < D // 2
    across = tl.where(first, d + D // 2, d - D // 2)
    inside = (rows < M)[:, None] & (d < D)[None, :]
    ty = qo.dtype.element_ty
    x = tl.load(src[:, None] + d[None, :], mask=inside, other=0.0).to(tl.float32)
    partner = tl.load(src[:, None] + across[None, :], mask=inside, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        x = _round(tl.load(gain + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
                   * _round(x * rstd, ty, RNE).to(tl.float32), ty, RNE).to(tl.float32)
        partner = _round(tl.load(gain + across, mask=d < D, other=0.0).to(tl.float32)[None, :]
                         * _round(partner * rstd, ty, RNE).to(tl.float32), ty, RNE).to(tl.float32)
    rotated = tl.where(first[None, :], -partner, partner)
    c = tl.load(cos + (b * scb + t * sct)[:, None] + d[None, :], mask=inside, other=0.0).to(tl.float32)
    s = tl.load(sin + (b * ssb + t * sst)[:, None] + d[None, :], mask=inside, other=0.0).to(tl.float32)
    y = _round(x * c, ty, RNE).to(tl.float32) + _round(rotated * s, ty, RNE).to(tl.float32)
    tl.store(dst[:, None] + d[None, :], _round(y, ty, RNE), mask=inside)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [B,Hq,T,D] and k [B,Hkv,T,D] (any strides: views of a linear's output) with cos/sin
    [B or 1,1,T,D] in their dtype, in one launch -> (q, k) rotated, each [B,T,H,D] memory viewed as
    [B,H,T,D] (the layout q/k came in, so attention reads them without a copy). D even, <= MAX_HEAD_DIM.
    norm (q_gain [D], k_gain [D], eps): Qwen3's qk-norm first, in the same launch (it took two copies of
    the strided heads and two RMSNorm launches a layer)."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    gains = norm[:2] if norm is not None else (q, q)
    if d % 2 or d > MAX_HEAD_DIM or not q.dtype == k.dtype == cos.dtype == sin.dtype == gains[0].dtype == gains[1].dtype:
        raise ValueError(f"rope: head_dim {d} must be even and <= {MAX_HEAD_DIM}, q/k/cos/sin (and the norm's "
                         f"gains) one dtype ({q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}, "
                         f"{gains[0].dtype}, {gains[1].dtype})")
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    cos, sin = (x.expand(b, 1, t, d) if x.stride(-1) == 1 else x.contiguous().expand(b, 1, t, d) for x in (cos, sin))
    qo = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    ko = torch.empty(b, t, hkv, d, dtype=k.dtype, device=k.device)
    _rope_kernel[(triton.cdiv(b * t, ROWS), hq + hkv)](
        q, k, cos, sin, *gains, qo, ko, b * t, t, hq, hkv, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2),
        norm[2] if norm is not None else 0.0, NORM=norm is not None, R=ROWS, D=d, DP=triton.next_power_of_2(d),
        RNE=INTERPRETED, enable_fp_fusion=False, **_pdl(q.device))
    return qo.transpose(1, 2), ko.transpose(1, 2)


@triton.jit(do_not_specialize=["T", "S", "N", "num_splits", "split_size"])
def _attention_split_kernel(q, kc, vc, kn, vn, index, count, acc_out, ml_out, arrived, y,
                            T, S, N, HKV, num_splits, split_size, scale,
                            sqb, sqh, sqt, skb, skh, sks, snb, snh, sns, svb, svh, svs,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            BLOCK: tl.constexpr, SB: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr):
    """Program (b*HKV + kv head, query row t, split s): the G query heads of one KV head over keys
    [s*split_size, (s+1)*split_size) of row t's compacted key list -> the split's running max m,
    sum l and unnormalized output acc (fp32) in the workspace; a split past the row's keys has none.
    FUSED: every split program then counts itself in on the (row, KV head)'s counter in `arrived`,
    and the last to arrive combines the splits (_combine); else _attention_combine_kernel does."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh, t, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = (bh // HKV).to(tl.int64), bh % HKV  # 64-bit: a batch's cache offset can pass 2^31 elements
    row = b * T + t
    start = s * split_size
    end = tl.minimum(start + split_size, tl.load(count + row))
    if start < end:
        g, d = tl.arange(0, GP), tl.arange(0, DP)
        gmask, dmask = g < G, d < D
        qv = tl.load(q + b * sqb + (h * G + g)[:, None] * sqh + t * sqt + d[None, :],
                     mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        m = tl.full([GP], -1.0e30, tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        for r0 in range(start, end, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            valid = r < end
            i = tl.load(index + row * (S + N) + r, mask=valid, other=0)
            cached = (valid & (i < S))[:, None] & dmask[None, :]
            fresh = (valid & (i >= S))[:, None] & dmask[None, :]
            k = tl.where(cached, tl.load(kc + b * skb + h * skh + i[:, None] * sks + d[None, :], mask=cached, other=0.0),
                         tl.load(kn + b * snb + h * snh + (i - S)[:, None] * sns + d[None, :], mask=fresh,
                                 other=0.0)).to(tl.float32)
            v = tl.where(cached, tl.load(vc + b * skb + h * skh + i[:, None] * sks + d[None, :], mask=cached, other=0.0),
                         tl.load(vn + b * svb + h * svh + (i - S)[:, None] * svs + d[None, :], mask=fresh,
                                 other=0.0)).to(tl.float32)
            scores = tl.sum(qv[:, None, :] * k[None, :, :], axis=2) * scale           # [GP, BLOCK]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = ((b * HKV + h) * G + g) * T + t                                     # [B,Hq,T] row of each head
        tl.store(acc_out + (out * num_splits + s)[:, None] * DP + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_out + (out * num_splits + s) * 2, m, mask=gmask)
        tl.store(ml_out + (out * num_splits + s) * 2 + 1, lsum, mask=gmask)
    if FUSED:
        if _last_arrival(arrived + bh * T + t, num_splits):
            _combine(acc_out, ml_out, count, y, b, h, t, T, HKV, num_splits, split_size, G, GP, D, DP, SB)


@triton.jit(do_not_specialize=["T", "num_splits", "split_size"])
def _attention_combine_kernel(acc_in, ml_in, count, y, T, HKV, num_splits, split_size, G: tl.constexpr,
                              GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr):
    """Program (b*HKV + kv head, query row t): _combine (the two-kernel path, _FUSED = False)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    _combine(acc_in, ml_in, count, y, (bh // HKV).to(tl.int64), bh % HKV, tl.program_id(1), T, HKV, num_splits,
             split_size, G, GP, D, DP, SB)


@_device
def _combine(acc_in, ml_in, count, y, b, h, t, T, HKV, num_splits, split_size, G: tl.constexpr, GP: tl.constexpr,
             D: tl.constexpr, DP: tl.constexpr, SB: tl.constexpr):
    """Row t of sequence b, the G query heads of KV head h: their splits that hold keys (the first
    cdiv(count, split_size): the same for a position in every call) combined SB at a time in split
    order, a block's SB terms added by _halves (a tree fixed by SB), every other step elementwise, so
    the same bits in whichever kernel and layout it runs (the launches turn FMA contraction off, which
    a layout could change); written to y laid out [B,T,Hq,D]. Loaded `.cg`, as _sum_splits."""
    g, d = tl.arange(0, GP), tl.arange(0, DP)
    rows = ((b * HKV + h) * G + g) * T + t                                        # [B,Hq,T] row of each head
    active = tl.cdiv(tl.load(count + b * T + t), split_size)
    top = tl.full([GP], -1.0e30, tl.float32)
    for s0 in range(0, active, SB):
        at = rows[:, None] * num_splits + s0 + tl.arange(0, SB)[None, :]          # [GP, SB]
        inside = (g < G)[:, None] & (s0 + tl.arange(0, SB) < active)[None, :]
        m = tl.load(ml_in + at * 2, mask=inside, other=-1.0e30, cache_modifier=".cg")
        top = tl.maximum(top, tl.max(m, axis=1))
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP * DP], tl.float32)
    for s0 in range(0, active, SB):
        at = rows[:, None] * num_splits + s0 + tl.arange(0, SB)[None, :]
        inside = (g < G)[:, None] & (s0 + tl.arange(0, SB) < active)[None, :]
        m = tl.load(ml_in + at * 2, mask=inside, other=-1.0e30, cache_modifier=".cg")
        lsum = tl.load(ml_in + at * 2 + 1, mask=inside, other=0.0, cache_modifier=".cg")
        weight = tl.where(inside, tl.exp(m - top[:, None]), 0.0)
        part = tl.load(acc_in + at[:, None, :] * DP + d[None, :, None], mask=inside[:, None, :], other=0.0,
                       cache_modifier=".cg")                                      # [GP, DP, SB]
        total += _halves(lsum * weight, GP, SB)
        acc += _halves(tl.reshape(part * weight[:, None, :], [GP * DP, SB]), GP * DP, SB)
    out = tl.reshape(acc, [GP, DP]) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(y + ((b * T + t) * HKV * G + h * G + g)[:, None] * D + d[None, :], out.to(y.dtype.element_ty),
             mask=(g < G)[:, None] & (d < D)[None, :])


def compact_keys(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [B,T,S+N] -> (index [B,T,S+N] int32: each row's visible keys first, in key order; count
    [B,T] int32). A stable descending sort of "visible" keeps the visible keys' order (and the others'
    after them). One per forward: every layer of a call sees the same mask (runtime/exact.py keeps the
    last)."""
    index = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return index.contiguous(), mask.sum(-1, dtype=torch.int32).contiguous()


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, mask: torch.Tensor, split_size: int = SPLIT_SIZE,
              keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Grouped-query attention, each row over its own visible keys (see the module's docstring).
    q [B,Hq,T,D]; k/v_cache [B,Hkv,S,D] (any slot stride); k/v_new [B,Hkv,N,D]; q, k_new and v_new may
    be strided views (the last dim dense); mask [B,T,S+N]; keys: compact_keys(mask) when the caller
    has it -> [B,Hq,T,D] in q's dtype, a view of [B,T,Hq,D] memory (so [B,T,Hq*D] is a free reshape).
    `split_size` is a constant: the tests plant a per-call one."""
    b, hq, t, d = q.shape
    hkv, s, n = k_cache.shape[1], k_cache.shape[2], k_new.shape[2]
    group = hq // hkv
    q, k_new, v_new = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_new, v_new))
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    index, count = keys if keys is not None else compact_keys(mask)
    num_splits = max(1, triton.cdiv(s + n, split_size))
    dp = triton.next_power_of_2(d)
    acc = torch.empty(b, hq, t, num_splits, dp, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, hq, t, num_splits, 2, dtype=torch.float32, device=q.device)
    y = torch.empty(b, t, hq, d, dtype=q.dtype, device=q.device)
    gp = triton.next_power_of_2(group)
    shape = dict(G=group, GP=gp, D=d, DP=dp, SB=min(COMBINE_BLOCK, 64 // gp), enable_fp_fusion=False, **_pdl(q.device))
    _attention_split_kernel[(b * hkv, t, num_splits)](
        q, k_cache, v_cache, k_new, v_new, index, count, acc, ml, _counters(q.device, b * hkv * t) if _FUSED else count,
        y, t, s, n, hkv, num_splits, split_size,
        1.0 / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1),
        v_new.stride(2), BLOCK=ATTN_BLOCK, FUSED=_FUSED, num_warps=ATTN_WARPS, **shape)
    if not _FUSED:
        _attention_combine_kernel[(b * hkv, t)](acc, ml, count, y, t, hkv, num_splits, split_size, **shape)
    return y.transpose(1, 2)


@triton.jit(do_not_specialize=["M", "V", "CHUNK"])
def _argmax_kernel(x, index, top_out, index_out, M, V, sx, CHUNK, R: tl.constexpr, BLOCK: tl.constexpr,
                   MAPPED: tl.constexpr, PDL: tl.constexpr):
    """Program (R rows, chunk c): the largest value of columns [c*CHUNK, (c+1)*CHUNK) and its first
    column, blocks in order -> top_out/index_out [M, chunks]. MAPPED (the second pass, over the chunks'
    tops): the column read through `index`, each chunk's winner."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * R + tl.arange(0, R)
    lo = tl.program_id(1) * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best = tl.full([R], float("-inf"), tl.float32)
    best_index = tl.zeros([R], tl.int64) + lo
    for v0 in range(lo, hi, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        vals = tl.load(x + rows[:, None] * sx + cols[None, :], mask=(rows < M)[:, None] & (cols < hi)[None, :],
                       other=float("-inf")).to(tl.float32)
        top = tl.max(vals, axis=1)
        first = tl.min(tl.where(vals == top[:, None], cols[None, :], hi), axis=1).to(tl.int64)
        better = top > best  # strictly: an equal value in a later block keeps the earlier index
        best_index = tl.where(better, first, best_index)
        best = tl.where(better, top, best)
    if MAPPED:
        best_index = tl.load(index + rows * sx + best_index, mask=rows < M, other=0)
    chunks = tl.num_programs(1)
    tl.store(top_out + rows * chunks + tl.program_id(1), best, mask=rows < M)
    tl.store(index_out + rows * chunks + tl.program_id(1), best_index, mask=rows < M)


def argmax(x: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """Index of the largest value along the last dim, ties to the lowest index -> int64 [...]. Each row
    is cut into chunks of a fixed size (`chunk`, a constant: the tests pass a small one), reduced in
    parallel, the chunks' winners then reduced in chunk order (one program a row over a large
    vocabulary took ~90 us on an H200)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, v = rows.shape
    chunks = triton.cdiv(v, chunk)
    top = torch.empty(m, chunks, dtype=torch.float32, device=x.device)
    index = torch.empty(m, chunks, dtype=torch.int64, device=x.device)
    _argmax_kernel[(triton.cdiv(m, ROWS), chunks)](rows, rows, top, index, m, v, rows.stride(0), chunk,
                                                   R=ROWS, BLOCK=ARGMAX_BLOCK, MAPPED=False, enable_fp_fusion=True,
                                                   **_pdl(x.device))
    if chunks > 1:
        out = torch.empty(m, 1, dtype=torch.int64, device=x.device)
        _argmax_kernel[(triton.cdiv(m, ROWS), 1)](top, index, torch.empty_like(top[:, :1]), out, m, chunks, chunks, chunks,
                                                  R=ROWS, BLOCK=ARGMAX_BLOCK, MAPPED=True, enable_fp_fusion=True,
                                                  **_pdl(x.device))
        index = out
    return index.view(x.shape[:-1])
