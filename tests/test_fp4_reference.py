"""The NVFP4 reference kernels against ModelOpt's own NVFP4QTensor (plain torch, on CPU): bit-exact."""

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from eagle_export.runtime.fp4_reference import (
    E2M1_GRID,
    e2m1_codes,
    nvfp4_dequantize,
    nvfp4_quantize,
    reference_evaluator,
)

NVFP4QTensor = pytest.importorskip("modelopt.torch.quantization.qtensor").NVFP4QTensor


def hard_tensor(rows=6, cols=64, seed=0) -> torch.Tensor:
    """Random values plus the cases that break a sloppy kernel: exact ties between E2M1 values,
    a block of zeros, tiny negatives that round to -0, values past the block maximum."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    x[1, 16:32] = 0.0
    x[1, 32:48] = torch.tensor([-1e-4] * 15 + [3.0])
    return x


def modelopt_quantize(x: torch.Tensor, global_scale: torch.Tensor):
    packed, scales, g = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=global_scale)
    data = packed._quantized_data
    codes = torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(x.shape)  # low nibble first
    dequantized = packed.dequantize(torch.float32, scale=scales, double_scale=g, block_sizes={-1: 16})
    return codes.numpy(), scales.view(torch.uint8).numpy(), dequantized.numpy()


def test_e2m1_rounding_is_nearest_even_and_saturates():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.3, -0.1, 0.0], dtype=np.float32)
    expected = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -0.0, 0.0], dtype=np.float32)
    codes = e2m1_codes(x)
    values = np.where(codes & 8, -1.0, 1.0) * E2M1_GRID[codes & 7]
    assert np.array_equal(values, expected)
    assert codes[-2] == 8  # -0.1 keeps its sign bit, as ModelOpt does


@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_matches_modelopt_bit_for_bit(seed):
    x = hard_tensor(seed=seed)
    g = x.abs().max() / (6 * 448)
    codes, scales, dequantized = modelopt_quantize(x, g)
    ref_codes, ref_scales = nvfp4_quantize(x.numpy(), g.numpy())
    assert np.array_equal(ref_codes.view(np.uint8), codes)
    assert np.array_equal(ref_scales.view(np.uint8), scales)
    assert np.array_equal(nvfp4_dequantize(ref_codes, ref_scales, g.numpy()), dequantized)


def test_calibrated_global_scale_smaller_than_the_tensor_saturates_like_modelopt():
    """Activations beyond the calibrated amax: block scales clamp at 448 and codes at 6."""
    x = hard_tensor(seed=3)
    g = torch.tensor(0.01 / (6 * 448))
    codes, scales, dequantized = modelopt_quantize(x, g)
    ref_codes, ref_scales = nvfp4_quantize(x.numpy(), g.numpy())
    assert np.array_equal(ref_codes.view(np.uint8), codes) and np.array_equal(ref_scales.view(np.uint8), scales)
    assert np.array_equal(nvfp4_dequantize(ref_codes, ref_scales, g.numpy()), dequantized)


def nvfp4_graph(weight_codes: np.ndarray, weight_scales: np.ndarray, weight_global: np.ndarray,
                act_global: float, rows: int) -> onnx.ModelProto:
    """y = NVFP4(x) @ NVFP4(W)^T in the exported form: TRT_FP4DynamicQuantize + double DQ for x,
    FLOAT4E2M1 / FLOAT8E4M3FN initializers + double DQ for W."""
    out_features, in_features = weight_codes.shape
    packed = (weight_codes[:, 0::2] | (weight_codes[:, 1::2] << 4)).astype(np.uint8)
    inits = [
        helper.make_tensor("w_f4", TensorProto.FLOAT4E2M1, [out_features, in_features], packed.tobytes(), raw=True),
        helper.make_tensor("w_f8", TensorProto.FLOAT8E4M3FN, list(weight_scales.shape), weight_scales.tobytes(), raw=True),
        numpy_helper.from_array(weight_global.astype(np.float32).reshape(()), "w_g"),
        numpy_helper.from_array(np.array(act_global, dtype=np.float32), "x_g"),
    ]
    nodes = [
        helper.make_node("TRT_FP4DynamicQuantize", ["x", "x_g"], ["x_f4", "x_f8"], domain="trt",
                         axis=-1, block_size=16, scale_type=TensorProto.FLOAT8E4M3FN),
        helper.make_node("DequantizeLinear", ["x_f8", "x_g"], ["x_scale"]),
        helper.make_node("DequantizeLinear", ["x_f4", "x_scale"], ["x_dq"], axis=-1, block_size=16),
        helper.make_node("DequantizeLinear", ["w_f8", "w_g"], ["w_scale"]),
        helper.make_node("DequantizeLinear", ["w_f4", "w_scale"], ["w_dq"], axis=-1, block_size=16),
        helper.make_node("Transpose", ["w_dq"], ["w_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x_dq", "w_t"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "nvfp4_linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, in_features])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, out_features]),
                               helper.make_tensor_value_info("x_dq", TensorProto.FLOAT, [rows, in_features])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trt", 1)],
                             ir_version=10)


def test_exported_form_in_reference_evaluator_matches_modelopt():
    weight, x = hard_tensor(8, 64, seed=4), hard_tensor(5, 64, seed=5)
    w_codes, w_scales, w_dq = modelopt_quantize(weight, weight.abs().max() / (6 * 448))
    x_global = x.abs().max() / (6 * 448)
    _, _, x_dq = modelopt_quantize(x, x_global)
    w_global = (weight.abs().max() / (6 * 448)).numpy()
    model = nvfp4_graph(w_codes, w_scales.view(ml_dtypes.float8_e4m3fn), w_global, float(x_global), 5)
    onnx.checker.check_model(model)  # custom domain aside, a valid opset-23 graph
    y, got_x_dq = reference_evaluator(model).run(None, {"x": x.numpy()})
    assert np.array_equal(got_x_dq, x_dq)  # activation path: bit-exact
    assert np.allclose(y, x_dq @ w_dq.T, rtol=1e-6, atol=1e-6)  # MatMul summation order aside
