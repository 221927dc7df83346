"""Clean-up passes for exported ONNX graphs, and the standard order to run them in.

Each pass works in place on an `onnx_ir.Model`. Where onnx_ir (or onnxscript, for constant
folding) already has the rewrite, the pass here delegates to it and adds what our PassBase
contract asks for: the counts of what changed, measured on the model before and after rather than
estimated. Identity elimination and cast clean-up are written here: onnx_ir's identity pass drops a
graph output when an Identity joins two of them, and onnx_ir has no cast pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
import onnx_ir.passes.common as onnx_ir_common

from .base import PassBase, PassManager, PassResult
from .onnx_pin import PinIrVersionPass, PinOutputShapesPass
from .onnx_types import infer_value_dtypes

_ONNX_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class _Census:
    """What a clean-up pass can shrink, counted over the main graph, subgraphs and functions."""

    nodes: int
    initializers: int
    initializer_bytes: int

    @classmethod
    def of(cls, model: ir.Model) -> _Census:
        nodes = sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))
        nodes += sum(1 for function in model.functions.values()
                     for _ in ir.traversal.RecursiveGraphIterator(function))
        initializers = [value for graph in model.graphs() for value in graph.initializers.values()]
        return cls(
            nodes=nodes,
            initializers=len(initializers),
            initializer_bytes=sum(value.const_value.nbytes for value in initializers
                                  if value.const_value is not None),
        )

    def changes_since(self, before: _Census) -> dict[str, int]:
        """Nonzero differences as `<what>_removed` / `<what>_added`, bytes as saved / added."""
        changes = {}
        for what, was, now in (("nodes", before.nodes, self.nodes),
                               ("initializers", before.initializers, self.initializers)):
            if now != was:
                changes[f"{what}_removed" if now < was else f"{what}_added"] = abs(was - now)
        if self.initializer_bytes != before.initializer_bytes:
            key = "bytes_saved" if self.initializer_bytes < before.initializer_bytes else "bytes_added"
            changes[key] = abs(before.initializer_bytes - self.initializer_bytes)
        return changes


class _DelegatingPass(PassBase):
    """A pass whose rewrite is an onnx_ir pass; this adds the counts onnx_ir does not report."""

    def __init__(self, rewrite: ir.passes.PassBase):
        self._rewrite = rewrite

    def call(self, model: ir.Model) -> PassResult:
        before = _Census.of(model)
        result = self._rewrite(model)
        return PassResult(result.model, result.modified, _Census.of(result.model).changes_since(before))


class ConstantFoldingPass(PassBase):
    """Replace nodes whose inputs are all constants by the constant they compute.

    Delegates to onnxscript's FoldConstantsPass (the folder behind torch.onnx's optimizer), which
    evaluates each foldable node with the ONNX reference implementation and stores the result as
    an initializer, and also applies its shape-level simplifications: `Shape` of a statically
    shaped value becomes a constant, a `Reshape` or `Expand` to the shape the value already has
    and a `Cast` to the type it already has become the value itself.

    Exact: a node whose inputs are all constant computes the same tensor on every run, so storing
    that tensor changes no output. Integer and shape arithmetic folds bit for bit; a float op folds
    to what the reference kernel computes, which can differ from another runtime's kernel in the
    last bit for transcendental functions (TensorRT folds such subgraphs at build time anyway).
    Quantize/DequantizeLinear are never folded (TensorRT needs the Q/DQ pairs to pick low-precision
    kernels), nor ConstantOfShape (folding would store the whole filled tensor); inputs larger than
    `input_size_limit` elements and results larger than `output_size_limit` are left alone so that
    folding does not grow the file.
    """

    name = "constant_folding"

    def __init__(self, input_size_limit: int = 8192, output_size_limit: int = 512 * 512):
        self.input_size_limit = input_size_limit
        self.output_size_limit = output_size_limit

    def call(self, model: ir.Model) -> PassResult:
        # Imported here: onnxscript takes about a second to import and only this pass needs it.
        import onnxscript.optimizer

        before = _Census.of(model)
        result = onnxscript.optimizer.fold_constants(
            model,
            onnx_shape_inference=False,
            input_size_limit=self.input_size_limit,
            output_size_limit=self.output_size_limit,
        )
        return PassResult(model, result.modified, _Census.of(model).changes_since(before))


class DeadCodeEliminationPass(_DelegatingPass):
    """Remove nodes and initializers that no graph output depends on.

    Delegates to onnx_ir's RemoveUnusedNodesPass, which also drops unused trailing optional outputs
    of the nodes it keeps. Exact: a value nothing reads cannot influence an output; graph inputs and
    outputs are never touched, so the model's signature stays the same.
    """

    name = "dead_code_elimination"

    def __init__(self):
        super().__init__(onnx_ir_common.RemoveUnusedNodesPass())


class IdentityEliminationPass(PassBase):
    """Remove Identity nodes, connecting their consumers to the Identity's input.

    Rewrite: every use of `y = Identity(x)` becomes a use of `x` and the node goes. When `y` is a
    graph output, `x` is renamed to `y` and takes its place in the outputs, which keeps the output
    name (the contract with the runtime); that is only done when `x` is produced by a node of the
    same graph and is not an output itself, otherwise the node stays (renaming would rename a graph
    input or lose another output's name). Exact: Identity returns its input unchanged.
    """

    name = "identity_elimination"

    def call(self, model: ir.Model) -> PassResult:
        removed = 0
        for node in _all_nodes(model):
            if node.op_type != "Identity" or node.domain not in _ONNX_DOMAINS:
                continue
            source, output = node.inputs[0], node.outputs[0]
            if source is None:
                continue
            graph = node.graph
            if output.is_graph_output():
                producer = source.producer()
                if producer is None or producer.graph is not graph or source.is_graph_output():
                    continue
                output_name = output.name
                output.replace_all_uses_with(source, replace_graph_outputs=True)
                source.name = output_name
            else:
                output.replace_all_uses_with(source)
            graph.remove(node, safe=True)
            removed += 1
        return PassResult(model, modified=removed > 0,
                          changes={"nodes_removed": removed} if removed else {})


# For each element type A, the types B that hold every value of A exactly, so that casting A to B
# changes no value and casting back gives A's value bit for bit. An integer fits a float when its
# width fits the float's significand (float16: 11 bits, bfloat16: 8, float32: 24, float64: 53);
# bool is 0 or 1 in every numeric type.
_D = ir.DataType
_EXACT_WIDENINGS: dict[ir.DataType, frozenset[ir.DataType]] = {
    _D.BOOL: frozenset({_D.UINT8, _D.INT8, _D.UINT16, _D.INT16, _D.UINT32, _D.INT32, _D.UINT64,
                        _D.INT64, _D.FLOAT16, _D.BFLOAT16, _D.FLOAT, _D.DOUBLE}),
    _D.UINT8: frozenset({_D.UINT16, _D.INT16, _D.UINT32, _D.INT32, _D.UINT64, _D.INT64,
                         _D.FLOAT16, _D.BFLOAT16, _D.FLOAT, _D.DOUBLE}),
    _D.INT8: frozenset({_D.INT16, _D.INT32, _D.INT64, _D.FLOAT16, _D.BFLOAT16, _D.FLOAT, _D.DOUBLE}),
    _D.UINT16: frozenset({_D.UINT32, _D.INT32, _D.UINT64, _D.INT64, _D.FLOAT, _D.DOUBLE}),
    _D.INT16: frozenset({_D.INT32, _D.INT64, _D.FLOAT, _D.DOUBLE}),
    _D.UINT32: frozenset({_D.UINT64, _D.INT64, _D.DOUBLE}),
    _D.INT32: frozenset({_D.INT64, _D.DOUBLE}),
    _D.FLOAT16: frozenset({_D.FLOAT, _D.DOUBLE}),
    _D.BFLOAT16: frozenset({_D.FLOAT, _D.DOUBLE}),
    _D.FLOAT: frozenset({_D.DOUBLE}),
}
_IEEE_FLOATS = frozenset({_D.FLOAT16, _D.BFLOAT16, _D.FLOAT, _D.DOUBLE})


class CastCleanupPass(PassBase):
    """Remove casts that cannot change a value: to the value's own type, or through a wider type.

    With A the element type of x, the rewrites are:
    1. `Cast(x, to=A)` -> `x`. ONNX defines a cast to the input's own type as the identity.
    2. `Cast(Cast(x, to=B), to=A)` -> `x` when B holds every value of A (float16 -> float32 ->
       float16, int32 -> int64 -> int32, bool -> int64 -> bool, ...): the first cast is exact, so
       the second gets back x's own value.
    3. `Cast(Cast(x, to=B), to=C)` -> `Cast(x, to=C)` when B holds every value of A and A, B and C
       are all float16/bfloat16/float32/float64: the first cast does not change the number, and
       rounding one number to C gives the same result whether it arrives as A or as B. Limited to
       floats because converting integers is where runtimes' Cast kernels differ (saturation,
       pairs that TensorRT's Cast does not implement).
    Not rewritten, because they are not exact: narrowing then widening (float32 -> float16 ->
    float32 rounds to half precision, which is usually the point), float -> int -> float
    (truncates). Casts whose output is a graph output stay, to keep the output's name and type.
    A cast whose input type is unknown (not declared and not inferable) is left alone.
    """

    name = "cast_cleanup"

    def call(self, model: ir.Model) -> PassResult:
        dtypes = infer_value_dtypes(model)
        removed = rewired = 0
        for node in _all_nodes(model):
            if node.graph is None or not _is_cast(node) or node.outputs[0].is_graph_output():
                continue  # the node may already be gone: removed as the first cast of a pair
            source, output = node.inputs[0], node.outputs[0]
            target = ir.DataType(node.attributes["to"].as_int())
            if dtypes.get(source) == target:
                output.replace_all_uses_with(source)
                node.graph.remove(node, safe=True)
                removed += 1
                continue
            first_cast = source.producer()
            if first_cast is None or not _is_cast(first_cast):
                continue
            origin = first_cast.inputs[0]
            origin_dtype = dtypes.get(origin)
            intermediate = ir.DataType(first_cast.attributes["to"].as_int())
            if intermediate not in _EXACT_WIDENINGS.get(origin_dtype, ()):
                continue
            if target == origin_dtype:
                output.replace_all_uses_with(origin)
                node.graph.remove(node, safe=True)
                removed += 1
            elif {origin_dtype, intermediate, target} <= _IEEE_FLOATS:
                node.replace_input_with(0, origin)
                rewired += 1
            else:
                continue
            if not source.uses() and not source.is_graph_output():
                first_cast.graph.remove(first_cast, safe=True)
                removed += 1
        changes = {key: count for key, count in
                   (("nodes_removed", removed), ("casts_rewired", rewired)) if count}
        return PassResult(model, modified=bool(changes), changes=changes)


class InitializerDeduplicationPass(_DelegatingPass):
    """Keep one initializer for each set of identical ones (same dtype, shape and bytes).

    Delegates to onnx_ir's DeduplicateHashedInitializersPass: initializers are grouped by a SHA-512
    of their data and, within a group, compared byte for byte before one replaces another, so a
    hash collision cannot merge different tensors. Exact: every reader of a duplicate now reads a
    tensor with the same dtype, shape and bytes. Initializers that are also graph inputs (a caller
    may override them) or graph outputs are left alone.
    """

    name = "initializer_deduplication"

    def __init__(self):
        super().__init__(onnx_ir_common.DeduplicateHashedInitializersPass())


class CommonSubexpressionEliminationPass(_DelegatingPass):
    """Compute each repeated expression once: a node equal to an earlier one reuses its outputs.

    Delegates to onnx_ir's CommonSubexpressionEliminationPass (main graph): two nodes are equal
    when they have the same op, domain, attributes and the very same input values. Exact for
    deterministic ops, which is every op but the Random* and Multinomial ones that it skips; nodes
    with subgraphs are skipped too. Run it after initializer de-duplication, which turns equal
    weights into the same value and so lets their readers merge.
    """

    name = "common_subexpression_elimination"

    def __init__(self):
        super().__init__(onnx_ir_common.CommonSubexpressionEliminationPass())


class TopologicalSortPass(_DelegatingPass):
    """Order nodes so that each comes after the producers of its inputs.

    Delegates to onnx_ir's TopologicalSortPass (a stable sort of the main graph and functions).
    Exact: order does not change what a dataflow graph computes; ONNX requires it, and TensorRT's
    parser and ONNX Runtime read nodes in file order.
    """

    name = "topological_sort"

    def __init__(self):
        super().__init__(onnx_ir_common.TopologicalSortPass())

    def call(self, model: ir.Model) -> PassResult:
        graph_likes = [model.graph, *model.functions.values()]
        position_before = {node: index for graph_like in graph_likes
                           for index, node in enumerate(graph_like)}
        result = super().call(model)
        moved = sum(1 for graph_like in graph_likes for index, node in enumerate(graph_like)
                    if position_before[node] != index)
        if moved:
            result.changes["nodes_moved"] = moved
        return result


def onnx_pipeline(spec=None) -> PassManager:
    """The clean-up passes in the order that lets each feed the next, then the pins: the outputs'
    shapes to `spec` (the graph's contract.GraphSpec, when given) and the IR version."""
    return PassManager([
        ConstantFoldingPass(),
        DeadCodeEliminationPass(),
        IdentityEliminationPass(),
        CastCleanupPass(),
        InitializerDeduplicationPass(),
        CommonSubexpressionEliminationPass(),
        TopologicalSortPass(),
        *([PinOutputShapesPass(spec)] if spec is not None else []),
        PinIrVersionPass(),
    ])


def _all_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node of the model, listed up front so that passes can remove nodes as they go."""
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    for function in model.functions.values():
        nodes.extend(ir.traversal.RecursiveGraphIterator(function))
    return nodes


def _is_cast(node: ir.Node) -> bool:
    return node.op_type == "Cast" and node.domain in _ONNX_DOMAINS
