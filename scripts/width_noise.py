"""Does a target row's result depend on its position within a call, on the call's key length, or only
on the call's width? The measurement behind the lossless contract's T1 (README: greedy decoding).

For a build and a backend, the logits of the last POSITIONS tokens of each prompt are computed,
teacher-forced, under several call layouts, each building its own cache of exactly the rows kept:
  w1                 one token per call (plain decoding)
  w1 +64 slots       the same, the cache shown with 64 more masked slots
  anti               each token as row 0 of a width-W call (W = verify width), the other rows filler
  anti, filler 5     the same with other filler tokens
  chunks             W tokens per call, every row kept (a fully accepted round)
  chunks, shifted    the chunks one position later (each token at another row of its call)
  chunks +64 slots   the chunks with 64 more masked slots
  ... view           the cache shown as the runtime shows it: a multiple of cache_step slots
and each pair that must agree for T1 is printed: bit-identical or not, max |logit difference|,
argmax flips (of the aux states, for a graph that returns no logits). Each chunk layout builds its own
cache, so it also carries the width noise of the calls before; `validate` probes the layouts T1 relies on
one at a time over a shared cache (`teacher_forced.position_variance`; README: the lossless contract).

Run: python scripts/width_noise.py BUILD [--backend onnxruntime|torch|tensorrt] [--positions 16]
"""

from __future__ import annotations

import argparse

import torch

from eagle_export.builder.build_dir import open_build
from eagle_export.builder.validate import CHECK_PROMPTS
from eagle_export.models import contract as C
from eagle_export.models.layers import causal_mask


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("build")
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--positions", type=int, default=16)
    args = parser.parse_args()
    opened = open_build(args.build, backend=args.backend, verify=False, verify_policy="fixed")
    backend, t = opened.runtime.backend, opened.manifest.target
    width, device = backend.verify_width, backend.device
    shape = (t.num_layers, 1, t.num_kv_heads, 0, t.head_dim)

    def call(ids, key, value, pad):
        """pad: that many more masked slots, or "view" for the runtime's views (multiples of cache_step)."""
        n = key.shape[3]
        step = opened.runtime.cache_step
        extra = -(-max(n, 1) // step) * step - n if pad == "view" else pad
        slots = torch.zeros(*shape[:3], n + extra, shape[4], dtype=backend.model_dtype, device=device)
        past_key, past_value = slots.clone(), slots.clone()
        past_key[:, :, :, :n], past_value[:, :, :, :n] = key, value
        out = backend.target({C.INPUT_IDS: torch.tensor([ids], device=device),
                              C.POSITIONS: torch.arange(n, n + len(ids), device=device)[None],
                              C.PAST_KEY: past_key, C.PAST_VALUE: past_value,
                              C.CACHE_LENS: torch.tensor([n], device=device),
                              C.TREE_MASK: causal_mask(1, len(ids), device)}, need_logits=True)
        values = out[C.LOGITS] if C.LOGITS in out else out[C.AUX_HIDDEN]  # a graph without logits: its aux states
        return values[0].float().cpu(), out[C.NEW_KEY], out[C.NEW_VALUE]

    def layout(seq, start, chunk, live, pad=0, filler=0):
        """logits of seq[start:]: calls of `chunk` tokens, the first `live` real (the rest filler,
        never cached), the cache shown with `pad` more slots."""
        empty = torch.zeros(*shape, dtype=backend.model_dtype, device=device)
        _, key, value = call(seq[:start], empty, empty, 0)
        out, n = [], start
        while n < len(seq):
            real = seq[n:n + live]
            logits, new_key, new_value = call(real + [filler] * (chunk - len(real)), key, value, pad)
            out.append(logits[:len(real)])
            key = torch.cat([key, new_key[:, :, :, :len(real)]], 3)
            value = torch.cat([value, new_value[:, :, :, :len(real)]], 3)
            n += len(real)
        return torch.cat(out)

    prompts = [opened.encode(p) for p in CHECK_PROMPTS] if opened.tokenizer else [list(range(1, 24))]
    starts = [max(2, len(p) - args.positions) for p in prompts]
    layouts = {"w1": dict(chunk=1, live=1), "w1 +64 slots": dict(chunk=1, live=1, pad=64),
               "anti": dict(chunk=width, live=1), "anti, filler 5": dict(chunk=width, live=1, filler=5),
               "chunks": dict(chunk=width, live=width), "chunks +64 slots": dict(chunk=width, live=width, pad=64),
               "w1 view": dict(chunk=1, live=1, pad="view"), "anti view": dict(chunk=width, live=1, pad="view"),
               "chunks view": dict(chunk=width, live=width, pad="view")}
    logits = {name: torch.cat([layout(p, s, **kw) for p, s in zip(prompts, starts)]) for name, kw in layouts.items()}
    logits["chunks, shifted"] = torch.cat([layout(p, s - 1, width, width)[1:] for p, s in zip(prompts, starts)])
    logits["chunks view, shifted"] = torch.cat([layout(p, s - 1, width, width, "view")[1:]
                                                for p, s in zip(prompts, starts)])
    print(f"{args.build} on {backend.name}, verify width {width}, {len(logits['w1'])} positions")
    for a, b in (("w1", "w1 +64 slots"), ("anti", "anti, filler 5"), ("chunks", "chunks, shifted"),
                 ("anti", "chunks"), ("chunks", "chunks +64 slots"), ("w1", "anti"), ("w1", "chunks"),
                 ("anti view", "chunks view"), ("chunks view", "chunks view, shifted"), ("w1 view", "anti view")):
        x, y = logits[a], logits[b]
        flips = int((x.argmax(-1) != y.argmax(-1)).sum())
        print(f"  {a:>16} vs {b:<16} bit-identical {str(torch.equal(x, y)):5}  max |dlogit| "
              f"{(x - y).abs().max().item():.3g}  argmax flips {flips}/{len(x)}")


if __name__ == "__main__":
    main()
