"""`eagle-export doctor`: what this machine has, what it can build, and what to install for the rest."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

# TensorRT's hardware floors for low-precision engines (compute capability, major.minor).
FP8_MIN_CC = (8, 9)    # Ada, Hopper, Blackwell
NVFP4_MIN_CC = (10, 0)  # Blackwell


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def tensorrt_version() -> str | None:
    try:
        import tensorrt
    except Exception:  # not installed, or installed without its CUDA libraries
        return None
    return tensorrt.__version__


def nvidia_driver_loaded() -> bool:
    """Whether an NVIDIA driver is present, read from the file system without importing torch (1-10 s):
    Linux and WSL expose it as device nodes; elsewhere (Windows) torch is asked."""
    if platform.system() != "Linux":
        return True
    return any(Path(p).exists() for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"))


NO_GPU_SELFTEST = "selftest --gpu: no CUDA GPU on this machine (no NVIDIA driver, or torch sees no GPU); nothing to test"


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where no NVIDIA driver is loaded."""
    if not nvidia_driver_loaded():
        return False
    import torch

    return torch.cuda.is_available()


def gpu_info() -> dict | None:
    """The first CUDA GPU's name, compute capability and memory; None without one."""
    if not cuda_available():
        return None
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}",
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}


def buildable_precisions(compute_capability: str | None, has_tensorrt: bool) -> dict[str, str]:
    """Each precision -> 'yes' or the reason it cannot be built into an engine here."""
    out = {}
    for precision in ("fp32", "fp16", "bf16", "fp8", "nvfp4"):
        if not has_tensorrt:
            out[precision] = "ONNX only (TensorRT is not installed)"
            continue
        if compute_capability is None:
            out[precision] = "ONNX only (no CUDA GPU)"
            continue
        cc = tuple(int(x) for x in compute_capability.split("."))
        floor = {"fp8": FP8_MIN_CC, "nvfp4": NVFP4_MIN_CC, "bf16": (8, 0)}.get(precision, (0, 0))
        out[precision] = "yes" if cc >= floor else \
            f"no (needs compute capability {floor[0]}.{floor[1]}+, this GPU has {compute_capability})"
    return out


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
