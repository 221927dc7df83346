"""`eagle-export doctor`: what this machine has, what it can build, and what to install for the rest."""

from __future__ import annotations

import platform

from ..environment import buildable_precisions, gpu_info, nvidia_driver_loaded, package_version, tensorrt_version

NO_GPU_SELFTEST = "selftest --gpu: no CUDA GPU on this machine (no NVIDIA driver, or torch sees no GPU); nothing to test"


ORT_FIX = "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu"


def package_conflicts() -> list[str]:
    """Installed packages that break each other, each with the command that mends it."""
    conflicts = []
    cpu, gpu = package_version("onnxruntime"), package_version("onnxruntime-gpu")
    if cpu and gpu:  # one folder, two packages: whichever installed last wins, often without CUDA
        conflicts.append(f"onnxruntime {cpu} and onnxruntime-gpu {gpu} are both installed; they share one folder "
                         f"and the CUDA provider can silently vanish. Fix: {ORT_FIX}")
    return conflicts


def _torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def doctor_report() -> dict:
    gpu = gpu_info()
    trt = tensorrt_version()
    ort_providers = []
    try:
        import onnxruntime

        ort_providers = onnxruntime.get_available_providers()
    except Exception:
        pass
    report = {
        "python": platform.python_version(),
        "torch": package_version("torch"), "nvidia_driver": nvidia_driver_loaded(),
        "cuda": _torch_cuda() if nvidia_driver_loaded() else None, "cuda_available": gpu is not None,
        "gpu": gpu, "tensorrt": trt, "onnx": package_version("onnx"),
        "onnxruntime": package_version("onnxruntime") or package_version("onnxruntime-gpu"),
        "onnxruntime_providers": ort_providers, "modelopt": package_version("nvidia-modelopt"),
        "can_build": buildable_precisions(gpu["compute_capability"] if gpu else None, trt is not None),
    }
    advice = package_conflicts()
    if trt is None:
        advice.append("TensorRT engines: pip install 'eagle-export[gpu]' on a machine with an NVIDIA GPU "
                      "(installs TensorRT for CUDA 12; see the README for CUDA 13)")
    if gpu is None:
        advice.append("no CUDA GPU: builds stop after the ONNX stage and run on ONNX Runtime (CPU); "
                      "NVFP4 calibration through ModelOpt needs CUDA (weights can still be packed on CPU)")
    if "CUDAExecutionProvider" not in ort_providers and gpu is not None:
        advice.append(f"ONNX Runtime has no CUDA provider: {ORT_FIX}")
    report["advice"] = advice
    return report
