"""The training data of the sample drafters: the target's states over chat text, cached in shards.

Two sources, one format:
- teacher-forced (`prepare`): the target reads ShareGPT conversations (rendered with its chat
  template, cut at --max-len tokens) in one batched prefill each;
- self-distilled (`prepare --self-distill`): the target answers ShareGPT first turns greedily,
  as a drafter meets text at inference.

Per token p of a sequence a shard stores: the token, the aux states entering the drafter's layers
(fp16), the target's greedy next token, its top-k next-token log-probabilities over the full
vocabulary (ids uint16, log-probs fp16), and `answer`: whether token p+1 is one the target
produces as an assistant (the loss mask: a drafter is only asked to continue answers). A dataset is a
directory of shards plus meta.json, whose `consumed` counter (conversations or prompts read, in a
seeded order) lets an interrupted `prepare` continue where it stopped and reproduce the same data.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eagle_export.data.prompts import ChatTemplate, sharegpt_conversations
from eagle_export.models.layers import apply_rope, rope_cos_sin

FIELDS = ("tokens", "aux", "greedy", "answer", "topk_ids", "topk_logp")
# ShareGPT conversations 1900..1999 give the held-out self-distilled prompts and 2000..2999 the
# long-context evaluation histories (eval_acceptance.py, prompts.long_context_messages uses ~150-250
# of them); teacher-forced training reads every other conversation.
HELD_OUT = range(1900, 3000)


@torch.no_grad()
def prefill(target, ids: torch.Tensor):
    """The target over right-padded sequences [B,T] from an empty cache: (final normed hidden [B,T,H],
    aux [B,T,A*H]). The same function as Target.forward with scaled_dot_product_attention's causal
    kernel (2.5x faster at T=1024 on CPU than the explicit masked scores); padding sits after each
    sequence, so causal attention keeps it out of every real position."""
    b, t = ids.shape
    x = target.embed_tokens(ids)
    cos, sin = rope_cos_sin(torch.arange(t)[None], target.inv_freq, x.dtype)
    aux = []
    for i, layer in enumerate(target.layers):
        if i in target.aux_layer_ids:
            aux.append(x)
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    if len(target.layers) in target.aux_layer_ids:
        aux.append(x)
    return target.norm(x), torch.cat(aux, dim=-1)


def logits_stats(logits: torch.Tensor, topk: int):
    """logits [N,V] -> greedy [N], top-k ids [N,k] and log-probs [N,k] over the full vocabulary."""
    logits = logits.float()
    logp, ids = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
    return logits.argmax(-1), ids, logp


@torch.no_grad()
def next_token_stats(target, hidden: torch.Tensor, topk: int, chunk: int = 1024):
    """hidden [N,H] (final normed) -> logits_stats of the target's next-token logits, in chunks."""
    parts = [logits_stats(target.lm_head(part), topk) for part in hidden.split(chunk)]
    return tuple(torch.cat(p) for p in zip(*parts))


def answer_mask(template: ChatTemplate, messages: list[dict], ids: list[int], eos_id: int) -> np.ndarray | None:
    """answer[p] = token p+1 is part of an assistant turn (its text and the EOS that ends it), for the
    rendered conversation `ids`; None if the template's rendering of a prefix is not a prefix of ids."""
    is_answer = np.zeros(len(ids) + 1, dtype=bool)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(template.encode_chat(messages[:i], add_generation_prompt=True))
        if start >= len(ids):
            break
        end = template.encode_chat(messages[:i + 1], add_generation_prompt=False)
        if end[:start] != ids[:start]:
            return None
        span = end[start:len(ids)]
        if eos_id in span:
            span = span[:span.index(eos_id) + 1]
        is_answer[start:start + len(span)] = True
    return is_answer[1:]


def to_fp16(aux: np.ndarray) -> np.ndarray:
    """Residual-stream outliers reach ~2.5e4 in this target; clip at fp16's range rather than store inf."""
    return np.clip(aux, -65504, 65504).astype(np.float16)


class ShardWriter:
    """Appends sequences to a dataset directory, one shard at a time, each written whole (a
    `.partial` directory renamed into place) before meta.json records it and the new `consumed`."""

    def __init__(self, out: Path, meta: dict, shard_tokens: int):
        self.out, self.meta, self.shard_tokens = out, meta, shard_tokens
        self.pending: list[dict] = []
        meta.setdefault("shards", [])
        meta.setdefault("consumed", 0)
        self.start, self.tokens_at_start = time.time(), self.tokens

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.meta["shards"]) + sum(len(p["tokens"]) for p in self.pending)

    def add(self, **fields) -> None:
        self.pending.append(fields)

    def chunk_done(self, consumed: int, of: int, unit: str, args) -> bool:
        """After a chunk of `consumed` of `of` inputs: write a full shard (or the last one once
        --tokens is reached) and report progress; True once the --max-minutes guard has passed."""
        self.maybe_flush(consumed, force=self.tokens >= args.tokens)
        elapsed = time.time() - self.start
        print(f"prepare: {consumed}/{of} {unit}, {self.tokens} tokens "
              f"({(self.tokens - self.tokens_at_start) / elapsed:.0f} tokens/s this run)", flush=True)
        return bool(args.max_minutes) and elapsed > 60 * args.max_minutes

    def close(self, consumed: int) -> None:
        self.maybe_flush(consumed, force=True)
        print(f"prepare: stopped with {self.tokens} tokens in {len(self.meta['shards'])} shards, "
              f"{self.meta['consumed']} inputs read", flush=True)

    def maybe_flush(self, consumed: int, force: bool = False) -> None:
        if self.pending and (force or sum(len(p["tokens"]) for p in self.pending) >= self.shard_tokens):
            self.flush(consumed)

    def flush(self, consumed: int) -> None:
        name = f"shard-{len(self.meta['shards']):05d}"
        partial = self.out / (name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        lengths = [len(p["tokens"]) for p in self.pending]
        np.save(partial / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        for field in FIELDS:
            np.save(partial / f"{field}.npy", np.concatenate([p[field] for p in self.pending]))
        os.replace(partial, self.out / name)
        self.meta["shards"].append({"name": name, "sequences": len(lengths), "tokens": int(sum(lengths))})
        self.meta["consumed"] = consumed
        write_meta(self.out, self.meta)
        self.pending = []


def write_meta(out: Path, meta: dict) -> None:
    tmp = out / "meta.json.partial"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / "meta.json")


def read_meta(out: Path) -> dict | None:
    path = out / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else None


def start_dataset(out: Path, settings: dict) -> dict:
    """meta.json of a new dataset, or of the one being continued (whose settings must match)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = read_meta(out)
    if meta is None:
        return dict(settings)
    differing = {k: (meta.get(k), v) for k, v in settings.items() if meta.get(k) != v}
    if differing:
        raise SystemExit(f"error: {out} was prepared with other settings {differing}; fix: use a new --out")
    return meta


def teacher_forced_order(seed: int) -> list[int]:
    """Conversation indices in the seeded order teacher-forced data reads them, held-out ones removed."""
    count = sum(1 for _ in sharegpt_conversations())
    order = np.random.default_rng(seed).permutation(count)
    return [int(i) for i in order if i not in HELD_OUT]


def prepare_teacher_forced(args, target, template: ChatTemplate, out: Path, settings: dict) -> None:
    meta = start_dataset(out, settings)
    writer = ShardWriter(out, meta, args.shard_tokens)
    conversations = list(sharegpt_conversations())
    order = teacher_forced_order(args.seed)
    eos_id = target.config.eos_token_id
    position = meta["consumed"]
    while position < len(order) and writer.tokens < args.tokens:
        # A chunk of conversations, sorted by length into padded batches of about --batch-tokens.
        chunk_end = min(position + args.chunk, len(order))
        sequences = []
        for index in order[position:chunk_end]:
            messages = conversations[index]
            ids = template.encode_chat(messages, add_generation_prompt=False)[:args.max_len]
            answer = answer_mask(template, messages, ids, eos_id)
            if answer is not None and answer.sum() >= args.min_answer:
                sequences.append((index, ids, answer))
        sequences.sort(key=lambda s: len(s[1]))
        batch: list = []
        for n, seq in enumerate(sequences):
            batch.append(seq)
            last = n + 1 == len(sequences)
            if last or len(sequences[n + 1][1]) * (len(batch) + 1) > args.batch_tokens:
                run_batch(target, batch, args.topk, writer)
                batch = []
        position = chunk_end
        if writer.chunk_done(position, len(order), "conversations", args):
            break
    writer.close(position)


def run_batch(target, batch, topk: int, writer: ShardWriter) -> None:
    width = max(len(s[1]) for s in batch)
    ids = torch.full((len(batch), width), target.config.eos_token_id, dtype=torch.int64)
    for b, (_, seq, _) in enumerate(batch):
        ids[b, :len(seq)] = torch.tensor(seq)
    hidden, aux = prefill(target, ids)
    for b, (index, seq, answer) in enumerate(batch):
        n = len(seq)
        greedy, top_ids, top_logp = next_token_stats(target, hidden[b, :n], topk)
        writer.add(tokens=np.array(seq, dtype=np.int32), aux=to_fp16(aux[b, :n].numpy()),
                   greedy=greedy.numpy().astype(np.int32), answer=answer,
                   topk_ids=top_ids.numpy().astype(np.uint16), topk_logp=top_logp.numpy().astype(np.float16))


class Dataset:
    """The sequences of one or more dataset directories, read through memmaps."""

    def __init__(self, dirs, max_shards: int = 0):
        """`max_shards`: only the first N shards of each directory (0: all)."""
        self.shards, self.index = [], []  # index: (shard number, sequence start, length)
        self.metas = []
        for d in dirs:
            meta = read_meta(Path(d))
            if meta is None:
                raise SystemExit(f"error: {d} holds no prepared data (meta.json); fix: run `prepare --out {d}` first")
            self.metas.append(meta)
            for shard in meta["shards"][:max_shards or None]:
                path = Path(d) / shard["name"]
                arrays = {f: np.load(path / f"{f}.npy", mmap_mode="r") for f in FIELDS}
                offsets = np.load(path / "offsets.npy")
                self.shards.append(arrays)
                n = len(self.shards) - 1
                self.index += [(n, int(a), int(b - a)) for a, b in zip(offsets[:-1], offsets[1:])]

    def __len__(self) -> int:
        return len(self.index)

    def length(self, i: int) -> int:
        return self.index[i][2]

    def sequence(self, i: int) -> dict:
        n, a, length = self.index[i]
        return {f: np.asarray(self.shards[n][f][a:a + length]) for f in FIELDS}

    def answer_tokens(self) -> np.ndarray:
        """The target's greedy token at every answer position (what a drafter is asked to propose)."""
        return np.concatenate([np.asarray(a["greedy"])[np.asarray(a["answer"])] for a in self.shards])

    def answer_counts(self, vocab_size: int) -> np.ndarray:
        """How often the target's greedy token is each id, over answer positions (the draft vocabulary's basis)."""
        return np.bincount(self.answer_tokens(), minlength=vocab_size).astype(np.int64)


@torch.no_grad()
def greedy_batch(target, prompts: list[list[int]], max_new_tokens: int, eos_id: int, topk: int = 0):
    """Greedy responses to a batch of prompts with every fed token's aux states and next-token stats.

    Returns, per prompt, (tokens, aux [T, A*H], greedy [T], topk_ids [T,k], topk_logp [T,k]): tokens are
    the prompt and the response without its last token (the last is never fed back), greedy[p] is the
    target's argmax after p (k = 0: empty top-k arrays)."""
    batch, capacity = len(prompts), max(len(p) for p in prompts) + max_new_tokens
    k_cache, v_cache = target.empty_cache(batch, capacity)
    tokens, auxes, stats = [list(p) for p in prompts], [], []

    def step_stats(logits):
        greedy, ids, logp = logits_stats(logits, max(topk, 1))
        return [greedy, ids[:, :topk], logp[:, :topk]]

    for b, prompt in enumerate(prompts):  # ragged prefill, one prompt at a time
        logits, aux, new_k, new_v = target(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                                           k_cache[:, b:b + 1, :, :0], v_cache[:, b:b + 1, :, :0], torch.tensor([0]))
        k_cache[:, b, :, :len(prompt)] = new_k[:, 0]
        v_cache[:, b, :, :len(prompt)] = new_v[:, 0]
        auxes.append([aux[0]])
        stats.append([step_stats(logits[0])])
    lengths = torch.tensor([len(p) for p in prompts])
    last = [int(s[0][0][-1]) for s in stats]
    done = [t == eos_id for t in last]
    for _ in range(max_new_tokens - 1):
        if all(done):
            break
        ids = torch.tensor([[t] for t in last])
        past = int(lengths.max())
        logits, aux, new_k, new_v = target(ids, lengths[:, None], k_cache[:, :, :, :past], v_cache[:, :, :, :past],
                                           lengths)
        step = step_stats(logits[:, -1])
        for b in range(batch):
            if done[b]:  # finished sequences ride along; nothing of theirs is kept
                continue
            k_cache[:, b, :, lengths[b]] = new_k[:, b, :, 0]
            v_cache[:, b, :, lengths[b]] = new_v[:, b, :, 0]
            lengths[b] += 1
            tokens[b].append(last[b])
            auxes[b].append(aux[b])
            stats[b].append([s[b:b + 1] for s in step])
            last[b] = int(step[0][b])
            done[b] = last[b] == eos_id
    results = []
    for t, a, s in zip(tokens, auxes, stats):
        greedy, ids, logp = (torch.cat(parts).numpy() for parts in zip(*s))
        results.append((t, torch.cat(a).numpy(), greedy, ids, logp))
    return results


def sharegpt_first_turns(template: ChatTemplate, conversations: range, max_prompt_tokens: int):
    """First user turns of the ShareGPT conversations in `conversations`, as chat prompts."""
    for i, messages in enumerate(sharegpt_conversations()):
        if i >= conversations.stop:
            return
        if i in conversations and messages[0]["role"] == "user":
            ids = template.encode_chat(messages[:1], add_generation_prompt=True)
            if 8 <= len(ids) <= max_prompt_tokens:
                yield ids


def prepare_self_distilled(args, target, template: ChatTemplate, out: Path, settings: dict) -> None:
    """ShareGPT first turns answered by the target itself, greedily, in batches (~80 tokens/s on 2 cores)."""
    meta = start_dataset(out, settings)
    writer = ShardWriter(out, meta, args.shard_tokens)
    first, last = (int(x) for x in args.conversations.split(":"))
    prompts = list(sharegpt_first_turns(template, range(first, last), args.max_prompt_tokens))[:args.max_prompts]
    eos_id = target.config.eos_token_id
    position = meta["consumed"]
    while position < len(prompts) and writer.tokens < args.tokens:
        chunk = prompts[position:position + args.batch]
        for prompt, (tokens, aux, greedy, ids, logp) in zip(chunk, greedy_batch(target, chunk, args.max_new_tokens,
                                                                                 eos_id, args.topk)):
            writer.add(tokens=np.array(tokens, dtype=np.int32), aux=to_fp16(aux),
                       greedy=greedy.astype(np.int32), answer=np.arange(len(tokens)) + 1 >= len(prompt),
                       topk_ids=ids.astype(np.uint16), topk_logp=logp.astype(np.float16))
        position += len(chunk)
        if writer.chunk_done(position, len(prompts), "prompts", args):
            break
    writer.close(position)


def text_token_counts(template: ChatTemplate, vocab_size: int) -> np.ndarray:
    """How often each token occurs in ShareGPT's assistant turns (held-out conversations excluded):
    20M tokens, a far larger sample of answer text than the target's greedy tokens of the prepared data."""
    texts = [m["content"] for i, conversation in enumerate(sharegpt_conversations()) if i not in HELD_OUT
             for m in conversation if m["role"] == "assistant"]
    counts = np.zeros(vocab_size, dtype=np.int64)
    for encoding in template.tokenizer.encode_batch(texts, add_special_tokens=False):
        counts += np.bincount(encoding.ids, minlength=vocab_size)
    return counts
