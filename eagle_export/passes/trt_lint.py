"""TensorRT-readiness lint: what would stop TensorRT's ONNX parser from building a strongly typed
network from a graph, found on a machine without TensorRT.

Each finding names the node (by its name) and the rule it breaks:
- unsupported_op / unsupported_domain: the op is not in TensorRT's ONNX support table
  (trt_onnx_support), or comes from a domain the parser does not import;
- opset: the model's ONNX opset is outside the range that table covers;
- unsupported_dtype: an operand's element type is not one the table lists for the op;
- float64: a double value anywhere (TensorRT has no FP64);
- fp8_format: an 8-bit float other than FLOAT8E4M3FN (TensorRT's only FP8 format);
- mixed_precision: an op whose float operands must share one type gets two (a strongly typed
  network inserts no casts, so the graph must carry them explicitly);
- zero_point, qdq_scale, block_quantization, fp4_block_size: the Q/DQ rules (zero points all
  zero, constant scales positive, at most one blocked axis and a block size that matches the
  scale's shape, FP4 blocks of 16);
- op_restriction: a restriction from the table that can be decided on the graph (TopK's
  `sorted` and K, ScatterND's reduction, constant axes for CumSum and reductions).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from . import trt_onnx_support as support
from .base import PassBase, PassResult
from .onnx_types import infer_value_dtypes

UNSUPPORTED_OP = "unsupported_op"
UNSUPPORTED_DOMAIN = "unsupported_domain"
OPSET = "opset"
UNSUPPORTED_DTYPE = "unsupported_dtype"
FLOAT64 = "float64"
FP8_FORMAT = "fp8_format"
MIXED_PRECISION = "mixed_precision"
ZERO_POINT = "zero_point"
QDQ_SCALE = "qdq_scale"
BLOCK_QUANTIZATION = "block_quantization"
FP4_BLOCK_SIZE = "fp4_block_size"
OP_RESTRICTION = "op_restriction"

_OTHER_FP8 = frozenset({ir.DataType.FLOAT8E5M2, ir.DataType.FLOAT8E4M3FNUZ,
                        ir.DataType.FLOAT8E5M2FNUZ})
# Element types with a rule of their own (float64, fp8_format); the dtype-table rule skips them
# so that one bad value gives one finding.
_REPORTED_ELSEWHERE = _OTHER_FP8 | {ir.DataType.DOUBLE}
# Ops whose data operands must all have one element type in a strongly typed network.
_SAME_TYPE_OPS = frozenset(
    "Add Sub Mul Div Pow Mod Max Min Sum Mean Equal Less Greater LessOrEqual GreaterOrEqual "
    "PRelu MatMul Gemm Einsum Concat Where".split())
# Reductions take their axes as input 1 from opset 18 (ReduceSum from 13).
_REDUCTIONS_WITH_AXES_INPUT = frozenset(op for op in support.ONNX_OPS if op.startswith("Reduce"))


@dataclass(frozen=True)
class Finding:
    node_name: str  # "" for model-level findings (opset, graph inputs and outputs)
    op_type: str
    rule: str
    message: str

    def __str__(self) -> str:
        where = f"{self.node_name} ({self.op_type})" if self.op_type else self.node_name or "model"
        return f"[{self.rule}] {where}: {self.message}"


@dataclass
class LintReport:
    findings: list[Finding] = field(default_factory=list)
    source: str = support.SOURCE

    @property
    def ok(self) -> bool:
        return not self.findings

    def format(self) -> str:
        if self.ok:
            return f"TensorRT readiness: OK (checked against {self.source})"
        counts = ", ".join(f"{rule}: {n}" for rule, n in
                           sorted(Counter(f.rule for f in self.findings).items()))
        lines = [f"TensorRT readiness: {len(self.findings)} finding(s) ({counts}), "
                 f"checked against {self.source}"]
        lines += [f"  {finding}" for finding in self.findings]
        return "\n".join(lines)


def lint_model(model: ir.Model) -> LintReport:
    """Check every node of `model` (main graph, subgraphs, local functions) against the table."""
    custom_rules = {(support.TRT_DOMAIN, op): _output_type_rule(types)
                    for op, types in support.TRT_OP_OUTPUT_TYPES.items()}
    dtypes = infer_value_dtypes(model, custom_rules)
    findings = _model_findings(model, dtypes)
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    for function in model.functions.values():
        nodes.extend(ir.traversal.RecursiveGraphIterator(function))
    for index, node in enumerate(nodes):
        name = node.name or f"<unnamed {node.op_type} #{index}>"
        for rule, message in _node_findings(node, dtypes, model):
            findings.append(Finding(name, node.op_type, rule, message))
    return LintReport(findings)


class TensorRTLintPass(PassBase):
    """Report what would stop TensorRT from parsing the graph as a strongly typed network.

    An analysis, not a rewrite: the model is never modified (modified=False always); the findings
    are in `self.report` (a LintReport) after each call and their number in changes["findings"].
    The checks are listed in this module's docstring; the support data is TensorRT 10.15's.
    """

    name = "trt_lint"

    def __init__(self):
        self.report: LintReport | None = None

    def call(self, model: ir.Model) -> PassResult:
        self.report = lint_model(model)
        return PassResult(model, modified=False, changes={"findings": len(self.report.findings)})


def _output_type_rule(types: tuple[support.OutputType, ...]):
    return lambda node: [output_type.of(node) for output_type in types]


def _model_findings(model: ir.Model, dtypes: dict[ir.Value, ir.DataType]) -> list[Finding]:
    findings = []
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if opset is not None and not support.MIN_OPSET <= opset <= support.MAX_OPSET:
        findings.append(Finding("", "", OPSET, (
            f"ONNX opset {opset} is outside {support.MIN_OPSET}-{support.MAX_OPSET}, the range "
            f"TensorRT {support.TENSORRT_VERSION} supports")))
    for kind, values in (("graph input", model.graph.inputs), ("graph output", model.graph.outputs)):
        for value in values:
            dtype = dtypes.get(value)
            if dtype == ir.DataType.DOUBLE:
                findings.append(Finding("", "", FLOAT64, (
                    f"{kind} '{value.name}' is float64; TensorRT has no FP64 tensors")))
            elif dtype in _OTHER_FP8:
                findings.append(Finding("", "", FP8_FORMAT, (
                    f"{kind} '{value.name}' is {dtype.name}; TensorRT's only FP8 format is "
                    "FLOAT8E4M3FN")))
    return findings


def _node_findings(node: ir.Node, dtypes: dict[ir.Value, ir.DataType],
                   model: ir.Model) -> list[tuple[str, str]]:
    """(rule, message) for each problem with `node`."""
    if node.op_identifier() in model.functions:
        return []  # a call of a local function: the parser inlines it; its body is checked itself
    findings = _value_type_findings(node, dtypes)
    if node.domain in support.ONNX_DOMAINS:
        op_support = support.ONNX_OPS.get(node.op_type)
        if op_support is None:
            marked = node.op_type in support.UNSUPPORTED_ONNX_OPS
            findings.append((UNSUPPORTED_OP, (
                f"TensorRT {support.TENSORRT_VERSION} marks {node.op_type} as unsupported" if marked
                else f"{node.op_type} is not in TensorRT {support.TENSORRT_VERSION}'s ONNX "
                     "support table")))
            return findings
    elif node.domain == support.TRT_DOMAIN:
        op_support = support.TRT_OPS.get(node.op_type)
        if op_support is None:
            findings.append((UNSUPPORTED_OP, (
                f"trt::{node.op_type} is not one of the custom ops TensorRT "
                f"{support.TENSORRT_VERSION}'s parser imports")))
            return findings
    else:
        findings.append((UNSUPPORTED_DOMAIN, (
            f"{node.domain}::{node.op_type}: TensorRT's parser imports the ONNX domain and "
            f"'{support.TRT_DOMAIN}' custom ops only")))
        return findings

    findings += _table_dtype_findings(node, op_support, dtypes)
    if node.op_type in _SAME_TYPE_OPS:
        findings += _mixed_precision_findings(node, op_support, dtypes)
    if node.op_type in support.QUANTIZE_OPS | support.DEQUANTIZE_OPS:
        findings += _qdq_findings(node, dtypes)
    if node.op_type == "TRT_FP4DynamicQuantize":
        findings += _fp4_dynamic_quantize_findings(node)
    findings += _restriction_findings(node)
    return findings


def _value_type_findings(node, dtypes) -> list[tuple[str, str]]:
    """float64 and non-E4M3FN FP8 values, wherever they appear."""
    values = [v for v in (*node.inputs, *node.outputs) if v is not None]
    doubles = [v.name for v in values if dtypes.get(v) == ir.DataType.DOUBLE]
    other_fp8 = [f"'{v.name}' ({dtypes[v].name})" for v in values if dtypes.get(v) in _OTHER_FP8]
    findings = []
    if doubles:
        findings.append((FLOAT64, f"float64 values {doubles}; TensorRT has no FP64 tensors"))
    if other_fp8:
        findings.append((FP8_FORMAT, (f"{', '.join(other_fp8)}: TensorRT's only FP8 format is "
                                      "FLOAT8E4M3FN")))
    return findings


def _operands(node: ir.Node, op_support: support.OpSupport):
    """(description, value) of the inputs and outputs the op's type list applies to."""
    positions = (range(len(node.inputs)) if op_support.typed_inputs is None
                 else op_support.typed_inputs)
    for i in positions:
        if i < len(node.inputs) and node.inputs[i] is not None:
            yield f"input {i} '{node.inputs[i].name}'", node.inputs[i]
    for i in op_support.typed_outputs:
        if i < len(node.outputs):
            yield f"output {i} '{node.outputs[i].name}'", node.outputs[i]


def _table_dtype_findings(node, op_support, dtypes) -> list[tuple[str, str]]:
    wrong = [f"{what} is {dtypes[value].name}" for what, value in _operands(node, op_support)
             if dtypes.get(value) is not None and dtypes[value] not in _REPORTED_ELSEWHERE
             and dtypes[value] not in op_support.dtypes]
    if not wrong:
        return []
    allowed = ", ".join(sorted(dtype.name for dtype in op_support.dtypes))
    return [(UNSUPPORTED_DTYPE, (f"{'; '.join(wrong)}; TensorRT {support.TENSORRT_VERSION}'s "
                                 f"{node.op_type} takes {allowed}"))]


def _mixed_precision_findings(node, op_support, dtypes) -> list[tuple[str, str]]:
    floats = {}
    for _, value in _operands(node, op_support):
        dtype = dtypes.get(value)
        if dtype is not None and dtype.is_floating_point():
            floats.setdefault(dtype, value.name)
    if len(floats) < 2:
        return []
    mix = " and ".join(f"{dtype.name} ('{name}')" for dtype, name in floats.items())
    return [(MIXED_PRECISION, (f"float inputs mix {mix}; a strongly typed network needs an "
                               "explicit Cast to one type"))]


def _qdq_findings(node, dtypes) -> list[tuple[str, str]]:
    data, scale = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    zero_point = node.inputs[2] if len(node.inputs) > 2 else None
    findings = []
    if zero_point is not None:
        values = _constant_array(zero_point)
        if values is None:
            findings.append((ZERO_POINT, (f"zero point '{zero_point.name}' is not a constant; "
                                          "TensorRT needs a zero point that is all zeros")))
        elif np.any(values.astype(np.float32) != 0):
            nonzero = int(np.count_nonzero(values.astype(np.float32)))
            findings.append((ZERO_POINT, (f"zero point '{zero_point.name}' has {nonzero} nonzero "
                                          f"element(s) of {values.size}; TensorRT quantizes "
                                          "symmetrically only (all zeros)")))
    scales = _constant_array(scale)
    if scales is not None and dtypes.get(scale, ir.DataType.UNDEFINED).is_floating_point():
        not_positive = int(np.sum(~(scales.astype(np.float32) > 0)))  # counts NaN too
        if not_positive:
            findings.append((QDQ_SCALE, (f"scale '{scale.name}' has {not_positive} element(s) "
                                         "that are not positive; TensorRT requires positive "
                                         "scales")))
    block_size = _int_attribute(node, "block_size", 0)
    data_shape, scale_shape = _static_shape(data), _static_shape(scale)
    if data_shape is not None and scale_shape is not None:
        axis = _int_attribute(node, "axis", 1)
        axis = axis + len(data_shape) if axis < 0 else axis
        findings += _blocking_findings(data_shape, scale_shape, axis, block_size)
    quantized = node.outputs[0] if node.op_type in support.QUANTIZE_OPS else data
    if dtypes.get(quantized) == support.FP4 and block_size != support.FP4_BLOCK_SIZE:
        findings.append((FP4_BLOCK_SIZE, (f"FP4 quantization with block_size {block_size}; "
                                          f"TensorRT's FP4 takes blocks of "
                                          f"{support.FP4_BLOCK_SIZE}")))
    return findings


def _blocking_findings(data_shape, scale_shape, axis, block_size) -> list[tuple[str, str]]:
    """TensorRT reads a scale as per-tensor (one element), per-channel (1-D, one per element of
    `axis`) or blocked (the data's rank, equal to the data's shape but along one axis)."""
    if math.prod(scale_shape) == 1 and block_size == 0:
        return []
    if len(scale_shape) == 1 and block_size == 0:
        if axis < len(data_shape) and scale_shape[0] != data_shape[axis]:
            return [(BLOCK_QUANTIZATION, (f"per-channel scale has {scale_shape[0]} elements but "
                                          f"axis {axis} of the data has {data_shape[axis]}"))]
        return []
    if len(scale_shape) != len(data_shape):
        return [(BLOCK_QUANTIZATION, (f"scale shape {list(scale_shape)} fits neither per-channel "
                                      f"nor blocked quantization of data {list(data_shape)}"))]
    blocked = [d for d in range(len(data_shape)) if scale_shape[d] != data_shape[d]]
    if len(blocked) > 1:
        return [(BLOCK_QUANTIZATION, (f"scale {list(scale_shape)} differs from data "
                                      f"{list(data_shape)} on axes {blocked}; TensorRT allows "
                                      "one blocked axis"))]
    if block_size > 0:
        if blocked and blocked[0] != axis:
            return [(BLOCK_QUANTIZATION, (f"the scale blocks axis {blocked[0]} but the node's "
                                          f"axis is {axis}"))]
        needed = -(-data_shape[axis] // block_size)
        if scale_shape[axis] != needed:
            return [(BLOCK_QUANTIZATION, (f"block_size {block_size} along axis {axis} (length "
                                          f"{data_shape[axis]}) needs {needed} scales there, the "
                                          f"scale has {scale_shape[axis]}"))]
    return []


def _fp4_dynamic_quantize_findings(node) -> list[tuple[str, str]]:
    findings = []
    block_size = _int_attribute(node, "block_size", support.FP4_BLOCK_SIZE)
    if block_size != support.FP4_BLOCK_SIZE:
        findings.append((FP4_BLOCK_SIZE, (f"block_size {block_size}; TensorRT's FP4 takes blocks "
                                          f"of {support.FP4_BLOCK_SIZE}")))
    scale_type = _int_attribute(node, "scale_type", support.FP8)
    if scale_type != support.FP8:
        findings.append((OP_RESTRICTION, (f"scale_type {ir.DataType(scale_type).name}; TensorRT "
                                          "writes FP4 block scales as FLOAT8E4M3FN")))
    scale = _constant_array(node.inputs[1] if len(node.inputs) > 1 else None)
    if scale is None or scale.size != 1:
        findings.append((OP_RESTRICTION, "the global scale (input 1) must be a constant scalar"))
    return findings


def _restriction_findings(node) -> list[tuple[str, str]]:
    op = node.op_type
    if op == "TopK":
        findings = []
        if _int_attribute(node, "sorted", 1) != 1:
            findings.append((OP_RESTRICTION, "sorted=0; TensorRT's TopK returns sorted values only"))
        k = _constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if k is not None and int(k.reshape(-1)[0]) >= support.TOPK_MAX_K:
            findings.append((OP_RESTRICTION, (f"K={int(k.reshape(-1)[0])}; TensorRT's TopK takes K "
                                              f"below {support.TOPK_MAX_K}")))
        return findings
    if op == "ScatterND":
        reduction = node.attributes["reduction"].as_string() if "reduction" in node.attributes \
            else "none"
        if reduction != "none":
            return [(OP_RESTRICTION, f"reduction='{reduction}'; TensorRT's ScatterND only "
                                     "overwrites")]
    if op == "CumSum" and len(node.inputs) > 1 and _constant_array(node.inputs[1]) is None:
        return [(OP_RESTRICTION, "axis is not a build-time constant")]
    if (op in _REDUCTIONS_WITH_AXES_INPUT and len(node.inputs) > 1 and node.inputs[1] is not None
            and _constant_array(node.inputs[1]) is None):
        return [(OP_RESTRICTION, "axes (input 1) must be an initializer or Constant")]
    return []


def _constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's contents when they are fixed at build time (an initializer that is not also a
    graph input, which a caller could override, or a Constant node's output)."""
    if value is None or value.is_graph_input():
        return None
    try:
        tensor = ir.convenience.get_const_tensor(value)
    except ValueError:  # a malformed Constant node: not something we can read
        return None
    return None if tensor is None else tensor.numpy()


def _static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    constant = _constant_array(value)
    if constant is not None:
        return constant.shape
    if value.shape is not None and all(isinstance(dim, int) for dim in value.shape):
        return tuple(value.shape)
    return None


def _int_attribute(node: ir.Node, name: str, default: int) -> int:
    return node.attributes[name].as_int() if name in node.attributes else default
