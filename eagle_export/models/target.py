"""The target LLM in plain PyTorch: the Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

One forward serves prefill and verify. It reads the runtime-owned KV cache and returns only the
new entries, plus the aux hidden states the drafter consumes: the residual stream entering each
layer in `aux_layer_ids` (vLLM's numbering).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TargetConfig
from .layers import MLP, Attention, RMSNorm, attention_mask, normed_linear, prenorm, rms_normalize, rope_cos_sin, rope_inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, bias=cfg.attention_bias,
                                   qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, mask, cache_lens=None):
        """Each norm applied here, or by the linear layers after it (`prenorm`: exact mode)."""
        h, norm = prenorm(self.input_layernorm, x, self.self_attn.inputs())
        x, new_k, new_v = self.self_attn(h, cos, sin, k_cache, v_cache, mask, cache_lens=cache_lens, residual=x,
                                         norm=norm)
        h, norm = prenorm(self.post_attention_layernorm, x, self.mlp.inputs())
        return self.mlp(h, residual=x, norm=norm), new_k, new_v


class Target(nn.Module):
    def __init__(self, cfg: TargetConfig, aux_layer_ids: tuple[int, ...] | None = None):
        super().__init__()
        self.config = cfg
        self.aux_layer_ids = tuple(aux_layer_ids if aux_layer_ids is not None else cfg.default_aux_layer_ids())
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        # Set by passes.fold_fc_norm_into_target: emit each aux state gain-free RMS-normalized with
        # the drafter's eps (the drafter's fc_norm moved here; the two are built as a pair).
        self.aux_norm_eps: float | None = None

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.config.hidden_size

    def empty_cache(self, batch: int, capacity: int, dtype=None, device=None):
        """K and V caches [L, B, Hkv, capacity, D], owned by the caller."""
        c = self.config
        shape = (c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim)
        dtype = dtype or self.embed_tokens.weight.dtype
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, input_ids, positions, k_cache, v_cache, cache_lens, logits: bool = True, tree_mask=None):
        """input_ids, positions [B,T]; k_cache, v_cache [L,B,Hkv,S,D]; cache_lens [B]; tree_mask [B,T,T]
        bool, which new tokens each new token sees (causal when None; a token tree's ancestor-or-self
        mask, with the nodes' depths as positions, to verify a tree)
        -> (logits [B,T,V] or final hidden [B,T,H], aux [B,T,A*H], new_k, new_v [L,B,Hkv,T,D])."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        mask = attention_mask(positions, cache_lens, k_cache.shape[3], self.config.sliding_window, tree_mask)
        aux, new_ks, new_vs = [], [], []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                aux.append(x)
            x, new_k, new_v = layer(x, cos, sin, k_cache[i], v_cache[i], mask, cache_lens)
            new_ks.append(new_k)
            new_vs.append(new_v)
        if len(self.layers) in self.aux_layer_ids:  # "entering" the layer after the last: the final state
            aux.append(x)
        if self.aux_norm_eps is not None:
            aux = [rms_normalize(a, self.aux_norm_eps) for a in aux]
        x, norm = prenorm(self.norm, x, [self.lm_head] if logits and not self.tied_gemm() else [])
        out = self.project_logits(x, norm) if logits else x
        aux_states = torch.cat(aux, dim=-1) if aux else x.new_zeros(*x.shape[:2], 0)
        return out, aux_states, torch.stack(new_ks), torch.stack(new_vs)

    def tied_gemm(self) -> bool:
        """lm_head is a plain Linear tied to the embeddings: `project_logits` applies it as a Gemm."""
        return self.lm_head.weight is self.embed_tokens.weight and type(self.lm_head) is nn.Linear

    def project_logits(self, x, norm=None):
        """lm_head(x), [B,T,H] -> [B,T,V] (x yet to pass `norm`: see layers.prenorm). A table tied to the
        embeddings is applied as one Gemm with transB on [B*T,H] rows (and a zero bias, the form the
        exporter maps to Gemm), reading the very weight the embedding Gather reads: the exported graph
        then stores the table once (a 3-D linear exports as MatMul on a constant-folded transposed
        copy, a second table of V*H). A quantized lm_head (not a plain Linear) keeps its module."""
        if self.tied_gemm():
            zero_bias = x.new_zeros(self.config.vocab_size)  # 2-D linear with a bias is what exports as Gemm
            return nn.functional.linear(x.flatten(0, 1), self.lm_head.weight, zero_bias).unflatten(0, x.shape[:2])
        return normed_linear(self.lm_head, x, norm)

    @torch.no_grad()
    def generate_greedy(self, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
        """Target-only greedy decoding at batch 1: the oracle speculative decoding must match."""
        device = self.embed_tokens.weight.device
        k_cache, v_cache = self.empty_cache(1, len(prompt_ids) + max_new_tokens, device=device)
        ids = torch.tensor([prompt_ids], device=device)
        length, out = 0, []
        for _ in range(max_new_tokens):
            positions = torch.arange(length, length + ids.shape[1], device=device).unsqueeze(0)
            logits, _, new_k, new_v = self(ids, positions, k_cache[:, :, :, :length], v_cache[:, :, :, :length],
                                           torch.tensor([length], device=device))
            k_cache[:, :, :, length:length + ids.shape[1]] = new_k
            v_cache[:, :, :, length:length + ids.shape[1]] = new_v
            length += ids.shape[1]
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in eos_ids:
                break
            ids = torch.tensor([[token]], device=device)
        return out
