"""Width invariance on the torch CPU backend (DESIGN.md): a position's logits and new K/V are the
same bits as row 0 of a one-token call over past p (plain decoding) and as row j of a wider call over
past p-j (a verify call that accepted j drafts), whatever the batch around it and the masked slots
its cache view shows. Tolerance: none, bit for bit. The planted variants (the graphs' [cache | call]
attention with two reductions; Linears left to pick their GEMM kernel by M) must fail the same check."""

import pytest
import torch
from tiny_models import tiny_drafter_config, tiny_target_config

from eagle_export.models import layers
from eagle_export.models.config import DrafterConfig, TargetConfig
from eagle_export.models.drafter import Drafter
from eagle_export.models.nvfp4 import NVFP4Linear
from eagle_export.models.target import Target

pytestmark = pytest.mark.usefixtures("no_grad")

WIDTH = 5      # K+1
PROMPT = 9     # positions every call shares (one prefill)
POSITIONS = 8  # positions compared after it
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tiny_target(dtype=torch.float32, seed=0) -> Target:
    torch.manual_seed(seed)
    target = Target(TargetConfig.from_hf(tiny_target_config("llama")))
    with torch.no_grad():
        for name, p in target.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return layers.width_invariant(target.to(dtype).eval())


def tiny_drafter(target: Target, seed=0) -> Drafter:
    torch.manual_seed(seed)
    drafter = Drafter(DrafterConfig.from_hf(tiny_drafter_config()))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    drafter.share_embeddings(target.embed_tokens)
    return layers.width_invariant(drafter.to(target.embed_tokens.weight.dtype).eval())


class Sequences:
    """B sequences through one model's forward (target, or drafter with per-position hidden states):
    each call takes its tokens at each sequence's own length, over a cache view of `slots` slots whose
    slots past the length hold stale values (as a runtime's reused cache does)."""

    def __init__(self, model, batch: int, length: int, seed: int):
        self.model, self.drafter = model, isinstance(model, Drafter)
        dtype = model.embed_tokens.weight.dtype
        # each sequence drawn from its own generator: sequence 0 is the same in every batch
        gens = [torch.Generator().manual_seed(seed + i) for i in range(batch)]
        self.tokens = torch.stack([torch.randint(3, 320, (length,), generator=g) for g in gens])
        self.hidden = torch.stack([torch.randn(length, model.config.hidden_size, generator=g) for g in gens]).to(dtype)
        g = gens[-1]
        layers_, heads, dim = ((1, model.config.num_kv_heads, model.config.head_dim) if self.drafter else
                               (model.config.num_layers, model.config.num_kv_heads, model.config.head_dim))
        self.key = torch.randn(layers_, batch, heads, length + 64, dim, generator=g).to(dtype)  # stale everywhere
        self.value = torch.randn_like(self.key)
        self.lens = torch.zeros(batch, dtype=torch.long)

    def call(self, rows: torch.Tensor, slots: int, commit: torch.Tensor):
        """rows [B]: how many tokens each sequence brings (the call is max(rows) wide, padded with its
        next tokens); commit [B]: how many of them join its cache. -> (logits [B,T,V], new K, new V)."""
        t = int(rows.max())
        positions = self.lens[:, None] + torch.arange(t)
        ids = self.tokens.gather(1, positions)
        view = (self.key[:, :, :, :slots], self.value[:, :, :, :slots])
        if self.drafter:
            hidden = self.hidden.gather(1, positions[..., None].expand(-1, -1, self.hidden.shape[2]))
            logits, _, new_k, new_v = self.model(ids, hidden, positions, *view, self.lens)
        else:
            logits, _, new_k, new_v = self.model(ids, positions, *view, self.lens)
        for b in range(len(self.lens)):
            n, at = int(commit[b]), int(self.lens[b])
            self.key[:, b, :, at:at + n], self.value[:, b, :, at:at + n] = new_k[:, b, :, :n], new_v[:, b, :, :n]
        self.lens = self.lens + commit
        return logits, new_k, new_v


def plain_rows(model, batch=1, seed=0):
    """Plain decoding: a prefill of PROMPT tokens, then one-token calls over views of exactly the
    cached slots. -> per position p >= PROMPT of sequence 0: (logits, K, V) of its row."""
    seqs = Sequences(model, batch, PROMPT + POSITIONS + WIDTH, seed)
    full = torch.full((batch,), PROMPT)
    seqs.call(full, PROMPT, full)
    rows = {}
    for p in range(PROMPT, PROMPT + POSITIONS):
        one = torch.ones(batch, dtype=torch.long)
        logits, k, v = seqs.call(one, p, one)
        rows[p] = (logits[0, 0], k[:, 0, :, 0], v[:, 0, :, 0])
    return rows


def differing_rows(model, batch=3, seed=0) -> int:
    """How many (p, j) rows of sequence 0, computed as row j of a WIDTH-wide call over past p-j in a
    batch of `batch` ragged sequences over a view with masked slots, differ from plain decoding's."""
    reference = plain_rows(model, seed=seed)
    differing = 0
    for j in range(WIDTH):
        seqs = Sequences(model, batch, PROMPT + POSITIONS + WIDTH, seed)
        prompt = torch.full((batch,), PROMPT)
        prompt[1:] -= torch.arange(1, batch)  # ragged: the other sequences are shorter
        seqs.call(prompt, PROMPT + 3, prompt)
        for p in range(PROMPT + j, PROMPT + POSITIONS):
            # bring sequence 0 to past p - j one token at a time, then the call that puts p at row j
            while int(seqs.lens[0]) < p - j:
                one = torch.ones(batch, dtype=torch.long)
                seqs.call(one, int(seqs.lens.max()) + 2, one)
            wide = torch.full((batch,), WIDTH)
            logits, k, v = seqs.call(wide, int(seqs.lens.max()) + WIDTH + 7, torch.zeros(batch, dtype=torch.long))
            ref_logits, ref_k, ref_v = reference[p]
            same = (torch.equal(logits[0, j], ref_logits) and torch.equal(k[:, 0, :, j], ref_k)
                    and torch.equal(v[:, 0, :, j], ref_v))
            differing += not same
    return differing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_target_row_is_the_same_bits_at_every_width_batch_and_place(dtype):
    assert differing_rows(tiny_target(dtype)) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_drafter_row_is_the_same_bits_at_every_width_batch_and_place(dtype):
    assert differing_rows(tiny_drafter(tiny_target(dtype))) == 0


@pytest.mark.slow  # 92 s at load 12 on 2 cores (ModelOpt quantizes every activation)
def test_nvfp4_target_row_is_the_same_bits_at_every_width_batch_and_place():
    """NVFP4 weights and activations: the activations' blocks of 16 lie within a row and their global
    scale is the calibrated constant, so quantization couples no rows either."""
    target = tiny_target()
    for name, module in list(target.named_modules()):
        for child, linear in list(module.named_children()):
            if type(linear) is layers.RowLinear and child != "lm_head":
                setattr(module, child, NVFP4Linear(linear.weight, linear.bias, input_amax=4.0))
    layers.width_invariant(target)
    assert differing_rows(target) == 0


def test_planted_two_reduction_attention_fails():
    """The graphs' attention ([cache | call] scored apart, probs.V as two MatMuls added) run in torch."""
    def graph_form(q, k, v, k_cache, v_cache, cache_lens, mask, tap=None):
        return layers.attend_graph(q, k, v, k_cache, v_cache, mask, tap)

    target = tiny_target()
    for module in target.modules():
        if isinstance(module, layers.Attention):
            module.core = graph_form
    assert differing_rows(target) > 0


def test_planted_linear_choosing_its_kernel_by_rows_fails():
    target = tiny_target()
    for module in target.modules():
        if type(module) is layers.RowLinear:
            module.__class__ = torch.nn.Linear
    assert differing_rows(target) > 0


def test_planted_one_row_gemv_fails(monkeypatch):
    """A probe that admitted M = 1 (a GEMV: another reduction order) for a call's last chunk."""
    monkeypatch.setattr(layers, "chunk_rows", lambda weight, bias=None: tuple(range(1, layers.LINEAR_ROWS + 1)))
    monkeypatch.setattr(layers, "_tail_rows", {})  # (tail_rows' table, built from the probe)
    assert differing_rows(tiny_target()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("features", [(576, 192), (576, 960), (576, 1536), (1536, 576), (576, 49152)])
def test_row_linear_gives_a_row_the_same_bits_in_calls_of_any_row_count(features, dtype):
    """At real shapes (the sample's k/v, fused qkv, gate, down projections and lm_head), where MKL picks
    its kernel by M and one bmm over 3 chunks gave other bits than over 1: every tail length a call's
    last chunk can have (1..LINEAR_ROWS-1 rows, padded to a probed row count in fp32), at an offset."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(features[1], features[0], generator=g).to(dtype), torch.randn(24, features[0], generator=g).to(dtype)
    full = layers.row_linear(x, w)
    for rows in range(1, 18):
        assert torch.equal(layers.row_linear(x[:rows], w), full[:rows]), rows
    assert torch.equal(layers.row_linear(x[7:12], w), full[7:12])
    assert layers.LINEAR_ROWS in layers.chunk_rows(w)
    if dtype != torch.float32:  # unprobed: the rounding hides the differences a probe looks for
        assert layers.chunk_rows(w) == (layers.LINEAR_ROWS,)


def test_chunk_rows_rejects_a_row_count_whose_gemm_differs(monkeypatch):
    """Planted: a GEMM whose result depends on M for M < 4 (rounded through bf16) must not be admitted."""
    real = torch.nn.functional.linear

    def m_dependent(x, w, b=None):
        out = real(x, w, b)
        return out.bfloat16().float() if x.shape[0] < 4 else out

    monkeypatch.setattr(layers.F, "linear", m_dependent)
    monkeypatch.setattr(layers, "_chunk_rows", {})
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    assert layers.chunk_rows(w) == tuple(range(4, layers.LINEAR_ROWS + 1))


def test_row_linear_equals_linear_within_rounding():
    """row_linear is x @ W^T + b (fp32 tolerance 1e-5 relative: only the GEMM's blocking differs)."""
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(3, 11, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    for b in (None, bias):
        torch.testing.assert_close(layers.row_linear(x, w, b), torch.nn.functional.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)


def test_attend_equals_the_graph_form_within_rounding():
    """The width-invariant core and the exported graphs' form compute the same attention (fp32,
    1e-5), on a ragged batch with masked cache slots and keys past the call's own (a prefix between
    cache and call: more keys after the cache than rows)."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, t, s, e, d = 3, 4, 2, 5, 70, 2, 16
    q, k, v = torch.randn(b, hq, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g), \
        torch.randn(b, hkv, t, d, generator=g)
    k_cache, v_cache = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    prefix = torch.randn(b, hkv, e, d, generator=g), torch.randn(b, hkv, e, d, generator=g)
    lens = torch.tensor([0, 33, 70])
    past = torch.arange(s)[None, None] < lens[:, None, None]
    mask = torch.cat([past.expand(-1, t, -1), torch.ones(b, t, e, dtype=torch.bool),
                      layers.causal_mask(b, t)], dim=-1)[:, None, None]
    k, v = torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2)
    got = layers.attend(q, k, v, k_cache, v_cache, lens, mask)
    expected = layers.attend_graph(q, k, v, k_cache, v_cache, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    no_cache_semantics = layers.attend(q, k, v, k_cache, v_cache, None, mask)
    torch.testing.assert_close(no_cache_semantics, expected, rtol=1e-5, atol=1e-5)


def one_row_over_views(attend, past: int, slots: list[int]) -> list[torch.Tensor]:
    """attend's output for a one-token call at position `past` (the cache holding 0..past-1) over cache
    views of each of `slots` slots; the view's slots past `past` hold stale values (masked)."""
    g = torch.Generator().manual_seed(past)
    hq, hkv, d = 4, 2, 16
    q, k, v = torch.randn(1, hq, 1, d, generator=g), torch.randn(1, hkv, 1, d, generator=g), \
        torch.randn(1, hkv, 1, d, generator=g)
    k_cache, v_cache = torch.randn(1, hkv, max(slots), d, generator=g), torch.randn(1, hkv, max(slots), d, generator=g)
    lens = torch.tensor([past])
    return [attend(q, k, v, k_cache[:, :, :s], v_cache[:, :, :s], lens,
                   layers.attention_mask(lens[:, None], lens, s)) for s in slots]


VIEWS = [41, 63, 64, 130, 151, 200, 320]  # 1, 1, 2, 3, 3, 4 and 6 key blocks of 64 with the call's key


@pytest.mark.parametrize("past", [40, 100, 150])
def test_attend_row_is_the_same_bits_over_views_of_any_length(past):
    """A row's attention over its prefix does not depend on how many masked slots the view shows,
    across one key block (its sum taken as is, no cumsum) and several (the blocks' cumsum): fp32, bit
    for bit, prefixes in one, two and three blocks."""
    outs = one_row_over_views(layers.attend, past, [s for s in VIEWS if s >= past])
    assert len(outs) >= 2 and all(torch.equal(out, outs[0]) for out in outs[1:])


def test_planted_key_split_by_count_fails(monkeypatch):
    """Planted: the keys split into two blocks whatever the view's length (a KV split by count, not by
    a fixed size): a prefix of 100 slots is two blocks over a 130-slot view and one over 320."""
    def split_in_two(q, k, v, k_cache, v_cache, cache_lens, mask, tap=None):
        monkeypatch.setattr(layers, "KEY_BLOCK", 32 * -(-(k_cache.shape[2] + k.shape[2]) // 64))
        monkeypatch.setattr(layers, "_layout_memo", [None])
        return layers.attend(q, k, v, k_cache, v_cache, cache_lens, mask, tap)

    outs = one_row_over_views(split_in_two, 100, [130, 320])
    assert not torch.equal(outs[0], outs[1])


def test_attend_passes_the_weights_through_a_hooked_tap():
    """Without a hook the weights skip the tap's layout (attend's shortcut); with one they go through
    it: a hook that reads them leaves every bit of the output as it was, and a hook that puts all
    weight on slot 0 makes the output V at slot 0 (a shortcut taken despite the hook fails this)."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, t, s, d = 2, 4, 2, 3, 70, 16
    q, k, v = torch.randn(b, hq, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g), \
        torch.randn(b, hkv, t, d, generator=g)
    k_cache, v_cache = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    lens = torch.tensor([30, 66])
    positions = lens[:, None] + torch.arange(t)
    mask = layers.attention_mask(positions, lens, s)
    tap = torch.nn.Identity()
    plain = layers.attend(q, k, v, k_cache, v_cache, lens, mask, tap=tap)
    read = []
    handle = tap.register_forward_hook(lambda module, args, weights: read.append(weights))
    assert torch.equal(layers.attend(q, k, v, k_cache, v_cache, lens, mask, tap=tap), plain)
    assert read and read[0].shape[:4] == (b, hkv, hq // hkv, t)
    torch.testing.assert_close(read[0].sum(-1), torch.ones(b, hkv, hq // hkv, t))  # fp32 rounding
    handle.remove()

    def onto_slot_0(module, args, weights):
        forced = torch.zeros_like(weights)
        forced[..., 0] = 1.0
        return forced

    tap.register_forward_hook(onto_slot_0)
    out = layers.attend(q, k, v, k_cache, v_cache, lens, mask, tap=tap).view(b, t, hkv, hq // hkv, d)
    assert torch.equal(out, v_cache[:, :, 0][:, None, :, None].expand_as(out))


def test_tail_rows_keeps_dtypes_apart():
    """tail_rows' table is per dtype: after an fp32 probe at a shape, a bf16 weight of that shape still
    runs a short call at LINEAR_ROWS rows (a table keyed by shape alone gave bf16 rows other bits)."""
    w = torch.randn(960, 576, generator=torch.Generator().manual_seed(0))
    fp32 = [layers.tail_rows(w, None, r) for r in range(1, layers.LINEAR_ROWS + 1)]
    assert all(n >= r for n, r in zip(fp32, range(1, layers.LINEAR_ROWS + 1)))
    assert [layers.tail_rows(w.bfloat16(), None, r) for r in range(1, layers.LINEAR_ROWS + 1)] == \
        [layers.LINEAR_ROWS] * layers.LINEAR_ROWS
