"""`eagle-export inspect`: what a checkpoint directory holds, and what would go wrong using it."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import check_pair, load_state_dict, repeated_aux_ids
from .config import DrafterConfig, TargetConfig, is_drafter_config, read_config_json


def inspect_checkpoint(path: str | Path, target: str | Path | None = None) -> dict:
    path = Path(path)
    raw = read_config_json(path)
    if not is_drafter_config(raw):
        cfg = TargetConfig.from_hf(raw, where=str(path))
        state = load_state_dict(path)
        return {
            "kind": "target", "path": str(path), "architecture": cfg.architecture,
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": cfg.torch_dtype,
            "num_parameters": sum(t.numel() for t in state.values()),
            "default_aux_layer_ids": list(cfg.default_aux_layer_ids()), "warnings": [],
        }
    cfg = DrafterConfig.from_hf(raw, where=str(path))
    state = load_state_dict(path)
    warnings = []
    report = {
        "kind": "drafter", "path": str(path), "eagle_version": cfg.eagle_version,
        "eagle_version_keys": cfg.eagle_version_keys,
        "aux_layer_ids": list(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else None,
        "layer_numbering": cfg.layer_numbering, "layer_numbering_reason": cfg.layer_numbering_reason,
        "draft_vocab_size": cfg.draft_vocab_size, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux,
        "flags": {"fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
                  "norm_before_fc": cfg.norm_before_fc, "norm_before_residual": cfg.norm_before_residual},
        "has_embeddings": any(k.endswith("embed_tokens.weight") for k in state),
        "num_parameters": sum(t.numel() for k, t in state.items() if t.is_floating_point()),
    }
    if cfg.aux_layer_ids is None:
        warnings.append("config.json names no aux layer ids: the target's default is used ((2, L//2, L-3); "
                        "(0, L//2, L) below 7 layers)")
    if target is None and cfg.aux_layer_ids is not None:
        warnings.extend(repeated_aux_ids(cfg.aux_layer_ids))
    if not report["has_embeddings"] and target is None:
        warnings.append("the drafter has no embedding table: it shares the target's (pass --target to check the fit)")
    if target is not None:
        target_cfg = TargetConfig.from_hf(read_config_json(target), where=str(target))
        report["aux_layer_ids_resolved"] = list(cfg.resolved_aux_layer_ids(target_cfg))
        warnings.extend(check_pair(cfg, target_cfg))
        if not report["has_embeddings"] and cfg.hidden_size != target_cfg.hidden_size:
            warnings.append(f"the drafter has no embeddings and its hidden size {cfg.hidden_size} differs from "
                            f"the target's {target_cfg.hidden_size}: the target's table cannot be shared")
    report["warnings"] = warnings
    return report
