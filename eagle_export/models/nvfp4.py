"""NVFP4 on CPU: ModelOpt's NVFP4 numerics as plain torch modules, and their ONNX form.

NVFP4 is E2M1 in blocks of 16 along the input axis, with FP8 (E4M3) block scales and an fp32
global scale. ModelOpt's fake-quantization kernel for it asserts a CUDA tensor, so on CPU the
calibrated Linears are converted to `NVFP4Linear` (`pack_nvfp4`): weights packed by ModelOpt's
NVFP4QTensor (plain torch), activations quantized per block at run time with the global scale
amax/(6*448) from ModelOpt's calibrated amax. Its numerics are NVFP4QTensor's, and it is the
module the NVFP4 ONNX graph is exported from: under `torch.onnx.export` it writes TensorRT's
`TRT_FP4DynamicQuantize` for activations and a placeholder node per weight that `qdq` rewrites
into FP4/FP8 initializers behind two DequantizeLinear nodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EagleExportError
from .layers import row_linear

NVFP4_BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0


def nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize of x along its last axis, with ModelOpt's NVFP4QTensor (plain torch)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    packed, block_scale, g = NVFP4QTensor.quantize(x.float(), NVFP4_BLOCK, weights_scaling_factor_2=global_scale)
    return packed.dequantize(torch.float32, scale=block_scale, double_scale=g,
                             block_sizes={-1: NVFP4_BLOCK}).to(x.dtype)


# torch's scalar type names -> ONNX element types, for the Cast back to the graph's float type.
_ONNX_FLOAT = {"Float": 1, "Half": 10, "BFloat16": 16}  # onnx.TensorProto.FLOAT, FLOAT16, BFLOAT16


def onnx_float_type(value) -> int:
    """The ONNX element type of a traced value (a torch._C.Value) of a float dtype."""
    return _ONNX_FLOAT[value.type().scalarType()]


class _NVFP4Activation(torch.autograd.Function):
    """Export only: TensorRT's TRT_FP4DynamicQuantize followed by the double DequantizeLinear
    (FP8 block scales times the fp32 global scale), whose output is fp32 (the scale's type), then
    a Cast back to x's type, as ModelOpt's NVFP4 exporter does: a strongly typed fp16/bf16 network
    must not mix it with the graph's own float type. The Cast is exact for what NVFP4QTensor's torch
    path does too (dequantize in fp32, then `.to(x.dtype)`). While tracing only the shape of the
    forward matters, and running NVFP4QTensor inside a traced Function breaks the TorchScript tracer."""

    @staticmethod
    def forward(ctx, x, global_scale: float):
        return x.clone()

    @staticmethod
    def symbolic(g, x, global_scale: float):
        scale = g.op("Constant", value_t=torch.tensor(global_scale, dtype=torch.float32))
        x_f4, block_f8 = g.op("trt::TRT_FP4DynamicQuantize", x, scale, axis_i=-1, block_size_i=NVFP4_BLOCK,
                              scale_type_i=17, outputs=2)  # 17: onnx.TensorProto.FLOAT8E4M3FN
        block_scale = g.op("DequantizeLinear", block_f8, scale)
        x_f32 = g.op("DequantizeLinear", x_f4, block_scale, axis_i=-1, block_size_i=NVFP4_BLOCK)
        return g.op("Cast", x_f32, to_i=onnx_float_type(x)).setType(x.type())


class _NVFP4Weight(torch.autograd.Function):
    """The dequantized NVFP4 weight in torch; in ONNX a placeholder node carrying the packed codes
    and scales as attributes, which `qdq` replaces with FP4 and FP8 initializers and two
    DequantizeLinear nodes and a Cast to the weight's own type `dtype` (ONNX's TorchScript exporter
    cannot write FLOAT4E2M1 tensors itself)."""

    @staticmethod
    def forward(ctx, weight, linear: "NVFP4Linear"):
        return weight

    @staticmethod
    def symbolic(g, weight, linear: "NVFP4Linear"):
        return g.op("eagle::NVFP4Weight", weight, codes_t=linear.weight_codes,
                    block_scales_t=linear.weight_block_scales.view(torch.uint8),
                    global_scale_f=float(linear.weight_global_scale), block_size_i=NVFP4_BLOCK,
                    dtype_i=onnx_float_type(weight)).setType(weight.type())


class NVFP4Linear(nn.Module):
    """A Linear with NVFP4 weights (packed by NVFP4QTensor) and, unless weight-only, NVFP4 inputs
    quantized per block at run time with the calibrated global scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_amax: float | None,
                 weight_global_scale: torch.Tensor | None = None):
        super().__init__()
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        if weight.shape[-1] % NVFP4_BLOCK:
            raise EagleExportError(f"a Linear with {weight.shape[-1]} inputs cannot take NVFP4 blocks of {NVFP4_BLOCK}",
                                   "exclude it from quantization (exclude=...) or use fp8")
        packed, block_scales, global_scale = NVFP4QTensor.quantize(
            weight.detach().float(), NVFP4_BLOCK, weights_scaling_factor_2=weight_global_scale)
        self.register_buffer("weight_codes", packed._quantized_data)           # uint8 [out, in/2]
        self.register_buffer("weight_block_scales", block_scales)              # float8_e4m3fn [out, in/16]
        self.register_buffer("weight_global_scale", global_scale.reshape(()))  # fp32
        self.register_buffer("weight", packed.dequantize(
            torch.float32, scale=block_scales, double_scale=global_scale, block_sizes={-1: NVFP4_BLOCK}).to(weight.dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # ModelOpt's activation global scale: amax / (E2M1 max * E4M3 max).
        self.input_global_scale = None if input_amax is None else float(input_amax) / (E2M1_MAX * E4M3_MAX)
        self.row_invariant = False  # layers.width_invariant: multiply through layers.row_linear

    @classmethod
    def from_packed(cls, codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor,
                    input_global_scale: torch.Tensor | None, bias: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> "NVFP4Linear":
        """An NVFP4Linear over stored codes and scales (ModelOpt's Hugging Face export), never re-quantized:
        codes uint8 [out, in/2], block_scales float8_e4m3fn [out, in/16], global_scale (weight_scale_2) and
        input_global_scale (input_scale, None when weight-only) fp32 scalars."""
        from modelopt.torch.quantization.qtensor import NVFP4QTensor

        self = cls.__new__(cls)
        nn.Module.__init__(self)
        shape = torch.Size([codes.shape[0], codes.shape[1] * 2])
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_block_scales", block_scales)
        self.register_buffer("weight_global_scale", global_scale.float().reshape(()))
        self.register_buffer("weight", NVFP4QTensor(shape, dtype, codes).dequantize(
            torch.float32, scale=block_scales, double_scale=self.weight_global_scale,
            block_sizes={-1: NVFP4_BLOCK}).to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.input_global_scale = None if input_global_scale is None else float(input_global_scale)
        self.row_invariant = False
        return self

    def forward(self, x):
        weight = self.weight
        if torch.onnx.is_in_onnx_export():
            weight = _NVFP4Weight.apply(weight, self)
            if self.input_global_scale is not None:
                x = _NVFP4Activation.apply(x, self.input_global_scale)
        elif self.input_global_scale is not None:
            # Per row: blocks of 16 along the row, under the static calibrated global scale.
            x = nvfp4_qdq(x, torch.tensor(self.input_global_scale, dtype=torch.float32))
        return (row_linear if self.row_invariant else F.linear)(x, weight, self.bias)


def pack_nvfp4(model: nn.Module) -> nn.Module:
    """Replace every ModelOpt Linear with an enabled NVFP4 weight quantizer by an NVFP4Linear
    (in place; other modules, FP8 ones included, are left as they are)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    replacements = []
    for name, module in model.named_modules():
        wq = getattr(module, "weight_quantizer", None)
        if not isinstance(module, nn.Linear) or wq is None or not wq.is_enabled:
            continue
        if wq.num_bits != (2, 1) or not wq.block_sizes or wq.block_sizes.get(-1) != NVFP4_BLOCK:
            continue
        iq = module.input_quantizer
        input_amax = None
        if iq.is_enabled:
            if iq.amax is None:
                raise EagleExportError(f"{name}'s input quantizer was never calibrated",
                                       "calibrate with batches that run through every quantized Linear")
            input_amax = float(iq.amax.float().max())
        # The weight's global scale as ModelOpt's own exporter reads it from the quantizer.
        global_scale = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(wq).reshape(())
        replacements.append((name, NVFP4Linear(module.weight, module.bias, input_amax, global_scale)))
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model



def linears_from_graph(model) -> dict[str, NVFP4Linear]:
    """The NVFP4 Linears of an exported graph (an onnx.ModelProto), rebuilt from its own FP4 codes,
    FP8 block scales and global scales (never re-quantized), by the name of the weight each one
    replaces (`target.layers.0.mlp.down_proj.weight`); each one's input scale is the one of the
    TRT_FP4DynamicQuantize feeding its MatMul (none: weight-only). They carry no bias (the caller
    keeps its module's). This runs a build's own NVFP4 weights on CPU, where ONNX Runtime cannot."""
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def constant(name: str) -> float:
        tensor = initializers[name] if name in initializers else producer[name].attribute[0].t
        return float(numpy_helper.to_array(tensor))

    def input_scale(weight: str) -> float | None:
        """weight -> (Cast) -> (Transpose) -> MatMul <- (Cast) <- DequantizeLinear <- DequantizeLinear <-
        TRT_FP4DynamicQuantize; the Casts are those of fp16/bf16 graphs."""
        use = consumers[weight][0]
        while use.op_type in ("Cast", "Transpose"):
            weight, use = use.output[0], consumers[use.output[0]][0]
        source = producer.get(next(i for i in use.input if i != weight))
        while source is not None and source.op_type in ("DequantizeLinear", "Cast"):
            source = producer.get(source.input[0])
        return constant(source.input[1]) if source is not None and source.op_type == "TRT_FP4DynamicQuantize" else None

    linears = {}
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or not node.input[0].endswith("_f4") or node.input[0] not in initializers:
            continue
        base = node.input[0][:-len("_f4")]
        # The block scales' DequantizeLinear names the FP8 scales and the global scale it reads: after
        # initializer deduplication a global scale equal to another layer's has that one's name.
        block_dq = producer[node.input[1]]
        f4, f8 = initializers[base + "_f4"], initializers[block_dq.input[0]]
        rows, cols = f4.dims
        codes = torch.from_numpy(np.frombuffer(f4.raw_data, np.uint8).reshape(rows, cols // 2).copy())
        block_scales = torch.from_numpy(np.frombuffer(f8.raw_data, np.uint8).reshape(tuple(f8.dims)).copy())
        scale = input_scale(node.output[0])
        linears[base] = NVFP4Linear.from_packed(
            codes, block_scales.view(torch.float8_e4m3fn), torch.tensor(constant(block_dq.input[1])),
            None if scale is None else torch.tensor(scale), None)
    return linears


def use_graph_weights(module: nn.Module, graph, prefix: str) -> int:
    """Replace each Linear of `module` that the exported graph holds in NVFP4 with one over the
    graph's own weights (`linears_from_graph`; `prefix` is the module's name in the graph:
    `target`, `drafter`), keeping its bias. Returns how many were replaced."""
    linears = linears_from_graph(graph)
    for name, linear in linears.items():
        path = name.removeprefix(prefix + ".").removesuffix(".weight")
        parent, _, child = path.rpartition(".")
        old = module.get_submodule(path)
        linear.bias, linear.weight = old.bias, linear.weight.to(old.weight.dtype)  # the graph's Cast to its type
        setattr(module.get_submodule(parent) if parent else module, child, linear)
    return len(linears)
