"""The ONNX IR version every graph this project writes declares, and the pass that sets it."""

from __future__ import annotations

import onnx_ir as ir

from .base import PassBase, PassResult

# onnx 1.23's helpers stamp IR version 14 on new models; ONNX Runtime up to 1.31 refuses to load
# them (1.32 accepts them) and TensorRT 10's parser bundles an older onnx. IR 10 (onnx 1.16) is
# understood by every ONNX Runtime and TensorRT parser this project supports. Anything that builds
# a ModelProto (exporter, tests) should use this constant rather than its own number.
ONNX_IR_VERSION = 10


class PinIrVersionPass(PassBase):
    """Set the model's ir_version to ONNX_IR_VERSION so ONNX Runtime and TensorRT load it.

    Rewrite: `model.ir_version = ONNX_IR_VERSION`. Exact: the IR version is file-format metadata;
    no node, value or weight changes, so the graph computes what it computed. It lowers newer
    versions as well as raising older ones: onnx.checker accepts, and ONNX Runtime 1.31 loads, an
    IR 10 model that imports opset 23 and holds FLOAT4E2M1 tensors, which NVFP4 graphs need.
    """

    name = "pin_ir_version"

    def call(self, model: ir.Model) -> PassResult:
        previous = model.ir_version
        if previous == ONNX_IR_VERSION:
            return PassResult(model, modified=False)
        model.ir_version = ONNX_IR_VERSION
        return PassResult(model, modified=True, changes={"previous_ir_version": previous})
