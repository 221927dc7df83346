"""What every graph this project writes declares exactly: its ONNX IR version, and its outputs' shapes
(the graph contract's), with the passes that set them."""

from __future__ import annotations

import onnx_ir as ir

from eagle_export.errors import EagleExportError
from eagle_export.models import contract as C

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


class PinOutputShapesPass(PassBase):
    """Declare each graph output's shape as the graph contract gives it: its fixed sizes and named axes.

    Rewrite: `output.shape = spec[output.name].shape` for every graph output. Exact: declared shapes
    are metadata; no node, value or weight changes. The exporter names each dim it cannot prove
    static after the node that made it ('Concatnew_key_dim_4' for new_key's head size, a TopK's output
    for a dynamic tree's node count), which tells a reader of the graph (ONNX Runtime's IO binding,
    TensorRT users, other tools) nothing the contract does not know. A fixed size the exporter
    declared that differs from the contract's is a bug in the export, and an error.
    """

    name = "pin_output_shapes"

    def __init__(self, spec: C.GraphSpec):
        self.spec = spec

    def call(self, model: ir.Model) -> PassResult:
        renamed = 0
        for value in model.graph.outputs:
            want = self.spec[value.name].shape
            have = tuple(value.shape) if value.shape is not None else (None,) * len(want)
            clash = [(h, w) for h, w in zip(have, want) if isinstance(h, int) and h != w]
            if len(have) != len(want) or clash:
                raise EagleExportError(f"the exported {value.name} has shape {list(have)}, the graph contract "
                                       f"says {list(want)}", "this is a bug in the export: report it")
            renamed += sum(not isinstance(h, type(w)) or h != w for h, w in zip(have, want))
            value.shape = ir.Shape(list(want))
        return PassResult(model, modified=renamed > 0, changes={"dims_pinned": renamed} if renamed else {})
