"""Element types of every value in an ONNX graph, for passes that must know them.

Exported graphs usually declare the type of each value, but not always (ops without a schema,
models written by hand, value_info dropped by a tool). `infer_value_dtypes` fills the gaps with
ONNX shape inference run on a copy of the graph that carries no weight data, so it costs the same
for a 100 MB model as for a 100 KB one and never touches the model itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import onnx
import onnx_ir as ir

# What a pass may say about an op that has no ONNX schema (a TensorRT custom op, say): one entry
# per output, either the output's fixed element type or the index of the input whose element type
# the output takes. None leaves that output to whatever the graph declares.
OutputDtypeRule = Callable[[ir.Node], "list[ir.DataType | int | None]"]


def infer_value_dtypes(
    model: ir.Model,
    custom_output_dtypes: Mapping[tuple[str, str], OutputDtypeRule] | None = None,
) -> dict[ir.Value, ir.DataType]:
    """Return the element type of every value of `model` whose type is known or inferable.

    Types declared on the values win over inferred ones. `custom_output_dtypes` maps
    (domain, op_type) of schemaless ops to a rule giving their output types, so that inference
    can continue past them instead of leaving everything downstream untyped.
    """
    values = list(_all_values(model))
    dtypes = {value: value.dtype for value in values if value.dtype is not None}
    by_name = {value.name: value for value in values if value.name}
    skeleton = _typed_skeleton(model, dtypes, custom_output_dtypes or {})
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference is best effort: fall back to the declared types.
        return dtypes
    for name, elem_type in _proto_value_types(inferred.graph):
        value = by_name.get(name)
        if value is not None and value not in dtypes and elem_type != onnx.TensorProto.UNDEFINED:
            dtypes[value] = ir.DataType(elem_type)
    return dtypes


def _all_values(model: ir.Model) -> Iterator[ir.Value]:
    for graph in model.graphs():
        yield from graph.inputs
        yield from graph.initializers.values()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        yield from (value for value in node.inputs if value is not None)
        yield from node.outputs


def _typed_skeleton(
    model: ir.Model,
    dtypes: Mapping[ir.Value, ir.DataType],
    custom_output_dtypes: Mapping[tuple[str, str], OutputDtypeRule],
) -> onnx.ModelProto:
    """The main graph as a ModelProto whose initializers are typed inputs without data.

    Nodes are serialized one by one rather than through ir.to_proto(model), which would copy every
    weight. A schemaless op with a rule in `custom_output_dtypes` is replaced by a stand-in whose
    outputs have the types the rule gives: fixed types become declared value_info, "same type as
    input i" becomes CastLike(input 0, input i), which keeps input 0's shape (right for the
    dequantize-like ops that use it) and takes input i's element type.
    """
    graph = model.graph
    value_info = []
    nodes = []
    for node in graph:
        rule = custom_output_dtypes.get((node.domain, node.op_type))
        if rule is None:
            nodes.append(ir.serde.serialize_node(node))
            continue
        for output, dtype in zip(node.outputs, rule(node)):
            if output in dtypes:
                continue  # the graph's own declaration wins
            if isinstance(dtype, ir.DataType):
                value_info.append(onnx.helper.make_tensor_value_info(output.name, dtype, None))
            elif isinstance(dtype, int) and dtype < len(node.inputs) and node.inputs[dtype] is not None:
                nodes.append(onnx.helper.make_node(
                    "CastLike", [node.inputs[0].name, node.inputs[dtype].name], [output.name]))
    declared = {value: dtype for value, dtype in dtypes.items() if value.name}
    inputs = [*graph.inputs, *(v for v in graph.initializers.values() if not v.is_graph_input())]
    proto_graph = onnx.helper.make_graph(
        nodes,
        graph.name or "skeleton",
        [_value_info(value, declared.get(value)) for value in inputs],
        [_value_info(value, declared.get(value)) for value in graph.outputs],
        value_info=value_info + [
            onnx.helper.make_tensor_value_info(value.name, dtype, None)
            for value, dtype in declared.items()
            if value.producer() is not None and value.producer().graph is graph
            and not value.is_graph_output()
        ],
    )
    opsets = [onnx.helper.make_opsetid(domain, version)
              for domain, version in model.opset_imports.items()]
    # CastLike needs opset 15; stand-ins are only emitted for models that have custom ops, whose
    # ONNX opset is recent anyway, and inference treats a too-old CastLike as unknown (no harm).
    proto = onnx.helper.make_model(proto_graph, opset_imports=opsets, ir_version=model.ir_version)
    proto.functions.extend(ir.serde.serialize_function(f) for f in model.functions.values())
    return proto


def _value_info(value: ir.Value, dtype: ir.DataType | None) -> onnx.ValueInfoProto:
    shape = None
    if value.shape is not None:
        shape = [dim if isinstance(dim, int) else (dim.value if dim.value else None)
                 for dim in value.shape]
    return onnx.helper.make_tensor_value_info(
        value.name, dtype if dtype is not None else onnx.TensorProto.UNDEFINED, shape)


def _proto_value_types(graph: onnx.GraphProto) -> Iterator[tuple[str, int]]:
    """(name, elem_type) of every typed value in `graph` and its subgraphs."""
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.HasField("tensor_type"):
            yield info.name, info.type.tensor_type.elem_type
    for node in graph.node:
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                yield from _proto_value_types(subgraph)
