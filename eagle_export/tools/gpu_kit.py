"""`eagle-export gpu-kit`: real-size shapes on a GPU, with nothing but this package and torch.

A GPU machine lent for minutes starts bare and takes no weights along, so the kit makes its pairs
on the machine itself: a target with the real config of Llama-3.2-1B, Llama-3.1-8B or Qwen3-8B and
an EAGLE-3 drafter of the real shape (one Llama decoder layer at the target's width, draft
vocabulary 32000 with d2t), random weights (initializer_range 0.02, as transformers initializes),
through the same model passes a build applies. Per shape, each step one record in one JSON report
(written after every step, so a run cut short keeps what it measured):

    pair        parameters, weight bytes, seconds to make, GPU memory
    lossless    greedy speculative output against plain decoding, batch 1 and 4, eager and with CUDA
                graphs, with the real (random) drafter and with synthetic acceptance 0.7; where an
                output differs, the first differing position and the plain run's top-2 logit margin
                there (a near-tie that the verify width's rounding can flip, or a bug)
    costs       the measured cost curves (verify T = 1..K+1, drafter) at batch 1, 4, 16, CUDA graphs, and
                the plain step's achieved bandwidth: (weight bytes + KV bytes it reads) / its time (the call as
                the runtime pays it, and with CUDA graphs the graph's replay alone), against
                the card's peak (PEAK_BANDWIDTH; a card not in the table: said so) and against a measured
                device-to-device copy (what the memory delivers to a kernel that only streams)
    sweep       `bench` at synthetic acceptance 0 .. 0.9 and 0.73/0.52/0.35/0.25 per depth (vLLM CI's Llama-3.1-8B pair)
                in fp32 (SWEEP_DTYPE, why there), both
                policies, batch 1 and 4, beside the cost model, and the break-even acceptance; PROMPTS
                prompts x NEW_TOKENS tokens a cell, REPEATS passes taking turns batch by batch, each
                policy's speedup per pass, their median and spread, and a cell whose passes disagree by
                more than REPEAT_TOLERANCE flagged (`repeats_disagree`)
    export      the real-width graphs (EXPORT_LAYERS decoder layers) exported to ONNX and run in ONNX
                Runtime against torch on one prefill

With `--exact` the kit runs exact mode's steps instead (runtime/exact.py, the width-invariant kernels):

    exact lossless   speculative == plain decoding on every prompt, both through the kernels: batch
                     1, 4 and 16, the random drafter and synthetic acceptance 0.7 and 0.9, a chain and
                     a dynamic tree, eager and with CUDA graphs
    exact cost       the plain step (median seconds of a plain decoding round) through the kernels
                     beside the same step through cuBLAS and torch attention, batch 1 and 16, one run

Random weights say nothing of acceptance (the synthetic drafter supplies that) and everything of
shapes, memory and time. `--shapes tiny` runs the whole kit on a CPU in seconds (CI does).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from .. import kernels
from ..errors import EagleExportError
from ..export.loader import prepare_pair
from ..export.unrolled import TargetGraph, UnrolledDrafter
from ..models.config import DrafterConfig, TargetConfig, default_aux_layer_ids
from ..models.drafter import Drafter
from ..models.target import Target
from ..output_dir import write_output
from ..runtime import exact as exact_mode
from ..runtime.backends import TorchBackend
from ..runtime.costs import PAST
from ..runtime.runtime import GenerationConfig, SpeculativeRuntime
from ..speculation.synthetic import SyntheticDrafts, parse_probabilities, verify_width_continuations
from ..speculation.tree import DynamicTree, as_tree
from .bench import _batches, bench, plot_sweep

DEPTH = 4
DRAFT_VOCAB = 32000
EXPORT_LAYERS = 2
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# The targets' config.json as released (the fields the loader reads).
TARGETS = {
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=True,
                         bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072,
                         tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643,
                     eos_token_id=151645),
    # CI's: every step on a CPU in seconds
    "tiny": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True,
                 bos_token_id=1, eos_token_id=2),
}
REAL_SHAPES = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-8b")
SWEEP = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9)
# The sweep runs in fp32: on an H200 in bf16 the speculative text parted from every continuation at
# its first near-tie (a 5-token verify call rounds differently from a 1-token step, and a row's result
# depends on its place in the call), after which every synthetic draft is wrong; in fp32 speculative
# and plain decoding were identical there. The cost curves and lossless checks stay in bf16.
SWEEP_DTYPE = torch.float32
# Llama-3.1-8B's EAGLE-3 per position in vLLM's CI (K = 3), and 0.25 for a fourth draft
REAL_ACCEPTANCE = (0.73, 0.52, 0.35, 0.25)
# A sweep cell: 4 prompts x 48 tokens was 0.5-2 s of decoding on an H200, and two cells where the policy
# behaved the same read 0.80x and 0.93x; 16 x 128, twice, the passes taking turns.
PROMPTS, NEW_TOKENS, REPEATS = 16, 128, 2
REPEAT_TOLERANCE = 0.05  # passes of one cell farther apart than this: the cell is flagged, not trusted
# Peak memory bandwidth in bytes/s, from NVIDIA's product datasheets: H100 SXM 3.35 TB/s, H100 PCIe 2 TB/s,
# H100 NVL 3.9 TB/s (H100 Tensor Core GPU datasheet); H200 SXM and NVL 4.8 TB/s (H200 datasheet); A100
# 40GB 1,555 GB/s, A100 80GB PCIe 1,935 GB/s, A100 80GB SXM 2,039 GB/s (A100 datasheet); L40S 864 GB/s
# (L40S datasheet); B200 8 TB/s (DGX B200 datasheet: 64 TB/s for its eight). Matched in this order
# against the name torch reports ("NVIDIA H100 80GB HBM3" is the SXM part); GH200's memory differs by
# model, so it is not guessed from the H200's.
PEAK_BANDWIDTH = (("GH200", None), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
                  ("H200", 4.8e12), ("A100 80GB PCIe", 1.935e12), ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12),
                  ("L40S", 864e9), ("B200", 8.0e12))


def peak_bandwidth(device: str) -> float | None:
    """The datasheet's peak memory bandwidth of a card by its name (bytes/s), None if not in the table."""
    return next((peak for key, peak in PEAK_BANDWIDTH if key in device), None)


def copy_bandwidth(device: str, size: int | None = None, reps: int = 5) -> float:
    """A measured device-to-device copy, bytes/s counting what it reads and writes (2 x size): the
    memory's practical ceiling for a kernel that only streams, the second reference beside the peak."""
    size = size or (1 << 30 if device == "cuda" else 1 << 26)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for rep in range(reps + 1):  # the first is a warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times += [time.perf_counter() - start] if rep else []
    return 2 * size / sorted(times)[len(times) // 2]


def step_bytes(runtime, batch: int) -> int:
    """What a plain step must read at least: the target's weights (all but an untied input embedding,
    of which it reads one row a sequence) and the K/V of the positions in cache, at the cost
    measurement's cache length (`costs.PAST`, as `costs.measure` clamps it)."""
    target = runtime.backend.graphs[None][0].target
    embed = target.embed_tokens.weight
    params = {id(p): p for p in target.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    if not any(p is embed for n, p in target.named_parameters() if n != "embed_tokens.weight"):
        weights -= embed.numel() * embed.element_size()  # untied: the head is another matrix
    layers, heads, dim = runtime.target_cache_shape
    past = max(1, min(PAST, runtime.max_context - 2 * (runtime.depth + 1)))
    kv = 2 * layers * batch * heads * past * dim * torch.empty((), dtype=runtime.backend.model_dtype).element_size()
    return weights + kv


def replay_s(runtime, batch: int, reps: int = 20) -> float | None:
    """Device seconds of one replay of the captured plain-step graph (batch, T = 1), replays back to
    back timed by CUDA events: the kernels' own time, without the host work a call adds (feeds copied
    in, ids read back). None without a captured graph (eager, a CPU)."""
    shapes = getattr(runtime.backend, "captured", {}).get(None)
    entry = next((g for key, g in shapes.graphs.items() if key[0] == (batch, 1)), None) if shapes else None
    if entry is None:
        return None
    replay = entry[1]
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def achieved(moved: int, seconds: float, peak: float | None, copy: float, key: str = "") -> dict:
    """A step that reads `moved` bytes in `seconds`: its ms, achieved GB/s, and share of the card's peak
    (None where not known) and of the measured copy, each name prefixed with `key`."""
    rate = moved / seconds
    return {f"{key}step_ms": round(1e3 * seconds, 3), f"{key}achieved_gb_s": float(f"{rate / 1e9:.4g}"),
            f"{key}share_of_peak": None if peak is None else float(f"{rate / peak:.3g}"),
            f"{key}share_of_copy": float(f"{rate / copy:.3g}")}  # a tiny CPU model's share is small


def bandwidth(runtime, batch: int, peak: float | None, copy: float) -> dict:
    """The plain step's achieved bandwidth at `batch`: step_bytes / the measured T = 1 verify call
    (what a call costs the runtime: host work and the ids' read included), and with CUDA graphs
    step_bytes / the graph's device time alone (what the kernels reach)."""
    moved = step_bytes(runtime, batch)
    device = replay_s(runtime, batch)
    return {"bytes_per_step": moved, **achieved(moved, runtime.costs.verify(batch, 1), peak, copy),
            **(achieved(moved, device, peak, copy, "device_") if device else {})}


def drafter_config(target: dict) -> dict:
    """An EAGLE-3 drafter of the real shape for `target`: one Llama layer at the target's width."""
    tiny = target["hidden_size"] < 256
    return dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=target["hidden_size"],
                intermediate_size=target["intermediate_size"] if not tiny else 128,
                num_attention_heads=target["num_attention_heads"], num_key_value_heads=target["num_key_value_heads"],
                head_dim=target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
                num_hidden_layers=1, vocab_size=target["vocab_size"],
                draft_vocab_size=DRAFT_VOCAB if not tiny else 128, target_hidden_size=target["hidden_size"],
                rms_norm_eps=target["rms_norm_eps"], rope_theta=target["rope_theta"],
                rope_scaling=target.get("rope_scaling"), max_position_embeddings=target["max_position_embeddings"],
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(default_aux_layer_ids(target["num_hidden_layers"]))})


@torch.no_grad()
def random_pair(shape: str, device: str, dtype: torch.dtype, layers: int | None = None, seed: int = 0):
    """Target and drafter of `shape` with random weights made on `device`, through the build's model passes."""
    cfg = dict(TARGETS[shape], **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(seed)
    with torch.device(device):
        target = Target(TargetConfig.from_hf(cfg, shape)).to(dtype)
        drafter = Drafter(DrafterConfig.from_hf(drafter_config(cfg), f"{shape} drafter")).to(dtype)
    for model in (target, drafter):
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    d = drafter.config
    if d.draft_vocab_size != d.vocab_size:  # the draft vocabulary: a random sorted subset, as d2t offsets
        ids = torch.randperm(d.vocab_size, device=device)[:d.draft_vocab_size].sort().values
        drafter.d2t.copy_(ids - torch.arange(d.draft_vocab_size, device=device))
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
    drafter.share_embeddings(target.embed_tokens)
    prepare_pair(target, drafter)
    return target.eval(), drafter.eval()


def make_runtime(target, drafter, device: str, cuda_graphs: bool, max_context: int = 1024, speculation=DEPTH,
                 exact: bool = False) -> SpeculativeRuntime:
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, speculation, False), device=device,
                           cuda_graphs=cuda_graphs, exact=exact)
    return SpeculativeRuntime.for_models(backend, target, drafter, max_context=max_context, verify_policy="fixed",
                                         static_cache=True)


def random_prompts(vocab: int, count: int, seed: int = 0, lengths: tuple[int, int] = (16, 96)) -> list[list[int]]:
    """Ragged prompts of random ids (16 to 96 tokens, or `lengths`)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(lengths[0], lengths[1] + 1, (count,), generator=gen)]


def _first_difference(runtime, prompt, plain, spec) -> dict:
    """Where `spec` first parts from `plain`, and the plain target's top-2 margin there."""
    d = next(i for i, (a, b) in enumerate(zip(plain + [None], spec + [None])) if a != b)
    ids = torch.tensor([prompt + plain[:d]], device=runtime.device)
    target = runtime.backend.graphs[None][0].target
    k, v = target.empty_cache(1, ids.shape[1], device=runtime.device)
    logits = target(ids, torch.arange(ids.shape[1], device=runtime.device)[None], k[:, :, :, :0], v[:, :, :, :0],
                    torch.zeros(1, dtype=torch.int64, device=runtime.device))[0][0, -1].float()
    top = logits.topk(2)
    return {"position": d, "plain": plain[d] if d < len(plain) else None, "speculative": spec[d] if d < len(spec) else None,
            "top2_margin": round(float(top.values[0] - top.values[1]), 5),
            "speculative_is_second": d < len(spec) and int(top.indices[1]) == spec[d]}


def lossless(runtime, prompts, new_tokens: int) -> dict:
    """Speculative decoding with the real drafter and with synthetic acceptance 0.7 against plain
    decoding (width 1) and against greedy decoding through the verify graph at width K+1 (the
    continuation the synthetic drafts' right tokens come from: decoded once for both)."""
    config = GenerationConfig(max_new_tokens=new_tokens)
    record = {}
    for batch in (1, 4):
        chunks = _batches(prompts, batch)
        plain = [r.tokens for chunk in chunks for r in runtime.generate(chunk, config, speculative=False)]
        continuations = [verify_width_continuations(runtime, chunk, config) for chunk in chunks]
        wide = [c[:new_tokens] for chunk in continuations for c in chunk]
        for drafts in ("drafter", 0.7):
            spec, taus = [], []
            for chunk, continued in zip(chunks, continuations):
                synthetic = (None if drafts == "drafter" else
                             SyntheticDrafts((drafts,) * DEPTH, continued, runtime.vocab_size))
                results = runtime.generate(chunk, config, synthetic=synthetic)
                spec += [r.tokens for r in results]
                taus += [r.stats.tau for r in results]
            same = [p == s for p, s in zip(plain, spec)]
            entry = {"identical": sum(same), "of": len(same), "tau": round(sum(taus) / len(taus), 3),
                     "identical_to_verify_width": sum(w == s for w, s in zip(wide, spec))}
            differing = [i for i, s in enumerate(same) if not s]
            if differing:
                i = differing[0]
                entry["first_difference"] = _first_difference(runtime, prompts[i], plain[i], spec[i])
            record[f"batch {batch}, {'synthetic 0.7' if drafts != 'drafter' else 'random drafter'}"] = entry
    return record


EXACT_SPECULATION = {"chain": DEPTH, "dynamic tree": DynamicTree(top_k=4, depth=DEPTH, nodes=8)}
EXACT_DRAFTS = ("random drafter", 0.7, 0.9)


def unbind(runtime) -> None:
    exact_mode.unbind(*(graph for graph, _ in runtime.backend.graphs.values()))


def exact_lossless(target, drafter, device: str, cuda_graphs: bool, prompts, new_tokens: int,
                   batches=(1, 4, 16), drafts=EXACT_DRAFTS, speculations=EXACT_SPECULATION) -> dict:
    """Exact mode: speculative output against plain decoding, both through the kernels, on every
    prompt; per speculation, batch and drafter, how many are identical (all, if the kernels hold).
    The synthetic drafts' right tokens are plain decoding's own, decoded `depth` tokens past the
    compared ones: the kernels give a row the same bits at every width, so the verify-width
    continuation `SyntheticDrafts.for_prompts` decodes is this one (a pass of speculative rounds per
    speculation saved; where the kernels failed that, the outputs differ here all the same)."""
    config = GenerationConfig(max_new_tokens=new_tokens)
    longer = GenerationConfig(max_new_tokens=new_tokens + max(as_tree(s).depth for s in speculations.values()))
    record, plain = {}, {}
    for name, speculation in speculations.items():
        runtime = make_runtime(target, drafter, device, cuda_graphs, speculation=speculation, exact=True)
        try:
            for batch in batches:
                chunks = _batches(prompts, batch)
                if batch not in plain:  # plain decoding does not depend on the speculation
                    plain[batch] = [[r.tokens for r in runtime.generate(c, longer, speculative=False)] for c in chunks]
                for chosen in drafts:
                    spec, taus = [], []
                    for chunk, continuations in zip(chunks, plain[batch]):
                        synthetic = (None if chosen == "random drafter" else
                                     SyntheticDrafts((chosen,) * runtime.depth, continuations, runtime.vocab_size))
                        results = runtime.generate(chunk, config, synthetic=synthetic)
                        spec += [r.tokens for r in results]
                        taus += [r.stats.tau for r in results]
                    expected = [c[:new_tokens] for chunk in plain[batch] for c in chunk]
                    same = [p == s for p, s in zip(expected, spec)]
                    entry = {"identical": sum(same), "of": len(same), "tau": round(sum(taus) / len(taus), 3)}
                    if not all(same):
                        i = same.index(False)
                        entry["first_difference"] = _first_difference(runtime, prompts[i], expected[i], spec[i])
                    label = "synthetic " + str(chosen) if chosen != "random drafter" else chosen
                    record[f"{name}, batch {batch}, {label}"] = entry
        finally:
            unbind(runtime)
    return record


def exact_cost(target, drafter, device: str, cuda_graphs: bool, prompts, new_tokens: int, batches=(1, 16)) -> dict:
    """The plain step through the kernels beside the same step through cuBLAS and torch attention, on
    the same weights and prompts, one after the other: median milliseconds of plain decoding's rounds
    (each one target call of width 1 and its host work) after one warm-up generate."""
    config = GenerationConfig(max_new_tokens=new_tokens)
    out = {}
    for batch in batches:
        chunk = (prompts * batch)[:batch]
        row = {}
        for name, exact in (("torch_ms", False), ("exact_ms", True)):
            runtime = make_runtime(target, drafter, device, cuda_graphs, exact=exact)
            try:
                runtime.generate(chunk, config, speculative=False)  # warm-up: compiles, captures
                runtime.generate(chunk, config, speculative=False)
                steps = sorted(runtime.timings.plain_round_s)
                row[name] = round(1000 * steps[len(steps) // 2], 3)
            finally:
                unbind(runtime)
        row["exact_over_torch"] = round(row["exact_ms"] / row["torch_ms"], 3)
        out[f"batch {batch}"] = row
    return out


def costs(runtime, batches=(1, 4, 16), peak: float | None = None, copy: float | None = None) -> dict:
    out = {}
    for b in batches:
        curves = runtime.cost_curves(b)
        out[b] = curves.in_ms(b)
        if copy is not None:
            out[b]["bandwidth"] = bandwidth(runtime, b, peak, copy)
    return out


def sweep(runtime, prompts, new_tokens: int, values=SWEEP, batches=(1, 4), repeat: int = REPEATS,
          deadline: float = math.inf) -> list[dict]:
    """`bench` at each synthetic setting, batch by batch; no batch starts past `deadline` (perf_counter)."""
    settings = [(a,) * DEPTH for a in values] + [REAL_ACCEPTANCE]
    config = GenerationConfig(max_new_tokens=new_tokens)
    runs = []
    for b in batches:
        if time.perf_counter() > deadline and runs:
            break
        runs.append(bench({"kit": runtime}, prompts, b, config, acceptances=settings, repeat=repeat))
    for run in runs:
        for record in run["builds"]["kit"]["sweep"]:
            for policy in record["policies"].values():
                passes = policy["speedup_by_pass"]
                policy["speedup_median_of_passes"] = round(statistics.median(passes), 4)
                policy["spread_of_passes"] = round(max(passes) / min(passes) - 1, 4)
                policy["repeats_disagree"] = policy["spread_of_passes"] > REPEAT_TOLERANCE
    return runs


def export_check(shape: str, out_dir: Path) -> dict:
    """The real-width graphs with EXPORT_LAYERS layers, fp32 on the CPU: exported, linted, and one
    prefill in ONNX Runtime against torch."""
    from ..export.export import export_drafter, export_target
    from ..models import contract as C
    from ..runtime.backends import ort_session, run_onnx

    target, drafter = random_pair(shape, "cpu", torch.float32, layers=EXPORT_LAYERS)
    start = time.perf_counter()
    summary = {"layers": EXPORT_LAYERS,
               "target": export_target(target, out_dir / "target.onnx", return_logits=False),
               "drafter": export_drafter(drafter, DEPTH, False, out_dir / "drafter.onnx")}
    ids = torch.tensor([random_prompts(target.config.vocab_size, 1)[0]])
    k, v = target.empty_cache(1, 0)
    feeds = {C.INPUT_IDS: ids, C.POSITIONS: torch.arange(ids.shape[1])[None], C.PAST_KEY: k, C.PAST_VALUE: v,
             C.CACHE_LENS: torch.zeros(1, dtype=torch.int64), C.TREE_MASK: torch.ones(1, ids.shape[1], ids.shape[1],
                                                                                         dtype=torch.bool).tril()}
    ort = run_onnx(ort_session(out_dir / "target.onnx"), feeds)
    with torch.no_grad():
        ref = TargetGraph(target, False)(*feeds.values())
    aux = ort[C.AUX_HIDDEN]
    return {**{k: {"nodes": v["nodes_after_passes"], "export_seconds": v["export_seconds"]} for k, v in summary.items()
               if k != "layers"},
            "layers": EXPORT_LAYERS, "seconds": round(time.perf_counter() - start, 1),
            "greedy_ids_equal": bool(torch.equal(ort[C.GREEDY_IDS], ref[0])),
            "aux_max_rel_err": float((aux - ref[1]).abs().max() / ref[1].abs().max())}


def step_key(name: str) -> str:
    """A report step's name as `--steps` names it: lossless (with CUDA graphs, or eager on a CPU), eager,
    fp32, cost (exact mode's plain step beside cuBLAS's), costs, sweep, export; pair always runs."""
    name = name.removeprefix("exact ")
    if name.startswith("lossless"):
        return "fp32" if "fp32" in name else "eager" if "(eager)" in name and torch.cuda.is_available() else "lossless"
    return name.split(" (")[0]


def check_steps(text: str, known) -> set[str]:
    chosen = set(known) if text.strip() == "all" else {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(chosen - set(known))
    if not chosen or unknown:
        raise EagleExportError(f"unknown kit step(s) {unknown or text!r}", f"choose from all, {', '.join(known)}")
    return chosen


def check_acceptances(text: str) -> tuple[float, ...]:
    """--sweep's comma-separated uniform acceptances, each in [0, 1]."""
    return tuple(parse_probabilities(text, "--sweep", "--sweep 0,0.6,0.9"))


def run_kit(shapes: list[str], report: Path, plot: Path | None, budget_s: float, echo=print,
            dtype: torch.dtype | None = None, export: bool = True, num_prompts: int | None = None,
            new_tokens: int | None = None, repeat: int = REPEATS, exact: bool = False, steps=None,
            values: tuple[float, ...] | None = None) -> dict:
    """Every step for every shape, in order, until `budget_s` runs out; the report after each step.
    The first shape also runs eagerly in fp32 (on a GPU), which tells the verify width's rounding in
    bf16 from a bug, and the export check follows it. `exact`: exact mode's steps instead, in bf16
    (on a CPU through Triton's interpreter, which must be on: the tiny shape in CI), the cost curves
    and the sweep through the kernels. `steps`: the step_key names to run (None: all); `values`: the
    sweep's uniform acceptances (None: SWEEP)."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if exact:  # refused here, before any model is made, where the kernels cannot run
        exact_mode.check(device, {torch.bfloat16})
        dtype = dtype or torch.bfloat16
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    result = {"device": torch.cuda.get_device_name(0) if cuda else "CPU", "torch": torch.__version__,
              "dtype": str(dtype).removeprefix("torch."), "depth": DEPTH, "exact": exact, "shapes": {},
              "note": "random weights; sweep rows are SYNTHETIC acceptance (the real drafter runs, its drafts "
                      "are replaced)"}
    if exact:  # how the kernels launch here: the reductions over programs, programmatic dependent launch
        result["kernels"] = kernels.ops().launch_path(torch.device(device))
        echo(f"  exact kernels: reductions {result['kernels']['reductions']}, programmatic dependent launch "
             f"{'on' if result['kernels']['pdl'] else 'off'}")
    start = time.perf_counter()

    def step(name, record, fn):
        if steps is not None and name != "pair" and step_key(name) not in steps:
            return None
        if time.perf_counter() - start > budget_s:
            record[name] = {"skipped": "the kit's time budget ran out"}
            echo(f"  {name}: skipped (budget)")
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
            record[name] = value
            echo(f"  {name}: {step_result(name, value)} ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # a failed step is a finding: record it and go on
            value = None
            record[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            echo(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        record.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        write_output(report, json.dumps(result, indent=1, default=str) + "\n")
        return value

    tiny = shapes == ["tiny"]
    # CI's CPU run keeps every step and shrinks the work; a GPU run measures
    count, values = (num_prompts or 2, values or (0.0, 0.9)) if tiny else (num_prompts or PROMPTS, values or SWEEP)
    asked_tokens, new_tokens = new_tokens, new_tokens or (8 if tiny else NEW_TOKENS)
    result["cells"] = {"prompts": count, "new_tokens": new_tokens, "repeats": repeat}
    peak = peak_bandwidth(result["device"])
    result["peak_bandwidth_gb_s"] = None if peak is None else peak / 1e9
    if peak is None:
        result["peak_note"] = (f"{result['device']} is not in the kit's table of peak bandwidths: the plain step "
                               "is reported against the measured copy only")
        echo(f"  {result['peak_note']}")
    copy = copy_bandwidth(device)
    result["copy_bandwidth_gb_s"] = float(f"{copy / 1e9:.4g}")
    echo(f"  bandwidth references: measured device-to-device copy {result['copy_bandwidth_gb_s']:g} GB/s, "
         + ("datasheet peak not known" if peak is None else f"datasheet peak {peak / 1e9:g} GB/s"))
    for n, shape in enumerate(shapes):
        echo(f"{shape} ({result['device']}, {result['dtype']})")
        record = result["shapes"][shape] = {}
        pair = {}

        def make():
            t0 = time.perf_counter()
            # the interpreter runs each kernel program in Python: CI's exact run keeps 2 layers
            pair["models"] = random_pair(shape, device, dtype, layers=2 if exact and tiny else None)
            target, drafter = pair["models"]
            params = {id(p): p for m in pair["models"] for p in m.parameters()}
            out = {"parameters": sum(p.numel() for p in params.values()),
                   "weight_bytes": sum(p.numel() * p.element_size() for p in params.values()),
                   "seconds": round(time.perf_counter() - t0, 1), "layers": target.config.num_layers,
                   "vocab": target.config.vocab_size, "draft_vocab": drafter.config.draft_vocab_size}
            if cuda:
                out["gpu_memory_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            return out

        if step("pair", record, make) is not None and exact:
            target, drafter = pair.pop("models")
            # CI's run proves the path (the interpreter: ~1 s a call); a GPU run measures. CI's two prompts
            # are ragged (2 and 5 tokens) and short: a prefill's attention is one interpreted program per row
            prompts = random_prompts(target.config.vocab_size, 2, lengths=(2, 5)) if tiny else \
                random_prompts(target.config.vocab_size, max(16, num_prompts or 16))
            tokens, batches = (3, (2,)) if tiny else (asked_tokens or 32, (1, 4, 16))
            drafts = (0.9,) if tiny else EXACT_DRAFTS
            speculations = {"chain": 2, "dynamic tree": DynamicTree(top_k=2, depth=2, nodes=3)} if tiny else \
                EXACT_SPECULATION
            for mode in ("eager", "cuda_graphs") if cuda else ("eager",):
                step(f"exact lossless ({mode})", record, lambda: exact_lossless(
                    target, drafter, device, mode == "cuda_graphs", prompts, tokens, batches, drafts, speculations))
            step("exact cost", record, lambda: exact_cost(target, drafter, device, cuda, prompts, 2 if tiny else tokens,
                                                          (1,) if tiny else (1, 16)))
            # the interpreter takes ~1 s a call: CI's tiny kit runs these steps without --exact
            if not tiny and (steps is None or steps & {"costs", "sweep"}):
                fast = make_runtime(target, drafter, device, cuda, exact=True)
                step("costs", record, lambda: costs(fast, (1, 4, 16), peak, copy))
                record["sweep dtype"], record["sweep kernels"] = str(dtype).removeprefix("torch."), "exact"
                step("sweep", record, lambda: sweep(fast, prompts[:count], new_tokens, values, (1, 4, 16), repeat,
                                                    deadline=start + budget_s))
                unbind(fast)
                fast = None
            target = drafter = None
            if cuda:
                torch.cuda.empty_cache()
        elif pair.get("models") is not None:
            target, drafter = pair.pop("models")
            prompts = random_prompts(target.config.vocab_size, count)
            runtimes = {"eager": make_runtime(target, drafter, device, cuda_graphs=False)} if n == 0 or not cuda else {}
            if cuda:
                runtimes["cuda_graphs"] = make_runtime(target, drafter, device, cuda_graphs=True)
            for mode, runtime in runtimes.items():
                step(f"lossless ({mode})", record, lambda: lossless(runtime, prompts, new_tokens))
            fast = runtimes.get("cuda_graphs", runtimes.get("eager"))
            step("costs", record, lambda: costs(fast, (1, 4) if tiny else (1, 4, 16), peak, copy))
            if dtype != SWEEP_DTYPE and (steps is None or "sweep" in steps):  # see SWEEP_DTYPE
                del runtimes, fast, runtime, target, drafter
                if cuda:
                    torch.cuda.empty_cache()
                target, drafter = random_pair(shape, device, SWEEP_DTYPE)
                fast = make_runtime(target, drafter, device, cuda_graphs=cuda)
            record["sweep dtype"] = str(SWEEP_DTYPE).removeprefix("torch.")
            step("sweep", record, lambda: sweep(fast, prompts, new_tokens, values, repeat=repeat))
            runtimes = runtime = fast = target = drafter = None  # the GPU memory goes before the next shape
            if cuda:
                torch.cuda.empty_cache()
        if n == 0 and cuda and dtype != torch.float32 and not exact:
            def fp32():
                target32, drafter32 = random_pair(shape, device, torch.float32)
                return lossless(make_runtime(target32, drafter32, device, cuda_graphs=False), prompts, new_tokens)
            step("lossless (eager, fp32: no bf16 rounding)", record, fp32)
            torch.cuda.empty_cache()
        if n == 0 and export and not exact:
            with tempfile.TemporaryDirectory() as tmp:
                step(f"export ({shape}, {EXPORT_LAYERS} layers, fp32, CPU)", result,
                     lambda: export_check(shape, Path(tmp)))
    result["seconds"] = round(time.perf_counter() - start, 1)
    write_output(report, json.dumps(result, indent=1, default=str) + "\n")
    if plot is not None:
        sweeps = [(s, r) for s, rec in result["shapes"].items() if isinstance(rec.get("sweep"), list)
                  for r in rec["sweep"]]
        if sweeps:
            plot_sweep([dict(r, backend=f"{s}: {r['backend']}") for s, r in sweeps], plot)
    return result


def step_result(name: str, value) -> str:
    """A kit step's result in one line, as the report holds it (the JSON has every figure)."""
    if name == "pair":
        return (f"{value['parameters'] / 1e9:.2f}B parameters, {value['weight_bytes'] / 2**30:.2f} GiB, "
                f"{value['layers']} layers, vocabulary {value['vocab']} (draft {value['draft_vocab']})")
    if name.startswith("lossless"):
        return "; ".join(f"{run}: identical {e['identical']}/{e['of']} (to verify width {e['identical_to_verify_width']}"
                         f"/{e['of']}), tau {e['tau']:.2f}" for run, e in value.items())
    if name == "costs":
        def device(bw):
            return f" (graph alone {bw['device_step_ms']:.2f} ms)" if "device_step_ms" in bw else ""
        return "; ".join(f"batch {b}: verify T=1 {v[min(v)]:.2f} ms{device(c.get('bandwidth', {}))}, T={max(v)} "
                         f"{v[max(v)]:.2f} ms, drafter {max(c['draft_ms'].values()):.2f} ms"
                         for b, c in value.items() for v in [c["verify_ms"]])
    if name == "sweep":
        return "; ".join(
            f"batch {r['batch']}: speedup goodput/fixed " + ", ".join(
                f"{rec['acceptance']} {rec['policies']['goodput']['decode_speedup']:.2f}/"
                f"{rec['policies']['fixed']['decode_speedup']:.2f}x" for rec in build["sweep"])
            + f", break-even acceptance {build['break_even_acceptance']}"
            # the fixed policy's rounds all draft and run on the device (captured bookkeeping with CUDA graphs);
            # its host time less the synthetic drafts' making, which the benchmark adds and a served request has not
            + ", host per drafted round (fixed, synthetic drafts' making apart) {:.2f}-{:.2f} ms".format(*_span(
                split["host_per_round_ms"] - split["synthetic_per_round_ms"]
                for rec in build["sweep"] for split in [rec["policies"]["fixed"]["time_split"]]))
            for r in value for build in r["builds"].values())
    if name.startswith("exact lossless"):
        same = sum(e["identical"] for e in value.values())
        return f"identical {same}/{sum(e['of'] for e in value.values())} over {len(value)} runs" + "".join(
            f"; {run}: {e['identical']}/{e['of']}" for run, e in value.items() if e["identical"] < e["of"])
    if name == "exact cost":
        return "; ".join(f"{b}: exact {r['exact_ms']:.2f} ms, torch {r['torch_ms']:.2f} ms ({r['exact_over_torch']:.2f}x)"
                         for b, r in value.items())
    if name.startswith("export"):
        return (f"greedy ids equal to torch: {'yes' if value['greedy_ids_equal'] else 'NO'}, aux max relative error "
                f"{value['aux_max_rel_err']:.2g}")
    return "done"


def _span(values) -> tuple[float, float]:
    values = list(values)
    return min(values), max(values)


def check_shapes(text: str) -> list[str]:
    shapes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in TARGETS]
    if not shapes or unknown:
        raise EagleExportError(f"unknown kit shape(s) {unknown or text!r}", f"choose from {', '.join(TARGETS)}")
    if "tiny" in shapes and len(shapes) > 1:
        raise EagleExportError("the tiny shape is CI's CPU run", "pass --shapes tiny alone, or real shapes")
    return shapes

