"""What this machine has: package versions, TensorRT, the NVIDIA driver, the GPU, and what it can build.

Small probes, each cheap where it can be (no torch import without an NVIDIA driver), read by
`doctor`, the build, the runtime's cost cache and the manifest alike.
"""

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
