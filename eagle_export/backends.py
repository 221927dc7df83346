"""Backends: run the target and drafter graphs by the contract's names, on torch tensors in and out.

torch: the exported torch modules themselves (the reference, and a GPU path); onnxruntime: the
ONNX files (CPU, or the CUDA provider when installed); tensorrt: the engines. The runtime loop is
the same for all three; only `target()` and `drafter()` differ.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from . import contract as C
from .errors import EagleExportError


class Backend:
    name = "?"
    device = "cpu"

    def __init__(self, depth: int, model_dtype: torch.dtype, has_logits: bool, has_sampling: bool):
        self.depth, self.model_dtype = depth, model_dtype
        self.has_logits, self.has_sampling = has_logits, has_sampling

    def target(self, feeds: dict[str, torch.Tensor], need_logits: bool = False) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def drafter(self, feeds: dict[str, torch.Tensor], sampling: bool = False) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, target_graph, drafter_graph, drafter_sampling_graph=None, device: str = "cpu"):
        dtype = target_graph.target.embed_tokens.weight.dtype
        super().__init__(drafter_graph.depth, dtype, target_graph.return_logits, drafter_sampling_graph is not None)
        self.target_graph, self.drafter_graph = target_graph, drafter_graph
        self.drafter_sampling_graph = drafter_sampling_graph
        self.device = device
        self.target_names = [C.GREEDY_IDS] + ([C.LOGITS] if target_graph.return_logits else []) + [
            C.AUX_HIDDEN, C.NEW_KEY, C.NEW_VALUE]

    @torch.inference_mode()
    def target(self, feeds, need_logits=False):
        args = [feeds[n] for n in (C.INPUT_IDS, C.POSITIONS, C.PAST_KEY, C.PAST_VALUE, C.CACHE_LENS)]
        return dict(zip(self.target_names, self.target_graph(*args)))

    @torch.inference_mode()
    def drafter(self, feeds, sampling=False):
        names = [C.INPUT_IDS, C.AUX_HIDDEN, C.NUM_VALID, C.PAST_KEY, C.PAST_VALUE, C.CACHE_LENS]
        graph = self.drafter_sampling_graph if sampling else self.drafter_graph
        if sampling:
            names += [C.TEMPERATURE, C.UNIFORM_NOISE]
        outputs = graph(*[feeds[n] for n in names])
        out_names = [C.DRAFT_IDS, C.DRAFT_TOKEN_PROBS] + ([C.DRAFT_PROBS] if sampling else []) + [C.NEW_KEY, C.NEW_VALUE]
        return dict(zip(out_names, outputs))


_ORT_TO_TORCH = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16,
                 "tensor(bfloat16)": torch.bfloat16}


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, target_onnx: Path, drafter_onnx: Path, drafter_sampling_onnx: Path | None = None,
                 providers: list[str] | None = None, threads: int | None = None, optimize: bool = True):
        import onnxruntime as ort

        available = ort.get_available_providers()
        providers = providers or [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        if not optimize:  # ORT fuses DequantizeLinear+MatMul into kernels that reject float8 inputs
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.providers = providers

        def session(path):
            try:
                return ort.InferenceSession(str(path), options, providers=providers)
            except Exception as e:  # ORT raises its own exception types for unreadable files
                raise EagleExportError(f"ONNX Runtime cannot load {Path(path).name}: {str(e).splitlines()[0]}",
                                       "rebuild with `eagle-export build --force`") from None

        self.target_session, self.drafter_session = session(target_onnx), session(drafter_onnx)
        self.drafter_sampling_session = session(drafter_sampling_onnx) if drafter_sampling_onnx else None
        target_outputs = [o.name for o in self.target_session.get_outputs()]
        past = next(i for i in self.target_session.get_inputs() if i.name == C.PAST_KEY)
        if past.type == "tensor(bfloat16)":
            raise EagleExportError("ONNX Runtime's CPU provider cannot feed bfloat16 graphs from numpy",
                                   "build with precision fp32 or fp16 for ONNX Runtime, or use --backend torch")
        super().__init__(int(self.drafter_session.get_outputs()[0].shape[1]), _ORT_TO_TORCH[past.type],
                         C.LOGITS in target_outputs, self.drafter_sampling_session is not None)
        self.device = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"

    @staticmethod
    def _run(session, feeds, output_names=None):
        inputs = {i.name: feeds[i.name].numpy() for i in session.get_inputs()}
        names = output_names or [o.name for o in session.get_outputs()]
        return {n: torch.from_numpy(np.asarray(v)) for n, v in zip(names, session.run(names, inputs))}

    def target(self, feeds, need_logits=False):
        names = [o.name for o in self.target_session.get_outputs() if need_logits or o.name != C.LOGITS]
        return self._run(self.target_session, feeds, names)

    def drafter(self, feeds, sampling=False):
        return self._run(self.drafter_sampling_session if sampling else self.drafter_session, feeds)


class TensorRTBackend(Backend):
    """Engines bound by name; profile 0 serves prefill, profile 1 decode (see engine.engine_profiles)."""

    name = "tensorrt"
    device = "cuda"

    def __init__(self, target_engine: Path, drafter_engine: Path, depth: int, model_dtype: torch.dtype,
                 has_logits: bool):
        from .engine import TensorRTSession

        super().__init__(depth, model_dtype, has_logits, has_sampling=False)
        self.target_session, self.drafter_session = TensorRTSession(target_engine), TensorRTSession(drafter_engine)

    def _profile(self, feeds):
        return 1 if feeds[C.INPUT_IDS].shape[1] <= self.depth + 1 else 0

    def target(self, feeds, need_logits=False):
        return self.target_session.run(dict(feeds), self._profile(feeds))

    def drafter(self, feeds, sampling=False):
        return self.drafter_session.run(dict(feeds), self._profile(feeds))
