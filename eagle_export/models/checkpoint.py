"""Checkpoint I/O: Hugging Face directories in, PyTorch modules out, and drafters back in vLLM's layout.

Weights are read from safetensors (single file or sharded with an index). A pickle
(`pytorch_model.bin`) is loaded only when `torch.load(weights_only=True)` accepts it, so no
code in a checkpoint ever runs. Every name mismatch is reported by name, every shape mismatch
with the tensor, the expected and the found shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..files import reading
from .config import DrafterConfig, TargetConfig, is_drafter_config, read_config_json
from .drafter import Drafter
from .layers import rope_inv_freq
from .modelopt_hf import checkpoint_precision, restore_quantized, split_quantized
from .target import Target

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# the names config.json's torch_dtype uses
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
SEPARATE_VOCAB_MAP_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".npy")
SPECULATORS_TRAINING_COPIES = ("verifier_lm_head.weight", "verifier_norm.weight")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _load_pickle_weights_only(file: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure means the file is not a plain tensor dict
        raise CheckpointError(
            f"{file} is a pickle that weights-only loading refuses ({type(e).__name__}); it may run code when loaded",
            "convert it to safetensors with a trusted tool, or obtain the safetensors release") from None
    if isinstance(obj, torch.Tensor):
        return {file.stem: obj}
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{file} does not hold a flat dict of tensors", "pass a weights-only checkpoint")
    return dict(obj)


def _read_safetensors(file: Path, prepare=None) -> dict[str, torch.Tensor]:
    """Every tensor of `file`, each passed through prepare(name, tensor) as it is read (so a cast
    to the build's dtype never holds the file's copy of more than one tensor beside it)."""
    prepare = prepare or (lambda name, tensor: tensor)
    # A loop, mode 000, a directory: named with their own fix, not "re-download".
    with reading(file, "re-download the file", CheckpointError), open(file, "rb"):
        pass
    try:
        with reading(file, "re-download the file", CheckpointError), safe_open(str(file), framework="pt") as f, \
                open(file, "rb") as raw:  # safe_open has checked the header and the offsets
            layout = _safetensors_layout(raw)
            return {k: prepare(k, _read_tensor(raw, layout[k]) if k in layout else f.get_tensor(k)) for k in f.keys()}
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e})",
                              "re-download the file; a truncated or corrupted file cannot be loaded") from None


# safetensors' dtype names (its format spec) -> torch's; a tensor of another dtype is read by safe_open.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _safetensors_layout(raw) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name -> (dtype, shape, first byte, end byte) in the file, for the dtypes torch has."""
    raw.seek(0)
    header_bytes = int.from_bytes(raw.read(8), "little")
    header = json.loads(raw.read(header_bytes))
    base = 8 + header_bytes
    return {name: (SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], base + entry["data_offsets"][0],
                   base + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__" and entry["dtype"] in SAFETENSORS_DTYPES}


def _read_tensor(raw, entry: tuple[torch.dtype, list[int], int, int]) -> torch.Tensor:
    """One tensor read into memory of its own. safe_open's tensors are views of the file mapped into
    memory: the whole file stays mapped while any of them lives, and every page read (the finiteness
    check reads them all) counts as resident, including those of q/k/v and gate/up once the model
    passes have fused them into new tensors: 1.8 GiB beside a Qwen3-1.7B-shaped fp16 model."""
    dtype, shape, begin, end = entry
    tensor = torch.empty(shape, dtype=dtype)
    raw.seek(begin)
    if raw.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != end - begin:
        raise ValueError("a tensor's bytes end before its offsets say")
    return tensor


FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # FP8 codes: their fp32 scales are


def load_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: single or sharded safetensors, else a weights-only
    pickle. A NaN or infinite weight is the checkpoint's problem, named here, not a numerics failure
    of the build later. dtype: fp32/fp16/bf16 tensors are cast to it one by one as they are read."""
    def prepare(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype in FINITE_CHECKED and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: weight {name} holds NaN or infinite values",
                                  "restore the checkpoint (a damaged download or a diverged training run)")
        return tensor.to(dtype) if dtype is not None and tensor.dtype in FINITE_CHECKED else tensor

    return _read_tensors(Path(path), prepare)


def _read_tensors(path: Path, prepare) -> dict[str, torch.Tensor]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            except (OSError, ValueError, AttributeError) as e:
                raise CheckpointError(f"{index} cannot be read as a JSON index ({e})",
                                      "restore the index file from the checkpoint") from None
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise CheckpointError(f"{index} names shards that are not there: {', '.join(missing)}",
                                      "download every shard listed in the index")
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                if shard.endswith(".safetensors"):
                    state.update(_read_safetensors(path / shard, prepare))
                else:
                    state.update({k: prepare(k, t) for k, t in _load_pickle_weights_only(path / shard).items()})
            return state
    safetensors_files = sorted(p for p in path.glob("*.safetensors") if not _is_vocab_map_file(p))
    if safetensors_files:
        state = {}
        for file in safetensors_files:
            state.update(_read_safetensors(file, prepare))
        return state
    pickles = sorted(p for p in path.glob("*.bin") if not _is_vocab_map_file(p)) + sorted(path.glob("*.pt"))
    pickles = [p for p in pickles if not _is_vocab_map_file(p)]
    if pickles:
        state = {}
        for file in pickles:
            state.update({k: prepare(k, t) for k, t in _load_pickle_weights_only(file).items()})
        return state
    raise CheckpointError(f"{path} has no weights (no *.safetensors, no index, no pytorch_model.bin)",
                          "pass a directory that holds the checkpoint's weight files")


def _is_vocab_map_file(p: Path) -> bool:
    return p.stem in ("d2t", "t2d")


def _materialize(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str,
                 dtype: torch.dtype | None, optional: tuple[str, ...] = ()) -> None:
    """Copy `state` into `model`, refusing missing, unexpected and misshapen tensors by name."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and k not in optional]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights: {', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}")
        if unexpected:
            parts.append(f"unexpected weights: {', '.join(unexpected[:12])}{' ...' if len(unexpected) > 12 else ''}")
        raise CheckpointError(f"{where}: " + "; ".join(parts),
                              "check that config.json belongs to these weights (layer count, architecture)")
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise CheckpointError(
                f"{where}: shape mismatch for {k}: expected {tuple(expected[k].shape)}, found {tuple(t.shape)}",
                "check that config.json belongs to these weights (hidden size, heads, vocabulary)")
    with torch.no_grad():
        for k, t in state.items():
            target_tensor = expected[k]
            if target_tensor.is_floating_point():
                t = t.to(dtype or t.dtype)
            else:
                t = t.to(target_tensor.dtype)
            _set_tensor(model, k, t)


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    current = getattr(module, attr)
    if isinstance(current, torch.nn.Parameter):
        setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
    else:
        module._buffers[attr] = value


# ---------------------------------------------------------------- target

def target_key(hf_name: str) -> str:
    """Hugging Face name -> our module name: `model.layers.0.mlp...` -> `layers.0.mlp...`."""
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def load_target(path: str | Path, dtype: str | torch.dtype | None = None,
                aux_layer_ids: tuple[int, ...] | None = None) -> Target:
    path = Path(path)
    raw = read_config_json(path)
    if is_drafter_config(raw):
        raise CheckpointError(f"{path} is an EAGLE drafter, not a target model",
                              "pass the target LLM's directory as the target, and this one as the drafter")
    cfg = TargetConfig.from_hf(raw, where=str(path))
    dtype = resolve_dtype(dtype) or DTYPES.get(cfg.torch_dtype, None)
    state = {target_key(k): v for k, v in load_state_dict(path, dtype).items()}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_config_against_weights(cfg, state, str(path))
    with torch.device("meta"):
        model = Target(cfg, aux_layer_ids)
    tied = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    _materialize(model, state, str(path), dtype, optional=tied)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)  # buffers built on meta are recomputed
    return model.eval()


def check_config_against_weights(cfg: TargetConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """The config fields the weights' shapes pin down, each compared by name, so a config.json of
    another size of the family is refused naming the field rather than the first misshapen tensor."""
    def disagree(field: str, configured, found, evidence: str):
        raise CheckpointError(f"{where}: config.json and the weights disagree on {field}: config.json says "
                              f"{configured}, the weights hold {found} ({evidence})",
                              "use the config.json released with these weights (this one may be another size's)")

    layers = {int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if layers and len(layers) != cfg.num_layers:
        disagree("num_hidden_layers", cfg.num_layers, len(layers), f"layers.{min(layers)} .. layers.{max(layers)}")
    shape = lambda name: tuple(state[name].shape) if name in state else None
    if (embed := shape("embed_tokens.weight")) is not None:
        if embed[1] != cfg.hidden_size:
            disagree("hidden_size", cfg.hidden_size, embed[1], f"embed_tokens.weight {embed}")
        if embed[0] != cfg.vocab_size:
            disagree("vocab_size", cfg.vocab_size, embed[0], f"embed_tokens.weight {embed}")
    if (q_norm := shape("layers.0.self_attn.q_norm.weight")) is not None and q_norm[0] != cfg.head_dim:
        disagree("head_dim", cfg.head_dim, q_norm[0], f"layers.0.self_attn.q_norm.weight {q_norm}")
    for proj, heads, key in (("q_proj", cfg.num_heads, "num_attention_heads"),
                             ("k_proj", cfg.num_kv_heads, "num_key_value_heads")):
        rows = shape(f"layers.0.self_attn.{proj}.weight")
        if rows is not None and rows[0] != heads * cfg.head_dim:
            disagree(f"{key} x head_dim", f"{heads} x {cfg.head_dim} = {heads * cfg.head_dim}", f"{rows[0]} rows",
                     f"layers.0.self_attn.{proj}.weight {rows}")
    if (gate := shape("layers.0.mlp.gate_proj.weight")) is not None and gate[0] != cfg.intermediate_size:
        disagree("intermediate_size", cfg.intermediate_size, gate[0], f"layers.0.mlp.gate_proj.weight {gate}")


# ---------------------------------------------------------------- drafter

def drafter_key(name: str) -> str:
    """Every naming in use -> ours: `model.` prefix dropped, `layers.0.` is `midlayer.`."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def _load_separate_vocab_map(path: Path, name: str) -> torch.Tensor | None:
    for suffix in SEPARATE_VOCAB_MAP_SUFFIXES:
        file = path / f"{name}{suffix}"
        if not file.is_file():
            continue
        if suffix == ".npy":
            try:
                array = np.load(file, allow_pickle=False)
                if array.dtype.kind not in "iub":
                    raise ValueError(f"dtype {array.dtype}")
            except (ValueError, OSError) as e:  # an object array needs pickle, refused
                raise CheckpointError(f"{file} is not a plain integer array ({e})",
                                      f"save {name} as an integer .npy (numpy.save of an int64 array)") from None
            return torch.from_numpy(array)
        if suffix == ".safetensors":
            tensors = _read_safetensors(file)
            return tensors.get(name, next(iter(tensors.values())))
        tensors = _load_pickle_weights_only(file)
        return tensors.get(name, next(iter(tensors.values())))
    return None


def check_pair(drafter_cfg: DrafterConfig, target_cfg: TargetConfig) -> list[str]:
    """Problems that make a drafter unusable with a target; empty when they fit."""
    problems = []
    if drafter_cfg.target_hidden_size != target_cfg.hidden_size:
        problems.append(f"the drafter expects target hidden size {drafter_cfg.target_hidden_size}, "
                        f"the target has {target_cfg.hidden_size}")
    if drafter_cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"the drafter's vocabulary is {drafter_cfg.vocab_size} tokens, "
                        f"the target's {target_cfg.vocab_size}")
    ids = drafter_cfg.resolved_aux_layer_ids(target_cfg)
    bad = [i for i in ids if not 0 <= i <= target_cfg.num_layers]
    if bad:
        problems.append(f"aux layer ids {bad} lie beyond the target's {target_cfg.num_layers} layers")
    problems += repeated_aux_ids(ids)
    return problems


def repeated_aux_ids(ids) -> list[str]:
    """A layer named twice among the aux ids (no drafter is trained on one state twice: a typo)."""
    repeated = sorted({i for i in ids if list(ids).count(i) > 1})
    return [f"aux layer ids {list(ids)} name layer(s) {repeated} more than once"] if repeated else []


def check_state_against_config(cfg: DrafterConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """Name the config key a checkpoint's weights contradict, before any generic name check."""
    has_fc_norm = any(k.startswith("fc_norm.") for k in state)
    if has_fc_norm and not cfg.fc_norm:
        raise CheckpointError(f"{where}: the weights hold fc_norm.* (EAGLE-3.1's per-aux norms) but config.json does "
                              "not set fc_norm: true", "set \"fc_norm\": true in config.json (EAGLE-3.1 drafters also "
                              "set \"norm_output\": true)")
    if cfg.fc_norm and not has_fc_norm:
        raise CheckpointError(f"{where}: config.json sets fc_norm: true but the weights hold no fc_norm.*",
                              "restore the fc_norm.N.weight tensors (a converter may have dropped them), or remove "
                              "fc_norm from config.json if this is an EAGLE-3 drafter")
    has_qk_norm = any(k.startswith("midlayer.self_attn.q_norm.") for k in state)
    if has_qk_norm != cfg.qk_norm:
        layer_type = (cfg.raw.get("transformer_layer_config") or cfg.raw.get("transformer_config") or cfg.raw).get(
            "model_type")
        raise CheckpointError(
            f"{where}: the weights {'hold' if has_qk_norm else 'lack'} q_norm/k_norm (a Qwen3 decoder layer) but "
            f"config.json's layer model_type is {layer_type!r}",
            "set the decoder layer's model_type to qwen3 when it has q_norm/k_norm weights, llama when not")
    d2t = state.get("d2t")
    if d2t is not None:
        ids = torch.arange(len(d2t)) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            absolute = int(d2t.min()) >= 0 and int(d2t.max()) < cfg.vocab_size
            raise CheckpointError(
                f"{where}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size}) "
                f"(target = draft + d2t[draft] reaches {int(ids.min())}..{int(ids.max())})"
                + ("; it looks like a table of absolute target ids, not offsets" if absolute else ""),
                "store d2t as offsets: d2t = target_ids - arange(draft_vocab_size)" if absolute
                else "pair the drafter with the target it was trained for (vocabulary size)")


def load_drafter(path: str | Path, target: Target | None = None,
                 dtype: str | torch.dtype | None = None) -> Drafter:
    """Load a drafter; with `target`, check the pair fits and share the target's embeddings."""
    path = Path(path)
    raw = read_config_json(path)
    if not is_drafter_config(raw):
        raise CheckpointError(f"{path} is not an EAGLE drafter (config.json names {raw.get('architectures')})",
                              "pass the drafter checkpoint (LlamaForCausalLMEagle3 or speculators Eagle3) here")
    cfg = DrafterConfig.from_hf(raw, where=str(path))
    state = {drafter_key(k): v for k, v in load_state_dict(path).items()}
    precision = checkpoint_precision(raw, str(path))
    quantized: dict = {}
    if precision:  # ModelOpt's HF format: FP8 weights dequantized here, NVFP4 ones restored below
        state, quantized = split_quantized(state, resolve_dtype(dtype))
    extra_layers = sorted({k.split(".")[1] for k in state if k.startswith("layers.")})
    if extra_layers:
        raise CheckpointError(f"{path}: drafter has more than one decoder layer (layers {', '.join(extra_layers)})",
                              "only single-layer EAGLE-3 drafters are supported")
    for name in ("d2t", "t2d"):
        if name not in state:
            separate = _load_separate_vocab_map(path, name)
            if separate is not None:
                state[name] = separate
    for name in SPECULATORS_TRAINING_COPIES:  # the target's head, copied for training losses only
        state.pop(name, None)
    check_state_against_config(cfg, state, str(path))
    if "d2t" in state and "t2d" not in state:  # t2d marks the target ids the draft vocabulary covers
        d2t = state["d2t"].long()
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(len(d2t)) + d2t] = True
    if cfg.draft_vocab_size != cfg.vocab_size and "d2t" not in state:
        raise CheckpointError(f"{path}: draft vocabulary ({cfg.draft_vocab_size}) differs from the target's "
                              f"({cfg.vocab_size}) but there is no d2t mapping",
                              "add d2t to the safetensors or beside it as d2t.pt / d2t.npy")
    own_embeddings = "embed_tokens.weight" in state
    if target is not None:
        problems = check_pair(cfg, target.config)
        if problems:
            raise CheckpointError(f"drafter {path} does not fit target: " + "; ".join(problems),
                                  "pair the drafter with the target it was trained for")
    dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = Drafter(cfg, own_embeddings=own_embeddings)
    # A missing norm_before_fc gain loads as ones, as speculators loads it.
    optional = ("d2t", "t2d", "input_norm.weight", *(f"{m}.weight" for m in quantized if f"{m}.weight" not in state))
    _materialize(model, state, str(path), dtype, optional=optional)
    if cfg.norm_before_fc and "input_norm.weight" not in state:
        ones = torch.ones(model.input_norm.weight.shape, dtype=model.fc.weight.dtype)
        model.input_norm.weight = torch.nn.Parameter(ones, requires_grad=False)
    if precision:
        restore_quantized(model, precision, quantized)
    for name in ("d2t", "t2d"):
        if name not in state:  # identity vocabulary: no mapping stored
            size = cfg.draft_vocab_size if name == "d2t" else cfg.vocab_size
            value = torch.zeros(size, dtype=torch.int64) if name == "d2t" else torch.ones(size, dtype=torch.bool)
            model._buffers[name] = value
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    model.has_vocab_map = "d2t" in state  # an identity vocabulary is saved without d2t/t2d, as it came
    if target is not None and not own_embeddings:
        model.share_embeddings(target.embed_tokens)
    return model.eval()


def drafter_state_for_saving(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The tensors vLLM loads: `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, `fc_norm.N`, and the
    embeddings only when the drafter owns them (a shared table is never stored twice)."""
    state = {}
    for k, v in drafter.state_dict().items():
        if k.startswith("embed_tokens.") and not drafter.owns_embeddings:
            continue
        if k in ("d2t", "t2d") and not drafter.has_vocab_map:
            continue
        state[k] = v.contiguous()
    return state


def save_drafter(drafter: Drafter, path: str | Path, config: dict | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(config if config is not None else drafter.config.raw)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(drafter_state_for_saving(drafter), str(path / "model.safetensors"), metadata={"format": "pt"})
