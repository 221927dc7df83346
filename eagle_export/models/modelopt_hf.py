"""The drafter in ModelOpt's Hugging Face quantized format: written by ModelOpt's own exporter, read back
into the quantized modules the rest of the project runs.

Format (what vLLM's and SGLang's ModelOpt loaders read), per quantized Linear `x`:
- FP8: `x.weight` float8_e4m3fn, `x.weight_scale` = weight amax / 448, `x.input_scale` = input amax / 448;
- NVFP4: `x.weight` uint8 (two E2M1 codes a byte, low nibble first), `x.weight_scale` float8_e4m3fn
  per block of 16 inputs, `x.weight_scale_2` fp32 (weight amax / (6 * 448)), `x.input_scale` fp32
  (input amax / (6 * 448));
and `quantization_config` in config.json (`quant_method: modelopt`, `quant_algo`, `ignore`: the
modules left in high precision), plus hf_quant_config.json, the file older loaders look for.

Export is ModelOpt's `_export_transformers_checkpoint`, the function its own EAGLE exporter calls;
the drafter is handed to it through `_ExportView`, which gives it the attributes it reads from a
Hugging Face model. Before export, the Linears that serving engines fuse (q/k/v, gate/up) are given
one input scale and one weight scale with ModelOpt's `preprocess_linear_fusion`: vLLM fuses them at
load and requantizes every shard to the largest scale otherwise, a second rounding the checked
model never saw. Reading back: FP8 weights are dequantized (codes x scale, exact in fp32) into
ModelOpt fake-quant Linears whose amaxes are the stored scales x 448, so they quantize to the same
codes; NVFP4 weights become `NVFP4Linear`s over the stored codes and scales, as `quantize` packs them.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import CheckpointError
from .drafter import Drafter
from .nvfp4 import NVFP4Linear

QUANT_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4"}  # ModelOpt quant_algo -> this project's precision
FP8_MAX, E2M1_MAX = 448.0, 6.0
SCALES = ("weight_scale", "weight_scale_2", "input_scale")
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


class _ExportView(nn.Module):
    """The drafter's modules (not its shared embedding table) under the names they have in the
    drafter, with what ModelOpt's exporter reads from a Hugging Face model: `config`, `device`, and
    `get_dummy_inputs` for the forward it runs to find Linears that share an input."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        for name, child in drafter.named_children():
            if name != "embed_tokens":
                self.add_module(name, child)
        self.config = SimpleNamespace(torch_dtype=None)
        self.__dict__["drafter"] = drafter  # not a submodule: its embedding table is the target's

    @property
    def device(self):
        return self.fc.weight.device

    def get_dummy_inputs(self) -> dict:
        c = self.drafter.config
        return {"aux": torch.zeros(1, 2, c.num_aux * c.target_hidden_size, dtype=self.fc.weight.dtype,
                                   device=self.device)}

    def forward(self, aux):
        d = self.drafter
        k, v = d.empty_cache(1, 0, dtype=aux.dtype, device=aux.device)
        ids = torch.zeros(1, aux.shape[1], dtype=torch.long, device=aux.device)
        positions = torch.arange(aux.shape[1], device=aux.device)[None]
        return d(ids, d.fuse_aux(aux), positions, k, v, torch.zeros(1, dtype=torch.long, device=aux.device))


def unify_fused_scales(drafter: Drafter) -> None:
    """One input and one weight scale for q/k/v and for gate/up (ModelOpt's preprocess_linear_fusion)."""
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    layer = drafter.midlayer
    for group in FUSED_GROUPS:
        modules = [layer.get_submodule(name) for name in group]
        if all(hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled for m in modules):
            preprocess_linear_fusion(modules)


def amax_from_scale(scale: torch.Tensor) -> torch.Tensor:
    """The amax an FP8 scale reads back as (the loader's): scale x 448, in fp32."""
    return scale.float() * FP8_MAX


def snap_fp8_amaxes(drafter: Drafter) -> None:
    """Set every enabled FP8 quantizer's amax to the one its written scale reads back as.

    The checkpoint stores scale = fl(amax / 448) and the loader sets amax' = fl(scale x 448); in fp32
    amax' != amax for about 9% of amaxes (one ulp apart). ModelOpt's fake quantization multiplies by
    fl(448 / amax) before rounding to E4M3, so one ulp of amax moves values across code boundaries and
    the model loaded back is not the model exported (the sample build's q/k/v input amax: draft
    logits 0.236 apart). fl(amax' / 448) == fl(amax / 448) for every fp32 amax, so the written scales
    are unchanged; only the exported model now computes with the amaxes a reader gets. Call it after
    the last change to an amax (unify_fused_scales) and before the export."""
    for _, module in drafter.named_modules():
        for quantizer in (getattr(module, name, None) for name in ("input_quantizer", "weight_quantizer")):
            if quantizer is not None and quantizer.is_enabled and quantizer.amax is not None:
                assert quantizer.num_bits == (4, 3) and quantizer.block_sizes is None, "per-tensor FP8 only"
                quantizer.amax = amax_from_scale(quantizer.amax.float() / FP8_MAX)


def export_quantized(drafter: Drafter, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict in the drafter's names, ModelOpt's hf_quant_config) from ModelOpt's exporter, the
    unquantized tensors in `dtype`. The drafter (fp32) is exported in fp32, so ModelOpt computes every
    code from the weight the fake quantizer saw (a bf16 division first would round some codes
    differently); the unquantized tensors are then cast, scales kept. The drafter's quantized Linears
    are rewritten in place (their weights become codes): pass a copy."""
    from modelopt.torch.export.unified_export_hf import _export_transformers_checkpoint

    with warnings.catch_warnings():  # ModelOpt's own copy-construct warning on scalar scales
        warnings.simplefilter("ignore", UserWarning)
        state, hf_quant_config = _export_transformers_checkpoint(_ExportView(drafter), torch.float32)
    state = {k: (v.to(dtype) if v.dtype == torch.float32 and not k.endswith(SCALES) else v).contiguous()
             for k, v in state.items()}
    for name in ("d2t", "t2d"):
        if drafter.has_vocab_map:
            state[name] = getattr(drafter, name)
    return state, hf_quant_config


def quantization_config(hf_quant_config: dict) -> dict:
    """config.json's `quantization_config` as ModelOpt's unified HF export writes it."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    return convert_hf_quant_config_format(hf_quant_config)


def checkpoint_precision(raw_config: dict, where: str) -> str | None:
    """The precision a ModelOpt-quantized checkpoint was exported in; None for an unquantized one."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    algo = qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo")
    if qc.get("quant_method", "modelopt") != "modelopt" or algo not in QUANT_ALGOS:
        raise CheckpointError(f"{where}: quantization_config names {qc.get('quant_method')!r} / {algo!r}; this "
                              f"tool reads ModelOpt checkpoints with quant_algo {' or '.join(QUANT_ALGOS)}",
                              "pass the unquantized drafter, or one exported by ModelOpt (eagle-export export-checkpoint)")
    return QUANT_ALGOS[algo]


def split_quantized(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> tuple[dict, dict]:
    """(the state with every FP8 weight dequantized and every NVFP4 weight left out, the quantized
    Linears' tensors by module name: weight, weight_scale, input_scale, weight_scale_2)."""
    linears = {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_scale")}
    plain, quantized = {}, {name: {} for name in linears}
    for key, value in state.items():
        module, _, attr = key.rpartition(".")
        if module in linears:
            quantized[module][attr] = value
        else:
            plain[key] = value
    for module, tensors in quantized.items():
        weight = tensors["weight"]
        if weight.dtype == torch.float8_e4m3fn:
            plain[f"{module}.weight"] = (weight.float() * tensors["weight_scale"].float()).to(dtype or torch.float32)
    return plain, quantized


def restore_quantized(drafter: Drafter, precision: str, quantized: dict[str, dict[str, torch.Tensor]]) -> None:
    """Turn a drafter loaded with `split_quantized`'s plain state back into the quantized model: FP8 ->
    ModelOpt fake-quant Linears with the stored amaxes, NVFP4 -> NVFP4Linear over the stored codes.
    The Linears with stored scales are the quantized ones; every other Linear stays as it is."""
    if precision == "nvfp4":
        for module, t in quantized.items():
            parent, _, child = module.rpartition(".")
            old = drafter.get_submodule(module)
            new = NVFP4Linear.from_packed(t["weight"], t["weight_scale"], t["weight_scale_2"], t.get("input_scale"),
                                          old.bias, dtype=drafter.fc.weight.dtype)
            setattr(drafter.get_submodule(parent), child, new)
        return
    with warnings.catch_warnings():  # modelopt warns about untested transformers versions at import
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq

        config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
        kept = [name for name, m in drafter.named_modules() if isinstance(m, nn.Linear) and name not in quantized]
        config["quant_cfg"] += [{"quantizer_name": f"{name}.{q}", "enable": False}
                                for name in kept for q in ("weight_quantizer", "input_quantizer")]
        mtq.quantize(drafter, config, None)  # no forward: the amaxes come from the checkpoint
    for module, t in quantized.items():
        m = drafter.get_submodule(module)
        m.weight_quantizer.amax = amax_from_scale(t["weight_scale"])
        if "input_scale" in t:
            m.input_quantizer.amax = amax_from_scale(t["input_scale"])
        else:
            m.input_quantizer.disable()
