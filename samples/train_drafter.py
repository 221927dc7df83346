"""Train the sample EAGLE-3 and EAGLE-3.1 drafters for SmolLM2-135M-Instruct on a CPU.

Two stages, so both drafters learn from the same cached target states:

  python samples/train_drafter.py prepare --out /tmp/eagle-data --tokens 48000
  python samples/train_drafter.py train --data /tmp/eagle-data --version 3   --steps 200 --out samples/eagle3-smollm2-135m
  python samples/train_drafter.py train --data /tmp/eagle-data --version 3.1 --steps 200 --out samples/eagle3.1-smollm2-135m

`prepare` renders ShareGPT conversations with the target's chat template, runs the target once over
them and stores, per token, the aux states (fp16 numpy memmap) and the target's greedy next token;
it also picks the draft vocabulary: the N most frequent target tokens of the tokenized data.
`train` runs training-time test: the drafter's chain of `depth` steps over every position at once,
each step consuming its own previous hidden state as at inference (`reference.parallel_drafts`);
the loss is cross-entropy against the target's greedy tokens (hard labels, the tokens greedy
verification accepts), weighted 0.8^k at step k. Labels outside the draft vocabulary are ignored.
Everything is seeded: the same data, steps and seed give the same drafter.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from eagle_export.checkpoint import load_target, save_drafter
from eagle_export.config import DrafterConfig
from eagle_export.drafter import Drafter
from eagle_export.prompts import ChatTemplate, sharegpt_conversations
from eagle_export.reference import parallel_drafts
from eagle_export.sample import sample_target_dir

AUX_LAYER_IDS = (2, 15, 27)  # vLLM numbering: the residual stream entering these layers
STEP_WEIGHT_DECAY = 0.8


def drafter_config(target_cfg, version: str, draft_vocab_size: int, aux_layer_ids=AUX_LAYER_IDS, hidden=576,
                   heads=9, kv_heads=3, intermediate=1536) -> dict:
    """config.json in the layout vLLM loads (LlamaForCausalLMEagle3)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "num_hidden_layers": 1,
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
    out.mkdir(parents=True, exist_ok=True)
    target_dir = Path(args.target) if args.target else sample_target_dir()
    target = load_target(target_dir, aux_layer_ids=tuple(args.aux_layer_ids)).eval()
    template = ChatTemplate(target_dir)
    if args.self_distill:
        prepare_self_distilled(args, target, template, target_dir, out)
        return
    sequences, total = [], 0
    for messages in sharegpt_conversations():
        ids = template.encode_chat(messages, add_generation_prompt=False)[:args.seq_len]
        if len(ids) < 64:
            continue
        sequences.append(ids)
        total += len(ids)
        if total >= args.tokens:
            break
    start, results, done = time.time(), [], 0
    empty_k, empty_v = target.empty_cache(1, 0)
    with torch.no_grad():
        for i, ids in enumerate(sequences):
            logits, aux, _, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None], empty_k, empty_v,
                                       torch.tensor([0]))
            results.append((ids, aux[0].numpy().astype(np.float16), logits[0].argmax(-1).numpy()))
            done += len(ids)
            if i % 10 == 0:
                print(f"prepare: {done}/{total} tokens, {done / (time.time() - start):.0f} tokens/s", flush=True)
    # The draft vocabulary: the most frequent tokens, counted over the training text (inputs and the
    # target's continuations are the same text here).
    counts = Counter(t for ids in sequences for t in ids)
    write_dataset(out, results, counts, args, target, target_dir, start, seq_len=args.seq_len)


def write_dataset(out: Path, results, counts: Counter, args, target, target_dir: Path, start: float, **meta) -> None:
    """The cache both drafters train from: per token its id, aux states (fp16) and the target's greedy
    next token, as numpy memmaps indexed by meta.json's offsets; and the draft vocabulary, the
    `--draft-vocab` most frequent tokens of `counts` (ties and the remainder go to the lowest ids)."""
    lengths = np.array([len(r[0]) for r in results], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    n = int(offsets[-1])
    aux = np.lib.format.open_memmap(out / "aux.npy", mode="w+", dtype=np.float16, shape=(n, target.aux_width))
    tokens = np.lib.format.open_memmap(out / "tokens.npy", mode="w+", dtype=np.int32, shape=(n,))
    greedy = np.lib.format.open_memmap(out / "greedy.npy", mode="w+", dtype=np.int32, shape=(n,))
    for i, (t, a, g) in enumerate(results):
        tokens[offsets[i]:offsets[i + 1]] = t
        aux[offsets[i]:offsets[i + 1]] = a.astype(np.float16)
        greedy[offsets[i]:offsets[i + 1]] = g
    aux.flush(), tokens.flush(), greedy.flush()
    ranked = sorted(range(target.config.vocab_size), key=lambda t: (-counts.get(t, 0), t))
    np.save(out / "draft_vocab.npy", np.array(sorted(ranked[:args.draft_vocab]), dtype=np.int64))
    meta = {"target": str(target_dir), "aux_layer_ids": list(args.aux_layer_ids), "offsets": offsets.tolist(),
            "sequences": len(results), "tokens": n, **meta, "draft_vocab": args.draft_vocab,
            "seconds": round(time.time() - start, 1)}
    (out / "meta.json").write_text(json.dumps(meta))
    print(f"prepare: done, {meta['tokens']} tokens in {meta['sequences']} sequences, {meta['seconds']} s", flush=True)


def sharegpt_first_turns(template: ChatTemplate, max_prompt_tokens: int):
    """First user turns of ShareGPT conversations, as chat prompts (generation prompt appended)."""
    for i, messages in enumerate(sharegpt_conversations()):
        if not messages or messages[0]["role"] != "user":
            continue
        ids = template.encode_chat(messages[:1], add_generation_prompt=True)
        if 8 <= len(ids) <= max_prompt_tokens:
            yield i, ids


@torch.no_grad()
def greedy_batch(target, prompts: list[list[int]], max_new_tokens: int, eos_id: int):
    """Greedy responses to a batch of prompts with every fed token's aux states and greedy next token.

    Returns, per prompt, (tokens, aux [T, A*H], greedy [T]): tokens are the prompt and the response
    without its last token (the last is never fed back), greedy[p] is the target's argmax after p."""
    batch, capacity = len(prompts), max(len(p) for p in prompts) + max_new_tokens
    k_cache, v_cache = target.empty_cache(batch, capacity)
    tokens, auxes, greedy = [list(p) for p in prompts], [], []
    for b, prompt in enumerate(prompts):  # ragged prefill, one prompt at a time
        logits, aux, new_k, new_v = target(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                                           k_cache[:, b:b + 1, :, :0], v_cache[:, b:b + 1, :, :0], torch.tensor([0]))
        k_cache[:, b, :, :len(prompt)] = new_k[:, 0]
        v_cache[:, b, :, :len(prompt)] = new_v[:, 0]
        auxes.append([aux[0]])
        greedy.append(logits[0].argmax(-1).tolist())
    lengths = torch.tensor([len(p) for p in prompts])
    done = [g[-1] == eos_id for g in greedy]
    for _ in range(max_new_tokens - 1):
        if all(done):
            break
        ids = torch.tensor([[g[-1]] for g in greedy])
        past = int(lengths.max())
        logits, aux, new_k, new_v = target(ids, lengths[:, None], k_cache[:, :, :, :past], v_cache[:, :, :, :past],
                                           lengths)
        for b in range(batch):
            if done[b]:  # finished sequences ride along; nothing of theirs is kept
                continue
            k_cache[:, b, :, lengths[b]] = new_k[:, b, :, 0]
            v_cache[:, b, :, lengths[b]] = new_v[:, b, :, 0]
            lengths[b] += 1
            tokens[b].append(int(ids[b, 0]))
            auxes[b].append(aux[b])
            greedy[b].append(int(logits[b, -1].argmax()))
            done[b] = greedy[b][-1] == eos_id
    return [(t, torch.cat(a).numpy(), np.array(g)) for t, a, g in zip(tokens, auxes, greedy)]


def prepare_self_distilled(args, target, template, target_dir: Path, out: Path) -> None:
    """The data as the drafter meets it at inference: ShareGPT first turns answered by the target itself.

    Prompts come from the first ShareGPT conversations (the long-context evaluation set uses
    conversations from 2000 on, so at most 2000 are read); each gets the target's greedy response of
    up to --max-new-tokens tokens, generated in batches, its aux states captured as the tokens are fed."""
    prompts = []
    for i, ids in sharegpt_first_turns(template, args.max_prompt_tokens):
        if i >= 2000 or len(prompts) == args.max_prompts:
            break
        prompts.append(ids)
    eos_id = target.config.eos_token_id
    results, start, total = [], time.time(), 0
    for first in range(0, len(prompts), args.batch):
        results += greedy_batch(target, prompts[first:first + args.batch], args.max_new_tokens, eos_id)
        total = sum(len(r[0]) for r in results)
        print(f"prepare: {len(results)}/{len(prompts)} prompts, {total} tokens, "
              f"{total / (time.time() - start):.0f} tokens/s", flush=True)
        if total >= args.tokens or (args.max_minutes and time.time() - start > 60 * args.max_minutes):
            break  # `--max-prompts len(results)` reproduces this data exactly
    # Draft vocabulary: the tokens the target itself emits most often (what the drafter must propose).
    counts = Counter(int(t) for _, _, g in results for t in g)
    write_dataset(out, results, counts, args, target, target_dir, start, self_distilled=True, batch=args.batch,
                  max_new_tokens=args.max_new_tokens)


def load_data(data: Path):
    meta = json.loads((data / "meta.json").read_text())
    arrays = {name: np.load(data / f"{name}.npy", mmap_mode="r") for name in ("aux", "tokens", "greedy")}
    return meta, arrays, np.load(data / "draft_vocab.npy")


def sequence_batch(arrays, offsets, i: int, depth: int):
    """(next_ids [1,T+depth-1], aux [1,T,A*H], labels [depth,T]) of sequence i.

    Step k at position p consumes token p+k+1 and predicts the target's greedy token after it."""
    a, b = offsets[i], offsets[i + 1]
    t = b - a
    tokens = torch.from_numpy(np.asarray(arrays["tokens"][a:b], dtype=np.int64))
    greedy = torch.from_numpy(np.asarray(arrays["greedy"][a:b], dtype=np.int64))
    aux = torch.from_numpy(np.asarray(arrays["aux"][a:b], dtype=np.float32))[None]
    pad = torch.zeros(depth, dtype=torch.int64)
    next_ids = torch.cat([tokens[1:], pad])[None]
    padded_greedy = torch.cat([greedy, torch.full((depth + 1,), -1)])
    labels = torch.stack([padded_greedy[k + 1:k + 1 + t] for k in range(depth)])
    return next_ids, aux, labels


def depth_losses(drafter, target_to_draft, next_ids, aux, labels, depth):
    """Per-step cross-entropy and correct counts; labels outside the draft vocabulary are ignored."""
    logits = parallel_drafts(drafter, next_ids, aux, depth)
    losses, correct, chain_ok, counted = [], [], None, None
    for k in range(depth):
        draft_labels = target_to_draft[labels[k].clamp(min=0)]
        draft_labels[labels[k] < 0] = -1
        losses.append(F.cross_entropy(logits[k][0], draft_labels, ignore_index=-1))
        hit = logits[k][0].argmax(-1) == draft_labels
        chain_ok = hit if chain_ok is None else chain_ok & hit
        if counted is None:
            counted = labels[depth - 1] >= 0  # positions with every step's label present
        correct.append((hit[counted].sum().item(), chain_ok[counted].sum().item(), counted.sum().item()))
    return losses, correct


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = Path(args.data)
    meta, arrays, draft_vocab = load_data(data)
    offsets = meta["offsets"]
    target = load_target(meta["target"], aux_layer_ids=tuple(meta["aux_layer_ids"]))
    cfg_dict = drafter_config(target.config, args.version, len(draft_vocab), meta["aux_layer_ids"])
    drafter = Drafter(DrafterConfig.from_hf(cfg_dict))
    with torch.no_grad():
        drafter.d2t.copy_(torch.from_numpy(draft_vocab) - torch.arange(len(draft_vocab)))
        drafter.t2d.zero_()
        drafter.t2d[torch.from_numpy(draft_vocab)] = True
    drafter.share_embeddings(target.embed_tokens)
    target.embed_tokens.weight.requires_grad_(False)
    del target.layers  # only the embedding table is needed from here on
    target_to_draft = torch.full((len(drafter.t2d),), -1, dtype=torch.int64)
    target_to_draft[torch.from_numpy(draft_vocab)] = torch.arange(len(draft_vocab))

    n = meta["sequences"]
    held_out = list(range(n - args.held_out, n))
    rng = np.random.default_rng(args.seed)
    params = [p for name, p in drafter.named_parameters() if not name.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = [STEP_WEIGHT_DECAY ** k for k in range(args.depth)]
    log = open(args.log, "a") if args.log else None
    order, seen_tokens, start = [], 0, time.time()

    def evaluate(step):
        drafter.eval()
        totals = np.zeros((args.depth, 3))
        with torch.no_grad():
            for i in held_out:
                _, correct = depth_losses(drafter, target_to_draft, *sequence_batch(arrays, offsets, i, args.depth),
                                          args.depth)
                totals += np.array(correct)
        drafter.train()
        acc = (totals[:, 0] / totals[:, 2]).round(4).tolist()
        chain = (totals[:, 1] / totals[:, 2]).round(4).tolist()
        # Expected tokens per round at depth K if position-wise chain hits were the loop's acceptances.
        record = {"version": args.version, "step": step, "train_tokens": seen_tokens, "held_out_acc": acc,
                  "held_out_chain": chain, "tau_estimate": round(1 + sum(chain), 3),
                  "seconds": round(time.time() - start, 1)}
        print(json.dumps(record), flush=True)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()

    for step in range(1, args.steps + 1):
        if not order:
            order = rng.permutation(n - args.held_out).tolist()
        i = order.pop()
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        losses, _ = depth_losses(drafter, target_to_draft, *sequence_batch(arrays, offsets, i, args.depth), args.depth)
        loss = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        seen_tokens += offsets[i + 1] - offsets[i]
        if step % 10 == 0:
            print(f"train {args.version}: step {step} tokens {seen_tokens} loss {loss.item():.3f} "
                  f"lr {lr:.2e} {time.time() - start:.0f} s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
        if args.max_minutes and time.time() - start > 60 * args.max_minutes:
            print(f"train {args.version}: stopping at step {step}: the {args.max_minutes} min budget is spent",
                  flush=True)
            evaluate(step)
            break
    drafter.to(torch.bfloat16)
    save_drafter(drafter, args.out, config=cfg_dict)
    print(f"train {args.version}: saved {args.out} after {time.time() - start:.0f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="run the target once over the data and cache its states")
    p.add_argument("--out", required=True)
    p.add_argument("--target", help="target checkpoint directory (default: the sample target)")
    p.add_argument("--tokens", type=int, default=48000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=list(AUX_LAYER_IDS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--self-distill", action="store_true",
                   help="answer ShareGPT first turns with the target's own greedy responses")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (--self-distill)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="longest prompt kept (--self-distill)")
    p.add_argument("--batch", type=int, default=16, help="prompts generated together (--self-distill)")
    p.add_argument("--max-prompts", type=int, default=2000, help="prompts answered at most (--self-distill)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop after the batch that passes this (--self-distill)")
    t = sub.add_parser("train", help="train one drafter on prepared data")
    t.add_argument("--data", required=True)
    t.add_argument("--version", choices=("3", "3.1"), required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--depth", type=int, default=4, help="training-time-test steps")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--held-out", type=int, default=4, help="sequences kept out of training for the curve")
    t.add_argument("--eval-every", type=int, default=25)
    t.add_argument("--max-minutes", type=float, default=0.0, help="stop early (and save) past this wall time")
    t.add_argument("--log", help="append the held-out curve (JSON lines) here")
    t.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    prepare(args) if args.command == "prepare" else train(args)


if __name__ == "__main__":
    main()
