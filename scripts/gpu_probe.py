"""GPU probe for the width-invariant kernels' speed (issues 43/44): two measurements a kernel engineer
wants before choosing tile sizes, each written to $OUT (or ./gpu-probe/) as JSON and text.

    linear   each real Llama-3.1-8B linear shape (qkv, o, gate_up, down, lm_head) at M = 1, 16, 80,
             bf16: cuBLAS (F.linear) beside the Triton linear kernel in linear_config's choice and (unless
             --default-only) a grid of fixed configurations
             (BLOCK_N, BLOCK_K, K splits, warps, stages), each timed as one CUDA graph streaming enough
             copies of the weight to pass the L2 cache (what a decode step does), in ms and GB/s;
             and whether a row's bits match between M = 1 and M = 16 for every configuration timed;
             at M = 1 and 16, the fused prologues at linear_config's choice: the RMSNorm (gain folded, as
             a build folds it) inside qkv, gate_up and lm_head, silu(gate) * up inside down, each beside
             the standalone kernel then the linear, and whether the two give the same bits.
    attention  the attention kernel at the 8B shape (32 query heads, 8 KV heads, D 128), batch 1 and 16,
             T = 1 and 5 new rows over 256 and 2048 cached keys: torch's SDPA beside the kernel at each
             (keys a block, keys a split, warps) of a grid, each a CUDA graph of 32 calls (a step's
             layers), in us a call.
    reduction  the reductions over programs done by the last program to finish (the default) beside
             the two-kernel path (K._FUSED off: a second kernel adds the partials): the 8B linear
             layers that split K (o and down, with their residual epilogue) at M = 1, 4, 16, each a
             CUDA graph streaming weights past L2 as `linear` does, and the attention at the 8B shape
             (the `attention` cells), 32 calls a graph; us a call each way, and whether the bits agree.
    profile  one plain decoding round of the 8B shape, eager, through the torch backend and through
             exact mode: the GPU time of each kernel, summed, top 25 (where a step's time goes).
    pdl      exact mode's plain step of the 8B shape (bf16, random weights, a cache of PAST valid slots)
             at batch 1 and 16, captured as a CUDA graph with programmatic dependent launch and without
             (kernels.triton_ops._PDL), the two replayed in turns: ms a step, achieved bandwidth, its
             share of the card's peak and of a copy, and whether the two give the same bits. ~30-60 s.

Usage: python scripts/gpu_probe.py linear|attention|reduction|profile|pdl [--budget-s S]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(os.environ.get("OUT") or "gpu-probe")
# Llama-3.1-8B: weight [N, K] and how many a step reads
SHAPES = {"qkv": (6144, 4096, 32), "o": (4096, 4096, 32), "gate_up": (28672, 4096, 32), "down": (4096, 14336, 32),
          "lm_head": (128256, 4096, 1)}
STREAM_BYTES = 384 << 20  # copies of a weight until a graph streams this much: past the H200's 50 MB L2


def captured(fn):
    """fn() run once (what compiles or allocates), then captured in a CUDA graph -> (graph, fn's result
    in it: the graph's outputs)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replays_ms(graph, reps: int) -> float:
    """ms a replay: `reps` replays back to back between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graph_ms(fn, reps: int = 7) -> float:
    """Median ms of one replay of a CUDA graph of fn()."""
    graph, _ = captured(fn)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def configs():
    """(BLOCK_M, BLOCK_N, BLOCK_K, K splits, warps, stages): the H200's best at 1-16 rows, and larger
    row tiles (one per call width up to 64: the same arithmetic for every row whatever the call)."""
    grid = [(bm, bn, bk, split, 4, stages) for bm in (16, 32, 64) for bn, bk, split, stages in
            ((64, 128, 1, 6), (64, 256, 1, 3), (64, 128, 4, 4), (32, 256, 1, 4), (128, 128, 1, 4))]
    return grid + [(64, 128, 128, 1, 8, 3), (64, 64, 256, 1, 4, 3), (32, 64, 128, 4, 4, 4)]


def linear(budget_s: float, only_default: bool = False) -> dict:
    from eagle_export.kernels import triton_ops as K

    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "shapes": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k, per_step) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(1, math.ceil(STREAM_BYTES / nbytes))
        weights = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        rec = result["shapes"][name] = {"n": n, "k": k, "per_step": per_step, "copies": copies,
                                        "default_config": list(K.linear_config(n, k, 0)), "m": {}}
        for m in (1, 16, 80):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            row = rec["m"][m] = {}
            ms = graph_ms(lambda: [F.linear(x, w) for w in weights]) / copies
            row["cublas"] = {"ms": round(ms, 4), "gb_s": round(nbytes / ms / 1e6, 1)}
            for cfg in configs() if not only_default else [tuple(rec["default_config"])]:
                if time.perf_counter() - start > budget_s:
                    row["stopped"] = "budget"
                    break
                key = "x".join(map(str, cfg))
                try:
                    ms = graph_ms(lambda: [K.linear(x, w, None, cfg) for w in weights]) / copies
                    entry = {"ms": round(ms, 4), "gb_s": round(nbytes / ms / 1e6, 1)}
                    if m > 1:  # rows at three places of the call, each against the same row alone
                        wide = K.linear(x, weights[0], None, cfg)
                        entry["row_invariant"] = all(torch.equal(wide[r], K.linear(x[r:r + 1], weights[0], None, cfg)[0])
                                                     for r in (3, m // 2, m - 1))
                    row[key] = entry
                except Exception as e:  # a configuration that does not compile here is a finding
                    row[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            if m <= 16 and name != "o":
                row["prologue"] = prologue(K, name, m, k, weights, tuple(rec["default_config"]), gen)
            best = min(((c, v) for c, v in row.items() if isinstance(v, dict) and "ms" in v and c != "cublas"),
                       key=lambda cv: cv[1]["ms"], default=None)
            if best:
                row["best"] = best[0]
            print(f"{name} [{n}x{k}] M={m}: cublas {row['cublas']['ms']:.4f} ms ({row['cublas']['gb_s']} GB/s); "
                  f"best {best[0] if best else '-'} {best[1]['ms'] if best else 0:.4f} ms "
                  f"({best[1]['gb_s'] if best else 0} GB/s); "
                  f"default {row.get('x'.join(map(str, rec['default_config'])), {}).get('ms')}",
                  flush=True)
        weights = None  # noqa: F841 (the GPU memory, before the next shape)
        torch.cuda.empty_cache()
        _save("linear", result)
    # a step's linear layers, each at its best configuration and at the default, beside cuBLAS (M = 1 and 16)
    for m in (1, 16):
        total = {"cublas": 0.0, "best": 0.0, "default": 0.0}
        for name, rec in result["shapes"].items():
            row = rec["m"][m]
            total["cublas"] += rec["per_step"] * row["cublas"]["ms"]
            total["best"] += rec["per_step"] * row[row["best"]]["ms"] if "best" in row else math.nan
            default = row.get("x".join(map(str, rec["default_config"])), {}).get("ms", math.nan)
            total["default"] += rec["per_step"] * default
        for key in ("fused_ms", "apart_ms"):  # the layers with a prologue, a step's worth
            total["prologue_" + key.removesuffix("_ms")] = sum(rec["per_step"] * rec["m"][m]["prologue"][key]
                                                              for rec in result["shapes"].values()
                                                              if "prologue" in rec["m"][m])
        result[f"step_linear_ms_m{m}"] = {k: round(v, 3) for k, v in total.items()}
        print(f"a step's linear layers at M={m}: {result[f'step_linear_ms_m{m}']}", flush=True)
    _save("linear", result)
    return result


def prologue(K, name: str, m: int, k: int, weights, cfg, gen) -> dict:
    """The layer with its prologue fused (the RMSNorm before qkv, gate_up, lm_head; SiLU-mul before
    down) beside the standalone kernel then the layer, ms a layer, and whether their bits agree."""
    if name == "down":
        gate, up = (torch.randn(m, 2 * k, device="cuda", generator=gen) * 3).to(torch.bfloat16).split(k, dim=-1)
        fused = lambda w: K.linear(gate, w, None, cfg, up=up)  # noqa: E731
        apart = lambda w: K.linear(K.silu_mul(gate, up), w, None, cfg)  # noqa: E731
    else:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        fused = lambda w: K.linear(x, w, None, cfg, norm=(None, 1e-5))  # noqa: E731
        apart = lambda w: K.linear(K.rms_norm(x, None, 1e-5), w, None, cfg)  # noqa: E731
    out = {"what": "silu_mul" if name == "down" else "rms_norm",
           "bit_identical": torch.equal(fused(weights[0]), apart(weights[0]))}
    for key, fn in (("fused_ms", fused), ("apart_ms", apart)):
        out[key] = round(graph_ms(lambda: [fn(w) for w in weights]) / len(weights), 4)
    print(f"  {name} M={m}: {out['what']} fused {out['fused_ms']} ms, apart {out['apart_ms']} ms, "
          f"bit-identical {out['bit_identical']}", flush=True)
    return out


ATTENTION_CELLS = ((1, 256, 1), (1, 256, 5), (1, 2048, 1), (1, 2048, 5), (16, 256, 1), (16, 256, 5))  # (b, s, t)


def attention_inputs(b: int, s: int, t: int, hq: int = 32, hkv: int = 8, d: int = 128):
    """q [b,32,t,128] and the new k/v as rope leaves them (strided views), a cache of s keys and 8 free
    slots, the causal mask among the t new keys: the 8B shape's attention call."""
    q = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kc, vc = (torch.randn(b, hkv, s + 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kn, vn = (torch.randn(b, t, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    mask = torch.ones(b, t, s + 8 + t, dtype=torch.bool, device="cuda")
    mask[:, :, s:s + 8] = False  # 8 free cache slots
    mask[:, :, s + 8:] = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    return q, kc, vc, kn, vn, mask


def attention(budget_s: float) -> dict:
    from eagle_export.kernels import triton_ops as K

    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(0), "cells": {}}
    hq, hkv, d, layers = 32, 8, 128, 32
    grid = [(block, split, warps) for block in (16, 32, 64) for split in (64, 128, 256) for warps in (2, 4)]
    for b, s, t in ATTENTION_CELLS:
        if time.perf_counter() - start > budget_s:
            break
        q, kc, vc, kn, vn, mask = attention_inputs(b, s, t, hq, hkv, d)
        keys = K.compact_keys(mask)
        cell = result["cells"][f"b{b}_s{s}_t{t}"] = {}
        full_k = torch.cat([kc[:, :, :s], kn], 2).repeat_interleave(hq // hkv, 1)
        full_v = torch.cat([vc[:, :, :s], vn], 2).repeat_interleave(hq // hkv, 1)
        sdpa_mask = torch.cat([mask[:, :, :s], mask[:, :, s + 8:]], -1)[:, None]
        cell["sdpa_us"] = round(1000 * graph_ms(lambda: [F.scaled_dot_product_attention(q, full_k, full_v, sdpa_mask)
                                                         for _ in range(layers)]) / layers, 2)
        reference = K.attention(q, kc, vc, kn, vn, mask, keys=keys)
        saved = K.ATTN_BLOCK, K.ATTN_WARPS
        for block, split, warps in grid:
            if time.perf_counter() - start > budget_s:
                cell["stopped"] = "budget"
                break
            K.ATTN_BLOCK, K.ATTN_WARPS = block, warps
            try:
                us = 1000 * graph_ms(lambda: [K.attention(q, kc, vc, kn, vn, mask, split, keys=keys)
                                              for _ in range(layers)]) / layers
                diff = (K.attention(q, kc, vc, kn, vn, mask, split, keys=keys).float() - reference.float()).abs().max()
                cell[f"{block}x{split}x{warps}"] = {"us": round(us, 2), "max_diff_vs_default": float(diff)}
            except Exception as e:
                cell[f"{block}x{split}x{warps}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            finally:
                K.ATTN_BLOCK, K.ATTN_WARPS = saved
        best = min((kv for kv in cell.items() if isinstance(kv[1], dict) and "us" in kv[1]), key=lambda kv: kv[1]["us"])
        default = cell.get(f"{K.ATTN_BLOCK}x{K.SPLIT_SIZE}x{K.ATTN_WARPS}", {}).get("us")
        print(f"attention b{b} s{s} t{t}: sdpa {cell['sdpa_us']} us, default {default} us, best {best[0]} {best[1]['us']} us",
              flush=True)
        _save("attention", result)
    return result


def reduction(budget_s: float) -> dict:
    from eagle_export.kernels import triton_ops as K

    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(0), "linear": {}, "attention": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)

    def both(fn, reps_ms):
        """(fused, two-kernel) times from reps_ms(fn) and whether fn's outputs agree in every bit."""
        out, ms, saved = {}, {}, K._FUSED
        for fused in (True, False):
            K._FUSED = fused
            try:
                out[fused], ms[fused] = fn(), reps_ms(fn)
            finally:
                K._FUSED = saved
        return ms[True], ms[False], torch.equal(out[True], out[False])

    for name in ("o", "down"):
        n, k, per_step = SHAPES[name]
        cfg = K.linear_config(n, k, 0)
        if cfg[3] == 1:  # this card splits no K here: the H200's configuration, so the A/B still means something
            cfg = (16, 64, 128, 4, 4, 4)
        copies = max(1, math.ceil(STREAM_BYTES / (n * k * 2)))
        weights = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        rec = result["linear"][name] = {"n": n, "k": k, "per_step": per_step, "config": list(cfg), "m": {}}
        for m in (1, 4, 16):
            if time.perf_counter() - start > budget_s:
                rec["stopped"] = "budget"
                break
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            res = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            fused, apart, same = both(lambda: K.linear(x, weights[0], None, cfg, residual=res),
                                      lambda fn: graph_ms(lambda: [K.linear(x, w, None, cfg, residual=res)
                                                                   for w in weights]) / copies)
            rec["m"][m] = {"fused_us": round(1000 * fused, 2), "two_kernel_us": round(1000 * apart, 2),
                           "bit_identical": same}
            print(f"linear {name} [{n}x{k}] M={m} {'x'.join(map(str, cfg))}: fused {1000 * fused:.2f} us, "
                  f"two kernels {1000 * apart:.2f} us, bit-identical {same}", flush=True)
        weights = None  # noqa: F841
        torch.cuda.empty_cache()
    layers = 32
    for b, s, t in ATTENTION_CELLS:
        if time.perf_counter() - start > budget_s:
            result["attention"]["stopped"] = "budget"
            break
        q, kc, vc, kn, vn, mask = attention_inputs(b, s, t)
        keys = K.compact_keys(mask)
        fused, apart, same = both(lambda: K.attention(q, kc, vc, kn, vn, mask, keys=keys),
                                  lambda fn: graph_ms(lambda: [fn() for _ in range(layers)]) / layers)
        result["attention"][f"b{b}_s{s}_t{t}"] = {"fused_us": round(1000 * fused, 2),
                                                  "two_kernel_us": round(1000 * apart, 2), "bit_identical": same}
        print(f"attention b{b} s{s} t{t}: fused {1000 * fused:.2f} us, two kernels {1000 * apart:.2f} us, "
              f"bit-identical {same}", flush=True)
    saved = {}
    for m in (1, 4, 16):  # a step's split-K layers and attention, the two-kernel path's time less the fused one's
        linear_us = sum(rec["per_step"] * (rec["m"][m]["two_kernel_us"] - rec["m"][m]["fused_us"])
                        for rec in result["linear"].values() if m in rec["m"])
        saved[f"m{m}"] = round(linear_us / 1000, 4)
    cell = result["attention"].get("b1_s256_t1")
    if cell:
        saved["attention_b1_s256_t1"] = round(layers * (cell["two_kernel_us"] - cell["fused_us"]) / 1000, 4)
    result["step_saved_ms"] = saved
    print(f"a step's saving, ms (split-K layers by M; attention at batch 1, 256 keys): {saved}", flush=True)
    _save("reduction", result)
    return result


def profile() -> dict:
    from eagle_export.runtime.runtime import GenerationConfig
    from eagle_export.tools.gpu_kit import make_runtime, random_pair, random_prompts, unbind

    target, drafter = random_pair("llama-3.1-8b", "cuda", torch.bfloat16)
    prompt = random_prompts(target.config.vocab_size, 1)[0]
    result = {}
    for exact in (False, True):
        runtime = make_runtime(target, drafter, "cuda", cuda_graphs=False, exact=exact)
        try:
            runtime.generate([prompt], GenerationConfig(max_new_tokens=4), speculative=False)
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                runtime.generate([prompt], GenerationConfig(max_new_tokens=9), speculative=False)
                torch.cuda.synchronize()
            name = "exact" if exact else "torch"
            table = None
            for key in ("self_device_time_total", "self_cuda_time_total"):
                try:
                    table = prof.key_averages().table(sort_by=key, row_limit=40)
                    break
                except Exception:  # the older name
                    continue
            result[name] = {"table": table, "note": "a prefill and 8 plain rounds, eager"}
            print(f"--- {name}: a prefill and 8 plain rounds, eager", flush=True)
            print(table, flush=True)
        finally:
            unbind(runtime)
    _save("profile", result)
    return result


PDL_BATCHES, PDL_REPLAYS, PDL_ROUNDS = (1, 16), 20, 6  # rounds: each graph timed over REPLAYS replays, in turns


def pdl(budget_s: float) -> dict:
    """The plain step with and without programmatic dependent launch (the module's docstring: `pdl`).
    The runtime gpu-kit builds (exact mode bound, static caches), its target called as costs.measure
    calls it for T = 1, captured once with K._PDL on and once off (each run eagerly first: the kernels
    compile, the counters exist); then PDL_ROUNDS rounds, the order alternating, of PDL_REPLAYS replays
    back to back between CUDA events, each graph's median a step (pdl_summary)."""
    from eagle_export.kernels import triton_ops as K
    from eagle_export.models import contract as C
    from eagle_export.models.layers import causal_mask
    from eagle_export.runtime.costs import PAST
    from eagle_export.tools.gpu_kit import copy_bandwidth, make_runtime, peak_bandwidth, random_pair, step_bytes, unbind

    start = time.perf_counter()
    device = torch.cuda.get_device_name(0)
    peak, copy = peak_bandwidth(device), copy_bandwidth("cuda")
    result = {"device": device, "peak_gb_s": None if peak is None else peak / 1e9, "copy_gb_s": round(copy / 1e9, 1),
              "batches": {}}
    if not K._pdl_card(torch.cuda.current_device()):
        result["skipped"] = "this card (compute capability < 9.0) or this Triton (no gdc_wait) has no PDL"
        print(f"pdl: {result['skipped']}", flush=True)
        _save("pdl", result)
        return result
    target, drafter = random_pair("llama-3.1-8b", "cuda", torch.bfloat16)
    runtime = make_runtime(target, drafter, "cuda", cuda_graphs=False, exact=True)
    print(f"pdl: 8B pair made and bound after {time.perf_counter() - start:.1f} s", flush=True)
    saved = K._PDL
    try:
        for batch in PDL_BATCHES:
            if time.perf_counter() - start > budget_s:
                result["stopped"] = "budget"
                break
            past = max(1, min(PAST, runtime.max_context - 2 * (runtime.depth + 1)))  # as costs.measure and step_bytes
            slots = runtime.cache_slots(past + 2 * (runtime.depth + 1), past + 2 * (runtime.depth + 1))
            target_k, target_v, _, _ = runtime.caches(batch, slots)
            lens = torch.full((batch,), past, dtype=torch.int64, device="cuda")
            feeds = {C.INPUT_IDS: torch.ones(batch, 1, dtype=torch.int64, device="cuda"), C.POSITIONS: lens[:, None].clone(),
                     C.PAST_KEY: target_k, C.PAST_VALUE: target_v, C.CACHE_LENS: lens,
                     C.TREE_MASK: causal_mask(batch, 1, "cuda")}
            graphs, outputs = {}, {}
            for on in (True, False):
                K._PDL = on
                graphs[on], outputs[on] = captured(lambda: runtime.backend.target(feeds))
            K._PDL = saved
            ms = {True: [], False: []}
            for r in range(PDL_ROUNDS):
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    ms[on].append(replays_ms(graphs[on], PDL_REPLAYS))
            for on in (True, False):
                graphs[on].replay()
            torch.cuda.synchronize()
            cell = result["batches"][batch] = pdl_summary(ms, step_bytes(runtime, batch), peak, copy)
            cell["bit_identical"] = all(torch.equal(outputs[True][name], outputs[False][name]) for name in outputs[True])
            print(f"pdl: plain step batch {batch}: {pdl_line(cell)}", flush=True)
            del graphs, outputs
            _save("pdl", result)
    finally:
        K._PDL = saved
        unbind(runtime)
    _save("pdl", result)
    return result


def pdl_summary(ms: dict[bool, list[float]], moved: int, peak: float | None, copy: float) -> dict:
    """ms: per-step times of the interleaved rounds with PDL (True) and without -> each one's median
    step, its spread (max - min over rounds) and achieved bandwidth (gpu_kit.achieved: `moved` bytes a
    step against the peak and the copy), and the ratio of the medians."""
    from eagle_export.tools.gpu_kit import achieved

    out = {"bytes_per_step": moved, "rounds": len(ms[True])}
    for on, name in ((True, "pdl"), (False, "plain")):
        out[name] = {**achieved(moved, statistics.median(ms[on]) / 1e3, peak, copy),
                     "spread_ms": round(max(ms[on]) - min(ms[on]), 4)}
    out["pdl_over_plain"] = round(out["pdl"]["step_ms"] / out["plain"]["step_ms"], 4)
    return out


def pdl_line(cell: dict) -> str:
    def one(r):
        share = "" if r["share_of_peak"] is None else f", {100 * r['share_of_peak']:.0f}% of peak"
        return f"{r['step_ms']:.3f} ms ({r['achieved_gb_s']:g} GB/s{share}, {100 * r['share_of_copy']:.0f}% of a copy)"
    return (f"PDL {one(cell['pdl'])}, without {one(cell['plain'])}: {cell['pdl_over_plain']:.3f}x"
            + (f", bit-identical {cell['bit_identical']}" if "bit_identical" in cell else ""))


def _save(name: str, result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"probe-{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("linear", "attention", "reduction", "profile", "pdl"))
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--default-only", action="store_true", help="linear: cuBLAS and linear_config's choice only")
    return parser


if __name__ == "__main__":
    args = parser().parse_args()
    if not torch.cuda.is_available():
        sys.exit("the probe needs a CUDA GPU")
    if args.what == "linear":
        linear(args.budget_s, args.default_only)
    elif args.what == "attention":
        attention(args.budget_s)
    elif args.what == "reduction":
        reduction(args.budget_s)
    elif args.what == "pdl":
        pdl(args.budget_s)
    else:
        profile()
