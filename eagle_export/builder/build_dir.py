"""Open a build directory: its manifest, a backend for its graphs, and a runtime over them."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from ..data.prompts import ChatTemplate
from ..engine.engine import pick_engine
from ..environment import gpu_info, tensorrt_version
from ..errors import REBUILD, EagleExportError
from ..export.loader import load_pair, passes_skipping
from ..export.unrolled import TargetGraph, UnrolledDrafter
from ..files import load_int_array, load_tokenizer
from ..models.nvfp4 import use_graph_weights
from ..runtime import exact as exact_mode
from ..runtime.backends import OnnxRuntimeBackend, TensorRTBackend, TorchBackend
from ..runtime.costs import CostCache, cache_path, cost_key
from ..runtime.runtime import PairShapes, SpeculativeRuntime
from .manifest import MANIFEST, Manifest, check_build, check_sources, contradictions, read_manifest, rebuild_hint

BACKENDS = ("auto", "tensorrt", "onnxruntime", "torch")


@dataclass
class OpenBuild:
    path: Path
    manifest: Manifest
    runtime: SpeculativeRuntime
    tokenizer: object | None
    eos_ids: tuple[int, ...]

    def chat_template(self) -> ChatTemplate:
        if not (self.path / "tokenizer_config.json").is_file():
            raise EagleExportError(f"{self.path} has no tokenizer_config.json to read a chat template from",
                                   "pass --prompt instead of --chat")
        return ChatTemplate(self.path)  # a base model's: the raw text (its note says so)

    def chat_prompt(self, text: str) -> list[int]:
        return self.chat_template().encode_chat([{"role": "user", "content": text}])

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EagleExportError(f"{self.path} has no tokenizer.json", "rebuild from a checkpoint with a tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def torch_models(manifest: Manifest, nvfp4_from: Path | None = None, allow_changed_sources: bool = False,
                 build_dir: Path | None = None):
    """The build's torch modules, rebuilt from its sources with the same model passes; unquantized
    even for a quantized build (validation compares its graphs with them), unless `nvfp4_from` names
    the build directory: then its NVFP4 models run the NVFP4 weights of its own graphs. Refused
    unless every source file still has the sha256 the build recorded (`check_sources`: other weights
    would run silently), or `allow_changed_sources`."""
    check_sources(manifest, allow_changed_sources, "the torch backend",
                  "use the onnxruntime backend (it runs the build's own graphs), ",
                  build_dir=build_dir or nvfp4_from or "BUILD")
    target, drafter = load_pair(manifest.target.source, manifest.drafter.source, manifest.target.dtype,
                                passes=passes_skipping(manifest.skipped_passes),
                                drafter_dtype=manifest.drafter.dtype, aux_layer_ids=manifest.target.aux_layer_ids)
    if nvfp4_from is not None:
        for role, module, graph in (("target", target, manifest.target_graph), ("drafter", drafter, manifest.drafter_graph)):
            if manifest.models[role].precision == "nvfp4":
                use_graph_weights(module, onnx.load(str(nvfp4_from / graph.file)), role)
    return target, drafter


def check_exact(manifest: Manifest, backend: str) -> None:
    """Exact mode's refusal (runtime/exact.py) from the manifest alone, before any model loads."""
    models = manifest.models.values()
    exact_mode.check("cuda" if torch.cuda.is_available() else "cpu", {m.dtype for m in models},
                     {m.precision for m in models}, max(m.head_dim for m in models), backend=backend)


def make_backend(path: Path, manifest: Manifest, backend: str, threads: int | None = None,
                 cuda_graphs: bool | None = None, allow_changed_sources: bool = False, exact: bool | None = None):
    """cuda_graphs (torch backend): None replays CUDA graphs whenever it runs on CUDA; True insists.
    exact: the torch backend bound to the width-invariant kernels: True insists (refused elsewhere,
    before loading), False never, None on a CUDA GPU wherever they hold (runtime.exact.resolve)."""
    if backend not in BACKENDS:
        raise EagleExportError(f"unknown backend {backend!r}", f"choose one of {', '.join(BACKENDS)}")
    if exact:
        backend = "torch" if backend == "auto" else backend  # auto: the one backend exact mode binds
        check_exact(manifest, backend)
    if cuda_graphs and backend != "torch":
        raise EagleExportError(f"CUDA graphs are the torch backend's fast path, not the {backend} backend's "
                               "(TensorRT and ONNX Runtime launch their own kernels)",
                               "pass --backend torch with --cuda-graphs")
    if backend in ("auto", "tensorrt") and manifest.engines:
        gpu = gpu_info()
        cc, trt = (gpu["compute_capability"] if gpu else None), tensorrt_version()
        try:
            chosen = {g: pick_engine([e for e in manifest.engines if e.graph == g], cc, trt)
                      for g in ("target", "drafter")}
            return TensorRTBackend(path / chosen["target"].file, path / chosen["drafter"].file, manifest.speculation,
                                   manifest.target_graph.return_logits)
        except EagleExportError as e:
            if backend == "tensorrt":
                raise
            # One line on why (a TensorRT patch upgrade, another GPU, no GPU), then the ONNX graphs.
            print(f"note: running on ONNX Runtime, not TensorRT: {e.problem}", file=sys.stderr)
    if backend == "tensorrt":
        raise EagleExportError(f"{path} has no TensorRT engines ({manifest.engines_skipped or ''})",
                               "use --backend onnxruntime, or rebuild on a machine with TensorRT and a GPU")
    precisions = {m.precision for m in manifest.models.values()}
    if backend == "torch":
        if "fp8" in precisions:
            raise EagleExportError("the torch backend runs unquantized and NVFP4 builds only",
                                   "use --backend onnxruntime (FP8) or tensorrt for this build")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if cuda_graphs and device != "cuda":
            raise EagleExportError("--cuda-graphs needs a CUDA GPU, and torch sees none here",
                                   "run without --cuda-graphs (the torch backend runs eagerly on the CPU)")
        target, drafter = torch_models(manifest, path, allow_changed_sources)  # NVFP4: the graphs' own weights
        target, drafter = target.to(device), drafter.to(device)
        speculation = manifest.speculation
        sampling_graph = UnrolledDrafter(drafter, speculation, True) if speculation.can_sample else None
        return TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, speculation, False),
                            sampling_graph, device=device,
                            cuda_graphs=device == "cuda" if cuda_graphs is None else cuda_graphs, exact=exact)
    if "nvfp4" in precisions:
        raise EagleExportError("ONNX Runtime has no FP4 kernels: this NVFP4 build runs on TensorRT, or on "
                               "torch over its graphs' NVFP4 weights (slowly, on CPU)",
                               "use --backend torch, or run it where TensorRT and a compute capability 10.0+ "
                               "GPU exist")
    sampling = manifest.drafter_sampling_graph
    return OnnxRuntimeBackend(path / manifest.target_graph.file, path / manifest.drafter_graph.file,
                              path / sampling.file if sampling else None, threads=threads,
                              speculation=manifest.speculation)


def open_build(path: str | Path, backend: str = "auto", threads: int | None = None,
               verify: bool = True, verify_policy: str = "goodput", cuda_graphs: bool | None = None,
               static_cache: bool | None = None, allow_changed_sources: bool = False,
               exact: bool | None = None) -> OpenBuild:
    """Open a build for generation; `verify` passes it through the integrity gate first (`check_build`:
    a corrupt file or an edited manifest is named; only the build's own writer skips it).
    `verify_policy`: "goodput" (drafts per round chosen from the measured costs, which are cached in
    the build directory per backend and machine) or "fixed" (always all K).
    `cuda_graphs`: the torch backend's CUDA graphs (None: on whenever it runs on CUDA); `static_cache`:
    caches allocated once at the context limit and fixed call widths (None: exactly with CUDA graphs).
    `allow_changed_sources`: the torch backend rebuilds the models from checkpoints that changed since
    the build (said on stderr) instead of refusing; `exact`: the torch backend's width-invariant kernels
    (README, "Exactness per backend and dtype"): speculative output bit-identical to plain decoding in
    bf16/fp16/fp32 on a GPU. True insists (refused, before any model loads, where it cannot hold); None,
    the default, binds them on a CUDA GPU wherever they hold; False keeps cuBLAS and torch attention."""
    path = Path(path)
    manifest = check_build(path) if verify else Manifest.from_json(read_manifest(path), path / MANIFEST)
    rebuild = rebuild_hint(path, manifest.recipe, {r: m.source for r, m in manifest.models.items()})
    draft_to_target = load_int_array(path / "draft_to_target.npy", rebuild)
    problems = contradictions(manifest) + vocab_map_problems(manifest, draft_to_target)
    if problems:
        raise EagleExportError(f"{path}'s manifest contradicts its graphs or its model: " + "; ".join(problems),
                               rebuild)
    try:
        chosen = make_backend(path, manifest, backend, threads, cuda_graphs, allow_changed_sources, exact)
    except EagleExportError as e:  # an engine or graph that will not load: its fix names this build's rebuild
        if not (e.fix and REBUILD in e.fix and "`" in rebuild):
            raise
        raise EagleExportError(e.problem, e.fix.replace(REBUILD, f"`{rebuild.split('`')[1]}`")) from None
    t, d = manifest.target, manifest.drafter
    draft_to_target = torch.from_numpy(draft_to_target.astype(np.int64))
    tokenizer = load_tokenizer(path / "tokenizer.json") if os.path.lexists(path / "tokenizer.json") else None
    shapes = PairShapes(t.num_layers, t.num_kv_heads, t.head_dim, d.num_kv_heads, d.head_dim,
                        len(t.aux_layer_ids) * t.hidden_size, manifest.max_context, t.vocab_size)
    runtime = SpeculativeRuntime(chosen, shapes, draft_to_target=draft_to_target, tokenizer=tokenizer,
                                 verify_policy=verify_policy,
                                 cost_cache=CostCache(cache_path(path, manifest),
                                                      cost_key(chosen, threads, static_cache)),
                                 static_cache=static_cache)
    runtime.cannot_sample_fix = sampling_fix(manifest, chosen.name, rebuild)
    return OpenBuild(path, manifest, runtime, tokenizer, manifest.eos_ids)


def sampling_fix(manifest: Manifest, backend: str, rebuild: str) -> str:
    """What to do when this build's `backend` cannot sample: the torch backend samples from the build's
    models rebuilt from their checkpoints (a chain or static tree, not FP8); or rebuild with sampling."""
    torch_samples = (backend != "torch" and manifest.speculation.can_sample
                     and "fp8" not in {m.precision for m in manifest.models.values()})
    with_sampling = rebuild.replace(" -o ", " --set sampling=true -o ", 1) if "`eagle-export build" in rebuild else rebuild
    return ("pass --backend torch (it samples today: it runs this build's models from their checkpoints), "
            if torch_samples else "") + f"use --temperature 0, or {with_sampling}"


def vocab_map_problems(manifest: Manifest, draft_to_target: np.ndarray) -> list[str]:
    """draft_to_target.npy against the manifest: one target id per draft id, each inside the vocabulary."""
    size = manifest.drafter.draft_vocab_size
    vocab = manifest.target.vocab_size
    problems = []
    if draft_to_target.ndim != 1 or isinstance(size, int) and len(draft_to_target) != size:
        problems.append(f"draft_to_target.npy has shape {draft_to_target.shape}, the drafter's vocabulary is {size}")
    elif isinstance(vocab, int) and len(draft_to_target) and not (
            0 <= draft_to_target.min() and draft_to_target.max() < vocab):
        problems.append(f"draft_to_target.npy maps to ids outside the target's vocabulary [0, {vocab})")
    return problems

