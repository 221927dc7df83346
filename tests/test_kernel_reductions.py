"""Reductions over programs (a split-K linear's partial sums, the attention's key splits), added by the
last program to finish in the launch that made them (kernels.triton_ops._last_arrival): bit for bit the
second kernels they replace, in any program order, and every counter back at 0 after a call. Planted
variants (a split added in completion order, a counter left unreset) must fail.

On a CPU these run through Triton's interpreter, whose programs run one after another: the order is
shuffled here to stand in for a GPU's. The memory ordering itself is proven only natively:
scripts/gpu_exact.sh runs this file first on a GPU (a failure there sends every later step of the
script to the two-kernel path). There too, the same cases launched with programmatic dependent launch
against plain launches, eager and from a CUDA graph (tests/test_kernel_pdl.py checks its discipline on
the CPU). A file of its own so the suite's two processes share the kernels' tests.
"""

import contextlib
import functools
import random
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels' tests need triton (pip install '.[test]')")
tl = triton.language

from test_kernels import DEVICE, DTYPES, SPLIT, _mask, rand  # noqa: E402

from eagle_export import kernels  # noqa: E402
from eagle_export.kernels import triton_ops as K  # noqa: E402

REPEATS = 2 if kernels.interpreted() else 20  # calls a case: each finds its counters at 0 again (a GPU: and races)


def reduction_cases(dtype, gen) -> dict:
    """name -> call, for the launches whose programs' partials are reduced by the last to finish:
    linear at M = 1, 16 (a whole tile), 21 (two) with 2, 3 and 4 K splits of K = 200 (a ragged last
    split), bias and residual (and one with the norm prologue); attention over rows whose keys span 1 to
    3 splits of SPLIT keys (a split past a row's keys still counts in), T = 1 and 3, G = 1, 3 (padded to
    4) and 4. On a GPU, where each case's constants cost a compile (seconds of the sitting), these in
    bf16 only, with 3 K splits and G = 3; then in every dtype the Llama-3.1-8B shapes: the o-projection
    at its H200 configuration (4 K splits) at M = 1, 4, 16, and the attention over 64 to 2000 keys in
    splits of K.SPLIT_SIZE."""
    cases, interpreted = {}, kernels.interpreted()
    x, w, b, res = (rand(21, 200, dtype=dtype, gen=gen), rand(70, 200, dtype=dtype, gen=gen),
                    rand(70, dtype=dtype, gen=gen), rand(21, 70, dtype=dtype, gen=gen) * 3)
    gain = (rand(200, gen=gen).abs() + 0.5).to(dtype)
    if interpreted or dtype == torch.bfloat16:
        for m in (1, 16, 21):
            for split in (2, 3, 4) if interpreted else (3,):
                cases[f"linear M={m} splits={split}"] = functools.partial(
                    K.linear, x[:m], w, b, (16, 32, 32, split, 4, 1), residual=res[:m])
        cases["linear M=5 splits=3 norm"] = functools.partial(K.linear, x[:5], w, None, (16, 32, 32, 3, 4, 1),
                                                              norm=(gain, 1e-5))
        for bsz, hq, hkv, t, lens in ((1, 2, 2, 1, [40]), (2, 6, 2, 3, [33, 9]), (3, 4, 1, 1, [5, 40, 20])):
            if interpreted or hq // hkv == 3:
                q = rand(bsz, hq, t, 16, dtype=dtype, gen=gen)
                kc, vc, kn, vn = (rand(bsz, hkv, n, 16, dtype=dtype, gen=gen) for n in (40, 40, t, t))
                mask = _mask(torch.tensor(lens), 40, torch.ones(t, t, dtype=torch.bool).tril())
                cases[f"attention B={bsz} T={t} G={hq // hkv}"] = functools.partial(K.attention, q, kc, vc, kn, vn,
                                                                                     mask, SPLIT)
    if not interpreted:
        wo, xo, ro = rand(4096, 4096, dtype=dtype, gen=gen) * 0.02, rand(16, 4096, dtype=dtype, gen=gen), \
            rand(16, 4096, dtype=dtype, gen=gen)
        for m in (1, 4, 16):
            cases[f"8B o-projection M={m}"] = functools.partial(K.linear, xo[:m], wo, None, (16, 64, 128, 4, 4, 4),
                                                                residual=ro[:m])
        for bsz, t, lens in ((1, 1, [2000]), (1, 5, [2000]), (4, 1, [2000, 700, 64, 1300])):
            q = rand(bsz, 32, t, 128, dtype=dtype, gen=gen)
            kc, vc, kn, vn = (rand(bsz, 8, n, 128, dtype=dtype, gen=gen) for n in (2048, 2048, t, t))
            mask = _mask(torch.tensor(lens), 2048, torch.ones(t, t, dtype=torch.bool).tril())
            cases[f"8B attention B={bsz} T={t}"] = functools.partial(K.attention, q, kc, vc, kn, vn, mask)
    return cases


def nan_filled(real=torch.empty):
    """torch.empty whose floating-point tensors hold NaN: an output or workspace element a kernel
    never writes then differs from everything, not the leftovers of a freed tensor (which may be the
    very values it should have written)."""
    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    return mock.patch.object(torch, "empty", empty)


def reduction_mismatches(dtype, plants=None) -> list:
    """(case, call) where a call of reduction_cases differs in any bit from the two-kernel path
    (K._FUSED off: _sum_splits_kernel, _attention_combine_kernel), each case called REPEATS times in a
    row, every output and workspace NaN until written; `plants`: helpers of triton_ops replaced (the
    interpreter only) in those calls."""
    found = []
    for name, call in reduction_cases(dtype, torch.Generator().manual_seed(12)).items():
        with nan_filled(), mock.patch.object(K, "_FUSED", False):
            want = call()
        with nan_filled(), mock.patch.multiple(K, **(plants or {"_FUSED": True})):
            found += [(name, i) for i in range(REPEATS) if not torch.equal(call(), want)]
    return found


@pytest.mark.slow  # (19-26 s a dtype through the interpreter)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_reduction_by_the_last_program_is_the_two_kernel_path_bit_for_bit(dtype):
    assert reduction_mismatches(dtype) == []


@contextlib.contextmanager
def programs_shuffled(seed):
    """Triton's interpreter runs a grid's programs one after another in index order, so the last to
    finish is always the last split; here each launch runs them in a random order (seeded)."""
    from triton.runtime import interpreter

    builder, rng, order = interpreter.interpreter_builder, random.Random(seed), []
    real = type(builder).set_grid_idx

    def set_grid_idx(x, y, z):
        nx, ny, nz = builder.grid_dim
        if (x, y, z) == (0, 0, 0):  # a launch begins
            order[:] = rng.sample(range(nx * ny * nz), nx * ny * nz)
        i = order[(x * ny + y) * nz + z]
        real(builder, i // (ny * nz), i // nz % ny, i % nz)

    with mock.patch.object(builder, "set_grid_idx", set_grid_idx):
        yield


def sum_own_split_last(part, rows, cols, M, N, SPLIT: tl.constexpr):
    """Planted: the last program's own partial added after the others' (what adding its accumulator,
    still in registers, to their sum computes): the splits in the order they finished."""
    own = tl.program_id(2)
    inside = (rows < M)[:, None] & (cols < N)[None, :]
    acc = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    for s in tl.static_range(SPLIT):
        if s != own:
            acc += tl.load(part + (s * M + rows[:, None]) * N + cols[None, :], mask=inside, other=0.0)
    return acc + tl.load(part + (own * M + rows[:, None]) * N + cols[None, :], mask=inside, other=0.0)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.interpreted(), reason="the interpreter's program order is what is shuffled, and a "
                    "planted helper replaces a @triton.jit one only there (a GPU's order is its own)")
def test_a_reduction_by_the_last_program_is_the_same_in_any_program_order():
    """The programs in a shuffled order: the same bits as the two-kernel path. Planted, the last
    program adding its own split last (right in the interpreter's own index order, where the last to
    finish is always the last split): flagged once the order is shuffled. One order each (each pass
    over the cases is ~15 s of interpreter time)."""
    with programs_shuffled(0):
        assert reduction_mismatches(torch.float32) == []
        found = reduction_mismatches(torch.float32, {"_sum_splits": sum_own_split_last})
    assert found and {name for name, _ in found} <= {name for name in reduction_cases(torch.float32, None)
                                                     if name.startswith("linear")}, found


def arrive_without_reset(counter, n):
    """Planted: _last_arrival without setting the counter back to 0."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel") == n - 1


@pytest.mark.skipif(not kernels.interpreted(), reason="a planted helper replaces a @triton.jit one only in the interpreter")
def test_a_counter_left_unreset_fails_the_bit_for_bit_check(monkeypatch):
    """Planted: the last program leaves its counter at n: a case's first call is right, its second
    finds no last program (its output never written: NaN) and is flagged, in every case."""
    monkeypatch.setattr(K, "_COUNTER_BUFFERS", {})  # the counters it leaves dirty go with the test
    found = reduction_mismatches(torch.float32, {"_last_arrival": arrive_without_reset})
    names = list(reduction_cases(torch.float32, None))
    assert (names[0], 0) not in found and all((name, 1) in found for name in names), found


@pytest.mark.cuda
def test_a_reduction_by_the_last_program_replays_from_a_cuda_graph():
    """Captured after a warm-up (the counters exist by then: no allocation, no memset in the graph),
    replayed 5 times: each replay the two-kernel path's bits, so each found its counters at 0."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU (the interpreter runs no graph)")
    cases = reduction_cases(torch.bfloat16, torch.Generator().manual_seed(13))
    with mock.patch.object(K, "_FUSED", False):
        want = {name: call() for name, call in cases.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        [call() for call in cases.values()]
    torch.cuda.current_stream().wait_stream(side)
    _replays_give(cases, want)


@pytest.mark.cuda
def test_launches_with_pdl_give_the_bits_of_plain_launches():
    """Programmatic dependent launch (on a card of compute capability >= 9.0): every case above, each
    called REPEATS times back to back (a launch overlapping the end of the one before), then replayed 5
    times from one CUDA graph (programmatic edges), the bits of plain launches (K._PDL off)."""
    if DEVICE != "cuda" or not K._pdl(torch.device("cuda"))["PDL"]:
        pytest.skip("PDL needs a CUDA GPU of compute capability >= 9.0 and Triton's gdc_wait (EAGLE_EXPORT_NO_PDL unset)")
    cases = reduction_cases(torch.bfloat16, torch.Generator().manual_seed(14))
    with mock.patch.object(K, "_PDL", False):
        want = {name: call() for name, call in cases.items()}
    eager = [name for name, call in cases.items() for _ in range(REPEATS) if not torch.equal(call(), want[name])]
    assert eager == []
    _replays_give(cases, want)


def _replays_give(cases, want) -> None:
    """Every case captured in one CUDA graph, replayed 5 times (the outputs zeroed before each): each
    replay gives `want`'s bits."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = {name: call() for name, call in cases.items()}
    for _ in range(5):
        for out in got.values():
            out.fill_(0)
        graph.replay()
        assert [name for name in cases if not torch.equal(got[name], want[name])] == []
