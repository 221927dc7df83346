"""The building blocks the target and the drafter share: RMSNorm, RoPE, MLP, attention.

Attention follows the graph contract: it reads the runtime-owned cache and returns only the new
K/V entries. Cache slot j of a sequence holds position j, so one boolean mask covers prefill,
verify and ragged batches: a query sees past slots j < cache_len[b] and new tokens up to itself.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = rms_normalize(x, self.eps)
        # No gain once passes.fold_norm_gains has folded it into the next linear layer.
        return normed if self.weight is None else self.weight * normed


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a gain, computed in fp32 and cast back, as transformers does."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`,
        # short ones kept, and the band between interpolated smoothly.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin of shape [B, 1, T, head_dim] for positions [B, T]."""
    freqs = positions.unsqueeze(-1).float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def in_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B,T,K] bool: key k lies in the sliding window of query t (the window counts the query itself,
    as Mistral and Qwen count it). query_positions [B,T]; key_positions [B,K] or [K]."""
    return key_positions.unsqueeze(-2) > query_positions.unsqueeze(-1) - window


def key_positions(past_len: int, positions: torch.Tensor) -> torch.Tensor:
    """[B, S+T]: the position of every key a step attends to, cache slot j holding position j."""
    slots = torch.arange(past_len, device=positions.device).expand(positions.shape[0], -1)
    return torch.cat([slots, positions], dim=-1)


def causal_mask(batch: int, tokens: int, device=None) -> torch.Tensor:
    """[B,T,T] bool: each new token sees the new tokens up to itself (a prefill's, or a chain's tree mask)."""
    return torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)


def attention_mask(positions: torch.Tensor, cache_lens: torch.Tensor, past_len: int,
                   sliding_window: int | None = None, new_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, 1, 1, T, past_len + T]: True where query t may attend to key s. Among the new
    tokens, `new_mask` [B,T,T] (a token tree's ancestor-or-self mask) when given, else causal."""
    t = positions.shape[1]
    slots = torch.arange(past_len, device=positions.device)
    past_ok = slots.view(1, 1, -1) < cache_lens.view(-1, 1, 1)            # [B,1,S]
    past_ok = past_ok.expand(-1, t, -1)                                    # [B,T,S]
    if new_mask is None:
        new_mask = causal_mask(positions.shape[0], t, positions.device)
    mask = torch.cat([past_ok, new_mask], dim=-1)
    if sliding_window is not None:
        mask = mask & in_window(positions, key_positions(past_len, positions), sliding_window)
    return mask[:, None, None]


# Width invariance (DESIGN.md): each row's arithmetic must not depend on the call's width, its batch
# or the row's place in the call. CPU BLAS picks its kernel by shape (MKL: a row of x @ W^T comes out
# other bits at M = 1, 5 and 64), so every product below runs at shapes proven to agree: rows in GEMMs
# of LINEAR_ROWS rows (a call's last, shorter chunk at a row count probed to give the same bits),
# attention queries in blocks of QUERY_BLOCK rows per KV head against keys in blocks of KEY_BLOCK slots.
LINEAR_ROWS = 8
QUERY_BLOCK = 8
KEY_BLOCK = 64  # a multiple of 32: elementwise kernels then run every element through their vector path
PROBE_ROWS = 16  # random rows `chunk_rows` multiplies at each row count, every place in a chunk covered
_chunk_rows: dict = {}  # (fp32 weight shape, bias?, threads) -> the row counts proven alike


def chunk_rows(weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[int, ...]:
    """The row counts m <= LINEAR_ROWS whose GEMM x[m,K] @ W^T gives every row, at every place in the
    chunk, the same bits as the LINEAR_ROWS-row GEMM, probed once per weight shape, bias and thread
    count on PROBE_ROWS random rows through this weight, fp32 only: there another reduction order
    changes most of a row's outputs, so a kernel that differs cannot pass the probe. In bf16/fp16 the
    output's rounding hides most such differences (an M = 2 GEMM at 960x576 passed a 16-row probe and
    differed on other rows), so they keep LINEAR_ROWS alone. MKL on a 2-core EPYC, fp32, weights out x
    in: 2..8 with one thread; with two, 2..8 for 3072x576, 576x1536 and the lm_heads, 4..8 for 960x576,
    576x576 and 576x1728 (M = 1, a GEMV, never). Memoized."""
    if weight.dtype != torch.float32:
        return (LINEAR_ROWS,)
    key = (tuple(weight.shape), bias is not None, torch.get_num_threads())
    if key not in _chunk_rows:
        x = torch.randn(PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
        reference = torch.cat([F.linear(c, weight, bias) for c in x.split(LINEAR_ROWS)])
        _chunk_rows[key] = tuple(m for m in range(1, LINEAR_ROWS + 1) if torch.equal(
            torch.cat([F.linear(c, weight, bias) for c in x[:PROBE_ROWS // m * m].split(m)]),
            reference[:PROBE_ROWS // m * m]))
    return _chunk_rows[key]


_tail_rows: dict = {}  # (weight shape, dtype, bias?, threads) -> per r <= LINEAR_ROWS, the rows r's GEMM runs at


def tail_rows(weight: torch.Tensor, bias: torch.Tensor | None, r: int) -> int:
    """The rows a GEMM of r <= LINEAR_ROWS rows through `weight` runs at: the fewest `chunk_rows` proved
    alike, >= r. Memoized as a table per weight shape, dtype, bias and thread count (a step asks at
    every Linear)."""
    key = (tuple(weight.shape), weight.dtype, bias is not None, torch.get_num_threads())
    table = _tail_rows.get(key)
    if table is None:
        alike = chunk_rows(weight, bias)
        table = _tail_rows[key] = tuple(next(n for n in alike if n >= r) for r in range(LINEAR_ROWS + 1))
    return table[r]


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with each row computed alike in every call: the rows of x [..., K]
    (all leading axes flattened) go through one GEMM call per chunk of LINEAR_ROWS rows, the last
    r rows padded to `tail_rows` (the smallest row count `chunk_rows` proved alike, >= r; LINEAR_ROWS
    at worst), so neither the call's width nor its batch nor the row's place changes a row's bits, and
    an fp32 one-token step costs a 2-row GEMM where that is proven, not an 8-row one (not one bmm over
    the chunks: MKL's batched GEMM gave other bits with 3 chunks than with 1 at 576x192). A call of
    at most LINEAR_ROWS rows (a step, a verify call) is one GEMM, with the fewest ops around it: on a
    one-token step each op counts (the weights stream through the caches between them). While
    tracing (the ONNX export) it is F.linear, the graph's MatMul."""
    if torch.jit.is_tracing():  # torch.onnx.is_in_onnx_export imports on every call: 5x the cost
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m <= LINEAR_ROWS:
        n = tail_rows(weight, bias, m)
        return F.linear(F.pad(rows, (0, 0, 0, n - m)) if n > m else rows, weight, bias)[:m].view(*x.shape[:-1], -1)
    tail = m % LINEAR_ROWS
    if tail:
        rows = F.pad(rows, (0, 0, 0, m // LINEAR_ROWS * LINEAR_ROWS + tail_rows(weight, bias, tail) - m))
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in rows.split(LINEAR_ROWS)])
    return out[:m].view(*x.shape[:-1], -1)


class RowLinear(nn.Linear):
    """nn.Linear through `row_linear` (`width_invariant` turns a model's Linears into these)."""

    def forward(self, x):
        return row_linear(x, self.weight, self.bias)


def width_invariant(model: nn.Module) -> nn.Module:
    """Bind `model` (in place, weights untouched) to the width-invariant forms, the torch CPU
    backend's: every plain nn.Linear a RowLinear, every module with a `row_invariant` switch
    (NVFP4Linear) through `row_linear`, every Attention's core `attend`. Returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowLinear
        elif hasattr(module, "row_invariant"):
            module.row_invariant = True
        elif isinstance(module, Attention):
            module.core = attend
    return model


_layout_memo: list = [None]  # the last call's (sizes, mask, cache_lens, layout), copies of its inputs


def _key_layout(mask, cache_lens, b: int, t: int, s: int, e: int, hkv: int, d: int):
    """`attend`'s key layout for one call: at [B,Hkv,E,D], the slot each of the call's E keys goes to
    (cache_lens[b] + i; without cache_lens after the view) as a scatter index into [B,Hkv,slots,D], and
    hidden [B,1,nq,nk,1,QB,KB] (contiguous), the slots each query row does NOT see, in its query and key
    blocks. A function of the mask's and cache_lens' values and the
    sizes alone, and every layer of a forward passes the same ones: the last call's layout is reused
    when they are equal (compared by value against copies: in-place writes between calls cannot go
    stale), so it is computed once per forward, not once per layer."""
    memo = _layout_memo[0]
    if (memo is not None and memo[0] == (b, t, s, e, hkv, d) and torch.equal(memo[1], mask)
            and (cache_lens is None if memo[2] is None else cache_lens is not None and torch.equal(memo[2], cache_lens))):
        return memo[3]
    n = -(-(s + e) // KEY_BLOCK) * KEY_BLOCK
    nk, tq = n // KEY_BLOCK, -(-t // QUERY_BLOCK) * QUERY_BLOCK
    start = cache_lens.view(b, 1) if cache_lens is not None else torch.full((b, 1), s, device=mask.device)
    slots = start + torch.arange(e, device=mask.device)                                     # [B,E]
    seen = mask.expand(b, 1, 1, t, s + e)[:, 0, 0]                                         # [B,T,S+E]
    seen = F.pad(seen[..., :s], (0, n - s)).scatter_(2, slots[:, None].expand(b, t, e), seen[..., s:])
    seen = F.pad(seen, (0, 0, 0, tq - t)).view(b, 1, tq // QUERY_BLOCK, QUERY_BLOCK, nk, KEY_BLOCK)
    hidden = (~seen.permute(0, 1, 2, 4, 3, 5)[:, :, :, :, None]).contiguous()              # [B,1,nq,nk,1,QB,KB]
    at = slots[:, None, :, None].expand(b, hkv, e, d)
    _layout_memo[0] = ((b, t, s, e, hkv, d), mask.clone(), None if cache_lens is None else cache_lens.clone(), (at, hidden))
    return at, hidden


def observed(tap) -> bool:
    """Whether anything reads the attention weights through `tap`: every Attention passes its
    weights_tap, an nn.Identity that returns them untouched unless a hook reads them (diagnose), so
    without one the weights need not be laid out for it and back (same values, same bits)."""
    return tap is not None and not (type(tap) is nn.Identity and not (tap._forward_hooks or tap._forward_pre_hooks))


def _in_slot_order(blocks: torch.Tensor) -> torch.Tensor:
    """The key blocks' partial sums [B,Hkv,nq,nk,...] added in slot order -> [B,Hkv,nq,1,...]: the last
    of a cumsum along the blocks (torch's CPU cumsum adds in that order, in double, rounding each
    prefix to fp32). One block is its own sum, the same bits (an fp32 through double and back is
    itself), without cumsum's cost: a one-token step over a short view has one block per query block."""
    return blocks if blocks.shape[3] == 1 else blocks.cumsum(3)[:, :, :, -1:]


def attend(q, k, v, k_cache, v_cache, cache_lens, mask, tap=None):
    """The attention core: q [B,Hq,T,D] and the keys after the cache k, v [B,Hkv,E,D] (after RoPE: the
    call's own, E = T, or with the unrolled drafter's earlier steps' before them); the cache views
    k_cache, v_cache [B,Hkv,S,D]; cache_lens [B], each sequence's cached slots (None: no cache
    semantics); mask [B,1,1,T,S+E] bool, which of [cache | k] each row sees; tap: a module the fp32
    attention weights [B,Hkv,G,T,keys] pass through (diagnose's hooks) -> out [B,T,Hq*D] in q's dtype.

    Width-invariant layout (DESIGN.md): the E keys after the cache are written into a copy of the cache view
    at each sequence's length (slot cache_lens[b] + i; without cache_lens after the view), so a key's
    slot is its position whichever call brought it; each row then reduces over that one buffer, in
    fp32, in blocks of KEY_BLOCK slots counted from slot 0: scores by fixed-shape GEMMs, the row's max
    (exact in any order), exp, and per block sum(p) and p.V, the blocks added in slot order (cumsum).
    A masked slot adds an exact 0 and blocks past a row's prefix add 0s at the end, so neither the
    view's length nor the keys the call brings nor the row's place changes a row's bits.
    In an ONNX export: `attend_graph`, the graph's [cache | call] form."""
    if torch.jit.is_tracing():  # as row_linear
        return attend_graph(q, k, v, k_cache, v_cache, mask, tap)
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k_cache.shape[2]
    g = hq // hkv
    keys, values = k, v
    e = keys.shape[2]
    n = -(-(s + e) // KEY_BLOCK) * KEY_BLOCK
    nk, tq = n // KEY_BLOCK, -(-t // QUERY_BLOCK) * QUERY_BLOCK
    nq = tq // QUERY_BLOCK
    at, hidden = _key_layout(mask, cache_lens, b, t, s, e, hkv, d)

    def place(cache, new):  # [B,Hkv,n,D] fp32: the view, then the call's keys at their slots
        return F.pad(cache.float(), (0, 0, 0, n - s)).scatter_(2, at, new.float())

    key_buf, value_buf = place(k_cache, keys), place(v_cache, values)
    queries = F.pad(q.float().reshape(b, hkv, g, t, d), (0, 0, 0, tq - t))
    queries = queries.view(b, hkv, g, nq, QUERY_BLOCK, d).transpose(2, 3).reshape(b, hkv, nq, 1, g * QUERY_BLOCK, d)
    key_blocks = key_buf.view(b, hkv, 1, nk, KEY_BLOCK, d)
    # in place from the scores on (each op's input is its own fresh output: no copies, the same bits)
    scores = torch.matmul(queries, key_blocks.transpose(-1, -2)).div_(math.sqrt(d))       # [B,Hkv,nq,nk,G*QB,KB]
    scores = scores.view(b, hkv, nq, nk, g, QUERY_BLOCK, KEY_BLOCK).masked_fill_(hidden, -math.inf)
    top = scores.amax(dim=(3, 6), keepdim=True).clamp_min_(torch.finfo(torch.float32).min)  # all-masked rows: finite
    # A masked slot's p is an exact 0, put there: exp(-inf) is 0 too, but 10x as slow as a finite exp (torch's CPU exp, fp32).
    p = scores.sub_(top).masked_fill_(hidden, 0.0).exp_().masked_fill_(hidden, 0.0)
    total = _in_slot_order(p.sum(-1, keepdim=True)).clamp_min_(1.0)  # >= 1 (the max's term) where any key is seen
    probs = p.div_(total)                                                                  # [B,Hkv,nq,nk,G,QB,KB]
    if observed(tap):  # the weights as [B,Hkv,G,T,slots], through the tap and back
        tapped = tap(probs.permute(0, 1, 4, 2, 5, 3, 6).reshape(b, hkv, g, tq, n)[:, :, :, :t])
        probs = F.pad(tapped, (0, 0, 0, tq - t)).view(b, hkv, g, nq, QUERY_BLOCK, nk, KEY_BLOCK)
        probs = probs.permute(0, 1, 3, 5, 2, 4, 6)
    probs = probs.reshape(b, hkv, nq, nk, g * QUERY_BLOCK, KEY_BLOCK)
    out = _in_slot_order(torch.matmul(probs, value_buf.view(b, hkv, 1, nk, KEY_BLOCK, d)))[:, :, :, 0]  # [B,Hkv,nq,G*QB,D]
    out = out.view(b, hkv, nq, g, QUERY_BLOCK, d).permute(0, 2, 4, 1, 3, 5).reshape(b, tq, hq * d)
    return out[:, :t].to(q.dtype)


def attend_graph(q, k, v, k_cache, v_cache, mask, tap=None, head_dim: int | None = None):
    """`attend` as the exported graphs compute it: scores over [cache view | the call's keys] (the
    cache is never copied), one Softmax, probs.V as a cache MatMul plus a call MatMul (README: the
    lossless contract, for what that layout costs ONNX Runtime's T1). `head_dim`: the module's own int
    (a traced shape would reach math.sqrt as a tensor: a TracerWarning in every export)."""
    b, hq, t, d = q.shape
    d = head_dim or d
    hkv = k.shape[1]
    keys, values = k, v
    # Group the query heads by their KV head instead of repeating K/V, and score the cache and
    # the new entries separately (concatenating scores, not keys): the cache is never copied.
    q = q.reshape(b, hkv, hq // hkv, t, d)
    past_scores = torch.matmul(q, k_cache.to(k.dtype).unsqueeze(2).transpose(-1, -2))
    new_scores = torch.matmul(q, keys.unsqueeze(2).transpose(-1, -2))
    scores = torch.cat([past_scores, new_scores], dim=-1) / math.sqrt(d)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    # Cast before the softmax, not via its dtype argument: the ONNX exporter turns that into a
    # half-precision Softmax followed by a Cast.
    probs = F.softmax(scores.float(), dim=-1)
    probs = (tap(probs) if tap is not None else probs).to(q.dtype)
    past_len = k_cache.shape[2]
    out = (torch.matmul(probs[..., :past_len], v_cache.to(v.dtype).unsqueeze(2))
           + torch.matmul(probs[..., past_len:], values.unsqueeze(2)))  # [B,Hkv,G,T,D]
    return out.reshape(b, hq, t, d).transpose(1, 2).reshape(b, t, -1)


class Attention(nn.Module):
    """GQA attention. `in_features` is 2H for the drafter's layer, H for the target's."""

    def __init__(self, in_features: int, out_features: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, bias: bool = False, qk_norm_eps: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_features, bias=False)
        if qk_norm_eps is not None:  # Qwen3: RMSNorm over each head's q and k before RoPE
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj = None  # q/k/v as one Linear once passes.fuse_qkv has run
        # A tap on the attention weights [B,Hkv,G,T,keys] (fp32): forward hooks read them here (diagnose).
        self.weights_tap = nn.Identity()
        self.qkv_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    # The attention core, the seam a backend binds once at load (an instance's `core`, a function of
    # attend's signature: `attend` on the torch CPU backend through `width_invariant`, the Triton
    # kernels in exact mode): everything before it is per-row projection and RoPE, everything after it
    # the output projection. Unbound (None): the exported graphs' form, `attend_graph`, which copies no
    # cache (the torch backend on a GPU, the models' own references, the export).
    core = None

    def forward(self, x, cos, sin, k_cache, v_cache, mask, prefix_kv=None, cache_lens=None, residual=None, norm=None):
        """x [B,T,in]; k_cache/v_cache [B,Hkv,S,D] -> (out [B,T,H*D], new_k, new_v [B,Hkv,T,D]).
        prefix_kv: optional small (K, V) [B,Hkv,E,D] sitting between the cache and the new tokens
        (the unrolled drafter's in-graph entries); then the mask covers S+E+T keys, and new_k, new_v
        are [prefix | new] [B,Hkv,E+T,D]: concatenated once, for the core and the caller's next call
        alike. cache_lens [B]:
        each sequence's cached slots (None: no cache semantics, the keys are [cache | prefix | new]
        as the mask says). residual [B,T,out]: out is residual + o_proj(...), the layer's skip
        connection (exact mode's linear adds it in its epilogue, bit for bit the same). norm: the
        RMSNorm x has yet to pass, applied by the projections themselves (`prenorm`)."""
        q, k, v = self.project(x, cos, sin, norm)
        if prefix_kv is not None:
            k, v = torch.cat([prefix_kv[0], k], dim=2), torch.cat([prefix_kv[1], v], dim=2)
        if self.core is None:
            out = attend_graph(q, k, v, k_cache, v_cache, mask, self.weights_tap, self.head_dim)
        else:
            out = self.core(q, k, v, k_cache, v_cache, cache_lens, mask, tap=self.weights_tap)
        return plus(self.o_proj, out, residual), k, v

    def inputs(self) -> list[nn.Module]:
        """The linear layers reading the attention's input: q/k/v, or the fused qkv_proj."""
        return [self.qkv_proj] if self.qkv_proj is not None else [self.q_proj, self.k_proj, self.v_proj]

    def project(self, x, cos, sin, norm=None):
        """x [B,T,in] -> q [B,Hq,T,D], k, v [B,Hkv,T,D], RoPE applied (and Qwen3's qk-norm before it)."""
        q, k, v = self.heads(x, norm=norm)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def heads(self, x, qk_norm: bool = True, norm=None):
        """x [B,T,in] -> q [B,Hq,T,D], k, v [B,Hkv,T,D] before RoPE (Qwen3's qk-norm applied unless
        `qk_norm` is False: exact mode's RoPE kernel applies it): views of the projections' [B,T,H*D]
        outputs. norm: see `prenorm`."""
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = normed_linear(self.qkv_proj, x, norm).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = (normed_linear(linear, x, norm) for linear in self.inputs())
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if qk_norm and self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj = None  # gate and up as one Linear once passes.fuse_gate_up has run
        self.intermediate_size = intermediate  # an int of its own: a quantized down_proj may not keep in_features

    def inputs(self) -> list[nn.Module]:
        """The linear layers reading the MLP's input: gate/up, or the fused gate_up_proj."""
        return [self.gate_up_proj] if self.gate_up_proj is not None else [self.gate_proj, self.up_proj]

    def forward(self, x, residual=None, norm=None):
        """down(silu(gate(x)) * up(x)), plus `residual` when given (as Attention's); norm: see `prenorm`."""
        gate, up = self.gate_up(x, norm)
        return plus(self.down_proj, F.silu(gate) * up, residual)

    def gate_up(self, x, norm=None):
        """x [B,T,H] -> (gate, up) [B,T,I]: views of gate_up_proj's output (gate first), or each its own."""
        if self.gate_up_proj is not None:
            # split at a Python int, not chunk(2): the exporter turns chunk into shape arithmetic
            return normed_linear(self.gate_up_proj, x, norm).split(self.intermediate_size, dim=-1)
        return normed_linear(self.gate_proj, x, norm), normed_linear(self.up_proj, x, norm)


def prenorm(norm: RMSNorm, x, linears) -> tuple[torch.Tensor, RMSNorm | None]:
    """(input, norm) for the `linears` that read norm(x) (a decoder layer's q/k/v, gate/up, lm_head),
    handed to each through `normed_linear`: (norm(x), None), the norm applied here, once; or, where each
    of them fuses a norm into its GEMM (`fuses_norm`: exact mode's linear, which normalizes the rows it
    reads in its K loop, bit for bit the norm's own kernel) and the gain is in x's dtype, (x, norm):
    no launch, and no pass over memory, of the norm's own."""
    if linears and all(getattr(linear, "fuses_norm", False) for linear in linears) \
            and (norm.weight is None or norm.weight.dtype == x.dtype):
        return x, norm
    return norm(x), None


def normed_linear(linear, x, norm=None):
    """linear(x), or linear(x, norm=norm): x yet to pass `norm` (see `prenorm`)."""
    return linear(x) if norm is None else linear(x, norm=norm)


def plus(linear, x, residual=None):
    """linear(x), and residual + linear(x) when a residual is given: a decoder layer's skip connection.
    A linear that fuses the add (exact mode's ExactLinear) takes it as its `residual`; any other (nn.Linear,
    a quantized layer) is added here, the same bits."""
    if residual is None:
        return linear(x)
    if getattr(linear, "fuses_residual", False):
        return linear(x, residual=residual)
    return residual + linear(x)
