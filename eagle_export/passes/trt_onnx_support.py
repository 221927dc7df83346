"""What TensorRT's ONNX parser accepts, as data: the table `trt_lint` checks graphs against.

Source: the operator support matrix of onnx-tensorrt (docs/operators.md) for TensorRT 10.15,
which covers ONNX opsets 9 to 24, plus the parser's importers for the custom ops in the "trt"
domain (onnxOpImporters.cpp) that ModelOpt's FP8/NVFP4 exports use. Re-check the table when the
TensorRT version the engines are built with moves: support grows with every release.

The "Supported Types" column of the matrix lists the element types of an op's data operands; it
says nothing about index, shape or axis operands (always int32/int64), so each entry also says
which inputs (and, for ops that create values, which outputs) those types apply to.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

TENSORRT_VERSION = "10.15"
SOURCE = "onnx-tensorrt docs/operators.md for TensorRT 10.15 (ONNX opsets 9-24)"
MIN_OPSET, MAX_OPSET = 9, 24

ONNX_DOMAINS = frozenset({"", "ai.onnx"})
# TensorRT's parser looks importers up by op_type alone, so "trt::DequantizeLinear" (as ModelOpt's
# NVFP4 export writes it) imports like the ONNX op. Other domains are not accepted here: an op
# from, say, com.microsoft that happens to share a name with an ONNX op would be imported with the
# ONNX op's semantics, which is wrong.
TRT_DOMAIN = "trt"


@dataclass(frozen=True)
class OpSupport:
    """One row of the matrix.

    dtypes: element types the op takes (the matrix's "Supported Types").
    typed_inputs: positions of the inputs those types apply to; None means every input.
    typed_outputs: positions of outputs they apply to, for ops whose output type is an attribute
        (Cast's `to`, Constant's value) rather than an input's.
    restrictions: the matrix's conditions, in short; `trt_lint` checks the ones it can decide.
    """

    dtypes: frozenset[ir.DataType]
    typed_inputs: tuple[int, ...] | None = (0,)
    typed_outputs: tuple[int, ...] = ()
    restrictions: str = ""


_D = ir.DataType
FP8 = _D.FLOAT8E4M3FN  # TensorRT's only 8-bit float
FP4 = _D.FLOAT4E2M1
_FLOAT = frozenset({_D.FLOAT, _D.FLOAT16, _D.BFLOAT16})
_FLOAT_INT = _FLOAT | {_D.INT32, _D.INT64}
_FLOAT_INT_BOOL = _FLOAT_INT | {_D.BOOL}
_BOOL = frozenset({_D.BOOL})
_FP32_FP16 = frozenset({_D.FLOAT, _D.FLOAT16})
_QUANTIZED = frozenset({_D.INT8, FP8, FP4, _D.INT4})
_CONSTANT_TYPES = _FLOAT_INT_BOOL | {FP8, FP4, _D.INT4}

# Ops whose output is computed from the input's values element by element (or per reduction)
# and whose data types are the same three floats.
_FLOAT_UNARY = (
    "Acos Acosh Asin Asinh Atan Atanh Ceil Celu Cos Cosh Elu Erf Exp Floor HardSigmoid HardSwish "
    "Hardmax ImageScaler InstanceNormalization IsInf LeakyRelu Log LogSoftmax LpNormalization "
    "MeanVarianceNormalization ParametricSoftplus Reciprocal Round ScaledTanh Selu Sigmoid Sin "
    "Sinh Softmax Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Upsample Clip BatchNormalization "
    "GroupNormalization LRN GlobalAveragePool GlobalLpPool GlobalMaxPool Dropout "
    "LayerNormalization RMSNormalization Resize Scan"
).split()
_FLOAT_INT_UNARY = "Abs Neg Sign Relu IsNaN Shrink DepthToSpace SpaceToDepth Pad".split()
_REDUCTIONS = ("ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin "
               "ReduceProd ReduceSum ReduceSumSquare").split()
# Data movement ops: the data operand (input 0) may also be bool.
_MOVERS = ("Expand Flatten Identity Reshape ReverseSequence Shape Size Slice Split Squeeze Tile "
           "Transpose Trilu Unsqueeze").split()

ONNX_OPS: dict[str, OpSupport] = {
    **{op: OpSupport(_FLOAT) for op in _FLOAT_UNARY},
    **{op: OpSupport(_FLOAT_INT) for op in _FLOAT_INT_UNARY},
    **{op: OpSupport(_FLOAT_INT, restrictions="axes must be an initializer") for op in _REDUCTIONS},
    **{op: OpSupport(_FLOAT_INT_BOOL) for op in _MOVERS},
    # Elementwise and variadic ops: every input carries data.
    **{op: OpSupport(_FLOAT_INT, typed_inputs=None) for op in (
        "Add Sub Mul Div Pow Mod Max Min Sum Equal Greater GreaterOrEqual Less LessOrEqual "
        "Range").split()},
    **{op: OpSupport(_BOOL, typed_inputs=None) for op in ("And", "Or", "Xor", "Not")},
    "Mean": OpSupport(_FLOAT_INT | {FP8}, typed_inputs=None),
    "PRelu": OpSupport(_FLOAT, typed_inputs=None),
    "MatMul": OpSupport(_FLOAT, typed_inputs=None),
    "Gemm": OpSupport(_FLOAT, typed_inputs=None),
    "Einsum": OpSupport(_FLOAT, typed_inputs=None),
    "Concat": OpSupport(_FLOAT_INT_BOOL, typed_inputs=None),
    "Where": OpSupport(_FLOAT_INT_BOOL, typed_inputs=(1, 2)),
    "Gelu": OpSupport(_FLOAT_INT | {_D.INT8}),
    "Mish": OpSupport(_FP32_FP16),
    "Conv": OpSupport(_FLOAT, typed_inputs=(0, 1)),
    "ConvTranspose": OpSupport(_FLOAT, typed_inputs=(0, 1)),
    "DeformConv": OpSupport(_FP32_FP16, typed_inputs=(0, 1)),
    "AveragePool": OpSupport(_FLOAT, restrictions="2D or 3D pooling; dilations empty or all ones"),
    "MaxPool": OpSupport(_FLOAT, restrictions="2D or 3D pooling; no Indices output; "
                                              "dilations empty or all ones"),
    "LpPool": OpSupport(_FLOAT, restrictions="dilations empty or all ones"),
    "GridSample": OpSupport(_FP32_FP16, restrictions="4D input"),
    "RoiAlign": OpSupport(_FP32_FP16),
    "NonMaxSuppression": OpSupport(_FP32_FP16, typed_inputs=(0, 1)),
    "NonZero": OpSupport(_FP32_FP16),
    "RotaryEmbedding": OpSupport(_FLOAT, restrictions="position_ids must be int64"),
    "Attention": OpSupport(_FLOAT | {_D.INT8, FP8}, typed_inputs=(0, 1, 2),
                           restrictions="4D Q/K/V/mask; no past/present KV, no qk_matmul_output, "
                                        "no softcap"),
    "TensorScatter": OpSupport(_FLOAT | {_D.INT32}, typed_inputs=(0, 1),
                               restrictions="4D past_cache and update; axis -2"),
    "GRU": OpSupport(_FLOAT, restrictions="bidirectional: same activations both ways"),
    "LSTM": OpSupport(_FLOAT, restrictions="bidirectional: same activations both ways; "
                                           "input_forget 0; layout 0"),
    "RNN": OpSupport(_FLOAT, restrictions="bidirectional: same activations both ways"),
    "BlackmanWindow": OpSupport(_FP32_FP16, typed_inputs=(), typed_outputs=(0,)),
    "HammingWindow": OpSupport(_FP32_FP16, typed_inputs=(), typed_outputs=(0,)),
    "HannWindow": OpSupport(_FP32_FP16, typed_inputs=(), typed_outputs=(0,)),
    "STFT": OpSupport(frozenset({_D.FLOAT}), restrictions="frame_step and window initializers; "
                                                          "real input"),
    "RandomNormal": OpSupport(_FLOAT, typed_inputs=(), typed_outputs=(0,),
                              restrictions="seed is ignored"),
    "RandomUniform": OpSupport(_FLOAT, typed_inputs=(), typed_outputs=(0,),
                               restrictions="seed is ignored"),
    "RandomNormalLike": OpSupport(_FLOAT, restrictions="seed is ignored"),
    "RandomUniformLike": OpSupport(_FLOAT, restrictions="seed is ignored"),
    "EyeLike": OpSupport(_FLOAT_INT_BOOL, restrictions="static input shape"),
    "Gather": OpSupport(_FLOAT_INT_BOOL),
    "GatherElements": OpSupport(_FLOAT_INT_BOOL),
    "GatherND": OpSupport(_FLOAT_INT_BOOL),
    "Scatter": OpSupport(_FLOAT_INT, typed_inputs=(0, 2)),
    "ScatterElements": OpSupport(_FLOAT_INT, typed_inputs=(0, 2)),
    "ScatterND": OpSupport(_FLOAT_INT, typed_inputs=(0, 2), restrictions="reduction must be none"),
    "OneHot": OpSupport(_FLOAT_INT_BOOL, typed_inputs=(2,), restrictions="depth must be a "
                                                                         "build-time constant"),
    "ArgMax": OpSupport(_FLOAT_INT),
    "ArgMin": OpSupport(_FLOAT_INT),
    "TopK": OpSupport(_FLOAT_INT, restrictions="sorted must be 1; K below 3840"),
    "CumSum": OpSupport(_FLOAT, restrictions="axis must be a build-time constant"),
    "Cast": OpSupport(_FLOAT_INT_BOOL | {_D.UINT8}, typed_outputs=(0,)),
    "CastLike": OpSupport(_FLOAT_INT_BOOL | {_D.UINT8}, typed_inputs=(0, 1)),
    "Constant": OpSupport(_CONSTANT_TYPES, typed_inputs=(), typed_outputs=(0,),
                          restrictions="no sparse_value, value_string or value_strings"),
    "ConstantOfShape": OpSupport(_CONSTANT_TYPES, typed_inputs=(), typed_outputs=(0,)),
    "QuantizeLinear": OpSupport(_FLOAT, restrictions="zero point must be 0"),
    "DequantizeLinear": OpSupport(_QUANTIZED, restrictions="zero point must be 0"),
    "If": OpSupport(_FLOAT_INT_BOOL, typed_inputs=(),
                    restrictions="branch outputs of equal rank and distinct names"),
    "Loop": OpSupport(_FLOAT_INT_BOOL, typed_inputs=(),
                      restrictions="static scan output length; loop-carried shapes fixed"),
}

# Ops the matrix marks unsupported (N), so a finding can say "unsupported" rather than "unknown".
UNSUPPORTED_ONNX_OPS = frozenset((
    "AffineGrid Bernoulli BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Col2Im CenterCropPad "
    "Compress ConcatFromSequence ConvInteger DFT Det DynamicQuantizeLinear ImageDecoder "
    "MatMulInteger MaxRoiPool MaxUnpool MelWeightMatrix Multinomial NegativeLogLikelihoodLoss "
    "Optional OptionalGetElement OptionalHasElement QLinearConv QLinearMatMul RegexFullMatch "
    "SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength "
    "SequenceMap SoftmaxCrossEntropyLoss SplitToSequence StringConcat StringNormalizer "
    "StringSplit TfIdfVectorizer Unique"
).split())

# Custom ops in the "trt" domain with an importer in TensorRT 10's parser. Q/DQ ops take the
# data types of their ONNX namesakes; the dynamic quantizers take a high-precision float.
TRT_OPS: dict[str, OpSupport] = {
    "TRT_FP4DynamicQuantize": OpSupport(
        _FLOAT, restrictions="block_size 16; scale_type FLOAT8E4M3FN; scale a constant scalar"),
    "TRT_MXFP8DynamicQuantize": OpSupport(_FLOAT, restrictions="block_size 32"),
    "TRT_FP8QuantizeLinear": OpSupport(_FLOAT, restrictions="zero point must be 0"),
    "TRT_FP8DequantizeLinear": OpSupport(frozenset({FP8})),
    "TRT_INT4QuantizeLinear": OpSupport(_FLOAT, restrictions="zero point must be 0"),
    "TRT_INT4DequantizeLinear": OpSupport(frozenset({_D.INT4})),
    "TRT_MXFP8QuantizeLinear": OpSupport(_FLOAT),
    "TRT_MXFP8DequantizeLinear": OpSupport(frozenset({FP8})),
    "QuantizeLinear": ONNX_OPS["QuantizeLinear"],
    "DequantizeLinear": ONNX_OPS["DequantizeLinear"],
}

# Element types the custom ops produce, which ONNX shape inference cannot know (they have no
# schema): per output, a fixed type, the index of the input whose type it takes, and the
# attribute that overrides either when the node sets it.
@dataclass(frozen=True)
class OutputType:
    default: ir.DataType | int | None
    attribute: str | None = None

    def of(self, node: ir.Node) -> ir.DataType | int | None:
        if self.attribute is not None and self.attribute in node.attributes:
            return ir.DataType(node.attributes[self.attribute].as_int())
        return self.default


_LIKE_SCALE = OutputType(1, "output_dtype")  # dequantize to the scale's type unless told otherwise
TRT_OP_OUTPUT_TYPES: dict[str, tuple[OutputType, ...]] = {
    "TRT_FP4DynamicQuantize": (OutputType(FP4), OutputType(FP8, "scale_type")),
    "TRT_MXFP8DynamicQuantize": (OutputType(FP8, "output_dtype"), OutputType(_D.UINT8)),
    "TRT_FP8QuantizeLinear": (OutputType(FP8),),
    "TRT_INT4QuantizeLinear": (OutputType(_D.INT4),),
    "TRT_MXFP8QuantizeLinear": (OutputType(FP8),),
    "TRT_FP8DequantizeLinear": (_LIKE_SCALE,),
    "TRT_INT4DequantizeLinear": (_LIKE_SCALE,),
    "TRT_MXFP8DequantizeLinear": (OutputType(_D.FLOAT, "output_dtype"),),
    "DequantizeLinear": (_LIKE_SCALE,),
    "QuantizeLinear": (OutputType(2, "output_dtype"),),  # the zero point's type, as in ONNX
}

# Quantize/dequantize ops of either domain: the zero point, scale and blocking rules apply.
QUANTIZE_OPS = frozenset({"QuantizeLinear", "TRT_FP8QuantizeLinear", "TRT_INT4QuantizeLinear",
                          "TRT_MXFP8QuantizeLinear"})
DEQUANTIZE_OPS = frozenset({"DequantizeLinear", "TRT_FP8DequantizeLinear",
                            "TRT_INT4DequantizeLinear", "TRT_MXFP8DequantizeLinear"})
# The block size TensorRT's FP4 kernels implement (NVFP4: 16 values share one FP8 scale).
FP4_BLOCK_SIZE = 16
# TopK's K must stay below this (the matrix's limit for TensorRT's TopK layer).
TOPK_MAX_K = 3840
