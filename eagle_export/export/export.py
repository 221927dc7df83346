"""ONNX export of the target graph and the unrolled drafter graph (`backends.py` runs the files).

Export uses the TorchScript exporter (`dynamo=False`) at opset `contract.ONNX_OPSET`, with dynamic
axes only for batch, tokens and past length. Quantized modules (ModelOpt FP8 quantizers,
NVFP4Linears) export at `qdq.EXPORT_OPSET` and then go through the Q/DQ rewrites of `qdq.py`.
The example inputs give the cache a few slots (S >= 1, `past` dynamic) so that no shape
computation is traced on an empty tensor, where the exporter may specialize a zero-sized
dimension; the exported graphs run with S = 0 (tested).

fp16 and bf16 graphs are strongly typed: every tensor has the model dtype except where the torch
modules cast explicitly (RMSNorm statistics, RoPE angles, attention softmax and draft
probabilities in fp32), and each of those casts is an explicit Cast node.

After export, the ONNX clean-up pipeline (`passes.onnx_pipeline`, which pins `ir_version` so ONNX
Runtime loads the file) runs, then the TensorRT-readiness lint: any finding fails the export,
quantized or not.
A model above 2 GB (the protobuf limit) is saved with its weights in one external data file. Weights
are held once: the exporter writes them, the graph passes run on the in-memory IR with each external
weight read from its file when a pass needs its values, and the save writes them tensor by tensor (a
one-file graph too: `save_single_file`). `export` and `build` free the target before they export the
drafter (`export_pair`).
"""

from __future__ import annotations

import errno
import functools
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import onnx_ir as ir
import torch

from ..errors import EagleExportError
from ..files import file_error, free_bytes
from ..models import contract as C
from ..models.checkpoint import DTYPE_NAMES
from ..models.config import DrafterConfig, TargetConfig, is_drafter_config, read_config_json
from ..models.nvfp4 import pack_nvfp4
from ..output_dir import atomic_output_dir, output_place
from ..passes import ONNX_IR_VERSION, lint_model, onnx_pipeline
from ..speculation.tree import check_depth
from .heap import TrimEvery, release_freed_memory, return_large_blocks_at_once
from .loader import load_pair
from .qdq import EXPORT_OPSET, finish_quantized, fp8_weight_codes
from .unrolled import TargetGraph, UnrolledDrafter

EXPORT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The axis sizes graphs are traced at (the drafter's tokens: decoding's W = K+1 rows). The cache has
# a few slots so that no shape computation is traced on an empty tensor (see the docstring).
EXAMPLE_SIZES = {C.BATCH: 2, C.TOKENS: 3, C.PAST: 4}
# Protobuf cannot serialize 2 GiB; above this many bytes of weights they go to an external data file.
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3 - 64 * 1024**2


def resolve_export_dtype(dtype: str) -> torch.dtype:
    aliases = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
    name = aliases.get(dtype, dtype)
    if name not in EXPORT_DTYPES:
        raise EagleExportError(f"unknown export dtype {dtype!r}", f"use one of {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def export_graph(module: torch.nn.Module, args: tuple, spec: C.GraphSpec, path: Path, quantized: bool = False) -> dict:
    """Export `module` to `path` by `spec`, clean it up and lint it; any lint finding fails the export.
    Returns node counts, seconds, the Q/DQ rewrite counts (quantized) and the pass/lint report.

    quantized: `module` holds ModelOpt FP8 quantizers and/or NVFP4Linears (ModelOpt's own NVFP4
    quantizers, the CUDA fake-quant path, are first packed into NVFP4Linears, in place); it exports
    at `qdq.EXPORT_OPSET` and `qdq.finish_quantized` rewrites it into TensorRT's Q/DQ form."""
    start = time.perf_counter()
    if quantized:
        pack_nvfp4(module)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp, torch.no_grad(), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        raw = Path(tmp) / path.name
        opset = EXPORT_OPSET if quantized else C.ONNX_OPSET
        torch.onnx.export(module, args, str(raw), dynamo=False, opset_version=opset,
                          input_names=spec.input_names, output_names=spec.output_names,
                          dynamic_axes=spec.dynamic_axes, do_constant_folding=True)
        # Weights above 2 GiB the exporter wrote as external files beside `raw`: they stay on disk,
        # read one tensor at a time by the passes that need values and by the save.
        model = streamed(ir.load(raw))
        # The tracer warns where a tree's structure (its parents, frontiers: Python constants of the shape)
        # becomes a graph constant, which is meant; whether a graph generalizes is what validate proves, on
        # inputs other than the trace's. The warnings go to the report, not to the user's terminal.
        trace_warnings = sorted({f"{Path(w.filename).name}:{w.lineno}: {str(w.message).split('.')[0]}"
                                 for w in caught if issubclass(w.category, torch.jit.TracerWarning)})
        others = [w for w in caught if not issubclass(w.category, torch.jit.TracerWarning)]
        exported_nodes = len(model.graph)
        export_seconds = time.perf_counter() - start
        start = time.perf_counter()
        rewrites = {}
        if quantized:  # the Q/DQ rewrites work on the proto (quantized graphs are small here)
            proto, rewrites = finish_quantized(ir.to_proto(model), fp8_weight_codes(module))
            model = ir.from_proto(proto)
        result = onnx_pipeline(spec)(model)
        findings = [str(f) for f in lint_model(result.model).findings]
        passes_seconds = time.perf_counter() - start
        if findings:
            raise EagleExportError(f"{path.name} fails the TensorRT lint: " + "; ".join(findings[:5]),
                                   "this is a bug in the export: report it with the model's config.json")
        save_model(result.model, path)
        nodes_after_passes, records = len(result.model.graph), [r.to_json() for r in result.records]
        del model, result
    release_freed_memory()
    for w in others:  # every other warning reaches the user as it would have
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return {"nodes_exported": exported_nodes, "nodes_after_passes": nodes_after_passes,
            "export_seconds": round(export_seconds, 3), "passes_seconds": round(passes_seconds, 3), **rewrites,
            "passes": records, "lint_findings": findings, "trace_warnings": trace_warnings}


def streamed(model: ir.Model) -> ir.Model:
    """Each initializer held in an external file becomes a tensor that reads its bytes from the file
    whenever asked and keeps nothing (onnx_ir's ExternalTensor keeps its file mapped once read, so
    hashing every weight for de-duplication and writing them out would map all of them at once).
    A Constant node's value the exporter wrote to a file of its own (it does so for every tensor of a
    graph over 2 GB) is read into the graph: the save writes only initializers to the data file, and
    that file is gone once the export's temporary directory is (ONNX Runtime refused the graph)."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            value.const_value = ir.LazyTensor(functools.partial(_read_external, tensor), tensor.dtype,
                                              tensor.shape, name=tensor.name)
    for node in model.graph.all_nodes():
        for name, attr in list(node.attributes.items()):
            if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                node.attributes[name] = ir.AttrTensor(name, _read_external(attr.value))
    return model


def _read_external(tensor: ir.ExternalTensor) -> ir.Tensor:
    with open(tensor.path, "rb") as f:
        f.seek(tensor.offset or 0)
        data = f.read(tensor.length if tensor.length is not None else -1)
    array = np.frombuffer(data, dtype=tensor.dtype.numpy()).reshape(tensor.shape.numpy())
    return ir.Tensor(array, dtype=tensor.dtype, name=tensor.name)


def save_model(model: ir.Model, path: Path) -> None:
    """One .onnx file, or (weights of EXTERNAL_DATA_THRESHOLD bytes or more) the graph and one
    `.onnx.data` file beside it; either way written tensor by tensor (tensors under 1 KiB stay in the
    graph)."""
    weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if weight_bytes < EXTERNAL_DATA_THRESHOLD:
        save_single_file(model, path)
        return
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    trim = TrimEvery()
    ir.save(model, path, external_data=data.name, size_threshold_bytes=1024,
            callback=lambda tensor, info: trim(tensor.nbytes))


def save_single_file(model: ir.Model, path: Path) -> None:
    """The bytes `ir.save(model, path)` writes, without a proto of the whole model or its serialized
    copy in memory (those are two more copies of every weight): the initializers are serialized one at
    a time.

    A protobuf message is its fields in field-number order, each length-delimited field written as
    tag, length (varint), bytes; a message's bytes are the concatenation of any split of its fields.
    So the file is: the model's fields before `graph` (7); graph's tag and length; the graph's fields
    before `initializer` (5); each initializer as one such field; the graph's fields after 5; the
    model's fields after 7. The skeleton (nodes, names, types) is serialized with a 0-byte placeholder
    for each initializer; the initializers go to a spool file first, which sizes the graph field."""
    initializers = [v for v in model.graph.initializers.values() if v.const_value is not None]
    tensors = [v.const_value for v in initializers]
    try:
        for value, tensor in zip(initializers, tensors):
            value.const_value = ir.Tensor(np.empty(0, dtype=np.uint8), name=value.name)
        skeleton = ir.serde.serialize_model(model)
    finally:
        for value, tensor in zip(initializers, tensors):
            value.const_value = tensor
    skeleton.graph.ClearField("initializer")
    model_before, model_after = _split_fields(skeleton, _field_number(skeleton, "graph"))
    graph_before, graph_after = _split_fields(skeleton.graph, _field_number(skeleton.graph, "initializer"))
    initializer_number = _field_number(skeleton.graph, "initializer")
    trim = TrimEvery()
    with tempfile.TemporaryFile(dir=path.parent) as spool:
        for value, tensor in zip(initializers, tensors):
            tensor.name = value.name  # as serialize_model names them
            data = ir.serde.serialize_tensor(tensor).SerializeToString()
            spool.write(_field_header(initializer_number, len(data)))
            spool.write(data)
            del data
            trim(tensor.nbytes)
        spool_bytes = spool.tell()
        spool.seek(0)
        with open(path, "wb") as f:
            f.write(model_before)
            f.write(_field_header(_field_number(skeleton, "graph"),
                                  len(graph_before) + spool_bytes + len(graph_after)))
            f.write(graph_before)
            shutil.copyfileobj(spool, f, 16 * 1024**2)
            f.write(graph_after)
            f.write(model_after)


def _field_number(message, name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number


def _split_fields(message, number: int) -> tuple[bytes, bytes]:
    """`message` serialized as two parts: its fields numbered below `number`, and above it."""
    before, after = type(message)(), type(message)()
    before.CopyFrom(message)
    after.CopyFrom(message)
    for field, _ in message.ListFields():
        if field.number >= number:
            before.ClearField(field.name)
        if field.number <= number:
            after.ClearField(field.name)
    return before.SerializeToString(), after.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_header(number: int, length: int) -> bytes:
    """Tag (wire type 2, length-delimited) and length of a field of `length` bytes."""
    return _varint(number << 3 | 2) + _varint(length)


def export_target(target, path: Path, return_logits: bool, quantized: bool = False) -> dict:
    spec = C.target_graph(target.config, len(target.aux_layer_ids), return_logits)
    args = C.example_args(spec, EXAMPLE_SIZES, dtype=target.embed_tokens.weight.dtype)
    return export_graph(TargetGraph(target, return_logits).eval(), args, spec, path, quantized)


def export_drafter(drafter, speculation, sampling: bool, path: Path, quantized: bool = False) -> dict:
    """speculation: a tree.Speculation, or a bare int K for a chain (the Python API's entry point)."""
    graph = UnrolledDrafter(drafter, speculation, sampling).eval()
    spec = C.drafter_graph(drafter.config, graph.tree, sampling)
    args = C.example_args(spec, {**EXAMPLE_SIZES, C.TOKENS: graph.depth + 1}, dtype=drafter.fc.weight.dtype)
    return export_graph(graph, args, spec, path, quantized)



# Peak resident memory, measured with /usr/bin/time -v (README "Bring your own model"). The loaded pair
# holds its weights W once. A graph under the 2 GiB protobuf limit goes through torch's exporter as one
# proto: its C++ proto, the serialized bytes and torch's own re-parse of them (it looks for onnxscript
# functions) hold about 3 x the graph's weights D for a moment (measured 3.0 x on a 0.94 GiB target
# graph); a larger graph the exporter writes
# tensor by tensor to external files, and the passes and the save stream it, one tensor at a time
# (the largest: the embedding table).
# `export` and a build's export stage free the target before the drafter's graph (`export_pair`): the
# peak is the larger of W + 3 D_target (target under the limit) and 4 D_drafter (the drafter graph
# carries its own copy of the embedding table). The rest, EXPORT_PEAK_FIXED_BYTES, is the interpreter,
# torch and the exporter's working memory, fit to the measurements.
EXPORT_PEAK_GRAPH_COPIES = 3
EXPORT_PEAK_FIXED_BYTES = int(1.25 * 2**30)


def weight_bytes(target_cfg: TargetConfig, drafter_cfg: DrafterConfig, dtype: torch.dtype) -> tuple[int, int, int]:
    """(bytes of the pair's weights, of the target graph's, of the drafter graph's) at `dtype`, from
    the configs alone (norm gains and biases left out: under 0.1%). The target graph stores a tied
    table once; the drafter shares the target's embedding table in memory, and its graph carries a copy."""
    t, d = target_cfg, drafter_cfg
    attention = lambda h_in, h, heads, kv, hd: h_in * (heads + 2 * kv) * hd + heads * hd * h
    layer = (attention(t.hidden_size, t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim)
             + 3 * t.hidden_size * t.intermediate_size)
    target = t.num_layers * layer + t.vocab_size * t.hidden_size * (1 if t.tie_word_embeddings else 2)
    drafter = (d.num_aux * d.target_hidden_size * d.hidden_size + d.draft_vocab_size * d.hidden_size
               + attention(2 * d.hidden_size, d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim)
               + 3 * d.hidden_size * d.intermediate_size)
    size = torch.empty(0, dtype=dtype).element_size()
    return (target + drafter) * size, target * size, (drafter + d.vocab_size * d.hidden_size) * size


def exporter_copies(graph_bytes: int, largest_tensor: int) -> int:
    """What exporting a graph of `graph_bytes` weights holds beyond the loaded model: 3 copies under
    the protobuf limit (EXPORT_PEAK_GRAPH_COPIES), else the one tensor a pass or the save reads at a time."""
    return EXPORT_PEAK_GRAPH_COPIES * graph_bytes if graph_bytes < EXTERNAL_DATA_THRESHOLD else largest_tensor


def projected_peak(target_cfg: TargetConfig, drafter_cfg: DrafterConfig, dtype: torch.dtype) -> int:
    """Peak resident bytes of exporting the pair at `dtype` (`export`, a build's export stage): the
    target's graph beside the pair, then (the target freed) each drafter graph beside the drafter."""
    weights, target_graph, drafter_graph = weight_bytes(target_cfg, drafter_cfg, dtype)
    table = target_cfg.vocab_size * target_cfg.hidden_size * torch.empty(0, dtype=dtype).element_size()
    target_stage = weights + exporter_copies(target_graph, table)
    drafter_stage = drafter_graph + exporter_copies(drafter_graph, table)
    return max(target_stage, drafter_stage) + EXPORT_PEAK_FIXED_BYTES


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_export_fits(target_dir, drafter_dir, dtype: torch.dtype, available: int | None = None) -> int:
    """Refuse, before loading anything, a pair whose projected export peak (`projected_peak`: `export`,
    a build's export stage) exceeds the memory this machine has available. Returns
    the projection in bytes. Pairs under 1 GiB of weights are not refused: the fit's fixed part is the
    interpreter and torch, which any machine running this has."""
    target_raw, drafter_raw = read_config_json(target_dir), read_config_json(drafter_dir)
    if is_drafter_config(target_raw) or not is_drafter_config(drafter_raw):
        return 0  # swapped or odd directories: the loaders name the problem
    target_cfg = TargetConfig.from_hf(target_raw, where=str(target_dir))
    drafter_cfg = DrafterConfig.from_hf(drafter_raw, where=str(drafter_dir))
    weights = weight_bytes(target_cfg, drafter_cfg, dtype)[0]
    projected = projected_peak(target_cfg, drafter_cfg, dtype)
    available = available_memory_bytes() if available is None else available
    if available is not None and projected > available and weights >= 1 << 30:
        gib = lambda n: f"{n / 2**30:.1f} GiB"
        smaller = ("" if dtype != torch.float32 else
                   f"; in fp16 it needs {gib(projected_peak(target_cfg, drafter_cfg, torch.float16))}")
        raise EagleExportError(
            f"exporting this pair ({target_cfg.architecture}, "
            f"{target_cfg.num_layers} layers, {gib(weights)} of {DTYPE_NAMES[dtype]} weights) needs about "
            f"{gib(projected)} of memory at its peak (README \"Bring your own model\", Memory), and this machine "
            f"has {gib(available)} available{smaller}",
            "export on a machine with that much free memory, close what else holds memory here, or export "
            "in fp16 (--dtype fp16) if you asked for fp32")
    return projected


def export_models(target_dir, drafter_dir, depth: int, dtype: str, out_dir, sampling: bool = False,
                  force: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Write target.onnx and drafter.onnx (+ export_summary.json) to `out_dir`; returns the summary.
    `sampling` exports the sampling drafter and a target that also returns its logits."""
    progress = progress or (lambda message: None)
    check_depth(depth)
    torch_dtype = resolve_export_dtype(dtype)
    out_dir = output_place(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        if not force or not out_dir.is_dir():
            raise EagleExportError(f"{out_dir} exists and is not an empty directory",
                                   "choose a new output directory, or pass --force to overwrite its files")
    check_export_fits(target_dir, drafter_dir, torch_dtype)

    progress(f"loading target {target_dir} and drafter {drafter_dir} ({DTYPE_NAMES[torch_dtype]}), "
             "through the model passes a build applies")
    target, drafter = load_pair(target_dir, drafter_dir, torch_dtype)
    return_large_blocks_at_once()  # for the export too: the tensors a save has written
    aux_ids = target.aux_layer_ids  # the states this drafter was trained on
    # The graphs hold every weight (the drafter's once per graph): a disk without room for them is
    # named before, not discovered as a truncated file after.
    needed = sum(t.numel() * t.element_size() for m in (target, drafter, *[drafter] * sampling)
                 for t in m.state_dict().values())
    if free_bytes(out_dir) < needed:
        raise file_error(out_dir, OSError(errno.ENOSPC, "No space left on device"), needed=needed)
    pair = [target, drafter]
    del target, drafter  # _export_into frees the target once its graph is written: no other reference may stay
    # Written beside and renamed in once complete (only once the inputs loaded): a refused, failed or
    # interrupted export leaves no file, nor half of one, in out_dir.
    try:
        with atomic_output_dir(out_dir, None, merge=True) as staging:
            return _export_into(staging, pair, aux_ids, depth, sampling, torch_dtype, progress)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        name = Path(e.filename).name if isinstance(e.filename, str) else None  # the file as out_dir will hold it
        raise file_error(out_dir / name if name else out_dir, OSError(e.errno, e.strerror), needed=needed) from None


def _export_into(out_dir, pair: list, aux_ids, depth, sampling, torch_dtype, progress) -> dict:
    """`pair` is [target, drafter], this function's only reference to them (`export_pair`)."""
    summary = {"dtype": DTYPE_NAMES[torch_dtype], "depth": depth, "sampling": sampling,
               "opset": C.ONNX_OPSET, "ir_version": ONNX_IR_VERSION, "aux_layer_ids": list(aux_ids)}
    summary.update(export_pair(pair, out_dir, depth, sampling, target_logits=sampling, progress=progress))
    (out_dir / "export_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def export_pair(pair: list, out_dir: Path, speculation, sampling: bool, target_logits: bool,
                quantized: tuple[bool, bool] = (False, False), progress: Callable[[str], None] | None = None) -> dict:
    """target.onnx, then drafter.onnx and (`sampling`) drafter_sampling.onnx, as `export` and `build` lay
    them out; returns each graph's report by its key (target, drafter, drafter_sampling).

    `pair` is [target, drafter] and must hold the caller's only references to them: it is emptied and
    the target freed once target.onnx is written, so each drafter graph, one proto in torch's exporter
    (about 3 x its weights, `exporter_copies`), is exported beside the drafter and the embedding table
    it shares, not beside the whole target. `quantized`: (target, drafter) go through the Q/DQ rewrites."""
    progress = progress or (lambda message: None)
    target, drafter = pair
    pair.clear()
    reports = {}
    progress("exporting target.onnx")
    reports["target"] = export_target(target, out_dir / "target.onnx", return_logits=target_logits,
                                      quantized=quantized[0])
    del target
    release_freed_memory()
    progress(f"  target: {reports['target']['nodes_exported']} nodes exported, "
             f"{reports['target']['nodes_after_passes']} after passes, {reports['target']['export_seconds']:.1f} s")
    # The greedy drafter is always drafter.onnx (what greedy decoding runs); sampling adds the
    # sampling one beside it.
    for key, file, sample in (("drafter", "drafter.onnx", False), ("drafter_sampling", "drafter_sampling.onnx", True)):
        if sample and not sampling:
            continue
        progress(f"exporting {file} ({'sampling' if sample else 'greedy'})")
        reports[key] = export_drafter(drafter, speculation, sample, out_dir / file, quantized=quantized[1])
        progress(f"  {key}: {reports[key]['nodes_exported']} nodes exported, "
                 f"{reports[key]['nodes_after_passes']} after passes, {reports[key]['export_seconds']:.1f} s")
    return reports
