"""Model configurations read from Hugging Face config.json files.

Only what the models need is kept, with each default stated where the Hugging Face classes
state it, so a checkpoint that omits a key behaves as it does in transformers and vLLM.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, EagleExportError
from ..files import is_dir, list_dir, read_json

# architecture name -> (family, attention_bias default, q/k norm)
TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
# The families as users name them (README "Bring your own model"; tests/test_architectures.py checks each).
SUPPORTED_FAMILIES = ("Llama 2/3.x (LlamaForCausalLM, rope_scaling llama3 or none), Mistral (MistralForCausalLM, "
                      "sliding window), Qwen2/2.5 (Qwen2ForCausalLM), Qwen3 (Qwen3ForCausalLM, dense)")
# Architectures users bring that compute another function, with what differs (named in the refusal).
REFUSED_FAMILIES = {
    "Gemma": "GeGLU MLP, embeddings scaled by sqrt(hidden), (1 + w) norm gains",
    "Phi3": "fused qkv and gate_up weights, longrope scaling",
    "Mixtral": "a mixture-of-experts MLP", "Qwen2Moe": "a mixture-of-experts MLP", "Qwen3Moe": "a mixture-of-experts MLP",
    "Deepseek": "multi-head latent attention (MLA) and a mixture-of-experts MLP",
}
DRAFTER_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator",
                         "Eagle3DraftModel", "LlamaForCausalLMEagle")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def read_config_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        if not is_dir(path):
            raise CheckpointError(f"{path} is not a directory",
                                  "pass a Hugging Face checkpoint directory (config.json + *.safetensors)")
        config_file = path / "config.json"
        if config_file not in list_dir(path):  # (an unreadable directory is named here)
            raise CheckpointError(f"{path} has no config.json",
                                  "pass the checkpoint directory itself, the one holding config.json")
        cfg = read_json(config_file, "restore the file from the checkpoint")
    except CheckpointError:
        raise
    except EagleExportError as e:  # unreadable, a loop, a directory, not JSON: named by files.py
        raise CheckpointError(e.problem, e.fix) from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{config_file} holds a JSON {type(cfg).__name__}, not an object of keys",
                              "restore the file from the checkpoint")
    return cfg


def _typed(from_hf):
    """from_hf with a wrong-typed value in config.json ("hidden_size": "big", a list where a number
    goes) reported as the checkpoint's problem, not as a ValueError from deep inside."""
    @functools.wraps(from_hf)
    def read(cls, cfg, *args, **kwargs):
        where = kwargs.get("where", args[0] if args else cls.__name__)
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{where}: config.json holds a JSON {type(cfg).__name__}, not an object of keys",
                                  "restore the checkpoint's original config.json")
        try:
            return from_hf(cls, cfg, *args, **kwargs)
        except (ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: config.json holds a value of the wrong type ({e})",
                                  "restore the checkpoint's original config.json") from None
    return read


REQUIRED = object()
KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string", dict: "an object",
         list: "a list"}


def _field(cfg: dict, key: str, where: str, kind: type, default=REQUIRED, name: str | None = None):
    """cfg[key] as `kind` (int, float, bool, str, dict or list); absent or null: `default` (refused as
    lacking when REQUIRED). A value of another JSON type ("hidden_size": "big", a string "false" where a
    flag goes) is refused naming the field and the type it must have, never converted."""
    value = cfg.get(key)
    if value is None:
        return _require(cfg, key, where) if default is REQUIRED else default
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int and number and float(value).is_integer() or kind is float and number \
            or kind not in (int, float) and isinstance(value, kind):
        return kind(value)
    shown = json.dumps(value)
    raise CheckpointError(f"{where}: config.json sets {name or key} to {shown[:40]}{'...' if len(shown) > 40 else ''}, "
                          f"which must be {KINDS[kind]}", "restore the checkpoint's original config.json")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict, where: str) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters`; older files have rope_theta + rope_scaling.
        params = _field(cfg, "rope_parameters", where, dict, {})
        scaling = _field(cfg, "rope_scaling", where, dict, {})
        theta = _field(params, "rope_theta", where, float, None, "rope_parameters.rope_theta")
        theta = _field(cfg, "rope_theta", where, float, 10000.0) if theta is None else theta
        merged = {**scaling, **params}
        rope_type = merged.get("rope_type", merged.get("type", "default"))

        def number(key, default, kind=float):
            return _field(merged, key, where, kind, default, f"rope_scaling.{key}")

        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(f"{where}: rope scaling type {rope_type!r} is not supported",
                                  f"supported types: {', '.join(SUPPORTED_ROPE_TYPES)}")
        return cls(theta=theta, rope_type=rope_type, factor=number("factor", 1.0),
                   low_freq_factor=number("low_freq_factor", 1.0), high_freq_factor=number("high_freq_factor", 4.0),
                   original_max_position_embeddings=number("original_max_position_embeddings", 8192, int))


# The one list of config fields whose values these models implement only in part: key -> the values
# implemented (absent counts as implemented). Anything else would build a graph that silently
# computes another function (a `gelu` target built byte-identical to the SiLU one), so it is refused.
IMPLEMENTED_VALUES = {
    "hidden_act": ("silu", "swish"),             # MLP activation
    "hidden_activation": ("silu", "swish"),
    "mlp_bias": (False,),
    "partial_rotary_factor": (1, 1.0),           # RoPE over the whole head
    "final_logit_softcapping": (None,),
    "attn_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),            # Granite-style multipliers
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "use_qk_norm": (None, False),
}


def check_implemented(cfg: dict, where: str) -> None:
    """Refuse a config that sets a field to a value the models here do not implement (rope types:
    RopeConfig; sliding windows: TargetConfig)."""
    for key, implemented in IMPLEMENTED_VALUES.items():
        if key in cfg and cfg[key] not in implemented:
            shown = ", ".join(repr(v) for v in implemented if v is not None) or "absent"
            raise CheckpointError(f"{where}: config.json sets {key}={cfg[key]!r}, which this tool does not implement "
                                  f"(implemented: {shown}); the model would compute something else",
                                  "use a checkpoint of a supported family (Llama, Mistral, Qwen2, Qwen3) as released")


def _target_window(cfg: dict, family: str, num_layers: int, where: str) -> int | None:
    """The sliding window of every layer, or None. Llama has none; Qwen2/3 slide only with
    use_sliding_window, and then (as transformers) the layers from max_window_layers on; a window
    on some layers only is not implemented."""
    window = cfg.get("sliding_window")
    if family == "llama" or not window:
        return None
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None  # Qwen configs carry a window they do not use unless use_sliding_window is set
        first = _field(cfg, "max_window_layers", where, int, 0)
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    if cfg.get("layer_types"):
        sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
    if all(sliding):
        return int(window)
    if not any(sliding):
        return None
    raise CheckpointError(f"{where}: a sliding window on {sum(sliding)} of {len(sliding)} layers "
                          "(max_window_layers / layer_types) is not implemented", "use a checkpoint whose layers all "
                          "use the same attention, or set use_sliding_window: false if the window was never used")


def _require(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{where}: config.json lacks {key!r}", "use the checkpoint's original config.json")
    return cfg[key]


@dataclass
class TargetConfig:
    architecture: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    @_typed
    def from_hf(cls, cfg: dict, where: str = "target") -> "TargetConfig":
        archs = _field(cfg, "architectures", where, list, [])
        arch = next((a for a in archs if a in TARGET_ARCHITECTURES), None)
        if arch is None:
            found = ", ".join(archs) or f"model_type {cfg.get('model_type')!r}"
            why = next((f" ({why})" for name, why in REFUSED_FAMILIES.items() if found.startswith(name)), "")
            raise CheckpointError(f"{where}: unsupported architecture {found}{why}",
                                  f"use a target of a supported family: {SUPPORTED_FAMILIES}")
        family, bias_default, qk_norm = TARGET_ARCHITECTURES[arch]
        check_implemented(cfg, where)
        attention_bias = _field(cfg, "attention_bias", where, bool, bias_default)
        if attention_bias and family != "qwen2":  # Qwen2's bias is on q/k/v only; Llama's would be on o_proj too
            raise CheckpointError(f"{where}: config.json sets attention_bias=true on a {arch}, whose o_proj bias "
                                  "this tool does not implement", "use the checkpoint as released (attention_bias: false)")
        hidden = _field(cfg, "hidden_size", where, int)
        heads = _field(cfg, "num_attention_heads", where, int)
        window = _target_window(cfg, family, _field(cfg, "num_hidden_layers", where, int), where)
        return cls(
            architecture=arch, family=family, hidden_size=hidden,
            intermediate_size=_field(cfg, "intermediate_size", where, int),
            num_layers=_field(cfg, "num_hidden_layers", where, int),
            num_heads=heads, num_kv_heads=_field(cfg, "num_key_value_heads", where, int, 0) or heads,
            head_dim=_field(cfg, "head_dim", where, int, 0) or hidden // heads,
            vocab_size=_field(cfg, "vocab_size", where, int),
            rms_norm_eps=_field(cfg, "rms_norm_eps", where, float, 1e-6),
            rope=RopeConfig.from_hf(cfg, where),
            max_position_embeddings=_field(cfg, "max_position_embeddings", where, int, 2048),
            tie_word_embeddings=_field(cfg, "tie_word_embeddings", where, bool, False),
            attention_bias=attention_bias, qk_norm=qk_norm, sliding_window=window,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
        )

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """eos_token_id (an id, a list of ids, or absent) as the tuple generation stops on."""
        eos = self.eos_token_id
        return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())

    def default_aux_layer_ids(self) -> tuple[int, ...]:
        return default_aux_layer_ids(self.num_layers)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Aux layer ids for a target whose drafter config names none (vLLM's numbering: the residual
    stream entering layer i, so 0..L are valid, L the last layer's output). EAGLE-3's (2, L//2, L-3),
    as vLLM and SpecForge default, from 7 layers up, where it is distinct and in order; below that it
    repeats or leaves 0..L (2 layers: (2, 1, -1)), so a tiny target takes first, middle and last
    (0, L//2, L): (0, 1, 2) for 2 layers, and the only two states (0, 1) for one."""
    n = num_layers
    return (2, n // 2, n - 3) if n >= 7 else tuple(sorted({0, n // 2, n}))


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default (default_aux_layer_ids)
    num_aux: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    fc_norm: bool = False          # EAGLE-3.1: one RMSNorm per aux state before fc
    norm_output: bool = False      # EAGLE-3.1: feed back the post-norm hidden state
    norm_before_fc: bool = False   # one RMSNorm over the concatenated aux states before fc
    norm_before_residual: bool = False  # the residual around attention is hidden_norm(x), not x
    sliding_window: int | None = None  # attention sees the last `sliding_window` positions only
    qk_norm: bool = False          # a Qwen3 decoder layer: RMSNorm over each query and key head
    layer_numbering: str = "vllm"  # "vllm": id i = entering layer i; "torchspec": id i = leaving layer i
    layer_numbering_reason: str = "default (no TorchSpec marker in config.json)"
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def eagle_version(self) -> str:
        return "3.1" if (self.fc_norm or self.norm_output) else "3"

    @property
    def eagle_version_keys(self) -> dict[str, bool]:
        """The config keys that decided `eagle_version`."""
        return {"fc_norm": self.fc_norm, "norm_output": self.norm_output}

    @classmethod
    @_typed
    def from_hf(cls, cfg: dict, where: str = "drafter") -> "DrafterConfig":
        # The speculators format nests the layer's config (`transformer_layer_config`, earlier
        # `transformer_config`); the EAGLE/vLLM format is flat. Top-level keys win.
        nested = (_field(cfg, "transformer_layer_config", where, dict, None)
                  or _field(cfg, "transformer_config", where, dict, {}))
        flat = {**nested, **{k: v for k, v in cfg.items() if k not in ("transformer_layer_config", "transformer_config")}}
        eagle_cfg = _field(flat, "eagle_config", where, dict, {})
        check_implemented(flat, where)
        hidden = _field(flat, "hidden_size", where, int)
        heads = _field(flat, "num_attention_heads", where, int)
        aux_ids, numbering, reason = _aux_layer_ids(flat, where)
        num_aux = _field(flat, "num_aux_hidden_states", where, int, 0) or (len(aux_ids) if aux_ids else 3)
        if aux_ids is not None and len(aux_ids) != num_aux:
            raise CheckpointError(f"{where}: {len(aux_ids)} aux layer ids but num_aux_hidden_states={num_aux}",
                                  "make eagle_aux_hidden_state_layer_ids and num_aux_hidden_states agree")
        vocab = _field(flat, "vocab_size", where, int)

        def flag(key: str) -> bool:
            if key in eagle_cfg:
                return _field(eagle_cfg, key, where, bool, False, f"eagle_config.{key}")
            return _field(flat, key, where, bool, False)

        return cls(
            hidden_size=hidden, intermediate_size=_field(flat, "intermediate_size", where, int),
            num_heads=heads, num_kv_heads=_field(flat, "num_key_value_heads", where, int, 0) or heads,
            head_dim=_field(flat, "head_dim", where, int, 0) or hidden // heads, vocab_size=vocab,
            draft_vocab_size=_field(flat, "draft_vocab_size", where, int, 0) or vocab,
            target_hidden_size=_field(flat, "target_hidden_size", where, int, 0) or hidden,
            aux_layer_ids=aux_ids, num_aux=num_aux, rms_norm_eps=_field(flat, "rms_norm_eps", where, float, 1e-6),
            rope=RopeConfig.from_hf(flat, where),
            max_position_embeddings=_field(flat, "max_position_embeddings", where, int, 2048),
            fc_norm=flag("fc_norm"), norm_output=flag("norm_output"),
            norm_before_fc=flag("norm_before_fc"), norm_before_residual=flag("norm_before_residual"),
            sliding_window=_drafter_window(flat, where),
            # the layer's own model_type: a speculators config's top level names the speculator, not the layer
            qk_norm=(nested or cfg).get("model_type") in QK_NORM_LAYER_TYPES,
            layer_numbering=numbering, layer_numbering_reason=reason, raw=cfg,
        )

    def resolved_aux_layer_ids(self, target: TargetConfig) -> tuple[int, ...]:
        """Aux layer ids in vLLM's convention (the residual stream entering layer i). The target's
        default (`default_aux_layer_ids`) is already in it; ids a config names in TorchSpec numbering are shifted."""
        if self.aux_layer_ids is None:
            return target.default_aux_layer_ids()
        shift = 1 if self.layer_numbering == "torchspec" else 0
        return tuple(i + shift for i in self.aux_layer_ids)


QK_NORM_LAYER_TYPES = ("qwen3",)  # decoder layer types with q/k norm (speculators' default layer config is Qwen3)


def _drafter_window(cfg: dict, where: str) -> int | None:
    """The drafter layer's sliding window: `layer_types: [sliding_attention]` with `sliding_window`
    (transformers' and speculators' spelling), or Qwen2-style `use_sliding_window`. A window the
    layer types do not use (Qwen3Config carries 4096 by default) is ignored."""
    layer_types = cfg.get("layer_types")
    if layer_types:
        if layer_types[0] != "sliding_attention":
            return None
    elif not cfg.get("use_sliding_window"):
        return None
    window = cfg.get("sliding_window")
    if not window:
        raise CheckpointError(f"{where}: the drafter layer is a sliding-window layer but config.json gives no "
                              "sliding_window", "add \"sliding_window\": N (the window the drafter was trained with)")
    return int(window)


# How each spelling of the aux layer ids counts. "vllm": id i is the residual stream entering
# decoder layer i (vLLM, speculators, this project). "torchspec": id i is the output of decoder
# layer i, one lower for the same state (TorchSpec, SGLang/SpecForge, Edge-LLM's and DFlash's
# `target_layer_ids`).
NUMBERING_ALIASES = {"vllm": "vllm", "entering": "vllm", "torchspec": "torchspec", "sglang": "torchspec",
                     "specforge": "torchspec", "leaving": "torchspec"}
AUX_ID_KEYS = (  # (where, key, numbering); the first present wins
    ("eagle_config", "eagle_aux_hidden_state_layer_ids", None),  # vLLM layout
    ("", "eagle_aux_hidden_state_layer_ids", None),              # speculators layout
    ("", "aux_hidden_state_layer_ids", None),                    # speculators' newer name
    ("eagle_config", "target_layer_ids", "torchspec"),           # TorchSpec / Edge-LLM
    ("", "target_layer_ids", "torchspec"),
)


def _aux_layer_ids(cfg: dict, where: str) -> tuple[tuple[int, ...] | None, str, str]:
    """(aux ids as written, their numbering, why that numbering) from whichever key the config uses;
    several keys must name the same target layers."""
    numbering, reason = _layer_numbering(cfg)
    found = []
    for place, key, key_numbering in AUX_ID_KEYS:
        scope = (cfg.get(place) or {}) if place else cfg
        if scope.get(key) is not None:
            spelled = f"{place}.{key}" if place else key
            ids = _field(scope, key, where, list, name=spelled)
            found.append((spelled, key_numbering or numbering,
                          tuple(_field({"id": i}, "id", where, int, name=f"{spelled}[{n}]") for n, i in enumerate(ids))))
    if not found:
        return None, numbering, reason
    spelled, key_numbering, ids = found[0]
    if key_numbering != numbering:
        numbering = key_numbering
        reason = f"config.json names its aux layers {spelled} (output of layer i, as TorchSpec and Edge-LLM count)"

    def entering(ids, numbering):
        return tuple(i + (numbering == "torchspec") for i in ids)

    for other, other_numbering, other_ids in found[1:]:
        if entering(other_ids, other_numbering) != entering(ids, numbering):
            raise CheckpointError(f"{where}: {spelled} = {list(ids)} and {other} = {list(other_ids)} name different "
                                  "target layers", "keep one aux layer id key, the one the drafter was trained with")
    return ids, numbering, reason


def _layer_numbering(cfg: dict) -> tuple[str, str]:
    """TorchSpec counts an aux layer by the layer it leaves, one lower than vLLM's id for the same
    state. A config says so explicitly (`layer_numbering`) or carries TorchSpec's marker."""
    explicit = cfg.get("layer_numbering") or (cfg.get("eagle_config") or {}).get("layer_numbering")
    if explicit in NUMBERING_ALIASES:
        return NUMBERING_ALIASES[explicit], f"config.json sets layer_numbering={explicit!r}"
    for key in ("framework", "trained_with", "training_framework", "library_name"):
        if "torchspec" in str(cfg.get(key, "")).lower():
            return "torchspec", f"config.json {key}={cfg[key]!r}"
    return "vllm", "default (no TorchSpec marker in config.json)"


def is_drafter_config(cfg: dict) -> bool:
    archs = cfg.get("architectures") or []
    return (any(a in DRAFTER_ARCHITECTURES or "eagle" in a.lower() for a in archs)
            or "draft_vocab_size" in cfg or cfg.get("speculators_model_type") is not None)
