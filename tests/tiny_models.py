"""Tiny random Hugging Face checkpoints of each supported family, written with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
    "smollm2": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True),
}


def tiny_target_config(family: str, **overrides) -> dict:
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=320, max_position_embeddings=512, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.update(FAMILIES[family])
    cfg.update(overrides)
    return cfg


def write_tiny_target(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random model of `family`, saved by transformers itself (so its naming is the real one)."""
    import transformers

    cfg_dict = tiny_target_config(family, **overrides)
    config = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # non-trivial norm gains, so a misplaced gain shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    write_word_tokenizer(path, cfg_dict["vocab_size"])
    return path


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer ("w0" .. "wN", space separated) and a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))


def tiny_drafter_config(version: str = "3.1", target_hidden: int = 64, vocab: int = 320,
                        draft_vocab: int = 96, aux=(1, 3, 4), **overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": target_hidden, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)},
    }
    if version == "3.1":
        cfg.update(fc_norm=True, norm_output=True)
    cfg.update(overrides)
    return cfg


def write_tiny_drafter(path: Path, version: str = "3.1", seed: int = 0, own_embeddings: bool = False,
                       **overrides) -> Path:
    """A random drafter in the EAGLE-3 / vLLM layout (`midlayer.*`), with random non-trivial gains."""
    from safetensors.torch import save_file

    from eagle_export.config import DrafterConfig
    from eagle_export.drafter import Drafter

    cfg_dict = tiny_drafter_config(version, **overrides)
    cfg = DrafterConfig.from_hf(cfg_dict)
    torch.manual_seed(seed)
    drafter = Drafter(cfg, own_embeddings=own_embeddings)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        if cfg.draft_vocab_size != cfg.vocab_size:
            target_ids = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
            drafter.d2t.copy_(target_ids - torch.arange(cfg.draft_vocab_size))
    state = {k: v.contiguous() for k, v in drafter.state_dict().items()
             if own_embeddings or not k.startswith("embed_tokens.")}
    if cfg.draft_vocab_size == cfg.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    else:
        state.pop("t2d")
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + drafter.d2t] = True
        state["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    save_file(state, str(path / "model.safetensors"))
    return path
