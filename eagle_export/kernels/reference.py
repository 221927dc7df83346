"""The torch reference of each kernel in `triton_ops`: the same function, computed by torch's own ops.

The kernels are tested against these within a stated tolerance (their reduction orders differ from
torch's); what the kernels add is that a row's bits do not depend on the call it sits in, which
these references do not promise on a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, norm: tuple[torch.Tensor | None, float] | None = None,
           up: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N]; with `residual`, residual + that (each
    rounded to the dtype, as the decoder layer's `x + linear(h)`). norm (gain, eps): rms_norm(x, gain,
    eps) in place of x; up: silu_mul(x, up) in place of x."""
    if norm is not None:
        x = rms_norm(x, *norm)
    if up is not None:
        x = silu_mul(x, up)
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as models.layers.RMSNorm computes it: normalized in fp32, cast to
    x's dtype, then times the gain (none once its gain is folded into the next linear layer)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's activation: silu(gate) * up, each op rounded to the dtype as torch rounds it."""
    return F.silu(gate) * up


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention over the keys [cache ; new]: q [B,Hq,T,D]; k/v_cache [B,Hkv,S,D];
    k/v_new [B,Hkv,N,D]; mask [B,T,S+N] bool, the keys each query row sees -> [B,Hq,T,D] in q's
    dtype. Scores and softmax in fp32 (a fully masked row gives zeros, as the kernel does)."""
    b, hq, t, d = q.shape
    group = hq // k_cache.shape[1]
    keys = torch.cat([k_cache, k_new], dim=2).float().repeat_interleave(group, dim=1)
    values = torch.cat([v_cache, v_new], dim=2).float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, values).to(q.dtype)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last dim, the lowest index among equal ones (torch
    documents the first maximal value) -> int64 [...]."""
    return x.argmax(-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [B,Hq,T,D] and k [B,Hkv,T,D] with cos/sin [B,1,T,D], as models.layers.apply_rope
    computes it (written out here: kernels come before models): x * cos + rotated * sin with
    rotated = [-x[D/2:], x[:D/2]], each op rounded to the dtype. norm (q_gain, k_gain, eps): each
    head's row rms_norm-ed first (Qwen3's qk-norm)."""
    def apply(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    if norm is not None:
        q, k = rms_norm(q, norm[0], norm[2]), rms_norm(k, norm[1], norm[2])
    return apply(q), apply(k)
