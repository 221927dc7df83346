"""Train the sample EAGLE-3 and EAGLE-3.1 drafters for SmolLM2-135M-Instruct on a CPU.

  python eagle_export/samples/train_drafter.py prepare --out /tmp/eagle-tf --tokens 2000000          # teacher-forced
  python eagle_export/samples/train_drafter.py prepare --out /tmp/eagle-eval --self-distill --conversations 1900:2000
  python eagle_export/samples/train_drafter.py train --data /tmp/eagle-tf --eval-data /tmp/eagle-eval --version 3.1 \\
      --ckpt /tmp/ckpt-3.1 --out eagle_export/samples/eagle3.1-smollm2-135m --max-minutes 90    # again with --resume

`prepare` (drafter_data.py) caches the target's states over chat text: aux states, greedy next
token, top-k next-token log-probs and the answer mask. `train` runs training-time test: the
drafter's chain of `--depth` steps over every position of a batch of sequences at once, each step
consuming its own previous hidden state as at inference (the same computation as
`reference.parallel_drafts`, with cheaper attention). The loss is taken only where the step's
label is an answer token; `--objective kd` is the cross-entropy to the target's top-k distribution
restricted to the draft vocabulary (renormalized), `hard` the cross-entropy to the target's greedy
token; each step is weighted 0.8^k. `--init layer` starts from the target's weights where shapes
allow, `--init-from DIR` from a saved drafter (to continue the committed samples). The held-out
metrics (`evaluate`) count answer positions only: acc@1 per step, the chain estimate and, on
self-distilled text, the greedy loop's tau replayed from the chains; `--best-out` keeps the drafter
of the evaluation with the highest replayed tau (the selection; loss keeps falling past it).
`train` checkpoints (weights, optimizer, data position, RNG) to `--ckpt` every `--save-minutes`
and before its `--max-minutes` guard stops it; `--resume` continues from there.
Everything is seeded: the same data, arguments and seed give the same drafter.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

if __package__:  # eagle_export.samples.train_drafter, as `eagle-export train-drafter` imports it
    from .drafter_data import Dataset, prepare_self_distilled, prepare_teacher_forced, read_meta, text_token_counts
else:  # the script, or its directory on sys.path
    from drafter_data import Dataset, prepare_self_distilled, prepare_teacher_forced, read_meta, text_token_counts

from eagle_export.data.prompts import ChatTemplate
from eagle_export.data.sample import sample_target_dir
from eagle_export.models.checkpoint import load_drafter, load_target, save_drafter
from eagle_export.models.config import DrafterConfig
from eagle_export.models.drafter import Drafter
from eagle_export.models.layers import apply_rope, rope_cos_sin

AUX_LAYER_IDS = (2, 15, 27)  # vLLM numbering: the residual stream entering these layers
STEP_WEIGHT_DECAY = 0.8


def drafter_config(target_cfg, version: str, draft_vocab_size: int, aux_layer_ids=AUX_LAYER_IDS) -> dict:
    """config.json in the layout vLLM loads (LlamaForCausalLMEagle3); the layer shaped like the target's
    (576 wide, 9 heads / 3 KV heads, intermediate 1536 for the sample), so it can start from its weights."""
    t = target_cfg
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim, "num_hidden_layers": 1,
        "vocab_size": target_cfg.vocab_size, "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target_cfg.hidden_size, "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope.theta, "max_position_embeddings": target_cfg.max_position_embeddings,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }
    if version == "3.1":
        cfg.update(fc_norm=True, norm_output=True)
    return cfg


def prepare(args) -> None:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    target_dir = Path(args.target) if args.target else sample_target_dir()
    target = load_target(target_dir, aux_layer_ids=tuple(args.aux_layer_ids)).eval()
    template = ChatTemplate(target_dir)
    settings = {"target": str(target_dir), "aux_layer_ids": list(args.aux_layer_ids), "topk": args.topk,
                "seed": args.seed}
    if args.self_distill:
        settings.update(source="self-distilled", conversations=args.conversations, max_new_tokens=args.max_new_tokens,
                        max_prompt_tokens=args.max_prompt_tokens, batch=args.batch)
        prepare_self_distilled(args, target, template, out, settings)
    else:
        settings.update(source="teacher-forced", max_len=args.max_len, min_answer=args.min_answer, chunk=args.chunk)
        prepare_teacher_forced(args, target, template, out, settings)


def ttt_logits(drafter: Drafter, next_ids: torch.Tensor, aux: torch.Tensor, depth: int,
               scored: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`reference.parallel_drafts` (first_chain 0) for training: the same chains, but step k scores
    its k own keys one by one instead of through a [T, (k+1)T] mask, and step 0 uses the causal
    scaled_dot_product_attention kernel. -> logits [B,T,Vd] of each step; step k at p predicts t_{p+k+2}.
    With `scored` [depth,B,T], step k's logits only where scored[k] ([N_k,Vd]): lm_head is half the
    drafter's work and padding and prompt positions need none."""
    layer, attn = drafter.midlayer, drafter.midlayer.self_attn
    b, t = aux.shape[:2]
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = heads // kv_heads
    hidden = drafter.fuse_aux(aux)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    own_k, own_v, out = [], [], []
    for k in range(depth):
        embeds = drafter.embed_tokens(next_ids[:, k:t + k]).to(hidden.dtype)
        cos, sin = rope_cos_sin(torch.arange(k, t + k)[None], drafter.inv_freq, hidden.dtype)
        normed_hidden = layer.hidden_norm(hidden)
        residual = normed_hidden if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed_hidden], dim=-1)
        q = apply_rope(attn.q_proj(x).view(b, t, heads, d).transpose(1, 2), cos, sin)
        new_k = apply_rope(attn.k_proj(x).view(b, t, kv_heads, d).transpose(1, 2), cos, sin)
        new_v = attn.v_proj(x).view(b, t, kv_heads, d).transpose(1, 2)
        if k == 0:
            keys, values = new_k, new_v
            o = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            own_k.append(new_k)
            own_v.append(new_v)
            qg = q.reshape(b, kv_heads, group, t, d)
            scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).masked_fill(~causal, float("-inf"))
            diag = torch.stack([(qg * ok.unsqueeze(2)).sum(-1) for ok in own_k], dim=-1)  # [B,Hkv,G,T,k]
            probs = torch.softmax(torch.cat([scores, diag], dim=-1) / math.sqrt(d), dim=-1)
            o = torch.matmul(probs[..., :t], values.unsqueeze(2))
            for j, ov in enumerate(own_v):
                o = o + probs[..., t + j, None] * ov.unsqueeze(2)
            o = o.reshape(b, heads, t, d)
        h = residual + attn.o_proj(o.transpose(1, 2).reshape(b, t, heads * d))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = drafter.norm(h)
        out.append(drafter.lm_head(normed if scored is None else normed[scored[k]]))
        hidden = normed if drafter.config.norm_output else h
    return out


def make_batch(data: Dataset, indices: list[int], depth: int, target_to_draft: torch.Tensor, topk: int):
    """Right-padded tensors of the sequences `indices`, with each step's labels.

    Step k at position p consumes token p+k+1 and is scored where token p+k+2 is an answer token:
    labels [depth,B,T] (draft id of the target's greedy token, -1 where unscored or outside the draft
    vocabulary), scored [depth,B,T], and the target's top-k distribution over draft ids
    (ids [depth,B,T,k] with -1 for tokens outside the draft vocabulary, probs renormalized over the rest)."""
    seqs = [data.sequence(i) for i in indices]
    b, t = len(seqs), max(len(s["tokens"]) for s in seqs)
    tokens = torch.zeros(b, t + depth, dtype=torch.int64)
    aux = torch.zeros(b, t, seqs[0]["aux"].shape[1])
    greedy = torch.full((b, t + depth), -1, dtype=torch.int64)
    answer = torch.zeros(b, t + depth, dtype=torch.bool)
    top_ids = torch.zeros(b, t + depth, topk, dtype=torch.int64)
    top_logp = torch.full((b, t + depth, topk), -float("inf"))
    for i, s in enumerate(seqs):
        n = len(s["tokens"])
        tokens[i, :n] = torch.from_numpy(s["tokens"].astype(np.int64))
        aux[i, :n] = torch.from_numpy(s["aux"].astype(np.float32))
        greedy[i, :n] = torch.from_numpy(s["greedy"].astype(np.int64))
        answer[i, :n] = torch.from_numpy(np.array(s["answer"]))
        top_ids[i, :n] = torch.from_numpy(s["topk_ids"][:, :topk].astype(np.int64))
        top_logp[i, :n] = torch.from_numpy(s["topk_logp"][:, :topk].astype(np.float32))
    next_ids = tokens[:, 1:]
    steps = [slice(k + 1, k + 1 + t) for k in range(depth)]  # label index of step k at p: p+k+1
    scored = torch.stack([answer[:, s] & (greedy[:, s] >= 0) for s in steps])
    labels = torch.stack([target_to_draft[greedy[:, s].clamp(min=0)] for s in steps])
    labels[~scored] = -1
    draft_top = torch.stack([target_to_draft[top_ids[:, s]] for s in steps])
    logp = torch.stack([top_logp[:, s] for s in steps]).masked_fill(draft_top < 0, -float("inf"))
    probs = torch.softmax(logp, dim=-1).nan_to_num(0.0)  # a position whose top-k misses the draft vocabulary: 0
    return next_ids, aux, scored, labels, draft_top.clamp(min=0), probs


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1/2 sum_i |p_i - q_i| = 1 - sum_i min(p_i, q_i) (the rejection rate of sampled
    verification), for p [N,k] given on k draft ids (0 elsewhere) and q [N,k] the drafter's
    probabilities of those ids: outside them |p - q| sums to the drafter's remaining mass 1 - sum q.
    A padding entry (p = 0, possibly repeating an id) adds |0 - q| - q = 0, so it needs no mask."""
    return 0.5 * ((p - q).abs().sum(-1) + 1 - q.sum(-1))


def step_losses(logits, scored, labels, draft_top, probs, objective: str, tv_weight: float = 1.0):
    """Per-step mean loss over scored positions (logits of those only, see ttt_logits), and whether
    each one's argmax is the target's greedy token. kd: -sum p log q (the KL to the target's top-k
    distribution p, up to p's entropy); kd-tv: that plus tv_weight * TV(p, q), a term on the
    acceptance itself (LK-style); hard: -log q(greedy)."""
    losses, hits = [], []
    for k, lg in enumerate(logits):
        mask = scored[k]
        logp = torch.log_softmax(lg, dim=-1)
        if objective in ("kd", "kd-tv"):
            p, logq = probs[k][mask], logp.gather(-1, draft_top[k][mask])
            loss = -(p * logq).sum(-1).mean()
            if objective == "kd-tv":
                loss = loss + tv_weight * total_variation(p, logq.exp()).mean()
        else:
            loss = F.nll_loss(logp, labels[k][mask], ignore_index=-1)
        losses.append(loss)
        hits.append((lg.argmax(-1) == labels[k][mask]).detach())
    return losses, hits


@torch.no_grad()
def evaluate(drafter, data: Dataset, target_to_draft, depth: int, topk: int) -> dict:
    """Held-out metrics over answer positions: acc@1 of each step, the chain estimate (1 + the mean
    number of leading correct steps over positions) and, on self-distilled text (where the fed tokens
    are the target's greedy tokens), the greedy loop's own tau at `depth` replayed from the chains."""
    drafter.eval()
    hits, scored_count, chains, accepted = np.zeros(depth), 0, [], []
    for i in range(len(data)):
        next_ids, aux, scored, labels, _, _ = make_batch(data, [i], depth, target_to_draft, topk)
        logits = ttt_logits(drafter, next_ids, aux, depth)
        correct = torch.stack([lg[0].argmax(-1) == labels[k][0] for k, lg in enumerate(logits)])  # [K,T]
        step0 = scored[0][0]
        # Chains starting at answer positions whose every step is scored.
        full = scored.all(0)[0]
        hits += correct[:, full].sum(1).numpy()
        scored_count += int(full.sum())
        leading = correct.long().cumprod(0).sum(0)  # leading correct steps at each position
        chains += leading[full].tolist()
        # Replay: the loop's first chain consumes the first answer token (the prefill's), so it sits one
        # past the first scored position; each round advances by m + 1.
        positions = torch.nonzero(step0).flatten().tolist()
        p, last = (positions[0] + 1, positions[-1]) if positions else (1, 0)
        while p <= last and bool(full[p]):
            accepted.append(int(leading[p]))
            p += accepted[-1] + 1
    drafter.train()
    return {"acc": (hits / max(scored_count, 1)).round(4).tolist(), "positions": scored_count,
            "chain_tau": round(1 + float(np.mean(chains)), 4) if chains else None,
            "replay_tau": round(1 + float(np.mean(accepted)), 4) if accepted else None, "rounds": len(accepted)}


def draft_vocabulary(data: Dataset, cache_dir: Path, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens, as sorted target ids: ShareGPT's assistant text and the
    target's greedy tokens in `data` (ties: lowest id). The text counts are cached in cache_dir."""
    cache = cache_dir / "text_counts.npy"
    if not cache.is_file():
        np.save(cache, text_token_counts(ChatTemplate(data.metas[0]["target"]), vocab_size))
    counts = data.answer_counts(vocab_size) + np.load(cache)
    return torch.from_numpy(np.sort(np.lexsort((np.arange(vocab_size), -counts))[:size]))


def coverage(args) -> None:
    """Per draft vocabulary size: the fraction of held-out answer positions whose target greedy token
    lies in the vocabulary `train` picks from --data (the ceiling of acc@1 at that size)."""
    data, held_out = Dataset(args.data), Dataset([args.eval_data])
    vocab_size = json.loads((Path(data.metas[0]["target"]) / "config.json").read_text())["vocab_size"]
    greedy = held_out.answer_tokens()
    for size in args.sizes:
        inside = np.isin(greedy, draft_vocabulary(data, Path(args.data[0]), vocab_size, size).numpy())
        print(json.dumps({"draft_vocab": size, "coverage": round(float(inside.mean()), 4), "positions": len(greedy)}))


def init_from_target(drafter: Drafter, target, draft_vocab: torch.Tensor, parts: str) -> None:
    """Copy target weights into the drafter where the shapes allow.

    head: lm_head rows of the draft vocabulary and the final norm (the drafter's output space is the
    target's). layer (also): the drafter layer from the target's last layer, its q/k/v weights in
    the hidden-state half of the 2H-wide input and zero in the token half (the layer starts as the
    target's own, reading the hidden state alone; the token half still learns, as the embeddings it
    multiplies are not zero), and fc as the projection that passes the last aux state (the deepest)
    through unchanged."""
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.lm_head.weight[draft_vocab])
        drafter.norm.weight.copy_(target.norm.weight)
        if parts != "layer":
            return
        last, mid, h = target.layers[-1], drafter.midlayer, target.config.hidden_size
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(mid.self_attn, name).weight[:, :h].zero_()
            getattr(mid.self_attn, name).weight[:, h:].copy_(getattr(last.self_attn, name).weight)
        mid.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        mid.hidden_norm.weight.copy_(last.input_layernorm.weight)
        mid.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mid.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -h:].copy_(torch.eye(h))


class Batches:
    """Seeded batches of about `tokens` padded tokens: an epoch is a permutation of the sequences, taken
    in windows of 64 batches sorted by length (less padding), the windows' batches shuffled."""

    def __init__(self, data: Dataset, tokens: int, seed: int, epoch: int = 0, position: int = 0,
                 queue: list[list[int]] | None = None, queue_end: int = 0):
        self.data, self.tokens, self.seed = data, tokens, seed
        self.epoch, self.position = epoch, position
        self.queue, self.queue_end = queue or [], queue_end

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "queue": self.queue, "queue_end": self.queue_end}

    def _fill(self) -> None:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.data))
        if self.position >= len(order):
            self.epoch, self.position = self.epoch + 1, 0
            return self._fill()
        mean = np.mean([self.data.length(i) for i in order[:256]])
        window = order[self.position:self.position + max(1, int(64 * self.tokens / mean))].tolist()
        window.sort(key=self.data.length)
        batches, current = [], []
        for i in window:
            if current and self.data.length(i) * (len(current) + 1) > self.tokens:
                batches.append(current)
                current = []
            current.append(i)
        batches.append(current)
        rng = np.random.default_rng([self.seed, self.epoch, self.position])
        self.queue = [batches[j] for j in rng.permutation(len(batches))]
        self.queue_end = self.position + len(window)

    def next(self) -> list[int]:
        """The next batch; `position` moves past a window once its last batch is handed out."""
        if not self.queue:
            self._fill()
        batch = self.queue.pop()
        if not self.queue:
            self.position = self.queue_end
        return batch


@torch.enable_grad()  # whatever the caller set (test modules turn gradients off at import)
def train(args) -> None:
    torch.set_num_threads(args.threads)
    ckpt = Path(args.ckpt)
    state = torch.load(ckpt / "state.pt", weights_only=False) if args.resume else None
    if state is not None:  # the run's own arguments, except those that only say how long to run
        for key, value in state["args"].items():
            if key not in ("resume", "tokens", "schedule_tokens", "depth", "shards", "max_minutes", "save_minutes",
                           "threads", "eval_every", "log", "out", "best_out", "run"):
                setattr(args, key, value)
        args.shards = args.shards or state["args"]["shards"]
    torch.manual_seed(args.seed)
    if not args.shards:  # pin the data a run (and its --resume) reads, while prepare may still be adding shards
        args.shards = max(len(m["shards"]) for m in (read_meta(Path(d)) or {"shards": [0]} for d in args.data))
    data = Dataset(args.data, args.shards)
    eval_data = Dataset([args.eval_data]) if args.eval_data else None
    target = load_target(data.metas[0]["target"], aux_layer_ids=tuple(data.metas[0]["aux_layer_ids"]))
    vocab = target.config.vocab_size
    warm = load_drafter(args.init_from, target=target, dtype=torch.float32) if args.init_from and not state else None
    if warm is not None and bool(warm.config.fc_norm) != (args.version == "3.1"):
        raise SystemExit(f"error: --init-from {args.init_from} is not an EAGLE-{args.version} drafter\n"
                         f"fix: pass --version {'3.1' if warm.config.fc_norm else '3'}")
    if state is not None:
        draft_vocab = state["draft_vocab"]
    elif warm is not None:  # a saved drafter goes on with its own draft vocabulary
        draft_vocab = warm.to_target_ids(torch.arange(warm.config.draft_vocab_size))
    else:
        draft_vocab = draft_vocabulary(data, Path(args.data[0]), vocab, args.draft_vocab)
    cfg_dict = (dict(warm.config.raw) if warm is not None else
                drafter_config(target.config, args.version, len(draft_vocab), data.metas[0]["aux_layer_ids"]))
    drafter = Drafter(DrafterConfig.from_hf(cfg_dict))
    with torch.no_grad():
        drafter.d2t.copy_(draft_vocab - torch.arange(len(draft_vocab)))
        drafter.t2d.zero_()
        drafter.t2d[draft_vocab] = True
    if warm is not None:
        drafter.load_state_dict({k: v for k, v in warm.state_dict().items() if not k.startswith("embed_tokens")},
                                strict=False)
        del warm
    elif args.init != "random" and state is None:
        init_from_target(drafter, target, draft_vocab, args.init)
    drafter.share_embeddings(target.embed_tokens)
    target.embed_tokens.weight.requires_grad_(False)
    del target.layers  # only the embedding table is needed from here on
    target_to_draft = torch.full((vocab,), -1, dtype=torch.int64)
    target_to_draft[draft_vocab] = torch.arange(len(draft_vocab))

    if args.freeze_head:  # the target's own output rows, kept: the drafter learns to land in its hidden space
        drafter.lm_head.weight.requires_grad_(False)
    params = [p for name, p in drafter.named_parameters() if not name.startswith("embed_tokens") and p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    batches = Batches(data, args.batch_tokens, args.seed)
    step, seen, scored_seen, spent, best_tau = 0, 0, 0, 0.0, None
    if state is not None:
        drafter.load_state_dict(state["drafter"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        batches = Batches(data, args.batch_tokens, args.seed, **state["batches"])
        step, seen, scored_seen, spent = state["step"], state["tokens"], state["scored_tokens"], state["seconds"]
        best_tau = state.get("best_replay_tau")
        torch.set_rng_state(state["torch_rng"])
        print(f"train {args.version}: resumed at step {step}, {seen} tokens, {spent / 60:.1f} min spent", flush=True)
    weights = [STEP_WEIGHT_DECAY ** k for k in range(args.depth)]
    log = open(args.log, "a") if args.log else None
    start, last_save, stop = time.time(), time.time(), []
    signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))

    def save_state():
        ckpt.mkdir(parents=True, exist_ok=True)
        own = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens")}
        torch.save({"drafter": own, "optimizer": optimizer.state_dict(), "batches": batches.state(), "step": step,
                    "tokens": seen, "scored_tokens": scored_seen, "seconds": spent + time.time() - start,
                    "torch_rng": torch.get_rng_state(), "draft_vocab": draft_vocab, "args": vars(args),
                    "best_replay_tau": best_tau},
                   ckpt / "state.pt.partial")
        os.replace(ckpt / "state.pt.partial", ckpt / "state.pt")

    def report():
        nonlocal best_tau
        record = {"version": args.version, "step": step, "train_tokens": seen, "scored_tokens": scored_seen,
                  "minutes": round((spent + time.time() - start) / 60, 2), "run": args.run or args.version}
        if eval_data is not None:
            record.update(evaluate(drafter, eval_data, target_to_draft, args.eval_depth, args.topk))
        tau = record.get("replay_tau")
        if args.best_out and tau is not None and (best_tau is None or tau > best_tau):  # selected by tau, not loss
            best_tau = record["best"] = tau
            save_rounded(drafter, args.best_out, cfg_dict)
        print(json.dumps(record), flush=True)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()

    if state is None:
        report()
    while seen < args.tokens and not stop:
        step += 1
        indices = batches.next()
        progress = min(1.0, seen / args.schedule_tokens)
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        next_ids, aux, scored, labels, draft_top, probs = make_batch(data, indices, args.depth, target_to_draft,
                                                                     args.topk)
        logits = ttt_logits(drafter, next_ids, aux, args.depth, scored)
        losses, hits = step_losses(logits, scored, labels, draft_top, probs, args.objective, args.tv_weight)
        loss = sum(w * step_loss for w, step_loss in zip(weights, losses)) / sum(weights)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        seen += sum(data.length(i) for i in indices)
        scored_seen += int(scored[0].sum())
        if step % 10 == 0:
            acc = " ".join(f"{h.float().mean().item():.3f}" for h in hits)
            print(f"train {args.version}: step {step} tokens {seen} loss {loss.item():.3f} acc {acc} lr {lr:.2e} "
                  f"{seen / (spent + time.time() - start):.0f} tok/s", flush=True)
        if step % args.eval_every == 0:
            report()
        elapsed = time.time() - start
        if args.max_minutes and elapsed > 60 * args.max_minutes:
            stop.append(f"the {args.max_minutes} min guard")
        if stop or elapsed - (last_save - start) > 60 * args.save_minutes:
            save_state()
            last_save = time.time()
    print(f"train {args.version}: stopping at step {step}, {seen} tokens"
          + (f" ({stop[0]})" if stop else ""), flush=True)
    save_state()
    if step % args.eval_every:
        report()
    if args.out:
        save_rounded(drafter, args.out, cfg_dict)
        print(f"train {args.version}: saved {args.out}", flush=True)


def save_rounded(drafter: Drafter, path, config: dict) -> None:
    """A bf16 copy of the drafter, saved in the vLLM layout; training goes on in fp32."""
    save_drafter(copy.deepcopy(drafter).to(torch.bfloat16), path, config=config)


def plot(args) -> None:
    """Held-out curves of the logged runs: loop tau (replayed) and step-0 acc@1 against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict]] = {}
    for log in args.logs:
        for line in Path(log).read_text().splitlines():
            record = json.loads(line)
            if record.get("replay_tau") is not None and (not args.runs or record["run"] in args.runs):
                runs.setdefault(record["run"], []).append(record)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for run, records in runs.items():
        records.sort(key=lambda r: r["train_tokens"])
        tokens = [r["train_tokens"] / 1e3 for r in records]
        left.plot(tokens, [r["replay_tau"] for r in records], marker=".", label=run)
        right.plot(tokens, [r["acc"][0] for r in records], marker=".", label=run)
    left.set(xlabel="training tokens (thousands)", ylabel=f"tau at K={args.depth}, held-out (replayed loop)",
             title=args.title)
    right.set(xlabel="training tokens (thousands)", ylabel="depth-1 acc@1, held-out answers", title=args.title)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out}")


TRAIN_SUMMARY = "train_summary.json"


def is_trained_drafter(path: Path) -> bool:
    """A drafter `eagle-export train-drafter` wrote (what its --force may replace)."""
    return (path / TRAIN_SUMMARY).is_file() and (path / "config.json").is_file()


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The target's default capture (2, L//2, L-3), each id moved into the layers a shallow target has
    (0..L-1) and duplicates dropped: a 2-layer target's is (0, 1)."""
    ids = (2, num_layers // 2, num_layers - 3)
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in ids}))


def train_for_target(target_dir, out, minutes: float = 4.0, tokens: int | None = None, version: str = "3",
                     force: bool = False, echo=print) -> dict:
    """`eagle-export train-drafter`: a drafter for any supported target in about `minutes`, through
    this script's own `prepare` and `train` (one path): teacher-forced ShareGPT data (a quarter of the
    budget at most, checked every 16 conversations), held-out data the target answers itself (8
    ShareGPT first turns from conversation 1900 on, which training never reads; a tenth of the budget
    at most), then training for what is left (or for `tokens` training tokens, whichever ends first),
    starting from the target's last layer. The draft vocabulary is the tokens the target answers with
    most often in the prepared data. The drafter's quality is measured on the held-out answers before
    and after training: acc@1 (step 0) and the greedy loop's tau replayed at depth 4; the drafter
    written is the one of the higher tau (`--best-out`: a budget of a few steps can leave the initial
    drafter the better one). Written atomically with its summary (train_summary.json); the data and
    checkpoints live in the temporary directory and go with it."""
    import shutil

    from eagle_export.models.config import read_config_json
    from eagle_export.output_dir import atomic_output_dir

    target_dir, start = Path(target_dir), time.time()
    layers = int(read_config_json(target_dir).get("num_hidden_layers", 0))
    aux = [str(i) for i in default_aux_layer_ids(layers)]
    vocab = int(read_config_json(target_dir).get("vocab_size", 8192))
    kind = ("a drafter written by eagle-export train-drafter", is_trained_drafter)
    with atomic_output_dir(out, kind, force, inputs=(target_dir,), warn=echo) as tmp:
        work = tmp / "work"
        data, held_out, ckpt, log = work / "data", work / "held-out", work / "ckpt", work / "log.jsonl"
        echo(f"train-drafter: preparing teacher-forced data from {target_dir} (aux layers {', '.join(aux)})")
        main(["prepare", "--target", str(target_dir), "--out", str(data), "--aux-layer-ids", *aux, "--chunk", "16",
              "--max-minutes", f"{minutes / 4:.3f}", "--tokens", "400000", "--threads", str(torch.get_num_threads())])
        # The draft vocabulary: the tokens this target answers with most often in the data (no ShareGPT
        # text counts: a target's own answers are what its drafter must produce, and counting 20M
        # tokens of text would take minutes of the budget).
        np.save(data / "text_counts.npy", np.zeros(vocab, dtype=np.int64))
        echo("train-drafter: held-out data: the target answers ShareGPT prompts training never reads")
        main(["prepare", "--self-distill", "--target", str(target_dir), "--out", str(held_out), "--aux-layer-ids", *aux,
              "--conversations", "1900:2000", "--max-prompts", "8", "--batch", "8", "--max-new-tokens", "64",
              "--max-minutes", f"{minutes / 10:.3f}", "--threads", str(torch.get_num_threads())])
        left = max(minutes - (time.time() - start) / 60, 0.2)
        echo(f"train-drafter: training EAGLE-{version} for {left:.1f} min"
             + (f" or {tokens} tokens" if tokens else ""))
        main(["train", "--data", str(data), "--eval-data", str(held_out), "--version", version, "--ckpt", str(ckpt),
              "--best-out", str(tmp), "--log", str(log), "--max-minutes", f"{left:.3f}", "--eval-every", "1000000000",
              "--tokens", str(tokens or 10**12), "--draft-vocab", str(min(8192, vocab)),
              "--batch-tokens", "4096", "--threads", str(torch.get_num_threads())])
        records = [json.loads(line) for line in log.read_text().splitlines()]
        kept = [r for r in records if "best" in r]  # the drafter --best-out kept
        if not kept:
            from eagle_export.errors import EagleExportError

            raise EagleExportError(f"the target answered no held-out prompt within {minutes} min, so the drafter "
                                   "could not be measured (nothing was written)", "raise --minutes")
        final = kept[-1]
        summary = {"target": str(target_dir.resolve()), "version": version, "aux_layer_ids": [int(i) for i in aux],
                   "train_tokens": final["train_tokens"], "steps": final["step"],
                   "minutes": round((time.time() - start) / 60, 2), "held_out_positions": final["positions"],
                   "acc@1": final["acc"][0], "acc_by_step": final["acc"], "replay_tau": final["replay_tau"]}
        shutil.rmtree(work)
        (tmp / TRAIN_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    echo(f"train-drafter: wrote {out} in {summary['minutes']:.1f} min (the drafter after {summary['train_tokens']} "
         "training tokens, the better of before and after training); "
         f"held-out acc@1 {summary['acc@1']:.3f} (step 0, {summary['held_out_positions']} answer positions), "
         f"tau {summary['replay_tau']} at depth 4 (the greedy loop replayed)"
         + ("; below 0.05: `build` refuses it unless --skip-conformance (train longer: --minutes)"
            if summary["acc@1"] < 0.05 else ""))
    return summary


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="run the target over chat text and cache its states (resumable)")
    p.add_argument("--out", required=True)
    p.add_argument("--target", help="target checkpoint directory (default: the sample target)")
    p.add_argument("--tokens", type=int, default=1_000_000, help="stop once the dataset holds this many tokens")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop after the chunk that passes this")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=list(AUX_LAYER_IDS))
    p.add_argument("--topk", type=int, default=32, help="next-token log-probs kept per position")
    p.add_argument("--seed", type=int, default=0, help="order in which conversations are read")
    p.add_argument("--shard-tokens", type=int, default=65536)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-len", type=int, default=768, help="conversation tokens kept (teacher-forced)")
    p.add_argument("--min-answer", type=int, default=32, help="fewest answer tokens a sequence needs (teacher-forced)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per prefill (teacher-forced)")
    p.add_argument("--chunk", type=int, default=64, help="conversations sorted into batches together (teacher-forced)")
    p.add_argument("--self-distill", action="store_true",
                   help="answer ShareGPT first turns with the target's own greedy responses")
    p.add_argument("--conversations", default="0:1900",
                   help="ShareGPT conversations whose first turns are asked (--self-distill)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (--self-distill)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="longest prompt kept (--self-distill)")
    p.add_argument("--batch", type=int, default=32, help="prompts generated together (--self-distill)")
    p.add_argument("--max-prompts", type=int, default=100000, help="prompts answered at most (--self-distill)")
    t = sub.add_parser("train", help="train one drafter on prepared data (resumable)")
    t.add_argument("--data", nargs="+", required=True, help="prepared dataset directories")
    t.add_argument("--shards", type=int, default=0,
                   help="read the first N shards of each --data directory (default: those present at the start; "
                        "a larger N on --resume adds data)")
    t.add_argument("--eval-data", help="held-out self-distilled dataset for the curve")
    t.add_argument("--version", choices=("3", "3.1"), required=True)
    t.add_argument("--ckpt", required=True, help="resumable checkpoint directory")
    t.add_argument("--resume", action="store_true", help="continue the run in --ckpt with its own arguments")
    t.add_argument("--out", help="write the drafter (bf16, vLLM layout) here when the run stops")
    t.add_argument("--run", help="a name for this run in the log")
    t.add_argument("--best-out", help="write the drafter (bf16) here at each held-out evaluation whose replayed "
                   "tau beats every earlier one (needs --eval-data of self-distilled text)")
    t.add_argument("--objective", choices=("kd", "kd-tv", "hard"), default="kd",
                   help="kd: cross-entropy to the target's top-k distribution; kd-tv: plus --tv-weight times the "
                   "total variation to it (1 - the acceptance of sampled drafts); hard: to its greedy token")
    t.add_argument("--tv-weight", type=float, default=1.0, help="weight of the total-variation term (kd-tv)")
    t.add_argument("--init", choices=("random", "head", "layer"), default="layer",
                   help="weights copied from the target: none, lm_head and norm, or those and the last layer")
    t.add_argument("--init-from", help="start from this saved drafter: its weights and draft vocabulary "
                   "(instead of --init and --draft-vocab)")
    t.add_argument("--freeze-head", action="store_true", help="keep lm_head at its initial value (with --init head/layer)")
    t.add_argument("--tokens", type=int, default=10_000_000, help="stop after this many training tokens")
    t.add_argument("--schedule-tokens", type=int, default=6_000_000, help="cosine learning-rate schedule length")
    t.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per step")
    t.add_argument("--draft-vocab", type=int, default=8192)
    t.add_argument("--topk", type=int, default=32, help="top-k target log-probs used by --objective kd")
    t.add_argument("--depth", type=int, default=4, help="training-time-test steps (may change on --resume)")
    t.add_argument("--eval-depth", type=int, default=4, help="chain depth K of the held-out metrics")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    t.add_argument("--max-minutes", type=float, default=0.0, help="checkpoint and stop past this wall time")
    t.add_argument("--save-minutes", type=float, default=10.0, help="checkpoint this often")
    t.add_argument("--log", help="append the held-out curve (JSON lines) here")
    t.add_argument("--threads", type=int, default=1)
    c = sub.add_parser("coverage", help="held-out greedy tokens inside the draft vocabulary, per vocabulary size")
    c.add_argument("--data", nargs="+", required=True, help="prepared dataset directories (what train reads)")
    c.add_argument("--eval-data", required=True, help="held-out prepared dataset")
    c.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    g = sub.add_parser("plot", help="plot the held-out curves of logged runs (matplotlib PNG)")
    g.add_argument("logs", nargs="+", help="--log files of train runs")
    g.add_argument("--out", required=True)
    g.add_argument("--runs", nargs="*", help="only these run names")
    g.add_argument("--title", default="")
    g.add_argument("--depth", type=int, default=4)
    g.add_argument("--dpi", type=int, default=80)
    args = parser.parse_args(argv)
    {"prepare": prepare, "train": train, "coverage": coverage, "plot": plot}[args.command](args)


if __name__ == "__main__":
    main()
