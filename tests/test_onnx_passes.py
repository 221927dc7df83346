"""Translation validation of the ONNX clean-up passes: each pass is run on a small graph built to
give it work, and the graph's outputs before and after are compared in ONNX Runtime on random
inputs. Each pass must also report what it changed, do nothing the second time, and leave a graph
with nothing to do byte for byte as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from eagle_export.passes.onnx_cleanup import (
    CastCleanupPass,
    CommonSubexpressionEliminationPass,
    ConstantFoldingPass,
    DeadCodeEliminationPass,
    IdentityEliminationPass,
    InitializerDeduplicationPass,
    TopologicalSortPass,
    onnx_pipeline,
)
from eagle_export.passes.onnx_pin import ONNX_IR_VERSION, PinIrVersionPass

RNG = np.random.default_rng(0)
FLOAT, FLOAT16, BFLOAT16, INT32, INT64 = (
    TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32,
    TensorProto.INT64)


def make_model(nodes, inputs, outputs, initializers=(), ir_version=ONNX_IR_VERSION):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=ir_version)


def tensor(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


def weight(name, array):
    return numpy_helper.from_array(array, name)


def run(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    # ONNX Runtime's own graph optimizations would fold and clean the "before" graph too.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def random_feeds(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    feeds = {}
    for value in proto.graph.input:
        shape = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[value.name] = RNG.integers(-1000, 1000, size=shape).astype(dtype)
        else:
            feeds[value.name] = (RNG.standard_normal(shape) * 10).astype(dtype)
    return feeds


def validate(pass_, proto: onnx.ModelProto):
    """Run `pass_` on `proto`; check outputs, names and idempotence; return (result, model)."""
    feeds = random_feeds(proto)
    expected = run(proto, feeds)
    model = ir.from_proto(proto)
    result = pass_(model)
    assert result.modified, f"{pass_.name} found nothing to do"
    assert result.model is model
    actual = run(model, feeds)
    assert [o.name for o in model.graph.outputs] == [o.name for o in proto.graph.output]
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=1e-6)
    again = pass_(model)
    assert (again.modified, again.changes) == (False, {}), f"{pass_.name} is not idempotent"
    return result, model


def op_types(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def test_constant_folding_folds_constant_subgraphs_but_keeps_dequantize():
    proto = make_model(
        [helper.make_node("Mul", ["W", "two"], ["W2"], name="scale_w"),
         helper.make_node("Transpose", ["W2"], ["W2t"], name="transpose_w", perm=[1, 0]),
         helper.make_node("MatMul", ["x", "W2t"], ["y"], name="matmul"),
         helper.make_node("Sqrt", ["c"], ["root_c"], name="sqrt_c"),
         helper.make_node("Mul", ["y", "root_c"], ["z"], name="mul_root"),
         helper.make_node("DequantizeLinear", ["Wq", "s"], ["Wdq"], name="dequantize_w"),
         helper.make_node("MatMul", ["z", "Wdq"], ["out"], name="matmul_q")],
        [tensor("x", FLOAT, [3, 4])], [tensor("out", FLOAT, [3, 4])],
        [weight("W", RNG.standard_normal((4, 4)).astype(np.float32)),
         weight("two", np.array(2.0, np.float32)),
         weight("c", np.array([1.5, 2.0, 3.0, 7.0], np.float32)),
         weight("Wq", RNG.integers(-127, 127, (4, 4)).astype(np.int8)),
         weight("s", np.array(0.05, np.float32))])
    result, model = validate(ConstantFoldingPass(), proto)
    assert op_types(model) == ["MatMul", "Mul", "DequantizeLinear", "MatMul"]
    # W (64 B), two (4 B) and c (16 B) became W2t (64 B) and root_c (16 B).
    assert result.changes == {"nodes_removed": 3, "initializers_removed": 1, "bytes_saved": 4}


def test_dead_code_elimination_removes_unused_nodes_and_weights():
    proto = make_model(
        [helper.make_node("Relu", ["x"], ["out"], name="relu"),
         helper.make_node("Exp", ["x"], ["unused"], name="dead_exp"),
         helper.make_node("Add", ["unused", "bias"], ["unused2"], name="dead_add")],
        [tensor("x", FLOAT, [2, 3])], [tensor("out", FLOAT, [2, 3])],
        [weight("bias", np.ones(3, np.float32)), weight("orphan", np.ones(8, np.float32))])
    result, model = validate(DeadCodeEliminationPass(), proto)
    assert op_types(model) == ["Relu"]
    assert result.changes == {"nodes_removed": 2, "initializers_removed": 2, "bytes_saved": 44}


def test_identity_elimination_bypasses_identities_and_keeps_output_names():
    proto = make_model(
        [helper.make_node("Identity", ["x"], ["x_copy"], name="id_in"),
         helper.make_node("Relu", ["x_copy"], ["r"], name="relu"),
         helper.make_node("Identity", ["r"], ["out"], name="id_out")],
        [tensor("x", FLOAT, [2, 3])], [tensor("out", FLOAT, [2, 3])])
    result, model = validate(IdentityEliminationPass(), proto)
    assert op_types(model) == ["Relu"]
    assert model.graph.node(0).outputs[0].name == "out"
    assert result.changes == {"nodes_removed": 2}


@pytest.mark.parametrize("source", ["graph_input", "graph_output"])
def test_identity_elimination_keeps_identity_that_names_a_second_output(source):
    """onnx_ir's own identity pass renames `a` to `b` here and the graph loses output `a`."""
    nodes = [helper.make_node("Identity", ["x" if source == "graph_input" else "a"], ["b"],
                              name="id")]
    outputs = [tensor("b", FLOAT, [2])]
    if source == "graph_output":
        nodes.insert(0, helper.make_node("Relu", ["x"], ["a"], name="relu"))
        outputs.insert(0, tensor("a", FLOAT, [2]))
    proto = make_model(nodes, [tensor("x", FLOAT, [2])], outputs)
    model = ir.from_proto(proto)
    result = IdentityEliminationPass()(model)
    assert (result.modified, result.changes) == (False, {})
    assert [o.name for o in model.graph.outputs] == [o.name for o in proto.graph.output]
    assert "Identity" in op_types(model)


def test_cast_cleanup_removes_exact_casts_and_shortens_float_chains():
    # No value_info: the pass has to infer the intermediate types itself.
    proto = make_model(
        [helper.make_node("Cast", ["x"], ["x_same"], name="cast_same", to=FLOAT),
         helper.make_node("Relu", ["x_same"], ["out_same"], name="relu"),
         # float16 -> float32 -> float16: exact round trip.
         helper.make_node("Cast", ["h"], ["h32"], name="h_to_f32", to=FLOAT),
         helper.make_node("Cast", ["h32"], ["h16"], name="f32_to_h", to=FLOAT16),
         helper.make_node("Add", ["h16", "h"], ["out_half"], name="add_half"),
         # int32 -> int64 -> int32: exact round trip.
         helper.make_node("Cast", ["i"], ["i64"], name="i_to_i64", to=INT64),
         helper.make_node("Cast", ["i64"], ["i32"], name="i64_to_i", to=INT32),
         helper.make_node("Neg", ["i32"], ["out_int"], name="neg_int"),
         # float16 -> float32 -> bfloat16 becomes float16 -> bfloat16.
         helper.make_node("Cast", ["h"], ["g32"], name="g_to_f32", to=FLOAT),
         helper.make_node("Cast", ["g32"], ["gbf"], name="f32_to_bf16", to=BFLOAT16),
         helper.make_node("Cast", ["gbf"], ["out_bf16"], name="bf16_to_f32", to=FLOAT)],
        [tensor("x", FLOAT, [2, 3]), tensor("h", FLOAT16, [64]), tensor("i", INT32, [5])],
        [tensor("out_same", FLOAT, [2, 3]), tensor("out_half", FLOAT16, [64]),
         tensor("out_int", INT32, [5]), tensor("out_bf16", FLOAT, [64])])
    result, model = validate(CastCleanupPass(), proto)
    assert result.changes == {"nodes_removed": 6, "casts_rewired": 1}
    remaining = {node.name: node for node in model.graph}
    assert set(remaining) == {"relu", "add_half", "neg_int", "f32_to_bf16", "bf16_to_f32"}
    assert remaining["f32_to_bf16"].inputs[0].name == "h"


def test_initializer_deduplication_merges_identical_weights():
    shared = RNG.standard_normal((16, 16)).astype(np.float32)
    proto = make_model(
        [helper.make_node("MatMul", ["x", "Wa"], ["a"], name="matmul_a"),
         helper.make_node("MatMul", ["x", "Wb"], ["b"], name="matmul_b"),
         helper.make_node("MatMul", ["x", "Wc"], ["c"], name="matmul_c")],
        [tensor("x", FLOAT, [2, 16])],
        [tensor("a", FLOAT, [2, 16]), tensor("b", FLOAT, [2, 16]), tensor("c", FLOAT, [2, 16])],
        [weight("Wa", shared), weight("Wb", shared.copy()), weight("Wc", shared + 1)])
    result, model = validate(InitializerDeduplicationPass(), proto)
    assert sorted(model.graph.initializers) == ["Wa", "Wc"]
    assert result.changes == {"initializers_removed": 1, "bytes_saved": 16 * 16 * 4}


def test_common_subexpression_elimination_computes_repeats_once():
    proto = make_model(
        [helper.make_node("Exp", ["x"], ["e1"], name="exp1"),
         helper.make_node("Exp", ["x"], ["e2"], name="exp2"),
         helper.make_node("Softmax", ["x"], ["s1"], name="softmax1", axis=1),
         helper.make_node("Softmax", ["x"], ["s2"], name="softmax_other_axis", axis=0),
         helper.make_node("Sum", ["e1", "e2", "s1", "s2"], ["out"], name="sum")],
        [tensor("x", FLOAT, [2, 3])], [tensor("out", FLOAT, [2, 3])])
    result, model = validate(CommonSubexpressionEliminationPass(), proto)
    assert op_types(model) == ["Exp", "Softmax", "Softmax", "Sum"]
    assert result.changes == {"nodes_removed": 1}


def test_topological_sort_orders_producers_first():
    proto = make_model(
        [helper.make_node("Neg", ["r"], ["out"], name="neg"),
         helper.make_node("Relu", ["x"], ["r"], name="relu")],
        [tensor("x", FLOAT, [2, 3])], [tensor("out", FLOAT, [2, 3])])
    result, model = validate(TopologicalSortPass(), proto)
    assert [node.name for node in model.graph] == ["relu", "neg"]
    assert result.changes == {"nodes_moved": 2}


def test_pin_ir_version_makes_a_default_onnx_model_loadable():
    proto = make_model([helper.make_node("Relu", ["x"], ["out"], name="relu")],
                       [tensor("x", FLOAT, [4])], [tensor("out", FLOAT, [4])],
                       ir_version=onnx.IR_VERSION)
    # What onnx's helpers write by default, which ONNX Runtime <= 1.31 and TensorRT 10's parser refuse
    # (whether the installed ONNX Runtime refuses it depends on its version, so it is not asserted).
    assert onnx.IR_VERSION > ONNX_IR_VERSION
    model = ir.from_proto(proto)
    result = PinIrVersionPass()(model)
    assert (result.modified, result.changes) == (True, {"previous_ir_version": onnx.IR_VERSION})
    assert ir.to_proto(model).ir_version == ONNX_IR_VERSION
    x = np.array([-1, 0, 2, -3], np.float32)
    np.testing.assert_array_equal(run(model, {"x": x})[0], np.maximum(x, 0))
    assert PinIrVersionPass()(model).modified is False


CLEANUP_PASSES = [ConstantFoldingPass, DeadCodeEliminationPass, IdentityEliminationPass,
                  CastCleanupPass, InitializerDeduplicationPass,
                  CommonSubexpressionEliminationPass, TopologicalSortPass, PinIrVersionPass]


@pytest.mark.parametrize("pass_class", CLEANUP_PASSES, ids=lambda cls: cls.name)
def test_pass_leaves_a_clean_graph_untouched(pass_class):
    # float32 -> float16 -> float32 rounds: cast clean-up must keep both casts.
    proto = make_model(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="matmul"),
         helper.make_node("Cast", ["y"], ["y16"], name="to_half", to=FLOAT16),
         helper.make_node("Cast", ["y16"], ["y32"], name="to_float", to=FLOAT),
         helper.make_node("Relu", ["y32"], ["out"], name="relu")],
        [tensor("x", FLOAT, [2, 4])], [tensor("out", FLOAT, [2, 4])],
        [weight("W", RNG.standard_normal((4, 4)).astype(np.float32))])
    model = ir.from_proto(proto)
    before = without_value_info(ir.to_proto(model))
    result = pass_class()(model)
    assert (result.modified, result.changes, result.skipped) == (False, {}, None)
    assert without_value_info(ir.to_proto(model)) == before


def without_value_info(proto: onnx.ModelProto) -> bytes:
    """The serialized model minus value_info: constant folding records the types it works out
    for Cast outputs there, which annotates the graph without rewriting it."""
    del proto.graph.value_info[:]
    return proto.SerializeToString()


def test_pipeline_cleans_a_messy_graph_and_is_idempotent():
    shared = RNG.standard_normal((8, 8)).astype(np.float32)
    proto = make_model(
        [helper.make_node("Add", ["r2", "r1"], ["sum"], name="add"),  # out of order on purpose
         helper.make_node("Identity", ["x"], ["x_id"], name="identity"),
         helper.make_node("Cast", ["x_id"], ["x32"], name="cast_same", to=FLOAT),
         helper.make_node("Mul", ["Wa", "one"], ["Wa1"], name="fold_me"),
         helper.make_node("MatMul", ["x32", "Wa1"], ["m1"], name="matmul_a"),
         helper.make_node("MatMul", ["x32", "Wb"], ["m2"], name="matmul_b"),
         helper.make_node("Relu", ["m1"], ["r1"], name="relu_a"),
         helper.make_node("Relu", ["m2"], ["r2"], name="relu_b"),
         helper.make_node("Exp", ["x"], ["dead"], name="dead_exp"),
         helper.make_node("Identity", ["sum"], ["out"], name="identity_out")],
        [tensor("x", FLOAT, [3, 8])], [tensor("out", FLOAT, [3, 8])],
        [weight("Wa", shared), weight("Wb", shared.copy()), weight("one", np.array(1.0, np.float32))],
        ir_version=onnx.IR_VERSION)
    feeds = random_feeds(proto)
    pinned = onnx.ModelProto()
    pinned.CopyFrom(proto)
    pinned.ir_version = ONNX_IR_VERSION
    expected = run(pinned, feeds)

    model = ir.from_proto(proto)
    first = onnx_pipeline()(model)
    assert op_types(first.model) == ["MatMul", "Relu", "Add"]
    np.testing.assert_allclose(run(first.model, feeds)[0], expected[0], rtol=0, atol=1e-6)
    # The folder already bypasses the Identity nodes and the same-type Cast (leaving them dead
    # for dead-code elimination), so the dedicated passes find nothing left in this graph.
    assert {record.name: record.changes for record in first.records} == {
        "constant_folding": {"nodes_removed": 1, "initializers_removed": 1, "bytes_saved": 4},
        "dead_code_elimination": {"nodes_removed": 4},
        "identity_elimination": {},
        "cast_cleanup": {},
        "initializer_deduplication": {"initializers_removed": 1, "bytes_saved": 8 * 8 * 4},
        "common_subexpression_elimination": {"nodes_removed": 2},
        "topological_sort": {"nodes_moved": 3},
        "pin_ir_version": {"previous_ir_version": onnx.IR_VERSION},
    }

    second = onnx_pipeline()(first.model)
    assert [(r.name, r.modified, r.changes) for r in second.records if r.modified or r.changes] == []
