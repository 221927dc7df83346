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

    from eagle_export.models.config import DrafterConfig
    from eagle_export.models.drafter import Drafter

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


def token_sequences(count: int = 8, length: int = 40, pool: int = 16, vocab: int = 320, seed: int = 0) -> list[list[int]]:
    """Random sequences over a small pool of token ids: each token recurs in many contexts, so the
    target's greedy token depends on the context (the aux states), not on the token alone."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(vocab - 3, generator=gen)[:pool] + 3
    return tokens[torch.randint(0, pool, (count, length), generator=gen)].tolist()


def write_trained_tiny_drafter(path: Path, target_dir: Path, version: str, sequences: list[list[int]],
                               aux=(1, 2, 4), draft_vocab: int | None = None, steps: int = 150,
                               seed: int = 0, **overrides) -> Path:
    """A tiny drafter trained briefly (training-time test over 2 steps, hard labels) to give the tiny
    target's greedy tokens on `sequences`, so its right conventions are the ones it was trained under.

    Trained on the sequences it is later checked on (it memorizes them): what matters is that each
    convention changes its numbers. Its gains are set so they do, as the scale drift of real drafters
    does: small hidden_norm and final-norm gains make the residual and the fed-back state differ in
    scale from their normalized forms; large fc_norm gains make norm_before_fc rescale fc's input.
    draft_vocab: None for the target's whole vocabulary (no d2t), else the most frequent greedy
    tokens of the sequences (d2t/t2d stored)."""
    import torch.nn.functional as F

    from eagle_export.builder.conformance import capture
    from eagle_export.models.checkpoint import load_target, save_drafter
    from eagle_export.models.config import DrafterConfig
    from eagle_export.models.drafter import Drafter
    from eagle_export.speculation.eager import parallel_drafts

    target = load_target(target_dir).eval()
    states = capture(target, sequences)
    vocab = target.config.vocab_size
    greedy = torch.cat([g for _, g in states])
    if draft_vocab is None:
        kept = torch.arange(vocab)
    else:
        kept = torch.bincount(greedy, minlength=vocab).argsort(descending=True)[:draft_vocab].sort().values
    cfg_dict = tiny_drafter_config(version, target_hidden=target.config.hidden_size, vocab=vocab,
                                   draft_vocab=len(kept), aux=aux, **overrides)
    torch.manual_seed(seed)
    drafter = Drafter(DrafterConfig.from_hf(cfg_dict))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_((1.0 + 0.3 * torch.randn_like(p)) * (0.1 if "hidden_norm" in name else 0.2 if name == "norm.weight"
                                                             else 3.0 if name.startswith("fc_norm") else 1.0))
        if draft_vocab is not None:
            drafter.d2t.copy_(kept - torch.arange(len(kept)))
            drafter.t2d.zero_()
            drafter.t2d[kept] = True
    drafter.has_vocab_map = draft_vocab is not None
    drafter.share_embeddings(target.embed_tokens)
    to_draft = torch.full((vocab,), -1)
    to_draft[kept] = torch.arange(len(kept))
    # Ragged sequences are padded at the end (causal attention: padding never reaches a real position).
    t = max(len(s) for s in sequences) - 2
    aux_in = torch.zeros(len(sequences), t, len(aux) * target.config.hidden_size)
    next_ids = torch.zeros(len(sequences), t + 1, dtype=torch.long)
    labels = torch.full((len(sequences), 2, t), -1)
    for i, (ids, (s, g)) in enumerate(zip(sequences, states)):
        n = len(ids) - 2
        aux_in[i, :n] = s[:n, list(aux)].reshape(n, -1)
        next_ids[i, :n + 1] = torch.tensor(ids[1:])
        for k in range(2):
            labels[i, k, :n] = g[k + 1:k + 1 + n]
    params = [p for name, p in drafter.named_parameters() if not name.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    with torch.enable_grad():  # some test modules switch autograd off at import
        for _ in range(steps):
            logits = parallel_drafts(drafter, next_ids, aux_in, 2)
            targets = [torch.where(labels[:, k] >= 0, to_draft[labels[:, k].clamp(min=0)], -1) for k in range(2)]
            loss = sum(F.cross_entropy(logits[k].flatten(0, 1), targets[k].flatten(), ignore_index=-1)
                       for k in range(2))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    drafter.requires_grad_(False)
    save_drafter(drafter, path, config=cfg_dict)
    return path
