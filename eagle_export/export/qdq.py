"""Q/DQ rewrites: a quantized graph as the TorchScript exporter writes it -> the form TensorRT's
ONNX parser reads (`export.export_graph(..., quantized=True)` runs them).

FP8 (ModelOpt's quantizers): the TorchScript exporter writes ModelOpt's `trt::TRT_FP8QuantizeLinear`
/ `TRT_FP8DequantizeLinear` custom ops; they become native QuantizeLinear / DequantizeLinear with a
float8e4m3fn zero point of 0 (opset 19+), and each weight's Q is folded into an FP8 initializer, so
a weight is stored once, in FP8, behind a DequantizeLinear.

NVFP4 (`nvfp4.NVFP4Linear`): activations are `trt::TRT_FP4DynamicQuantize` -> DequantizeLinear
(FP8 block scales x fp32 global scale) -> DequantizeLinear (FLOAT4E2M1, block_size 16, axis -1);
weights are FLOAT4E2M1 and FLOAT8E4M3FN initializers behind the same double DequantizeLinear.
The second DequantizeLinear's output is fp32 (the global scale stays fp32, as TensorRT reads it),
so in fp16/bf16 graphs a Cast to the graph's float type follows it, as in ModelOpt's exporter.
FLOAT4E2M1 in DequantizeLinear needs opset 23, so NVFP4 graphs declare it (as ModelOpt does).

The torch export runs at opset 20 (`EXPORT_OPSET`, the TorchScript exporter's highest; FP8 Q/DQ
need 19): the ops it writes mean the same at 20 and 23. After these rewrites the ONNX cleanup
pipeline runs as for any graph (passes/onnx_cleanup.py never folds Q/DQ; its CSE shares one Q
between q/k/v and between gate/up, which read the same input with the same scale).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..passes import ONNX_IR_VERSION

EXPORT_OPSET = 20
NVFP4_OPSET = 23
FP8_MAX = 448.0


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            return numpy_helper.to_array(node.attribute[0].t)
    return None


def _drop_value_info(model: onnx.ModelProto, names: set[str]) -> None:
    kept = [vi for vi in model.graph.value_info if vi.name not in names]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def _remove_unused_constants(model: onnx.ModelProto) -> None:
    """Drop initializers and Constant nodes nothing reads (the scales of folded weight Qs)."""
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    nodes = [n for n in model.graph.node if n.op_type != "Constant" or n.output[0] in used]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def fp8_weight_codes(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """The FP8 codes of every FP8-quantized weight under `module`, by parameter name (= initializer
    name), rounded exactly as ModelOpt's fake quantization does: w * (448 / amax) in fp32, saturated,
    nearest-even. Recomputing them from the exported scale would not do: the graph stores amax/448,
    and dividing by it rounds exact ties differently now and then (GGUF-converted weights sit on such
    ties by the thousand)."""
    codes = {}
    for name, sub in module.named_modules():
        wq = getattr(sub, "weight_quantizer", None)
        if wq is None or not wq.is_enabled or wq.num_bits != (4, 3) or wq.block_sizes or wq.amax is None:
            continue
        multiplier = FP8_MAX / wq.amax.float()
        q = (sub.weight.detach().float() * multiplier).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        codes[f"{name}.weight"] = q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return codes


def fp8_to_native_qdq(model: onnx.ModelProto, weight_codes: dict[str, np.ndarray] | None = None) -> dict[str, int]:
    """ModelOpt's TRT_FP8 Q/DQ custom ops -> native Q/DQ; weight Q folded into FP8 initializers
    (from `weight_codes`, see fp8_weight_codes; weights missing there are quantized from the graph)."""
    weight_codes = weight_codes or {}
    graph = model.graph
    zero_point = numpy_helper.from_array(np.zeros((), dtype=ml_dtypes.float8_e4m3fn), "fp8_zero_point")
    counts = {"activation_qdq": 0, "fp8_weights": 0}
    new_nodes, retyped = [], set()
    initializers = {t.name: t for t in graph.initializer}
    folded: dict[str, str] = {}  # Q output -> FP8 initializer
    for node in graph.node:
        if node.domain == "trt" and node.op_type == "TRT_FP8QuantizeLinear":
            x, scale = node.input
            if x in initializers and _constant(model, scale) is not None:
                # A weight: stored once, in FP8; the unrolled drafter's steps share it.
                if x + "_fp8" not in initializers:
                    q = weight_codes.get(x)
                    if q is None:  # QuantizeLinear's own formula: x / scale, saturate, nearest-even
                        w = numpy_helper.to_array(initializers[x]).astype(np.float32)
                        q = np.clip(w / _constant(model, scale), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
                    initializers[x + "_fp8"] = numpy_helper.from_array(q, x + "_fp8")
                    graph.initializer.append(initializers[x + "_fp8"])
                    counts["fp8_weights"] += 1
                folded[node.output[0]] = x + "_fp8"
                continue
            new_nodes.append(helper.make_node("QuantizeLinear", [x, scale, zero_point.name], list(node.output),
                                              name=node.name))
            counts["activation_qdq"] += 1
            retyped.add(node.output[0])
        elif node.domain == "trt" and node.op_type == "TRT_FP8DequantizeLinear":
            q, scale = node.input
            new_nodes.append(helper.make_node("DequantizeLinear", [folded.get(q, q), scale, zero_point.name],
                                              list(node.output), name=node.name))
        else:
            new_nodes.append(node)
    if counts["activation_qdq"] or counts["fp8_weights"]:
        graph.initializer.append(zero_point)
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_value_info(model, retyped | set(folded))
    return counts


def nvfp4_weights_to_double_dq(model: onnx.ModelProto) -> int:
    """Placeholder `eagle::NVFP4Weight` nodes -> FP4 codes + FP8 block scales + fp32 global scale
    initializers and two DequantizeLinear nodes (TensorRT's NVFP4 weight form), whose fp32 output
    is cast to the weight's own type (the placeholder's `dtype`) when that is not fp32."""
    graph = model.graph
    new_nodes, count = [], 0
    done: dict[str, str] = {}     # weight initializer -> its dequantized output
    renamed: dict[str, str] = {}  # a repeated placeholder's output -> the first one's
    for node in graph.node:
        if not (node.domain == "eagle" and node.op_type == "NVFP4Weight"):
            new_nodes.append(node)
            continue
        if node.input[0] in done:  # the unrolled drafter reads each weight once per step
            renamed[node.output[0]] = done[node.input[0]]
            continue
        done[node.input[0]] = node.output[0]
        attrs = {a.name: a for a in node.attribute}
        codes = numpy_helper.to_array(attrs["codes"].t)                  # uint8 [out, in/2], low nibble first
        block_scales = numpy_helper.to_array(attrs["block_scales"].t)    # uint8 bits of FP8 [out, in/16]
        block_size = attrs["block_size"].i
        base = node.input[0]
        w_f4 = helper.make_tensor(base + "_f4", TensorProto.FLOAT4E2M1, [*codes.shape[:-1], codes.shape[-1] * 2],
                                  codes.tobytes(), raw=True)
        s_f8 = helper.make_tensor(base + "_f8_scale", TensorProto.FLOAT8E4M3FN, list(block_scales.shape),
                                  block_scales.tobytes(), raw=True)
        g = numpy_helper.from_array(np.array(attrs["global_scale"].f, dtype=np.float32), base + "_f32_scale")
        graph.initializer.extend([w_f4, s_f8, g])
        new_nodes.append(helper.make_node("DequantizeLinear", [s_f8.name, g.name], [base + "_block_scale"],
                                          name=base + "_DequantizeLinear"))
        dtype = attrs["dtype"].i if "dtype" in attrs else TensorProto.FLOAT
        dequantized = node.output[0] if dtype == TensorProto.FLOAT else base + "_dequantized"
        new_nodes.append(helper.make_node("DequantizeLinear", [w_f4.name, base + "_block_scale"], [dequantized],
                                          name=base + "_DequantizeLinear_1", axis=-1, block_size=block_size))
        if dequantized != node.output[0]:
            new_nodes.append(helper.make_node("Cast", [dequantized], list(node.output), name=base + "_Cast", to=dtype))
        count += 1
    for node in new_nodes:
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_value_info(model, set(renamed))
    return count


def finish_quantized(model: onnx.ModelProto, fp8_weights: dict[str, np.ndarray] | None = None
                     ) -> tuple[onnx.ModelProto, dict]:
    """All rewrites from the exporter's output to the TensorRT form, plus opset and ir_version pins."""
    report = dict(fp8_to_native_qdq(model, fp8_weights))
    report["nvfp4_weights"] = nvfp4_weights_to_double_dq(model)
    report["nvfp4_activations"] = sum(n.op_type == "TRT_FP4DynamicQuantize" for n in model.graph.node)
    _remove_unused_constants(model)
    fp4 = report["nvfp4_weights"] or report["nvfp4_activations"]
    if fp4:
        quantized = {o for n in model.graph.node if n.op_type == "TRT_FP4DynamicQuantize" for o in n.output}
        _drop_value_info(model, quantized)
    opsets = {o.domain: o for o in model.opset_import}
    opsets[""].version = NVFP4_OPSET if fp4 else max(opsets[""].version, EXPORT_OPSET)
    if "eagle" in opsets:  # the placeholders' domain, now unused
        model.opset_import.remove(opsets["eagle"])
    model.ir_version = ONNX_IR_VERSION
    report["opset"] = opsets[""].version
    return model, report
