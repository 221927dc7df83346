"""Open a build directory: its manifest, a backend for its graphs, and a runtime over them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import EagleExportError
from .manifest import read_manifest, verify_artifacts
from .recipe import QUANTIZED
from .runtime import SpeculativeRuntime

BACKENDS = ("auto", "tensorrt", "onnxruntime", "torch")


@dataclass
class OpenBuild:
    path: Path
    manifest: dict
    runtime: SpeculativeRuntime
    tokenizer: object | None
    eos_ids: tuple[int, ...]

    def chat_template(self):
        from .prompts import ChatTemplate

        if not (self.path / "tokenizer_config.json").is_file():
            raise EagleExportError(f"{self.path} has no chat template", "pass --prompt instead of --chat")
        return ChatTemplate(self.path)

    def chat_prompt(self, text: str) -> list[int]:
        return self.chat_template().encode_chat([{"role": "user", "content": text}])

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EagleExportError(f"{self.path} has no tokenizer.json", "rebuild from a checkpoint with a tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _eos_ids(manifest: dict) -> tuple[int, ...]:
    eos = manifest["models"]["target"].get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def torch_models(manifest: dict):
    """The build's torch modules, rebuilt from its sources with the same model passes; unquantized
    even for a quantized build (validation compares its graphs with them)."""
    from .checkpoint import load_drafter, load_target
    from .passes.base import PassManager
    from .passes.model_pipeline import EagleModels, model_passes

    models = manifest["models"]
    for role in ("target", "drafter"):
        if not Path(manifest["sources"][role]).is_dir():
            raise EagleExportError(f"the torch backend needs the {role} checkpoint {manifest['sources'][role]}, "
                                   "which is gone", "use --backend onnxruntime, or restore the checkpoint")
    target = load_target(manifest["sources"]["target"], dtype=models["target"]["dtype"],
                         aux_layer_ids=tuple(models["target"]["aux_layer_ids"]))
    drafter = load_drafter(manifest["sources"]["drafter"], target=target, dtype=models["drafter"]["dtype"])
    skip = set(manifest["passes"]["skipped_by_recipe"])
    PassManager([p for p in model_passes() if p.name not in skip])(EagleModels(target, drafter))
    return target, drafter


def make_backend(path: Path, manifest: dict, backend: str, threads: int | None = None):
    from .backends import OnnxRuntimeBackend, TensorRTBackend, TorchBackend

    if backend not in BACKENDS:
        raise EagleExportError(f"unknown backend {backend!r}", f"choose one of {', '.join(BACKENDS)}")
    engines = manifest["engines"]
    if backend in ("auto", "tensorrt") and isinstance(engines, list):
        from .doctor import gpu_info, tensorrt_version
        from .engine import pick_engine

        gpu = gpu_info()
        cc, trt = (gpu["compute_capability"] if gpu else None), tensorrt_version()
        try:
            chosen = {g: pick_engine([e for e in engines if e["graph"] == g], cc, trt) for g in ("target", "drafter")}
        except EagleExportError:
            if backend == "tensorrt":
                raise
        else:
            from .checkpoint import resolve_dtype

            dtype = resolve_dtype(manifest["models"]["target"]["dtype"])
            return TensorRTBackend(path / chosen["target"]["file"], path / chosen["drafter"]["file"],
                                   manifest["depth"], dtype, manifest["graphs"]["target"]["return_logits"])
    if backend == "tensorrt":
        raise EagleExportError(f"{path} has no TensorRT engines ({engines.get('skipped', '')})",
                               "use --backend onnxruntime, or rebuild on a machine with TensorRT and a GPU")
    if backend == "torch":
        from .unrolled import TargetGraph, UnrolledDrafter

        models = manifest["models"]
        if models["target"]["precision"] in QUANTIZED or models["drafter"]["precision"] in QUANTIZED:
            raise EagleExportError("the torch backend runs unquantized builds only",
                                   "use --backend onnxruntime (FP8) or tensorrt for this build")

        target, drafter = torch_models(manifest)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        target, drafter = target.to(device), drafter.to(device)
        depth = manifest["depth"]
        return TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, depth, False),
                            UnrolledDrafter(drafter, depth, True), device=device)
    graphs = manifest["graphs"]
    precisions = {manifest["models"][m]["precision"] for m in ("target", "drafter")}
    if "nvfp4" in precisions:
        raise EagleExportError("ONNX Runtime has no FP4 kernels: this NVFP4 build runs on TensorRT only",
                               "run it where TensorRT and a compute capability 10.0+ GPU exist")
    sampling = path / graphs["drafter_sampling"]["file"] if "drafter_sampling" in graphs else None
    return OnnxRuntimeBackend(path / graphs["target"]["file"], path / graphs["drafter"]["file"], sampling,
                              threads=threads, optimize="fp8" not in precisions)


def open_build(path: str | Path, backend: str = "auto", threads: int | None = None,
               verify: bool = True) -> OpenBuild:
    """Open a build for generation; `verify` re-hashes every artifact first (a corrupt file is named)."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        problems = verify_artifacts(path, manifest)
        if problems:
            raise EagleExportError(f"{path} does not match its manifest: " + "; ".join(problems),
                                   "rebuild it with `eagle-export build --force`")
    chosen = make_backend(path, manifest, backend, threads)
    t, d = manifest["models"]["target"], manifest["models"]["drafter"]
    draft_to_target = torch.from_numpy(np.load(path / "draft_to_target.npy"))
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    runtime = SpeculativeRuntime(chosen, t["num_layers"], t["num_kv_heads"], t["head_dim"], d["num_kv_heads"],
                                 d["head_dim"], len(t["aux_layer_ids"]) * t["hidden_size"], manifest["max_context"],
                                 draft_to_target=draft_to_target, tokenizer=tokenizer)
    return OpenBuild(path, manifest, runtime, tokenizer, _eos_ids(manifest))
