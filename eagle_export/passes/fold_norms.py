"""Fold RMSNorm gains into the linear layers they feed, leaving gain-free normalizations.

RMSNorm(x) = g * n(x) with n(x) = x / rms(x). When n's output goes only into a linear layer W,
W @ (g * n(x)) = (W diag(g)) @ n(x): scaling W's input columns by g removes the multiply from the
graph and the gain from the weights. It is exact in real arithmetic; in floating point the folded
weight W*g is rounded once (fp32: ~1e-7 relative; bf16: ~4e-3 per weight, the same order as the
bf16 rounding of g * n(x) it replaces). A normalization whose output also goes somewhere else
(a residual, a fed-back state, the RoPE'd q/k heads) keeps its gain.
"""

from __future__ import annotations

from torch import nn

from eagle_export.models.layers import RMSNorm

from .base import PassBase, PassResult, PostconditionError
from .eagle_models import EagleModels, fold_gain


class FoldFcNorm(PassBase):
    """Fold EAGLE-3.1's per-aux fc_norm gains into fc's column blocks (step 0 keeps gain-free norms).

    EAGLE-3.1 computes fc(cat(g_0 * n(a_0), ..., g_{A-1} * n(a_{A-1}))). Column block i of fc
    multiplies aux state i only, so fc(cat(g_i * n(a_i))) = fc'(cat(n(a_i))) with block i of fc'
    = block i of fc scaled column-wise by g_i. The A RMSNorm modules stay, gain-free. Not applied
    when the drafter also has `norm_before_fc`: that norm renormalizes the concatenation, whose
    RMS depends on the gains.
    """

    name = "fold_fc_norm"

    def requires(self, models: EagleModels) -> str | None:
        d = models.drafter
        if d is None:
            return "no drafter"
        if d.aux_normalized_by_target:
            return "fc normalization already moved into the target (fold_fc_norm_into_target)"
        if d.fc_norm is None:
            return "drafter has no fc_norm (EAGLE-3)"
        if d.input_norm is not None:
            return "drafter also has norm_before_fc: the concatenated RMS depends on the fc_norm gains"
        if all(norm.weight is None for norm in d.fc_norm):
            return "fc_norm gains already folded into fc"
        return None

    def call(self, models: EagleModels) -> PassResult:
        params, saved = fold_fc_norm_gains(models.drafter)
        return PassResult(models, modified=True, changes={
            "tensors_rewritten": 1, "params_removed": params, "bytes_saved": saved})

    def ensures(self, models: EagleModels) -> None:
        if any(norm.weight is not None for norm in models.drafter.fc_norm):
            raise PostconditionError("fold_fc_norm left an fc_norm gain in place")


def fold_fc_norm_gains(drafter) -> tuple[int, int]:
    width = drafter.config.target_hidden_size
    params = saved = 0
    for i, norm in enumerate(drafter.fc_norm):
        if norm.weight is not None:
            p, b = fold_gain(norm, [drafter.fc], start=i * width)
            params, saved = params + p, saved + b
    return params, saved


class FoldFcNormIntoTarget(PassBase):
    """Fold fc_norm gains into fc and move the gain-free aux normalization into the target.

    After fold_fc_norm the drafter's step 0 is fc(cat(n(a_i))) with n(a) = rms_normalize(a, eps).
    n acts on each aux state alone, so the target can emit n(a_i) instead of a_i: the target
    normalizes each aux chunk (in fp32, cast back, as the drafter did) with the drafter's eps, and
    the drafter's step 0 becomes a single matmul. The values reaching fc are bit-identical to the
    in-drafter placement. The target and the drafter must then be built, exported and shipped as a
    pair: the rewritten target's aux outputs are no longer raw residual states, and the rewritten
    drafter fed raw aux states would be wrong (the drafter records `aux_normalized_by_target`).
    Cost in the target: none in the exported graph when the drafter's eps is the target's, since
    the aux state entering layer i is the input of that layer's input_layernorm, whose
    rms_normalize subexpression the ONNX pipeline's CSE then shares (measured by
    scripts/bench_fc_norm_placement.py); with another eps, A normalizations of T rows.
    """

    name = "fold_fc_norm_into_target"

    def requires(self, models: EagleModels) -> str | None:
        d, t = models.drafter, models.target
        if d is None:
            return "no drafter"
        if d.aux_normalized_by_target:
            return "fc normalization already moved into the target"
        if d.fc_norm is None:
            return "drafter has no fc_norm (EAGLE-3)"
        if t is None:
            return "no target: the normalization can only move into a target built with this drafter"
        if d.input_norm is not None:
            return "drafter also has norm_before_fc: the concatenated RMS depends on the fc_norm gains"
        if t.aux_norm_eps is not None:
            return "the target already normalizes its aux states for another drafter"
        return None

    def call(self, models: EagleModels) -> PassResult:
        d, t = models.drafter, models.target
        params, saved = fold_fc_norm_gains(d)
        eps = {norm.eps for norm in d.fc_norm}
        assert len(eps) == 1, "every fc_norm of a drafter is built with the config's rms_norm_eps"
        t.aux_norm_eps = eps.pop()
        removed = len(d.fc_norm) + 1  # the RMSNorms and their ModuleList
        d.fc_norm = None
        d.aux_normalized_by_target = True
        return PassResult(models, modified=True, changes={
            "tensors_rewritten": 1, "params_removed": params, "bytes_saved": saved, "modules_removed": removed})

    def ensures(self, models: EagleModels) -> None:
        if models.target.aux_norm_eps != models.drafter.config.rms_norm_eps or models.drafter.fc_norm is not None:
            raise PostconditionError("the aux normalization is not in the target with the drafter's eps")


def foldable_norms(models: EagleModels) -> tuple[list[tuple[str, RMSNorm, list[nn.Linear], int]], dict[str, str]]:
    """The gains that fold exactly: (name, norm, linears it feeds, first column); and, by name,
    each gain that stays and why."""
    folds, kept = [], {}
    t, d = models.target, models.drafter
    if t is not None:
        for i, layer in enumerate(t.layers):
            folds.append((f"target.layers.{i}.input_layernorm", layer.input_layernorm,
                          layer.self_attn.inputs(), 0))
            folds.append((f"target.layers.{i}.post_attention_layernorm", layer.post_attention_layernorm,
                          layer.mlp.inputs(), 0))
        if t.lm_head.weight is t.embed_tokens.weight:
            kept["target.norm"] = ("lm_head is tied to embed_tokens: folding would untie it and store a "
                                   "second vocab x hidden table (the drafter shares embed_tokens too)")
        else:
            folds.append(("target.norm", t.norm, [t.lm_head], 0))
    if d is not None:
        layer, h = d.midlayer, d.config.hidden_size
        if d.input_norm is not None:
            folds.append(("drafter.input_norm", d.input_norm, [d.fc], 0))
        folds.append(("drafter.midlayer.input_layernorm", layer.input_layernorm, layer.self_attn.inputs(), 0))
        if layer.norm_before_residual:
            kept["drafter.midlayer.hidden_norm"] = "norm_before_residual: its output is also the residual"
        else:
            folds.append(("drafter.midlayer.hidden_norm", layer.hidden_norm, layer.self_attn.inputs(), h))
        folds.append(("drafter.midlayer.post_attention_layernorm", layer.post_attention_layernorm,
                      layer.mlp.inputs(), 0))
        if d.config.norm_output:
            kept["drafter.norm"] = "norm_output (EAGLE-3.1): the normed state is also fed back"
        else:
            folds.append(("drafter.norm", d.norm, [d.lm_head], 0))
    folds = [f for f in folds if f[1].weight is not None]
    kept = {name: why for name, why in kept.items() if _gain_of(models, name) is not None}
    return folds, kept


def _gain_of(models: EagleModels, name: str):
    owner, _, path = name.partition(".")
    return getattr(models, owner).get_submodule(path).weight


class FoldNormGains(PassBase):
    """Fold RMSNorm gains into the q/k/v, gate/up, lm_head (and fc) layers they feed, where exact.

    Folded: target input_layernorm -> q/k/v; post_attention_layernorm -> gate/up; final norm ->
    lm_head unless lm_head is tied to the embeddings (folding would have to untie it: a second
    vocab x hidden table to save `hidden` multiplies per token, so the gain stays). Drafter
    input_layernorm -> q/k/v columns [0:H]; hidden_norm -> columns [H:2H] unless
    norm_before_residual (its output is also the residual); post_attention_layernorm -> gate/up;
    norm_before_fc's norm -> fc; final norm -> lm_head unless norm_output (EAGLE-3.1 feeds the
    normed state back). Never Qwen3's q_norm/k_norm: RoPE follows them, not a linear layer.
    Each folded norm keeps its module, gain-free (weight None), so the graph has no multiply.
    The target's `logits=False` output (the final hidden state, which nothing exports) becomes
    gain-free when the final norm folds. The gains that stay are listed in `self.kept` after a call.
    """

    name = "fold_norm_gains"

    def __init__(self):
        self.kept: dict[str, str] = {}

    def requires(self, models: EagleModels) -> str | None:
        folds, kept = foldable_norms(models)
        if not folds:
            why = "; ".join(f"{name}: {reason}" for name, reason in kept.items())
            return "no RMSNorm gain left that folds exactly" + (f" (kept: {why})" if why else "")
        return None

    def call(self, models: EagleModels) -> PassResult:
        folds, self.kept = foldable_norms(models)
        params = saved = 0
        for _, norm, linears, start in folds:
            p, b = fold_gain(norm, linears, start)
            params, saved = params + p, saved + b
        rewritten = len({id(linear.weight) for _, _, linears, _ in folds for linear in linears})
        return PassResult(models, modified=True, changes={
            "norms_folded": len(folds), "norms_kept": len(self.kept), "tensors_rewritten": rewritten,
            "params_removed": params, "bytes_saved": saved})

    def ensures(self, models: EagleModels) -> None:
        left, _ = foldable_norms(models)
        if left:
            raise PostconditionError(f"fold_norm_gains left foldable gains: {[name for name, *_ in left]}")
