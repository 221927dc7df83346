"""Width-invariant kernels: one arithmetic per row, whatever call the row sits in.

Speculative decoding computes position p as row j of a (K+1)-wide verify call; plain decoding as
row 0 of a 1-wide call. Greedy output is identical only if both give the same bits. GPU libraries
pick a kernel per shape (cuBLAS a GEMM tactic and a split-K per M, attention a number of KV
splits per call), so in bf16 they do not (DESIGN.md, "Width invariance"). The fix, after Thinking
Machines' batch_invariant_ops: a row's reduction order must be fixed by the layer's shape alone.

    linear     one tile configuration for every M (from the layer's shape and the card), a fixed order
               along K, no split-K chosen by M (a fixed K split by shape, added in split order)
    rms_norm   one program per row (RMSNorm, and Qwen3's qk-norm over head_dim), each row's sum of
               squares in an order fixed by its length; also the prologue of the linear after it
    silu_mul   elementwise, fused; also the prologue of the down projection
    attention  each row over its own visible keys in key order (the cache-first layout read
               through an index), fixed blocks, a fixed split SIZE, splits combined in order
    rope       q and k in one launch: torch's RoPE took ~10 small elementwise kernels a layer (slice,
               neg, cat, two muls, an add, for q and for k), a visible share of a GPU decode step.
               Still width-invariant: elementwise per row, each element x * cos + rotated * sin of
               its own operands (cos/sin of its own position) with torch's roundings, bit for bit
    argmax     ties to the lowest index

`triton_ops` holds the kernels, `reference` a torch reference for each. Triton is optional: this
package imports without it, and `ops()` names what is missing. Nothing here is imported by the
runtime unless exact mode is asked for (`runtime.exact`).
"""

from __future__ import annotations

import os

from ..errors import EagleExportError

DTYPES = ("float32", "float16", "bfloat16")
MAX_HEAD_DIM = 256    # attention keeps a head's query and a key block in registers
MAX_GROUP = 16        # query heads per KV head, held together by one attention program
TIERED = "the torch backend's own kernels (cuBLAS GEMMs, torch attention) run instead, and outputs are " \
         "then under the tiered contract (T0-T3), not exact"


def interpreted() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1, read when triton is imported): CI's stand-in for a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def ops():
    """The kernels module, or a one-line error when Triton is not installed."""
    try:
        from . import triton_ops
    except ImportError as e:
        raise EagleExportError(f"exact mode needs Triton, which is not importable here ({e})",
                               "install triton (CUDA builds of torch ship it), or run without --exact: " + TIERED) from None
    return triton_ops


def capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, None without one."""
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def problems(device: str, dtypes, head_dim: int, group: int) -> list[str]:
    """Why the kernels cannot run a model here (empty when they can): no Triton, no CUDA device (the
    interpreter stands in for one), a card too old for Triton or for its bf16 dot, a dtype or a shape
    past the kernels' limits."""
    import importlib.util

    found = []
    if importlib.util.find_spec("triton") is None:
        found.append("Triton is not installed")
    if device != "cuda" and not interpreted():
        found.append(f"the model runs on {device}, and the kernels need a CUDA GPU")
    short = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # a manifest's names
    named = {short.get(str(d), str(d).removeprefix("torch.")) for d in dtypes}
    bad = sorted(named - set(DTYPES))
    if bad:
        found.append(f"dtype {', '.join(bad)} (the kernels cover {', '.join(DTYPES)})")
    card = capability() if device == "cuda" else None
    if card is not None and card < (7, 0):
        found.append(f"a GPU of compute capability {card[0]}.{card[1]} (Triton needs 7.0 or later)")
    elif card is not None and card < (8, 0) and "bfloat16" in named:
        found.append(f"bfloat16 on a GPU of compute capability {card[0]}.{card[1]} (the kernels' bf16 tensor-core "
                     "dot needs 8.0, Ampere, or later)")
    if head_dim > MAX_HEAD_DIM:
        found.append(f"head_dim {head_dim} > {MAX_HEAD_DIM}")
    elif head_dim % 2:
        found.append(f"head_dim {head_dim} is odd (RoPE rotates its two halves)")
    if group > MAX_GROUP:
        found.append(f"{group} query heads per KV head > {MAX_GROUP}")
    return found
