"""trt_lint: a graph shaped like ours passes; each planted violation is reported, by rule, under
the name of the node that carries it, and only there."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from eagle_export.passes import PassManager, trt_lint
from eagle_export.passes import trt_onnx_support as support
from eagle_export.passes.onnx_pin import ONNX_IR_VERSION
from eagle_export.passes.trt_lint import Finding, LintReport, TensorRTLintPass, lint_model

T = TensorProto
RNG = np.random.default_rng(0)


def node(op_type, inputs, outputs, name, domain=None, **attributes):
    return helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attributes)


def tensor(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


def const(name, elem_type, shape, values):
    return helper.make_tensor(name, elem_type, shape, values)


def weight(name, array):
    return numpy_helper.from_array(array, name)


def lint(nodes, inputs, outputs, initializers=(), opset=23, functions=()) -> LintReport:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("trt", 1)]
    proto = helper.make_model(graph, opset_imports=opsets, ir_version=ONNX_IR_VERSION,
                              functions=list(functions))
    return lint_model(ir.from_proto(proto))


def found(report: LintReport) -> set[tuple[str, str]]:
    return {(finding.node_name, finding.rule) for finding in report.findings}


def clean_graph():
    """A decoder-ish slice in the shapes and types our exports use: fp16 embedding gather,
    RMSNorm, an FP8 Q/DQ'd activation, an NVFP4 weight (two-level DQ), an NVFP4 dynamically
    quantized activation (TensorRT's custom op), fp32 softmax, fused argmax, top-k."""
    hidden, out_features = 32, 16
    nodes = [
        node("Gather", ["embed", "ids"], ["x"], "embed_tokens"),
        node("Pow", ["x", "two"], ["x2"], "rms_pow"),
        node("ReduceMean", ["x2", "last_axis"], ["ms"], "rms_mean", keepdims=1),
        node("Add", ["ms", "eps"], ["ms_eps"], "rms_add_eps"),
        node("Sqrt", ["ms_eps"], ["rms"], "rms_sqrt"),
        node("Reciprocal", ["rms"], ["inv_rms"], "rms_reciprocal"),
        node("Mul", ["x", "inv_rms"], ["normed"], "rms_scale"),
        # FP8 activation quantization.
        node("QuantizeLinear", ["normed", "act_scale", "fp8_zero"], ["normed_q"], "act_quant"),
        node("DequantizeLinear", ["normed_q", "act_scale", "fp8_zero"], ["normed_dq"], "act_dequant"),
        # NVFP4 weight: FP8 block scales dequantized by a per-tensor scale, then FP4 data.
        node("DequantizeLinear", ["w_block_scale", "w_global_scale"], ["w_scale"], "w_scale_dq"),
        node("DequantizeLinear", ["w_fp4", "w_scale"], ["w32"], "w_dq", axis=1, block_size=16),
        node("Cast", ["w32"], ["w16"], "w_to_half", to=T.FLOAT16),
        node("Transpose", ["w16"], ["w16t"], "w_transpose", perm=[1, 0]),
        # NVFP4 dynamic activation quantization, TensorRT's custom op, as ModelOpt exports it.
        node("TRT_FP4DynamicQuantize", ["normed_dq", "x_global_scale"], ["x_fp4", "x_block_scale"],
             "x_fp4_quant", domain="trt", axis=-1, block_size=16, scale_type=T.FLOAT8E4M3FN),
        node("DequantizeLinear", ["x_block_scale", "x_global_scale"], ["x_scale"], "x_scale_dq",
             domain="trt"),
        node("DequantizeLinear", ["x_fp4", "x_scale"], ["x_dq"], "x_dq", domain="trt", axis=-1,
             block_size=16),
        node("MatMul", ["x_dq", "w16t"], ["logits16"], "lm_head"),
        node("Cast", ["logits16"], ["logits"], "logits_to_float", to=T.FLOAT),
        node("Softmax", ["logits"], ["probs"], "softmax", axis=-1),
        node("ArgMax", ["logits"], ["greedy"], "greedy_argmax", axis=-1, keepdims=0),
        node("TopK", ["probs", "k"], ["top_p", "top_i"], "top_k", axis=-1),
    ]
    inputs = [tensor("ids", T.INT64, [1, 4])]
    outputs = [tensor("greedy", T.INT64, [1, 4]), tensor("top_p", T.FLOAT, [1, 4, 4]),
               tensor("top_i", T.INT64, [1, 4, 4])]
    initializers = [
        weight("embed", RNG.standard_normal((64, hidden)).astype(np.float16)),
        weight("two", np.array(2.0, np.float16)),
        weight("eps", np.array(1e-5, np.float16)),
        weight("last_axis", np.array([-1], np.int64)),
        weight("act_scale", np.array(0.02, np.float16)),
        const("fp8_zero", T.FLOAT8E4M3FN, [], [0.0]),
        const("w_block_scale", T.FLOAT8E4M3FN, [out_features, hidden // 16],
              [1.0] * (out_features * hidden // 16)),
        weight("w_global_scale", np.array(0.01, np.float32)),
        const("w_fp4", T.FLOAT4E2M1, [out_features, hidden], [0.5, -1.0] * (out_features * hidden // 2)),
        weight("x_global_scale", np.array(0.05, np.float16)),
        weight("k", np.array([4], np.int64)),
    ]
    return nodes, inputs, outputs, initializers


def test_a_graph_built_like_ours_is_clean():
    report = lint(*clean_graph())
    assert report.findings == []
    assert report.ok
    assert "OK" in report.format() and support.TENSORRT_VERSION in report.format()


def test_the_table_covers_every_op_our_graphs_use():
    ours = ("Add Sub Mul Div Pow Sqrt Reciprocal ReduceMean MatMul Gemm Gather GatherElements "
            "Concat Reshape Transpose Slice Split Squeeze Unsqueeze Shape Expand Where Equal Less "
            "Greater LessOrEqual And Or Not Softmax Exp Log Neg Sigmoid Cast Constant "
            "ConstantOfShape Range ArgMax TopK CumSum Max Min Trilu ScatterElements ScatterND "
            "QuantizeLinear DequantizeLinear Identity").split()
    assert [op for op in ours if op not in support.ONNX_OPS] == []
    assert "TRT_FP4DynamicQuantize" in support.TRT_OPS
    assert support.ONNX_OPS.keys().isdisjoint(support.UNSUPPORTED_ONNX_OPS)


def test_lint_pass_runs_in_a_pass_manager_and_never_modifies():
    nodes, inputs, outputs, initializers = clean_graph()
    nodes.append(node("Unique", ["ids"], ["unique_ids"], "unique_ids"))
    outputs.append(tensor("unique_ids", T.INT64, None))
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers)
    proto = helper.make_model(graph, ir_version=ONNX_IR_VERSION, opset_imports=[
        helper.make_opsetid("", 23), helper.make_opsetid("trt", 1)])
    model = ir.from_proto(proto)
    lint_pass = TensorRTLintPass()
    result = PassManager([lint_pass])(model)
    assert [(r.name, r.modified, r.changes) for r in result.records] == [
        ("trt_lint", False, {"findings": 1})]
    assert lint_pass.report.findings == [Finding(
        "unique_ids", "Unique", trt_lint.UNSUPPORTED_OP,
        f"TensorRT {support.TENSORRT_VERSION} marks Unique as unsupported")]
    assert ir.to_proto(result.model).SerializeToString() == ir.to_proto(
        ir.from_proto(proto)).SerializeToString()
    assert "unique_ids (Unique)" in lint_pass.report.format()


@pytest.mark.parametrize("op_type, domain, rule, words", [
    ("Swish", None, trt_lint.UNSUPPORTED_OP, "not in TensorRT"),  # ONNX opset 24, not in the table
    ("DynamicQuantizeLinear", None, trt_lint.UNSUPPORTED_OP, "marks DynamicQuantizeLinear"),
    ("SkipLayerNormalization", "com.microsoft", trt_lint.UNSUPPORTED_DOMAIN, "com.microsoft"),
    ("TRT_NotAnImporter", "trt", trt_lint.UNSUPPORTED_OP, "custom ops"),
])
def test_op_outside_the_support_table_is_reported(op_type, domain, rule, words):
    report = lint([node(op_type, ["x"], ["y"], "suspect", domain=domain)],
                  [tensor("x", T.FLOAT, [2, 4])], [tensor("y", T.FLOAT, [2, 4])], opset=24)
    assert found(report) == {("suspect", rule)}
    assert words in report.findings[0].message


def test_float64_is_reported_on_every_node_that_touches_it():
    report = lint([node("Cast", ["x"], ["x64"], "to_double", to=T.DOUBLE),
                   node("Cast", ["x64"], ["y"], "from_double", to=T.FLOAT)],
                  [tensor("x", T.FLOAT, [3])], [tensor("y", T.FLOAT, [3])])
    assert found(report) == {("to_double", trt_lint.FLOAT64), ("from_double", trt_lint.FLOAT64)}
    assert "x64" in report.findings[0].message


def test_float64_graph_input_is_reported():
    report = lint([node("Cast", ["x"], ["y"], "from_double", to=T.FLOAT)],
                  [tensor("x", T.DOUBLE, [3])], [tensor("y", T.FLOAT, [3])])
    assert found(report) == {("", trt_lint.FLOAT64), ("from_double", trt_lint.FLOAT64)}
    assert any("graph input 'x'" in finding.message for finding in report.findings)


@pytest.mark.parametrize("op_type, types", [
    ("Add", (T.FLOAT, T.FLOAT16)),   # invalid ONNX as well; a hand-edited graph can still have it
    ("Pow", (T.FLOAT16, T.FLOAT)),   # valid ONNX (Pow's exponent has its own type), not for TensorRT
    ("MatMul", (T.BFLOAT16, T.FLOAT16)),
])
def test_mixed_float_inputs_are_reported(op_type, types):
    report = lint([node(op_type, ["a", "b"], ["y"], "mixed")],
                  [tensor("a", types[0], [2, 2]), tensor("b", types[1], [2, 2])],
                  [tensor("y", types[0], [2, 2])])
    assert found(report) == {("mixed", trt_lint.MIXED_PRECISION)}
    message = report.findings[0].message
    assert onnx.TensorProto.DataType.Name(types[0]) in message and "'b'" in message


def test_mixed_precision_is_found_past_tensorrt_custom_ops():
    """The dequantized activation's type comes from the custom ops' output-type rules; without
    them ONNX inference stops at the first trt:: node and this Add would go unchecked."""
    nodes, inputs, outputs, initializers = clean_graph()
    nodes.append(node("Add", ["x_dq", "bias32"], ["biased"], "add_float_bias"))
    outputs.append(tensor("biased", T.FLOAT16, None))
    initializers.append(weight("bias32", np.zeros(32, np.float32)))
    report = lint(nodes, inputs, outputs, initializers)
    assert found(report) == {("add_float_bias", trt_lint.MIXED_PRECISION)}


def test_operand_type_missing_from_the_table_is_reported():
    report = lint([node("MatMul", ["a", "b"], ["y"], "int_matmul")],
                  [tensor("a", T.INT32, [2, 2]), tensor("b", T.INT32, [2, 2])],
                  [tensor("y", T.INT32, [2, 2])])
    assert found(report) == {("int_matmul", trt_lint.UNSUPPORTED_DTYPE)}
    assert "input 0 'a' is INT32" in report.findings[0].message


def test_cast_to_a_type_tensorrt_cannot_cast_to_is_reported():
    report = lint([node("Cast", ["x"], ["x8"], "to_int8", to=T.INT8),
                   node("Cast", ["x8"], ["y"], "back", to=T.FLOAT)],
                  [tensor("x", T.FLOAT, [3])], [tensor("y", T.FLOAT, [3])])
    assert found(report) == {("to_int8", trt_lint.UNSUPPORTED_DTYPE),
                             ("back", trt_lint.UNSUPPORTED_DTYPE)}


def qdq_pair(zero_point, zero_name="zp", scale=0.1, names=("quant", "dequant")):
    """x -> QuantizeLinear -> DequantizeLinear -> y with the given zero point initializer."""
    return ([node("QuantizeLinear", ["x", "s", zero_name], ["xq"], names[0]),
             node("DequantizeLinear", ["xq", "s", zero_name], ["y"], names[1])],
            [tensor("x", T.FLOAT, [4, 8])], [tensor("y", T.FLOAT, [4, 8])],
            [weight("s", np.array(scale, np.float32)), zero_point])


def test_nonzero_zero_point_is_reported():
    nodes, inputs, outputs, initializers = qdq_pair(weight("zp", np.array(3, np.int8)))
    report = lint(nodes, inputs, outputs, initializers)
    assert found(report) == {("quant", trt_lint.ZERO_POINT), ("dequant", trt_lint.ZERO_POINT)}
    assert "1 nonzero element(s) of 1" in report.findings[0].message


def test_zero_zero_point_passes():
    report = lint(*qdq_pair(weight("zp", np.zeros((), np.int8))))
    assert report.ok, report.format()


def test_zero_point_from_a_graph_input_is_reported():
    nodes, inputs, outputs, initializers = qdq_pair(weight("unused", np.zeros((), np.int8)))
    report = lint(nodes, inputs + [tensor("zp", T.INT8, [])], outputs, initializers)
    assert found(report) == {("quant", trt_lint.ZERO_POINT), ("dequant", trt_lint.ZERO_POINT)}
    assert "not a constant" in report.findings[0].message


def test_non_positive_scale_is_reported():
    report = lint(*qdq_pair(weight("zp", np.zeros((), np.int8)), scale=-0.1))
    assert found(report) == {("quant", trt_lint.QDQ_SCALE), ("dequant", trt_lint.QDQ_SCALE)}


@pytest.mark.parametrize("data_shape, scale_shape, block_size, words", [
    ((64, 32), (4, 2), 16, "on axes [0, 1]"),        # two blocked axes
    ((8, 64), (8, 2), 16, "needs 4 scales"),         # block size does not match the scale
    ((8, 64), (2, 64), 16, "blocks axis 0"),         # blocked on an axis other than `axis`
    ((8, 64), (8, 4, 1), 16, "fits neither"),        # scale rank fits no scheme
    ((8, 64), (63,), 0, "per-channel scale has 63"),  # per-channel along axis 1 (length 64)
])
def test_blocked_quantization_rules(data_shape, scale_shape, block_size, words):
    attributes = {"axis": 1} | ({"block_size": block_size} if block_size else {})
    report = lint([node("DequantizeLinear", ["w", "w_scale"], ["w_dq"], "w_dequant", **attributes)],
                  [], [tensor("w_dq", T.FLOAT, list(data_shape))],
                  [weight("w", RNG.integers(-8, 8, data_shape).astype(np.int8)),
                   weight("w_scale", np.full(scale_shape, 0.1, np.float32))])
    assert found(report) == {("w_dequant", trt_lint.BLOCK_QUANTIZATION)}
    assert words in report.findings[0].message


def test_well_formed_blocked_quantization_passes():
    report = lint([node("DequantizeLinear", ["w", "w_scale"], ["w_dq"], "w_dequant", axis=1,
                        block_size=16)],
                  [], [tensor("w_dq", T.FLOAT, [8, 64])],
                  [weight("w", RNG.integers(-8, 8, (8, 64)).astype(np.int8)),
                   weight("w_scale", np.full((8, 4), 0.1, np.float32))])
    assert report.ok, report.format()


def test_fp4_block_size_other_than_16_is_reported():
    fp4 = const("w_fp4", T.FLOAT4E2M1, [8, 64], [1.0, -0.5] * 256)
    report = lint(
        [node("DequantizeLinear", ["w_fp4", "w_scale"], ["w_dq"], "fp4_dequant_32", axis=1,
              block_size=32),
         node("TRT_FP4DynamicQuantize", ["x", "x_scale"], ["x_fp4", "x_block_scale"],
              "fp4_dynamic_32", domain="trt", axis=-1, block_size=32,
              scale_type=T.FLOAT8E4M3FN)],
        [tensor("x", T.FLOAT16, [2, 64])],
        [tensor("w_dq", T.FLOAT, [8, 64]), tensor("x_fp4", T.FLOAT4E2M1, None),
         tensor("x_block_scale", T.FLOAT8E4M3FN, None)],
        [fp4, weight("w_scale", np.full((8, 2), 0.1, np.float32)),
         weight("x_scale", np.array(0.05, np.float16))])
    assert found(report) == {("fp4_dequant_32", trt_lint.FP4_BLOCK_SIZE),
                             ("fp4_dynamic_32", trt_lint.FP4_BLOCK_SIZE)}


def test_fp4_dynamic_quantize_needs_a_constant_scalar_scale_and_fp8_scales():
    report = lint(
        [node("TRT_FP4DynamicQuantize", ["x", "x_scale"], ["x_fp4", "x_block_scale"], "fp4_dynamic",
              domain="trt", axis=-1, block_size=16, scale_type=T.FLOAT8E5M2)],
        [tensor("x", T.FLOAT16, [2, 64]), tensor("x_scale", T.FLOAT16, [])],
        [tensor("x_fp4", T.FLOAT4E2M1, None), tensor("x_block_scale", T.FLOAT8E5M2, None)])
    messages = [f.message for f in report.findings if f.node_name == "fp4_dynamic"]
    assert found(report) == {("fp4_dynamic", trt_lint.OP_RESTRICTION),
                             ("fp4_dynamic", trt_lint.FP8_FORMAT),
                             ("", trt_lint.FP8_FORMAT)}
    assert any("constant scalar" in m for m in messages)
    assert any("scale_type FLOAT8E5M2" in m for m in messages)


def test_fp8_e5m2_is_reported_where_it_appears():
    nodes, inputs, outputs, initializers = qdq_pair(
        const("zp", T.FLOAT8E5M2, [], [0.0]), names=("quant_e5m2", "dequant_e5m2"))
    report = lint(nodes, inputs, outputs, initializers)
    assert found(report) == {("quant_e5m2", trt_lint.FP8_FORMAT),
                             ("dequant_e5m2", trt_lint.FP8_FORMAT)}
    assert "FLOAT8E5M2" in report.findings[0].message


@pytest.mark.parametrize("case", ["topk_unsorted", "topk_large_k", "scatternd_add",
                                  "reduce_dynamic_axes", "cumsum_dynamic_axis"])
def test_decidable_op_restrictions(case):
    x = tensor("x", T.FLOAT, [2, 5000])
    k = weight("k", np.array([4096 if case == "topk_large_k" else 4], np.int64))
    graphs = {
        "topk_unsorted": ([node("TopK", ["x", "k"], ["v", "i"], case, sorted=0)], [x],
                          [tensor("v", T.FLOAT, None), tensor("i", T.INT64, None)], [k]),
        "topk_large_k": ([node("TopK", ["x", "k"], ["v", "i"], case)], [x],
                         [tensor("v", T.FLOAT, None), tensor("i", T.INT64, None)], [k]),
        "scatternd_add": ([node("ScatterND", ["x", "idx", "upd"], ["y"], case, reduction="add")],
                          [x, tensor("idx", T.INT64, [1, 1]), tensor("upd", T.FLOAT, [1, 5000])],
                          [tensor("y", T.FLOAT, [2, 5000])], []),
        "reduce_dynamic_axes": ([node("ReduceMean", ["x", "axes"], ["y"], case)],
                                [x, tensor("axes", T.INT64, [1])], [tensor("y", T.FLOAT, None)], []),
        "cumsum_dynamic_axis": ([node("CumSum", ["x", "axis"], ["y"], case)],
                                [x, tensor("axis", T.INT64, [])], [tensor("y", T.FLOAT, None)], []),
    }
    report = lint(*graphs[case])
    assert found(report) == {(case, trt_lint.OP_RESTRICTION)}


def test_opset_outside_the_supported_range_is_reported():
    report = lint([node("Relu", ["x"], ["y"], "relu")],
                  [tensor("x", T.FLOAT, [3])], [tensor("y", T.FLOAT, [3])], opset=8)
    assert found(report) == {("", trt_lint.OPSET)}


def test_local_function_calls_are_checked_through_their_body():
    body = [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Unique", ["r"], ["u"])]
    function = helper.make_function("local", "relu_unique", ["a"], ["u"], body,
                                    [helper.make_opsetid("", 23)])
    graph = helper.make_graph([node("relu_unique", ["x"], ["y"], "call", domain="local")], "g",
                              [tensor("x", T.FLOAT, [3])], [tensor("y", T.FLOAT, None)])
    proto = helper.make_model(graph, ir_version=ONNX_IR_VERSION, functions=[function],
                              opset_imports=[helper.make_opsetid("", 23),
                                             helper.make_opsetid("local", 1)])
    report = lint_model(ir.from_proto(proto))
    assert [(f.op_type, f.rule) for f in report.findings] == [("Unique", trt_lint.UNSUPPORTED_OP)]
