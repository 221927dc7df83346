"""Exact mode: the torch backend's models bound once, at load, to the width-invariant kernels.

vLLM's way of choosing kernels: variants are bound when the model is built, never chosen per call.
`bind` swaps, in the target and the drafter alike, every plain Linear (lm_head included), every
RMSNorm (qk-norm included), the MLP's activation, the attention's RoPE and core and the graphs'
greedy argmax for the kernels in `eagle_export.kernels`. Plain decoding, verification, `bench`'s
baseline and `validate`'s references then run the same kernels, and a position's logits and K/V have the same
bits whether it is row 0 of a one-token step or row j of a verify call (bf16, fp16, fp32).

The residual adds ride in the o- and down-projections' epilogue (`layers.plus`): the product rounded,
then the sum rounded, as torch's add (one launch a layer less each). An RMSNorm read only by linear
layers (the target's input and post-attention norms, its final norm before lm_head, the drafter's
post-attention norm) rides in their prologue (`layers.prenorm`), and the MLP's silu(gate) * up in the
down projection's: bit for bit the RMSNorm and SiLU-mul kernels, with no launch of their own. The
drafter's input_layernorm and hidden_norm (its attention reads their concatenation) and its final
norm (also fed back, and the root's row is picked after it) keep their launches. Not swapped, and why that keeps
the property: embeddings (a gather), casts (elementwise, so per element the same ops at any width),
and the drafter's softmax/top-k over its draft vocabulary (they choose drafts, which greedy
verification accepts only where they equal the target's argmax). A diagnose tap on the attention
weights sees nothing in exact mode.

A prefill wider than any decoding call (more than WIDEST rows a sequence) runs the linear layers and
attention through torch's kernels: a prompt's positions are computed once, by the same call, in plain
and in speculative decoding, so no other call's bits must match them, and cuBLAS is built for wide
calls (the decoding widths, up to a verify call over the largest tree, always run the kernels).

`check` refuses exact mode where it cannot hold (no Triton, no CUDA, a dtype or shape past the
kernels' limits, a quantized model) before anything loads: one line naming what runs instead. This
module imports no Triton until `bind` runs.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .. import kernels
from ..errors import EagleExportError
from ..models.contract import MAX_TREE_NODES
from ..models.layers import MLP, Attention, RMSNorm, RowLinear, attend_graph


def refusal(problems: list[str]) -> EagleExportError:
    return EagleExportError("exact mode cannot hold here: " + "; ".join(problems),
                            "run without --exact (exact=False): " + kernels.TIERED)


def problems(device: str, dtypes, precisions=(), head_dim: int = 0, group: int = 1,
             backend: str = "torch") -> list[str]:
    """Why the kernels cannot run `backend`'s models of these dtypes, precisions and shapes (the largest
    head_dim and query heads per KV head of target and drafter) on `device`; [] when they can."""
    found = [] if backend == "torch" else [
        f"the {backend} backend runs its own kernels (only the torch backend binds the width-invariant ones)"]
    quantized = sorted(set(precisions) - {"fp32", "fp16", "bf16"})
    if quantized:
        found.append(f"{', '.join(quantized)} weights (the kernels run unquantized ones)")
    return found + kernels.problems(str(device), dtypes, head_dim, group)


def check(*args, **kwargs) -> None:
    """Raise `refusal` where `problems` finds any (exact mode asked for: --exact, exact=True)."""
    insist(problems(*args, **kwargs))


def insist(found: list[str]) -> None:
    if found:
        raise refusal(found)


def model_problems(device: str, target, drafter) -> list[str]:
    """`problems` for loaded models (the Python API's path; the CLI's checks the manifest before loading).
    A module holding weights of its own that is not a plain Linear, Embedding or RMSNorm (an NVFP4 or
    ModelOpt-quantized layer) would keep its own kernels: a problem, never silently left unbound."""
    configs = (target.config, drafter.config)
    known = (nn.Linear, RowLinear, ExactLinear, nn.Embedding, RMSNorm, ExactRMSNorm)
    other = sorted({type(m).__name__ for model in (target, drafter) for m in model.modules()
                    if type(m) not in known and next(m.parameters(recurse=False), None) is not None})
    return problems(device, {target.embed_tokens.weight.dtype, drafter.fc.weight.dtype},
                    [f"{other[0]} layers'"] if other else (), max(c.head_dim for c in configs),
                    max(c.num_heads // c.num_kv_heads for c in configs))


def resolve(exact: bool | None, device: str, target, drafter) -> bool:
    """Whether the torch backend binds the kernels. True: it must (`refusal` where it cannot); False:
    torch's kernels; None, the default: on a CUDA GPU wherever the kernels hold (their plain step
    measured no slower than cuBLAS + torch attention: README "Exact mode"), else torch's with one
    `note:` line saying why and that outputs are then tiered; on a CPU the torch CPU backend's own
    width-invariant layout (models/layers.py), no note."""
    if exact:
        insist(model_problems(device, target, drafter))
        return True
    if exact is False or torch.device(device).type != "cuda":
        return False
    found = model_problems(device, target, drafter)
    if found:
        print(f"note: exact mode off ({'; '.join(found)}): {kernels.TIERED}", file=sys.stderr)
    return not found


# The widest call a decoding position is ever computed in: a verify call over the largest tree (its
# root and MAX_TREE_NODES nodes). Only a prefill is wider, and a prompt's positions are computed once,
# by the same call, in plain and in speculative decoding alike: no other call's bits must match them.
# So a wider call runs torch's GEMMs and attention (cuBLAS, built for wide calls; the kernels' 16-row
# tiles and per-row attention would make a long prompt's prefill several times slower), and every
# call of decoding widths the kernels. (The drafter's rows never decide an output token.)
WIDEST = MAX_TREE_NODES + 1


def prefill(x) -> bool:
    """A call of more rows a sequence than any decoding call: x [B,T,...] with T > WIDEST."""
    return x.dim() >= 3 and x.shape[-2] > WIDEST


class ExactLinear(nn.Linear):
    fuses_residual = True  # layers.plus hands it the skip connection: added in the kernel's epilogue
    fuses_norm = True  # layers.prenorm hands it the RMSNorm before it: the rows normalized in its K loop

    def forward(self, x, residual=None, norm=None, up=None):
        """x @ W^T (+ bias) (+ residual). norm (an RMSNorm): x's rows normalized first; up: x is the MLP's
        gate, the input silu(x) * up. Both inside the kernel, bit for bit the RMSNorm and silu_mul kernels."""
        ops = kernels.ops()
        if prefill(x):
            x = x if norm is None else norm(x)
            x = x if up is None else ops.silu_mul(x, up)
            y = nn.functional.linear(x, self.weight, self.bias)
            return y if residual is None else residual + y
        return ops.linear(x, self.weight, self.bias, residual=residual,
                          norm=None if norm is None else (norm.weight, norm.eps), up=up)


class ExactRMSNorm(RMSNorm):
    def forward(self, x):
        return kernels.ops().rms_norm(x, self.weight, self.eps)


class ExactMLP(MLP):
    """The activation in the down projection's prologue: silu(gate) * up per element as it is read."""

    def forward(self, x, residual=None, norm=None):
        gate, up = self.gate_up(x, norm)
        return self.down_proj(gate, residual=residual, up=up)


class ExactAttention(Attention):
    """Attention whose RoPE is the fused kernel: q and k rotated in one launch, in the layout the
    projections wrote them (the attention kernel reads them there, no copy), Qwen3's qk-norm in the
    same launch where its gains are in the activations' dtype (else the RMSNorm kernel first)."""

    def project(self, x, cos, sin, norm=None):
        qn, kn = self.q_norm, self.k_norm
        fused = qn is not None and qn.weight is not None and kn.weight is not None and qn.eps == kn.eps \
            and qn.weight.dtype == kn.weight.dtype == cos.dtype
        q, k, v = self.heads(x, qk_norm=not fused, norm=norm)
        return *kernels.ops().rope(q, k, cos, sin, (qn.weight, kn.weight, qn.eps) if fused else None), v


class _Keys:
    """The last mask's compacted key lists (kernels' compact_keys): every layer of a forward gets the
    same mask object, so the sort runs once a forward, not once a layer (and once in a CUDA graph).
    Holding the mask keeps its id from being reused by another tensor."""
    mask = keys = None

    @classmethod
    def of(cls, mask, rows):
        if mask is not cls.mask:
            cls.mask, cls.keys = mask, kernels.ops().compact_keys(rows)
        return cls.keys


def attention_core(q, k, v, k_cache, v_cache, cache_lens, mask, tap=None):
    """layers.attend's signature on the attention kernel: the keys k, v [B,Hkv,E,D] after the cache,
    each row over the keys its mask [B,1,1,T,S+E] shows -> [B,T,Hq*D] (the kernel writes it laid out
    so, no copy)."""
    if prefill(q):  # q [B,Hq,T,D]: see WIDEST
        return attend_graph(q, k, v, k_cache, v_cache, mask, tap, q.shape[-1])
    b, _, t, _ = q.shape
    rows = mask.expand(b, 1, 1, t, -1)[:, 0, 0]
    out = kernels.ops().attention(q, k_cache.to(k.dtype), v_cache.to(v.dtype), k, v, rows,
                                  keys=_Keys.of(mask, rows))
    return out.transpose(1, 2).reshape(b, t, -1)


SWAPS = {nn.Linear: ExactLinear, RMSNorm: ExactRMSNorm, MLP: ExactMLP, Attention: ExactAttention}


def bind(*graphs) -> None:
    """Swap the kernels into the models of `graphs` (a TargetGraph, UnrolledDrafters), in place, once.
    A module's class is swapped for its exact subclass (same parameters, same state dict; Attention's
    runs the fused RoPE); the attention core and each graph's argmax are set on the instances."""
    ops = kernels.ops()  # no Triton: the one-line error, before anything is changed
    for graph in graphs:
        for module in graph.modules():
            exact = ExactLinear if type(module) is RowLinear else SWAPS.get(type(module))  # RowLinear: the
            if exact is not None:  # torch CPU backend's form of a plain Linear (layers.width_invariant)
                vars(module)["unbound_class"] = type(module)  # what unbind restores
                module.__class__ = exact
            if isinstance(module, Attention):
                module.core = attention_core
        graph.argmax = ops.argmax


def unbind(*graphs) -> None:
    """`bind` undone: torch's kernels again (the GPU kit times both on the same weights)."""
    for graph in graphs:
        for module in graph.modules():
            if "unbound_class" in vars(module):
                module.__class__ = vars(module).pop("unbound_class")
            if isinstance(module, Attention):
                vars(module).pop("core", None)
        vars(graph).pop("argmax", None)
