"""Fuse the linear layers that read the same input into one: q/k/v, and gate/up.

Stacking the weights [W_a; W_b] row-wise gives one Linear whose output is cat(W_a x, W_b x); the
forward splits it back. Each output element is the same dot product as before, so the result is
exact up to the GEMM's summation order (fp32: ~1e-7 relative). One matmul instead of two or three
means fewer kernel launches and a larger, better-shaped GEMM for TensorRT and the quantizer.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle_export.models.layers import MLP, Attention

from .base import PassBase, PassResult, PostconditionError
from .eagle_models import EagleModels


def stacked_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear computing cat([p(x) for p in parts], -1), sharing nothing with `parts`."""
    w0 = parts[0].weight
    has_bias = parts[0].bias is not None
    with torch.device("meta"):  # no random initialisation: the weights are assigned below
        fused = nn.Linear(w0.shape[1], sum(p.weight.shape[0] for p in parts), bias=has_bias)
    fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=w0.requires_grad)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=w0.requires_grad)
    return fused


def _modules_of(models: EagleModels, kind: type) -> list[nn.Module]:
    return [m for _, model in models.present() for m in model.modules() if isinstance(m, kind)]


class FuseQKV(PassBase):
    """Fuse q_proj, k_proj, v_proj into one qkv_proj Linear (biases too, as in Qwen2), split after.

    qkv_proj.weight = cat(W_q, W_k, W_v) along the output axis (biases likewise); the attention
    splits its output at [H_q*D, H_kv*D, H_kv*D], giving q, k, v exactly as the three matmuls did.
    """

    name = "fuse_qkv"

    def requires(self, models: EagleModels) -> str | None:
        if not any(a.qkv_proj is None for a in _modules_of(models, Attention)):
            return "no attention with separate q/k/v projections"
        return None

    def call(self, models: EagleModels) -> PassResult:
        fused = 0
        for attn in _modules_of(models, Attention):
            if attn.qkv_proj is None:
                attn.qkv_proj = stacked_linear([attn.q_proj, attn.k_proj, attn.v_proj])
                del attn.q_proj, attn.k_proj, attn.v_proj
                fused += 1
        return PassResult(models, modified=True, changes={"modules_fused": fused, "modules_removed": 2 * fused})

    def ensures(self, models: EagleModels) -> None:
        for attn in _modules_of(models, Attention):
            if attn.qkv_proj is None or attn.qkv_proj.weight.shape[0] != sum(attn.qkv_sizes):
                raise PostconditionError("an attention was left without a well-formed qkv_proj")


class FuseGateUp(PassBase):
    """Fuse the MLP's gate_proj and up_proj into one gate_up_proj Linear, chunked in two after.

    gate_up_proj.weight = cat(W_gate, W_up) along the output axis; chunk(2) of its output gives the
    gate and up activations exactly as the two matmuls did.
    """

    name = "fuse_gate_up"

    def requires(self, models: EagleModels) -> str | None:
        if not any(m.gate_up_proj is None for m in _modules_of(models, MLP)):
            return "no MLP with separate gate/up projections"
        return None

    def call(self, models: EagleModels) -> PassResult:
        fused = 0
        for mlp in _modules_of(models, MLP):
            if mlp.gate_up_proj is None:
                mlp.gate_up_proj = stacked_linear([mlp.gate_proj, mlp.up_proj])
                del mlp.gate_proj, mlp.up_proj
                fused += 1
        return PassResult(models, modified=True, changes={"modules_fused": fused, "modules_removed": fused})

    def ensures(self, models: EagleModels) -> None:
        for mlp in _modules_of(models, MLP):
            if mlp.gate_up_proj is None or mlp.gate_up_proj.weight.shape[0] % 2:
                raise PostconditionError("an MLP was left without a well-formed gate_up_proj")
