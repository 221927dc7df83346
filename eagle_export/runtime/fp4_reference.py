"""NVFP4 reference kernels in numpy, for running exported NVFP4 graphs on CPU.

TensorRT runs NVFP4 activations as `trt::TRT_FP4DynamicQuantize` (a TensorRT custom op) followed
by two DequantizeLinear nodes; ONNX Runtime has neither the op nor FP4 DequantizeLinear, so NVFP4
graphs are checked with `onnx.reference.ReferenceEvaluator` plus the kernel below.

NVFP4 numerics (ModelOpt's NVFP4QTensor, which this file matches bit for bit):
    global scale  g = amax / (6 * 448)                (fp32; amax from calibration)
    block scale   s = fp8_e4m3(clamp(block_amax / (6 * g), 2**-9, 448))   (blocks of 16 on axis -1;
                  a block of zeros gets s = 1)
    codes         q = e2m1(x / (float(s) * g))        round to nearest, ties to even, saturate at 6
    dequantized   x' = e2m1_value(q) * (float(s) * g)
onnx.reference's own DequantizeLinear already handles FLOAT4E2M1 with block_size (opset 23), so
only the quantize kernel lives here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

E2M1_MAX, E4M3_MAX = 6.0, 448.0
BLOCK_SIZE = 16
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)  # codes 0..7


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """fp32 -> 4-bit E2M1 codes (sign in bit 3) as uint8, nearest-even, saturating at +-6."""
    mag = np.minimum(np.abs(x.astype(np.float32)), E2M1_MAX)
    # Distance to every grid point; ties go to the even code (an even code has a zero mantissa bit).
    dist = np.abs(mag[..., None] - E2M1_GRID)
    best = dist.min(-1, keepdims=True)
    candidates = np.where(dist == best, np.arange(8), 99)
    even_first = np.where(candidates % 2 == 0, candidates, candidates + 100)
    code = np.min(even_first, axis=-1) % 100
    # ModelOpt sets the sign bit of every negative input, so -0.1 becomes code 8 (-0), not 0.
    return (code + 8 * (x < 0)).astype(np.uint8)


def as_float4(codes: np.ndarray) -> np.ndarray:
    """uint8 E2M1 codes -> numpy float4_e2m1fn, the dtype onnx.reference uses for FLOAT4E2M1."""
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn)


def nvfp4_block_scales(x: np.ndarray, global_scale: np.ndarray | float,
                       block_size: int = BLOCK_SIZE) -> np.ndarray:
    """Per-block FP8 (E4M3) scales of x [..., N] (N a multiple of block_size) -> [..., N/block_size]."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, block_size)
    amax = np.abs(blocks).max(-1)
    scale = amax / (np.float32(E2M1_MAX) * np.float32(global_scale))
    scale = np.where(scale == 0, np.float32(1.0), scale)
    return np.clip(scale, 2.0 ** -9, E4M3_MAX).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)


def nvfp4_quantize(x: np.ndarray, global_scale: np.ndarray | float, block_size: int = BLOCK_SIZE):
    """x [..., N] -> (E2M1 codes as float4_e2m1fn [..., N], FP8 block scales [..., N/block_size])."""
    if x.shape[-1] % block_size:
        raise ValueError(f"the last axis ({x.shape[-1]}) is not a multiple of the block size {block_size}")
    scales = nvfp4_block_scales(x, global_scale, block_size)
    step = scales.astype(np.float32) * np.float32(global_scale)
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, block_size) / step[..., None]
    return as_float4(e2m1_codes(blocks).reshape(x.shape)), scales


def nvfp4_dequantize(codes: np.ndarray, scales: np.ndarray, global_scale: np.ndarray | float,
                     block_size: int = BLOCK_SIZE) -> np.ndarray:
    """The double DequantizeLinear of an NVFP4 tensor, in the same order of operations."""
    step = scales.astype(np.float32) * np.float32(global_scale)
    values = codes.astype(np.float32).reshape(*codes.shape[:-1], -1, block_size)
    return (values * step[..., None]).reshape(codes.shape)


class TRT_FP4DynamicQuantize(OpRun):
    """TensorRT's dynamic NVFP4 quantizer: (x, global scale) -> (FP4 x, FP8 block scales)."""

    op_domain = "trt"

    def _run(self, x, global_scale, axis=-1, block_size=BLOCK_SIZE, scale_type=None):
        if axis not in (-1, x.ndim - 1):
            raise NotImplementedError(f"TRT_FP4DynamicQuantize along axis {axis}: only the last axis is used")
        return nvfp4_quantize(x, np.float32(np.asarray(global_scale).reshape(())), block_size)


def reference_evaluator(model) -> ReferenceEvaluator:
    """A ReferenceEvaluator that runs exported NVFP4 graphs (TensorRT's custom quantizer included)."""
    return ReferenceEvaluator(model, new_ops=[TRT_FP4DynamicQuantize])
