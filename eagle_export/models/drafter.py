"""The EAGLE-3 / EAGLE-3.1 drafter in plain PyTorch, driven only by the checkpoint's config.json.

Step 0:  x = fc(aux_0 .. aux_{A-1})     (EAGLE-3.1 `fc_norm`: one RMSNorm per aux state first)
Layer:   attn(cat(input_layernorm(embed(tok)), hidden_norm(x))) + residual, then MLP + residual
Output:  logits = lm_head(norm(h)) over the draft vocabulary; target id = draft id + d2t[draft id]
Step k>0 feeds back h (EAGLE-3) or norm(h) (EAGLE-3.1 `norm_output`) in place of fc(...).
Variants read from the config: a sliding window over the keys (speculators' `layer_types:
[sliding_attention]`); RMSNorm over each query and key head (a Qwen3 decoder layer).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import DrafterConfig
from .layers import MLP, Attention, RMSNorm, attention_mask, in_window, key_positions, prenorm, rope_cos_sin, rope_inv_freq


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, k_cache, v_cache, mask, prefix_kv=None, cache_lens=None):
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        attn_in = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        x, new_k, new_v = self.self_attn(attn_in, cos, sin, k_cache, v_cache, mask, prefix_kv, cache_lens,
                                         residual=residual)
        h, norm = prenorm(self.post_attention_layernorm, x, self.mlp.inputs())  # (the attention's two inputs
        return self.mlp(h, residual=x, norm=norm), new_k, new_v  # are normed apart: their own launches)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, own_embeddings: bool = False):
        super().__init__()
        self.config = cfg
        h, ht, a = cfg.hidden_size, cfg.target_hidden_size, cfg.num_aux
        # Usually shared from the target (see `share_embeddings`); a checkpoint may carry its own.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embeddings else None
        self.owns_embeddings = own_embeddings
        self.has_vocab_map = cfg.draft_vocab_size != cfg.vocab_size
        self.fc_norm = nn.ModuleList(RMSNorm(ht, cfg.rms_norm_eps) for _ in range(a)) if cfg.fc_norm else None
        self.input_norm = RMSNorm(a * ht, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(a * ht, h, bias=False)
        self.midlayer = DrafterLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                             if cfg.draft_vocab_size == cfg.vocab_size else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.head_dim), persistent=False)
        # Set by passes.apply_draft_vocab: target id = draft_to_target[draft id], replacing d2t/t2d.
        self.register_buffer("draft_to_target", None)
        # Set by passes.fold_fc_norm_into_target: fc_norm moved into the target's aux outputs.
        self.aux_normalized_by_target = False

    def share_embeddings(self, embed_tokens: nn.Embedding) -> None:
        """Use the target's embedding table (the same Parameter, never a copy)."""
        self.embed_tokens = embed_tokens
        self.owns_embeddings = False

    def empty_cache(self, batch: int, capacity: int, dtype=None, device=None):
        """K and V caches [1, B, Hkv, capacity, D] (one layer), owned by the caller."""
        c = self.config
        shape = (1, batch, c.num_kv_heads, capacity, c.head_dim)
        dtype = dtype or self.fc.weight.dtype
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def fuse_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B,T,A*Ht] -> the step-0 input state [B,T,H]."""
        if self.fc_norm is not None:
            chunks = aux.split(self.config.target_hidden_size, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def step(self, input_ids, hidden, positions, past_k, past_v, mask, key_positions, prefix_kv=None,
             cache_lens=None, rope=None):
        """The drafter step every path runs (forward, the unrolled graph, the reference's parallel
        drafts): embed the tokens, RoPE at `positions`, the decoder layer over the cache, final norm.
        input_ids, positions [B,T]; hidden [B,T,H]; past_k, past_v [B,Hkv,S,D]; mask broadcast to
        [B,Hq,T,S(+prefix)+T], which keys are valid; key_positions [B or 1, S(+prefix)+T], the position
        of each of those keys (a sliding-window drafter also hides keys behind its window);
        prefix_kv: extra keys/values after the cache; cache_lens [B]: each sequence's cached slots,
        None where the cache has no such meaning (see Attention); rope: (cos, sin) [B,1,T,D] at `positions`,
        where a caller stepping several times computes them once (key_positions may then be None unless
        the drafter has a sliding window)
        -> (normed state [B,T,H], lm_head's input; feedback state [B,T,H]; new_k, new_v [B,Hkv,T,D],
        after the prefix's where one is given: [B,Hkv,E+T,D])."""
        if self.config.sliding_window is not None:
            mask = mask & in_window(positions, key_positions, self.config.sliding_window)[:, None, None]
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.inv_freq, hidden.dtype)
        h, new_k, new_v = self.midlayer(embeds, hidden, cos, sin, past_k, past_v, mask, prefix_kv, cache_lens)
        normed = self.norm(h)
        # The feedback rule: EAGLE-3 feeds back the pre-norm state, EAGLE-3.1 (norm_output) the normed one.
        return normed, (normed if self.config.norm_output else h), new_k, new_v

    def forward(self, input_ids, hidden, positions, k_cache, v_cache, cache_lens):
        """One drafter step over T tokens.
        input_ids, positions [B,T]; hidden [B,T,H] (fuse_aux(aux) at step 0, else the feedback);
        k_cache, v_cache [1,B,Hkv,S,D]; cache_lens [B]
        -> (draft logits [B,T,Vd], feedback hidden [B,T,H], new_k, new_v [1,B,Hkv,T,D])."""
        if self.embed_tokens is None:
            raise RuntimeError("the drafter has no embedding table: call share_embeddings(target.embed_tokens)")
        mask = attention_mask(positions, cache_lens, k_cache.shape[3])
        normed, feedback, new_k, new_v = self.step(input_ids, hidden, positions, k_cache[0], v_cache[0], mask,
                                                   key_positions(k_cache.shape[3], positions), cache_lens=cache_lens)
        return self.lm_head(normed), feedback, new_k.unsqueeze(0), new_v.unsqueeze(0)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.draft_to_target is not None:
            return self.draft_to_target[draft_ids]
        return draft_ids + self.d2t[draft_ids]
