"""`eagle-export export-checkpoint`: the drafter back out as a Hugging Face checkpoint serving engines load.

Formats (what each reader was measured, or read from its source, to need):
- `vllm`: vLLM's native EAGLE-3 layout (`LlamaForCausalLMEagle3`, `midlayer.*`, aux ids in
  `eagle_config`, numbered as vLLM counts them: the residual stream entering layer i).
- `sglang`: the same layout with the aux ids numbered as SGLang and SpecForge count them (the
  output of layer i, one lower for the same state). One checkpoint cannot carry ids right for both.
- `speculators`: the speculators library's layout (`Eagle3Speculator`, `transformer_layer_config`,
  `layers.0.*`, top-level flags), which vLLM also serves. `norm_before_residual: false` is written
  explicitly (vLLM's adapter defaults it to true), the embedding table is stored by default
  (speculators fills it from the target only when it loads as NaN, which transformers 5 does not
  guarantee), and `fc_norm` / `norm_output` are repeated inside `transformer_layer_config` for vLLM
  versions whose adapter copies only the keys it knows from the top level.
In every format `norm_output` is written only when true: SpecForge reads `norm_output: false` as
"no final norm". The config's `eagle_export` block says which numbering the ids use, whether the
embedding table is stored, and which passes were (not) applied and why.

Weights: the checkpoint's own tensors, after only the passes that are exact and that readers can
represent: `share_embeddings` (an own table equal to the target's is dropped) for vllm/sglang.
Every other model pass changes a tensor a reader loads by name (see PASSES_NOT_APPLIED).
FP8/NVFP4: the drafter is quantized with ModelOpt (calibrated on the target's aux states) and
written by ModelOpt's exporter (`modelopt_hf`), in the format vLLM's ModelOpt loader reads.

The directory is written atomically and only after a round trip: it is loaded back with this
project's loader and its draft logits must equal the exported model's (ROUND_TRIP_TOLERANCE).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import __version__
from ..builder.manifest import MANIFEST, check_build
from ..builder.recipe import QUANTIZED
from ..data.prompts import ChatTemplate, chat_prompts
from ..errors import EagleExportError
from ..export.loader import load_pair
from ..models.checkpoint import DTYPE_NAMES, DTYPES, drafter_state_for_saving, load_drafter, resolve_dtype
from ..models.config import read_config_json
from ..models.drafter import Drafter
from ..models.modelopt_hf import export_quantized, quantization_config, snap_fp8_amaxes, unify_fused_scales
from ..models.nvfp4 import pack_nvfp4
from ..output_dir import atomic_output_dir, check_output, output_place
from ..quantize import quantize as Q
from ..speculation.eager import parallel_drafts

FORMATS = ("vllm", "sglang", "speculators")
PASSES_NOT_APPLIED = {
    "fold_fc_norm": "readers load fc_norm.N.weight and normalize each aux state themselves",
    "fold_fc_norm_into_target": "it rewrites the target, which readers load from its own checkpoint",
    "fold_norm_gains": "readers load every RMSNorm gain; folded gains would also move the weights quantization calibrates on",
    "fuse_qkv": "readers fuse q/k/v themselves at load",
    "fuse_gate_up": "readers fuse gate/up themselves at load",
    "apply_draft_vocab": "readers read d2t as offsets (target id = draft id + d2t[draft id])",
}
# Max abs difference of the draft logits, exported model vs loaded back, computed in fp32. FP8 and
# NVFP4 weights are dequantized exactly on load (codes x scales); what remains is fp32 rounding.
ROUND_TRIP_TOLERANCE = 1e-5


def is_checkpoint_export(path: Path) -> bool:
    """A checkpoint export-checkpoint wrote: its config.json names this tool (`eagle_export.exported_by`)."""
    try:
        config = json.loads((path / "config.json").read_text())
        return str(config["eagle_export"]["exported_by"]).startswith("eagle-export ")
    except (OSError, ValueError, KeyError, TypeError):
        return False


EXPORT_OUTPUT = ("a checkpoint written by eagle-export export-checkpoint", is_checkpoint_export)


def resolve_source(source, target=None, allow_changed_sources: bool = False, reader: str = "this command") -> dict:
    """{target_dir, drafter_dir, precision, calibration, depth, conformance} from a build directory
    (its manifest) or from a drafter directory and `target`. A build passes the integrity gate with
    its sources (they are what is read): an edited build, or a checkpoint changed since it was built,
    is refused unless `allow_changed_sources` (then said on stderr)."""
    source = Path(source)
    if os.path.lexists(source / MANIFEST):  # (one that cannot be read is named by check_build)
        manifest = check_build(source, sources=True, allow_changed_sources=allow_changed_sources, reader=reader)
        recipe = manifest.recipe
        return {"target_dir": Path(manifest.target.source), "drafter_dir": Path(manifest.drafter.source),
                "precision": manifest.drafter.precision, "keep": recipe["precision"]["keep_high_precision"],
                "calibration": recipe["calibration"], "depth": manifest.depth, "build": str(source),
                "conformance": manifest.conformance}
    if target is None:
        raise EagleExportError(f"{source} is not a build directory (no manifest.json), so the target is unknown",
                               "pass --target TARGET_DIR with a drafter directory, or pass a build directory")
    return {"target_dir": Path(target), "drafter_dir": source, "precision": None, "keep": ["lm_head", "fc"],
            "calibration": {"dataset": "sharegpt", "num_samples": 16, "max_tokens": 512}, "depth": 4, "build": None,
            "conformance": None}


def _rope(cfg) -> dict:
    rope = cfg.rope
    out = {"rope_theta": rope.theta}
    if rope.rope_type != "default":
        out["rope_scaling"] = {"rope_type": rope.rope_type, "factor": rope.factor}
        if rope.rope_type == "llama3":
            out["rope_scaling"].update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                                       original_max_position_embeddings=rope.original_max_position_embeddings)
    return out


def layer_config(cfg, dtype: torch.dtype) -> dict:
    """The decoder layer's config keys, as every format spells them (a Qwen3 layer: q/k norm)."""
    window = {"layer_types": ["sliding_attention"], "sliding_window": cfg.sliding_window} if cfg.sliding_window else {}
    return {"model_type": "qwen3" if cfg.qk_norm else "llama", **window,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": DTYPE_NAMES[dtype], **_rope(cfg)}


def eagle_flags(cfg) -> dict:
    """EAGLE-3.1's keys only when set (absent reads as false everywhere; `norm_output: false` does not)."""
    flags = {"norm_before_residual": cfg.norm_before_residual}  # explicit: one adapter defaults it to true
    for key in ("fc_norm", "norm_output", "norm_before_fc"):
        if getattr(cfg, key):
            flags[key] = True
    return flags


# How third-party readers served our exports of the sample drafters, as measured against an
# independent EAGLE forward (docs: the shared INTEROP notes, 2026-11-26): speculators 0.9.0 and
# SpecForge 0.2.0 on CPU; written into the exported config and printed.
MEASURED_READERS = "speculators 0.9.0, SpecForge 0.2.0 (measured 2026-11-26)"


def reader_notes(fmt: str, eagle_version: str, precision: str | None) -> dict:
    """{exact, mis_serve, refuse, unmeasured, measured}: the readers measured to serve this export
    exactly, those known to mis-serve it (reader, version, how and how much), those that refuse it,
    what no reader was run on, and which readers were run at all."""
    notes = {"exact": [], "mis_serve": [], "refuse": [], "unmeasured": [], "measured": MEASURED_READERS}
    if precision in QUANTIZED:
        notes["refuse"] = [f"speculators 0.9.0 (--format speculators --precision {precision} is refused here)"
                           ] if fmt == "speculators" else []
        if precision == "nvfp4":  # what was measured is FP8's: no reader was run on NVFP4's packed codes
            notes["unmeasured"] = ["no reader was run on an NVFP4 export; transformers 5.19, speculators 0.9.0 and "
                                   "SpecForge 0.2.0 load FP8 exports' codes without their scales (measured), so check "
                                   "an NVFP4 one's draft logits in the engine that serves it"]
            return notes
        notes["mis_serve"] = [
            "transformers 5.19 and speculators 0.9.0's Eagle3Converter load the FP8 codes without their "
            "scales, with a warning only (top-1 agreement 2.6% EAGLE-3, ~39% EAGLE-3.1)",
            "SpecForge 0.2.0 likewise loads the FP8 codes without their scales"]
        return notes
    if eagle_version != "3.1":
        return {**notes, "exact": ["speculators 0.9.0 (through its Eagle3Converter unless --format speculators; it "
                                   "stores no embedding table: supply the target's)", "SpecForge 0.2.0"]}
    if fmt == "speculators":
        return {**notes, "exact": ["speculators 0.9.0 (as-is)"], "refuse": ["SpecForge 0.2.0 (not its format)"]}
    return {**notes, "refuse": ["speculators 0.9.0 as-is (only through its Eagle3Converter)"],
            "mis_serve": [
                "speculators 0.9.0's Eagle3Converter drops fc_norm.N.weight (EAGLE-3.1's per-aux norms), logging only "
                "\"Unexpected keys\": top-1 agreement 92.8% at step 0, 92.7/89.0/89.2% at steps 1-3",
                "SpecForge 0.2.0 feeds back the pre-norm state: step 0 exact, steps 1-3 agree 24.1/13.3/10.1%",
                "SGLang releases without EAGLE-3.1 support skip fc_norm.* silently (read from source, not run)"]}


def checkpoint_config(fmt: str, cfg, aux_ids: tuple[int, ...], dtype: torch.dtype, provenance: dict,
                      verifier: str, target_architecture: str, depth: int) -> dict:
    """config.json for `fmt`; `aux_ids` in vLLM numbering."""
    numbering = "sglang" if fmt == "sglang" else "vllm"
    ids = [i - 1 for i in aux_ids] if numbering == "sglang" else list(aux_ids)
    provenance = {**provenance, "aux_layer_numbering": numbering,
                  "aux_layer_ids": {"vllm": list(aux_ids), "sglang": [i - 1 for i in aux_ids]}}
    common = {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
              **eagle_flags(cfg)}
    if fmt == "speculators":
        layer = layer_config(cfg, dtype)
        layer.update({k: True for k in ("fc_norm", "norm_output") if getattr(cfg, k)})
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "transformer_layer_config": layer, "eagle_aux_hidden_state_layer_ids": ids, **common,
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": depth,
                                          "verifier_accept_k": 1}],
                    "verifier": {"name_or_path": verifier, "architectures": [target_architecture]}},
                "torch_dtype": DTYPE_NAMES[dtype], "eagle_export": provenance}
    return {"architectures": ["LlamaForCausalLMEagle3"], **layer_config(cfg, dtype), **common,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
            "layer_numbering": numbering, "eagle_export": provenance}


def weight_names(fmt: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vllm/sglang keep `midlayer.*`; speculators names the layer `layers.0.*`."""
    if fmt != "speculators":
        return state
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}


@torch.no_grad()
def round_trip(reference: Drafter, path: Path, target, batches) -> float:
    """Max abs difference of step-0 and step-1 draft logits: `reference` vs `path` loaded back, in fp32.
    First every FP8 quantizer's amax must read back exactly: an amax one ulp off changes codes only
    where a value lies near a code boundary, which the check prompts may miss (the sample build's
    export missed it or not depending on the torch thread count)."""
    loaded = load_drafter(path, target=target, dtype=reference.fc.weight.dtype)
    read, written = loaded.config, reference.config
    for key in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual", "draft_vocab_size",
                "sliding_window", "qk_norm"):
        if getattr(read, key) != getattr(written, key):
            raise EagleExportError(f"the exported config.json reads back with {key}={getattr(read, key)}, "
                                   f"the drafter has {getattr(written, key)}", "this is a bug in export-checkpoint")
    if read.resolved_aux_layer_ids(target.config) != written.resolved_aux_layer_ids(target.config):
        raise EagleExportError("the exported config.json reads back with other aux layers "
                               f"({read.resolved_aux_layer_ids(target.config)})", "this is a bug in export-checkpoint")
    for name, module in reference.named_modules():  # logits can hide a wrong amax (see snap_fp8_amaxes)
        for attr in ("input_quantizer", "weight_quantizer"):
            written = getattr(module, attr, None)
            if written is None or not written.is_enabled or written.amax is None:
                continue
            read = getattr(loaded.get_submodule(name), attr, None)
            if read is None or not read.is_enabled or not torch.equal(read.amax.float(), written.amax.float()):
                got = "none" if read is None or not read.is_enabled else f"{read.amax.float().max().item()!r}"
                raise EagleExportError(f"{name}.{attr} loads back with amax {got}, the exported model computes with "
                                       f"{written.amax.float().max().item()!r}", "this is a bug in export-checkpoint")
    worst = 0.0
    for ids, aux in batches:
        next_ids = torch.cat([ids, ids[:, -1:]], dim=1)
        for a, b in zip(parallel_drafts(reference, next_ids, aux, 2), parallel_drafts(loaded, next_ids, aux, 2)):
            worst = max(worst, float((a.float() - b.float()).abs().max()))
    return worst


def export_checkpoint(source, out_dir, fmt: str = "vllm", target=None, precision: str | None = None,
                      dtype: str | None = None, embeddings: str | None = None, verifier: str | None = None,
                      calib_prompts: list[list[int]] | int | None = None, check_prompts: list[list[int]] | None = None,
                      force: bool = False, progress=print, allow_changed_sources: bool = False) -> dict:
    """Write the drafter of `source` (a build directory, or a drafter directory with `target`) to `out_dir`
    as a `fmt` checkpoint; returns the export summary (also written as export_summary.json).

    precision: None (the build's drafter precision, else unquantized), a float dtype name, fp8 or nvfp4.
    embeddings: "store" or "share" (default: store for speculators, share otherwise).
    calib_prompts: token ids to calibrate FP8/NVFP4 on, or how many ShareGPT conversations (default:
    the source's calibration set).
    allow_changed_sources: export a build's drafter from checkpoints changed since the build.
    check_prompts: prompts for the round trip's logits (default: a few of the calibration prompts)."""
    if fmt not in FORMATS:
        raise EagleExportError(f"unknown checkpoint format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    src = resolve_source(source, target, allow_changed_sources, "export-checkpoint")
    inputs = (src["target_dir"], src["drafter_dir"]) + ((src["build"],) if src.get("build") else ())
    check_output(output_place(out_dir), EXPORT_OUTPUT, inputs, force)  # before any work; again at the rename
    # A build's fp16/bf16/fp32 is its engines' precision; a checkpoint keeps the drafter's own dtype.
    precision = precision or (src["precision"] if src["precision"] in QUANTIZED else None)
    quantized = precision in QUANTIZED
    if precision is not None and not quantized and precision not in DTYPES:
        raise EagleExportError(f"unknown precision {precision!r}", f"use fp32, fp16, bf16, {' or '.join(QUANTIZED)}")
    if quantized and fmt == "speculators":
        raise EagleExportError("the speculators format carries no quantization config its readers apply (vLLM's "
                               "speculators adapter keeps only the layer config and the EAGLE keys)",
                               "export FP8/NVFP4 drafters with --format vllm (or sglang)")
    embeddings = embeddings or ("store" if fmt == "speculators" else "share")
    if embeddings not in ("store", "share"):
        raise EagleExportError(f"unknown embeddings choice {embeddings!r}", "use store or share")

    # fp32 for everything computed here (calibration, logits); `out_dtype` only for what is written.
    # No model pass: the checkpoint keeps the drafter's own layout (q/k/v apart, gains unfolded).
    target_model, drafter = load_pair(src["target_dir"], src["drafter_dir"], "float32", passes=())
    drafter_cfg_dtype = read_config_json(src["drafter_dir"]).get("torch_dtype")
    out_dtype = resolve_dtype(dtype or (precision if precision in DTYPES else None) or drafter_cfg_dtype or "float32")
    if fmt != "speculators" and drafter.config.qk_norm:
        raise EagleExportError("this drafter's decoder layer is a Qwen3 layer (q/k norm), which vLLM's "
                               "LlamaForCausalLMEagle3 layout has no weights for",
                               "export it with --format speculators (vLLM serves Qwen3-layer drafters in that layout)")
    aux_ids = target_model.aux_layer_ids
    own_table = drafter.owns_embeddings and not torch.equal(drafter.embed_tokens.weight, target_model.embed_tokens.weight)
    if embeddings == "share" and own_table:
        raise EagleExportError("the drafter's own embedding table differs from the target's, so it cannot be shared",
                               "export with --embeddings store")
    passes = ["share_embeddings"] if drafter.owns_embeddings and embeddings == "share" else []
    if not own_table:
        drafter.share_embeddings(target_model.embed_tokens)

    if isinstance(calib_prompts, int):
        calib_prompts = list(chat_prompts(ChatTemplate(src["target_dir"]), "sharegpt", calib_prompts,  # each cut to
                                          src["calibration"]["max_tokens"]))  # the calibration's token limit
    if calib_prompts is None:
        cal = src["calibration"]
        calib_prompts = list(chat_prompts(ChatTemplate(src["target_dir"]), cal["dataset"], cal["num_samples"],
                                          cal["max_tokens"]))
    check_prompts = check_prompts or calib_prompts[:4]
    summary = {"format": fmt, "precision": precision if quantized else DTYPE_NAMES[out_dtype],
               "source": {k: str(src[k]) if src[k] else None for k in ("target_dir", "drafter_dir", "build")},
               "aux_layer_ids_vllm": list(aux_ids), "embeddings": embeddings, "passes_applied": passes,
               "conformance": src["conformance"]}
    # The reference is the drafter with its weights as they will be written (rounded to out_dtype),
    # computed in fp32; the loaded-back checkpoint must give its logits.
    reference = copy.deepcopy(drafter)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if not name.startswith("embed_tokens."):
                p.copy_(p.to(out_dtype).float())
    table = drafter.embed_tokens if own_table else target_model.embed_tokens
    if embeddings == "store":  # the reference reads the table as stored
        table = torch.nn.Embedding.from_pretrained(table.weight.detach().to(out_dtype).float(), freeze=True)
    reference.share_embeddings(table)
    if quantized:
        start = time.perf_counter()
        progress(f"quantizing the drafter to {precision} with ModelOpt on {len(calib_prompts)} prompts (up to "
                 f"{max(map(len, calib_prompts))} tokens each): the target's aux states first")
        batches = Q.drafter_calibration_batches(target_model, calib_prompts)
        progress(f"aux states in {time.perf_counter() - start:.0f} s; calibrating the drafter's quantizers")
        Q.quantize(reference, precision, batches, exclude=tuple(src["keep"]), fake_quant="export")
        progress(f"calibrated in {time.perf_counter() - start:.0f} s")
        unify_fused_scales(reference)
        if precision == "fp8":  # the exported model computes with the amaxes the written scales read back as
            snap_fp8_amaxes(reference)
        exported = copy.deepcopy(reference)
        state, hf_quant_config = export_quantized(exported, out_dtype)
        if precision == "nvfp4":  # ModelOpt's NVFP4 quantizers run on CUDA only: compare with the packed form
            pack_nvfp4(reference)
        summary["calibration"] = {"prompts": len(calib_prompts)}
    else:
        state, hf_quant_config = {k: v.to(out_dtype) if v.is_floating_point() else v
                                  for k, v in drafter_state_for_saving(reference).items()}, None
    if embeddings == "store":
        state["embed_tokens.weight"] = table.weight.to(out_dtype)
    summary["readers"] = reader_notes(fmt, drafter.config.eagle_version, precision)
    provenance = {"exported_by": f"eagle-export {__version__}", "format": fmt,
                  "embeddings": "stored" if embeddings == "store" else "shared with the target (not stored)",
                  "passes_applied": passes, "passes_not_applied": PASSES_NOT_APPLIED,
                  "readers": summary["readers"]}
    config = checkpoint_config(fmt, drafter.config, aux_ids, out_dtype, provenance, verifier or str(src["target_dir"]),
                               target_model.config.architecture, src["depth"])
    numbering = summary["aux_layer_numbering"] = config["eagle_export"]["aux_layer_numbering"]
    summary["aux_layer_ids"] = config["eagle_export"]["aux_layer_ids"][numbering]  # as written, in that numbering
    if hf_quant_config is not None:
        config["quantization_config"] = quantization_config(hf_quant_config)

    with atomic_output_dir(out_dir, EXPORT_OUTPUT, force, inputs, warn=progress) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weight_names(fmt, state), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if hf_quant_config is not None:
            (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2) + "\n")
        progress("loading the checkpoint back and comparing its draft logits")
        batches = Q.drafter_calibration_batches(target_model, check_prompts)
        diff = round_trip(reference, tmp, target_model, batches)
        summary["round_trip"] = {"max_abs_logit_diff": diff, "tolerance": ROUND_TRIP_TOLERANCE,
                                 "prompts": len(check_prompts), "compared_in": "float32"}
        if not diff <= ROUND_TRIP_TOLERANCE:
            raise EagleExportError(f"the exported checkpoint loads back with draft logits {diff:.3g} away from the "
                                   f"exported model's (tolerance {ROUND_TRIP_TOLERANCE})",
                                   "this is a bug in export-checkpoint: report it with the source; nothing was written")
        (tmp / "export_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
