"""The width-invariant kernels (eagle_export/kernels): each against its torch reference within a stated
tolerance, and a row's bits the same at every call width, batch size and place in the call. Planted
variants that choose their arithmetic from the call (a split-K chosen by M, a KV split by count)
must fail the same invariance checks.

On a CPU these run through Triton's interpreter (conftest sets TRITON_INTERPRET=1 before triton is
imported; tl.dot's operands are upcast to fp32 there). scripts/gpu_exact.sh runs this file on a GPU
with TRITON_INTERPRET=0, where bf16 runs on tensor cores: the only place its numerics can be checked.
"""


import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels' tests need triton (pip install '.[test]')")
tl = triton.language

from eagle_export import kernels  # noqa: E402
from eagle_export.kernels import reference as R  # noqa: E402
from eagle_export.kernels import triton_ops as K  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not kernels.interpreted() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Max error relative to the reference's largest magnitude: fp32 reduction orders differ by a few
# ulps of the sum; a 16-bit result rounded twice (RMSNorm's normed row, then its gain) can be two of
# its ulps off wherever the fp32 sums differ (bf16: 2^-7 relative each).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}
SPLIT = 16  # a small fixed split size, so the tests' short rows span several splits (the GPU's: K.SPLIT_SIZE)


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def close(got, want, dtype):
    err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)
    assert err <= TOLERANCE[dtype], f"relative error {float(err):.3g} > {TOLERANCE[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_kernel_matches_its_torch_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w, b = rand(7, 150, dtype=dtype, gen=gen), rand(90, 150, dtype=dtype, gen=gen), rand(90, dtype=dtype, gen=gen)
    close(K.linear(x, w, b), R.linear(x, w, b), dtype)
    close(K.linear(x[None], w), R.linear(x[None], w), dtype)
    h, gain = rand(3, 2, 100, dtype=dtype, gen=gen), (rand(100, gen=gen).abs() + 0.5).to(dtype)
    close(K.rms_norm(h, gain, 1e-5), R.rms_norm(h, gain, 1e-5), dtype)
    close(K.rms_norm(h, None, 1e-6), R.rms_norm(h, None, 1e-6), dtype)
    qk = rand(2, 3, 5, 16, dtype=dtype, gen=gen).transpose(1, 2)  # qk-norm: a strided [B,H,T,D] view
    close(K.rms_norm(qk, gain[:16], 1e-6), R.rms_norm(qk, gain[:16], 1e-6), dtype)
    gate_up = rand(4, 2 * 300, dtype=dtype, gen=gen)
    gate, up = gate_up.split(300, dim=-1)
    close(K.silu_mul(gate, up), R.silu_mul(gate, up), dtype)
    q, kc, vc = rand(2, 4, 3, 16, dtype=dtype, gen=gen), rand(2, 2, 40, 16, dtype=dtype, gen=gen), \
        rand(2, 2, 40, 16, dtype=dtype, gen=gen)
    kn, vn = rand(2, 2, 3, 16, dtype=dtype, gen=gen), rand(2, 2, 3, 16, dtype=dtype, gen=gen)
    mask = _mask(torch.tensor([33, 9]), 40, torch.ones(3, 3, dtype=torch.bool).tril())
    close(K.attention(q, kc, vc, kn, vn, mask, SPLIT), R.attention(q, kc, vc, kn, vn, mask), dtype)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, kn, vn))  # rope's layout, read in place
    assert torch.equal(K.attention(qt, kc, vc, kt, vt, mask, SPLIT), K.attention(q, kc, vc, kn, vn, mask, SPLIT))
    logits = rand(6, 2500, dtype=dtype, gen=gen)
    assert torch.equal(K.argmax(logits), R.argmax(logits))


def test_argmax_breaks_ties_to_the_lowest_index_across_blocks():
    x = torch.zeros(4, 3 * K.ARGMAX_BLOCK + 5, device=DEVICE)
    x[0, [7, 9]] = 1.0                                  # in one block
    x[1, [K.ARGMAX_BLOCK + 3, 2 * K.ARGMAX_BLOCK]] = 2  # in two later blocks
    x[2, -1] = 3.0                                      # the ragged last block
    assert K.argmax(x).tolist() == R.argmax(x).tolist() == [7, K.ARGMAX_BLOCK + 3, x.shape[1] - 1, 0]
    # the same across chunks (a block a chunk: the second pass picks among the chunks' winners)
    assert K.argmax(x, chunk=K.ARGMAX_BLOCK).tolist() == R.argmax(x).tolist()
    y = torch.randn(5, 3000, device=DEVICE)
    y[1, [100, 2900]] = 9.0  # equal maxima in the first and last chunks
    assert K.argmax(y, chunk=512).tolist() == R.argmax(y).tolist() and K.argmax(y, chunk=512)[1] == 100


# --- invariance: the same row in calls of every width, batch and place ---------------------------------

WIDTHS = (1, 2, 3, 5, 8)  # 1..K+1 for K = 4, and a tree's width


def linear_row_mismatches(fn, dtype=torch.float32) -> list:
    """Row 0 of x computed alone, then at every place of calls of each width (the other rows random):
    the (width, place) where its bits differ."""
    gen = torch.Generator().manual_seed(1)
    x, w, b = rand(1, 128, dtype=dtype, gen=gen), rand(80, 128, dtype=dtype, gen=gen), rand(80, dtype=dtype, gen=gen)
    alone = fn(x, w, b)[0]
    found = []
    for width in WIDTHS + (16, 21, 70):  # and past one M tile
        for place in sorted({0, width // 2, width - 1}):
            call = rand(width, 128, dtype=dtype, gen=gen)
            call[place] = x[0]
            if not torch.equal(fn(call, w, b)[place], alone):
                found.append((width, place))
    return found


SPLIT_CONFIG = (16, 32, 32, 3, 4, 1)  # K = 128 in three splits of 64 (the last one short), summed in order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_linear_row_is_the_same_at_every_width_and_place(dtype):
    assert linear_row_mismatches(K.linear, dtype) == []
    assert linear_row_mismatches(lambda x, w, b: K.linear(x, w, b, SPLIT_CONFIG), dtype) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_linear_split_along_k_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    x, w, b = rand(5, 128, dtype=dtype, gen=gen), rand(70, 128, dtype=dtype, gen=gen), rand(70, dtype=dtype, gen=gen)
    close(K.linear(x, w, b, SPLIT_CONFIG), R.linear(x, w, b), dtype)
    close(K.linear(x, w, None, SPLIT_CONFIG), R.linear(x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_residual_is_the_layers_add_bit_for_bit(dtype):
    """linear(h, residual=x) is the decoder layer's `x + linear(h)`: the product rounded to the dtype,
    then the sum rounded again, in one launch and in the split-K epilogue alike; rounding once (the
    fp32 sum plus x, a tempting fusion) is planted and must differ."""
    gen = torch.Generator().manual_seed(5)
    x, w, b, res = (rand(5, 128, dtype=dtype, gen=gen), rand(70, 128, dtype=dtype, gen=gen),
                    rand(70, dtype=dtype, gen=gen), rand(5, 70, dtype=dtype, gen=gen) * 3)
    for config in (None, SPLIT_CONFIG):
        assert torch.equal(K.linear(x, w, b, config, residual=res), res + K.linear(x, w, b, config))
        close(K.linear(x, w, b, config, residual=res), R.linear(x, w, b, residual=res), dtype)
    if dtype != torch.float32:
        rounded_once = (res.float() + K.linear(x.float(), w.float(), b.float())).to(dtype)  # the interpreter's same sums
        assert not torch.equal(rounded_once, res + K.linear(x, w, b))


def test_a_split_k_chosen_by_m_fails_the_linear_invariance_check():
    """cuBLAS splits K for small M: planted, calls of at most 2 rows sum four K quarters."""
    def split_k_by_m(x, w, b):
        if x.shape[0] > 2:
            return K.linear(x, w, b)
        quarters = [K.linear(xq, wq) for xq, wq in zip(x.chunk(4, -1), w.chunk(4, -1))]
        return ((quarters[0] + quarters[1]) + quarters[2]) + quarters[3] + b
    assert linear_row_mismatches(split_k_by_m)


def test_an_rms_norm_row_is_the_same_at_every_width_and_place():
    gen = torch.Generator().manual_seed(2)
    row, gain = rand(1, 96, dtype=torch.bfloat16, gen=gen), rand(96, dtype=torch.bfloat16, gen=gen)
    alone = K.rms_norm(row, gain, 1e-5)[0]
    for width in WIDTHS:
        call = rand(width, 96, dtype=torch.bfloat16, gen=gen)
        call[-1] = row[0]
        assert torch.equal(K.rms_norm(call, gain, 1e-5)[-1], alone), width


def _mask(lens, slots, new_mask):
    """[B,T,S+N]: slots below each sequence's length, then `new_mask` [T,N] or [B,T,N] among the new keys."""
    t = new_mask.shape[-2]
    past = torch.arange(slots)[None, None, :] < lens[:, None, None]
    return torch.cat([past.expand(-1, t, -1), new_mask.expand(len(lens), -1, -1)], dim=-1).to(DEVICE)


class Sequence:
    """One sequence's per-position queries, keys and values (1 KV head, 2 query heads), and the
    calls that compute its position p: as a one-token step, as row j of a verify call, as a tree
    node whose ancestors sit among siblings, and inside a batch."""

    def __init__(self, length=64, dtype=torch.float32, gen=None):
        self.dtype, self.gen = dtype, gen
        self.q = rand(2, length, 16, dtype=dtype, gen=gen)
        self.k, self.v = rand(1, length, 16, dtype=dtype, gen=gen), rand(1, length, 16, dtype=dtype, gen=gen)

    def cache(self, length, slots):
        """A cache view of `slots` slots holding positions 0..length-1; stale garbage after them."""
        k, v = rand(1, 1, slots, 16, dtype=self.dtype, gen=self.gen), rand(1, 1, slots, 16, dtype=self.dtype, gen=self.gen)
        k[0, :, :length], v[0, :, :length] = self.k[:, :length], self.v[:, :length]
        return k, v

    def verify(self, fn, p, width, row, slots=48):
        """Position p as row `row` of a causal call of `width` tokens over past p - row."""
        start = p - row
        kc, vc = self.cache(start, slots)
        q = torch.cat([self.q[:, start:start + width]], 1)[None]
        kn, vn = self.k[None, :, start:start + width], self.v[None, :, start:start + width]
        mask = _mask(torch.tensor([start]), slots, torch.ones(width, width, dtype=torch.bool).tril())
        return fn(q, kc, vc, kn, vn, mask)[0, :, row]

    def tree(self, fn, p, slots=48):
        """Position p as node 6 of an 8-node tree over past p - 3 whose path is nodes 0, 2, 3, 6."""
        path, start = [0, 2, 3, 6], p - 3
        kc, vc = self.cache(start, slots)
        kn, vn = rand(1, 1, 8, 16, dtype=self.dtype, gen=self.gen), rand(1, 1, 8, 16, dtype=self.dtype, gen=self.gen)
        q = rand(1, 2, 8, 16, dtype=self.dtype, gen=self.gen)
        for depth, node in enumerate(path):
            kn[0, :, node], vn[0, :, node], q[0, :, node] = self.k[:, start + depth], self.v[:, start + depth], \
                self.q[:, start + depth]
        sees = torch.zeros(8, 8, dtype=torch.bool)
        sees[6, path] = True
        return fn(q, kc, vc, kn, vn, _mask(torch.tensor([start]), slots, sees))[0, :, 6]

    def batched(self, fn, p, slots=48):
        """Position p as a one-token step of the middle sequence of a batch of three."""
        kc, vc = self.cache(p, slots)
        others = [rand(1, 1, slots, 16, dtype=self.dtype, gen=self.gen) for _ in range(4)]
        kc, vc = torch.cat([others[0], kc, others[1]]), torch.cat([others[2], vc, others[3]])
        q = torch.cat([rand(1, 2, 1, 16, dtype=self.dtype, gen=self.gen), self.q[None, :, p:p + 1],
                       rand(1, 2, 1, 16, dtype=self.dtype, gen=self.gen)])
        kn = torch.cat([rand(1, 1, 1, 16, dtype=self.dtype, gen=self.gen), self.k[None, :, p:p + 1],
                        rand(1, 1, 1, 16, dtype=self.dtype, gen=self.gen)])
        vn = torch.cat([rand(1, 1, 1, 16, dtype=self.dtype, gen=self.gen), self.v[None, :, p:p + 1],
                        rand(1, 1, 1, 16, dtype=self.dtype, gen=self.gen)])
        mask = _mask(torch.tensor([5, p, 40]), slots, torch.ones(1, 1, dtype=torch.bool))
        return fn(q, kc, vc, kn, vn, mask)[1, :, 0]


def attention_row_mismatches(fn, dtype=torch.float32) -> list:
    """Position p = 37 computed as a one-token step, then as every other kind of row: the kinds whose
    bits differ. Its 38 keys span three splits of SPLIT keys."""
    seq, p = Sequence(dtype=dtype, gen=torch.Generator().manual_seed(3)), 37
    plain = seq.verify(fn, p, 1, 0)
    calls = {"plain step, a wider cache view": lambda: seq.verify(fn, p, 1, 0, slots=64),
             **{f"verify T={t} row {j}": (lambda t=t, j=j: seq.verify(fn, p, t, j))
                for t, j in ((2, 1), (3, 2), (5, 4), (5, 0), (5, 2))},
             "tree node": lambda: seq.tree(fn, p), "batch of 3": lambda: seq.batched(fn, p)}
    return [name for name, call in calls.items() if not torch.equal(call(), plain)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_attention_row_is_the_same_in_every_call(dtype):
    assert attention_row_mismatches(lambda *a: K.attention(*a, split_size=SPLIT), dtype) == []


def test_a_kv_split_by_count_fails_the_attention_invariance_check():
    """Flash-decoding's usual choice: a fixed number of splits (4) over the call's keys, so the split
    size, and every split boundary, moves with the cache view and the call's width."""
    found = attention_row_mismatches(lambda q, kc, vc, kn, vn, mask: K.attention(
        q, kc, vc, kn, vn, mask, split_size=triton.cdiv(kc.shape[2] + kn.shape[2], 4)))
    assert len(found) >= 3, found


# --- RoPE: torch's arithmetic bit for bit, a row the same in every call -------------------------------------


def rope_inputs(d, dtype, gen, positions, hq=4, hkv=2):
    """q [B,Hq,T,D], k [B,Hkv,T,D] as Attention.heads makes them (strided views of one fused
    projection's output [B,T,(Hq+2Hkv)*D]) and the models' cos/sin [B,1,T,D] at `positions` [B,T]."""
    from eagle_export.models.config import RopeConfig
    from eagle_export.models.layers import rope_cos_sin, rope_inv_freq

    b, t = positions.shape
    out = rand(b, t, (hq + 2 * hkv) * d, dtype=dtype, gen=gen) * 4
    q, k, _ = out.split([hq * d, hkv * d, hkv * d], dim=-1)
    cos, sin = rope_cos_sin(positions.to(DEVICE), rope_inv_freq(RopeConfig(), d).to(DEVICE), dtype)
    return q.view(b, t, hq, d).transpose(1, 2), k.view(b, t, hkv, d).transpose(1, 2), cos, sin


def rope_mismatches(fn) -> list:
    """(dtype, head_dim) where fn's rotated q or k differ from reference.rope in any bit (80: a head_dim
    that is no power of 2, a padded block; 256: kernels.MAX_HEAD_DIM)."""
    gen, found = torch.Generator().manual_seed(4), []
    for dtype in DTYPES:
        for d in (16, 64, 80, 128, 256):
            args = rope_inputs(d, dtype, gen, torch.randint(0, 5000, (2, 3), generator=gen))
            got, want = fn(*args), R.rope(*args)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                found.append((dtype, d))
    return found


def test_rope_is_torchs_arithmetic_bit_for_bit():
    assert rope_mismatches(K.rope) == []
    gen = torch.Generator().manual_seed(5)
    q, k = K.rope(*rope_inputs(64, torch.bfloat16, gen, torch.arange(3)[None]))
    assert q.shape == (1, 4, 3, 64) and q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()
    with pytest.raises(ValueError, match="head_dim 7 must be even"):
        K.rope(q[..., :7], k[..., :7], q[..., :7], q[..., :7])


def test_rope_rounded_once_fails_the_bit_for_bit_check():
    """Planted: products and sum in fp32, rounded once (what a kernel that fuses the multiply-add
    computes): every 16-bit dtype is flagged, fp32 (where that is torch's arithmetic) is not."""
    def rounded_once(q, k, cos, sin):
        def apply(x):
            rotated = torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], dim=-1)
            return (x.float() * cos.float() + rotated.float() * sin.float()).to(x.dtype)
        return apply(q), apply(k)
    assert {dtype for dtype, _ in rope_mismatches(rounded_once)} == {torch.bfloat16, torch.float16}


@pytest.mark.skipif(not kernels.interpreted(), reason="the interpreter's truncating bf16 cast (a GPU rounds to nearest)")
def test_rope_without_the_interpreters_bf16_rounding_fails_the_check(monkeypatch):
    """Planted: the interpreter's own fp32 -> bf16 cast, which truncates where torch rounds to nearest even."""
    monkeypatch.setattr(K, "INTERPRETED", False)
    assert {dtype for dtype, _ in rope_mismatches(K.rope)} == {torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_with_qk_norm_is_the_norm_then_the_rotation(dtype):
    """Qwen3's qk-norm fused into the RoPE launch: within tolerance of reference rms_norm then rope, on
    strided heads (views of a qkv output); a planted gain-less norm fails the same check."""
    gen = torch.Generator().manual_seed(8)
    qkv = rand(2, 3, 6 * 16, dtype=dtype, gen=gen) * 4
    q, k = (x.view(2, 3, -1, 16).transpose(1, 2) for x in qkv.split([4 * 16, 2 * 16], dim=-1))
    cos, sin = (rand(2, 1, 3, 16, dtype=dtype, gen=gen) for _ in range(2))
    norm = ((rand(16, gen=gen).abs() + 0.5).to(dtype), (rand(16, gen=gen).abs() + 0.5).to(dtype), 1e-6)
    want = R.rope(q, k, cos, sin, norm)
    for got, ref in zip(K.rope(q, k, cos, sin, norm), want):
        close(got, ref, dtype)
    planted = R.rope(q, k, cos, sin, (torch.ones_like(norm[0]), torch.ones_like(norm[1]), 1e-6))
    with pytest.raises(AssertionError):
        close(K.rope(q, k, cos, sin, norm)[0], planted[0], dtype)


def test_a_rope_row_is_the_same_at_every_width_and_place():
    """A position's q and k heads rotated alone, then at every place of bf16 calls of each width as the
    second sequence of a batch of two (the other rows random, at other positions)."""
    gen = torch.Generator().manual_seed(6)
    q, k, cos, sin = rope_inputs(16, torch.bfloat16, gen, torch.tensor([[1234]]))
    alone = K.rope(q, k, cos, sin)
    norm = (torch.linspace(0.5, 1.5, 16).to(torch.bfloat16), torch.linspace(1.5, 0.5, 16).to(torch.bfloat16), 1e-6)
    alone_normed = K.rope(q, k, cos, sin, norm)
    for width in WIDTHS:
        for place in sorted({0, width // 2, width - 1}):
            positions = torch.randint(0, 5000, (2, width), generator=gen)
            positions[1, place] = 1234
            cq, ck, ccos, csin = rope_inputs(16, torch.bfloat16, gen, positions)
            cq[1, :, place], ck[1, :, place] = q[0, :, 0], k[0, :, 0]
            got = K.rope(cq, ck, ccos, csin)
            assert torch.equal(got[0][1, :, place], alone[0][0, :, 0]), (width, place)
            assert torch.equal(got[1][1, :, place], alone[1][0, :, 0]), (width, place)
            normed = K.rope(cq, ck, ccos, csin, norm)  # with Qwen3's qk-norm in the launch
            assert torch.equal(normed[0][1, :, place], alone_normed[0][0, :, 0]), (width, place)
            assert torch.equal(normed[1][1, :, place], alone_normed[1][0, :, 0]), (width, place)


def test_the_references_are_the_models_arithmetic():
    """reference.rms_norm and reference.rope are models.layers' RMSNorm and apply_rope bit for bit
    (the kernels are held to them)."""
    from eagle_export.models.layers import RMSNorm, apply_rope

    norm = RMSNorm(32, 1e-5).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert torch.equal(norm(x), R.rms_norm(x, norm.weight, 1e-5))
    q, k, cos, sin = rope_inputs(16, torch.bfloat16, torch.Generator().manual_seed(7), torch.tensor([[3, 900]]))
    assert all(map(torch.equal, R.rope(q, k, cos, sin), (apply_rope(q, cos, sin), apply_rope(k, cos, sin))))


def test_without_triton_the_error_says_what_runs_instead(monkeypatch):
    import builtins
    import sys

    from eagle_export.errors import EagleExportError

    real_import = builtins.__import__
    monkeypatch.delitem(sys.modules, "eagle_export.kernels.triton_ops", raising=False)
    monkeypatch.delattr(kernels, "triton_ops", raising=False)
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError("no triton"))
                        if name == "triton" else real_import(name, *a, **k))
    with pytest.raises(EagleExportError) as e:
        kernels.ops()
    assert "Triton" in e.value.problem and "tiered contract" in e.value.fix


# --- prologues: an RMSNorm, or the MLP's silu(gate) * up, inside the linear's K loop ------------------------

NORM_K = 300  # past K.NORM_BLOCK on a GPU and the interpreter (a ragged last step), three BLOCK_K steps


# (dtype, split, residual, case) -> the standalone kernel then the linear, on prologue_mismatches' inputs (the
# same every call: seed 9), computed once for the check and its planted variants (a plant replaces a helper
# in the fused call only)
_STANDALONE = {}


def prologue_mismatches(fused=K.linear, dtypes=DTYPES) -> list:
    """(dtype, case, split, residual) where `fused` (linear's signature) differs in any bit from the standalone kernel then the
    linear: rms_norm(x, gain or None, eps) then linear, and silu_mul(gate, up) then linear (gate and up
    the halves of one gate_up output), at one K split and three, each with a residual epilogue too.
    x is a strided view (a row stride past K), its rows' magnitudes spread over 2^-4..2^4."""
    gen, found = torch.Generator().manual_seed(9), []
    for dtype in dtypes:
        scale = (2.0 ** torch.randint(-4, 5, (5, 1), generator=gen)).to(DEVICE)
        x = (rand(5, NORM_K + 20, dtype=torch.float32, gen=gen) * scale).to(dtype)[:, :NORM_K]
        w, b = rand(70, NORM_K, dtype=dtype, gen=gen), rand(70, dtype=dtype, gen=gen)
        gain, res = (rand(NORM_K, gen=gen).abs() + 0.5).to(dtype), rand(5, 70, dtype=dtype, gen=gen) * 3
        gate, up = (rand(5, 2 * NORM_K, dtype=dtype, gen=gen) * 3).split(NORM_K, dim=-1)
        for config in (None, SPLIT_CONFIG):
            for residual in (None, res):
                def both(fused, standalone, case):
                    key = (dtype, case, config is not None, residual is not None)
                    if key not in _STANDALONE:
                        _STANDALONE[key] = standalone()
                    if not torch.equal(fused, _STANDALONE[key]):
                        found.append(key)
                both(fused(x, w, b, config, residual, norm=(gain, 1e-5)),
                     lambda: K.linear(K.rms_norm(x, gain, 1e-5), w, b, config, residual), "norm")
                both(fused(x, w, None, config, residual, norm=(None, 1e-6)),
                     lambda: K.linear(K.rms_norm(x, None, 1e-6), w, None, config, residual), "norm without gain")
                both(fused(gate, w, b, config, residual, up=up),
                     lambda: K.linear(K.silu_mul(gate, up), w, b, config, residual), "silu")
    return found


@pytest.mark.slow
def test_a_fused_prologue_is_the_standalone_kernel_then_the_linear_bit_for_bit():
    assert prologue_mismatches() == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_fused_prologue_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(10)
    x, w, b = rand(5, NORM_K, dtype=dtype, gen=gen), rand(70, NORM_K, dtype=dtype, gen=gen), rand(70, dtype=dtype, gen=gen)
    gain, up = (rand(NORM_K, gen=gen).abs() + 0.5).to(dtype), rand(5, NORM_K, dtype=dtype, gen=gen)
    for config in (None, SPLIT_CONFIG):
        close(K.linear(x, w, b, config, norm=(gain, 1e-5)), R.linear(x, w, b, norm=(gain, 1e-5)), dtype)
        close(K.linear(x, w, b, config, up=up), R.linear(x, w, b, up=up), dtype)
    with pytest.raises(ValueError, match="not both"):
        K.linear(x, w, norm=(gain, 1e-5), up=up)
    with pytest.raises(ValueError, match="in x's dtype"):
        K.linear(x, w, norm=(gain.to(torch.float64), 1e-5))


def standalone_mismatches() -> set:
    """(dtype, kernel) where rms_norm or silu_mul differ in any bit from the models' arithmetic, on
    inputs where only roundings could: rows whose sum of squares is exact in any order (small
    integers), silu_mul elementwise (16-bit dtypes: torch computes each op in fp32 and rounds)."""
    gen, found = torch.Generator().manual_seed(11), set()
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randint(-8, 9, (4, 300), generator=gen).to(DEVICE, dtype)
        gain = (rand(300, gen=gen).abs() + 0.5).to(dtype)
        if not torch.equal(K.rms_norm(x, gain, 1e-5), R.rms_norm(x, gain, 1e-5)):
            found.add((dtype, "rms_norm"))
        gate, up = rand(4, 300, dtype=dtype, gen=gen) * 3, rand(4, 300, dtype=dtype, gen=gen)
        if not torch.equal(K.silu_mul(gate, up), R.silu_mul(gate, up)):
            found.add((dtype, "silu_mul"))
    return found


@pytest.mark.skipif(not kernels.interpreted(), reason="on a GPU torch's exp and rsqrt and Triton's differ in "
                    "fp32's last bits (the kernels are held to the references within tolerance there)")
def test_the_standalone_kernels_round_as_torch(monkeypatch):
    """Bit for bit where only roundings could differ; planted, the interpreter's own bf16 cast (it
    truncates, where torch rounds to nearest even): both kernels flagged in bf16, neither in fp16."""
    assert standalone_mismatches() == set()
    monkeypatch.setattr(K, "INTERPRETED", False)
    assert standalone_mismatches() == {(torch.bfloat16, "rms_norm"), (torch.bfloat16, "silu_mul")}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_fused_prologues_row_is_the_same_at_every_width_and_place(dtype):
    """A row's rstd is over its own K columns, whatever rows share its tile, and whatever K split."""
    gain = torch.linspace(0.5, 1.5, 128).to(DEVICE, dtype)
    for config in (None, SPLIT_CONFIG):
        assert linear_row_mismatches(lambda x, w, b: K.linear(x, w, b, config, norm=(gain, 1e-5)), dtype) == []
        assert linear_row_mismatches(lambda x, w, b: K.linear(x, w, b, config, up=x.flip(-1)), dtype) == []


@pytest.mark.slow
@pytest.mark.skipif(not kernels.interpreted(), reason="planted by replacing a @triton.jit helper, which only the "
                    "interpreter resolves at each call (a compiled kernel refuses a changed global)")
def test_a_prologue_rounded_once_fails_the_bit_for_bit_check(monkeypatch):
    """Planted: the norm's x * rstd * gain, and silu(gate) * up, each in fp32 rounded once (what a kernel
    that skips torch's intermediate rounding computes): every 16-bit case flagged, fp32 (where the
    intermediate rounding is a no-op) not."""
    @triton.jit
    def normed_once(v, rstd, gain, cols, k, ty: tl.constexpr, out: tl.constexpr,
                    HAS_GAIN: tl.constexpr, RNE: tl.constexpr):
        normed = v.to(tl.float32) * rstd[:, None]
        if HAS_GAIN:
            normed = tl.load(gain + cols, mask=cols < k, other=0.0).to(tl.float32)[None, :] * normed
        return K._round(normed, out, RNE)

    @triton.jit
    def silu_mul_once(g, u, ty: tl.constexpr, RNE: tl.constexpr):
        g = g.to(tl.float32)
        return K._round(g / (1.0 + tl.exp(-g)) * u.to(tl.float32), ty, RNE)

    def planted(name, helper):
        def fused(*args, **kwargs):  # the helper replaced in the fused call only (rms_norm, silu_mul share it)
            with monkeypatch.context() as m:
                m.setattr(K, name, helper)
                return K.linear(*args, **kwargs)
        return fused

    found = prologue_mismatches(planted("_normed", normed_once))
    assert {(dtype, case) for dtype, case, *_ in found} == {(d, "norm") for d in DTYPES[1:]}, found
    assert len(found) == 2 * 4, found  # each 16-bit dtype: one split and three, with and without a residual
    found = prologue_mismatches(planted("_silu_mul", silu_mul_once))
    assert {(dtype, case) for dtype, case, *_ in found} == {(d, "silu") for d in DTYPES[1:]}, found
