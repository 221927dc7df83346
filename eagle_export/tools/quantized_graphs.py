"""`eagle-export quantize -o DIR`: the quantized models exported, each graph checked against its module.

Beside the command rather than in `quantize.py`, so quantizing (which `build` and `export-checkpoint`
use) does not load the exporter or the runtime's backends.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..export.export import EXAMPLE_SIZES, export_drafter, export_target
from ..export.unrolled import TargetGraph, UnrolledDrafter
from ..models import contract as C
from ..output_dir import atomic_output_dir
from ..runtime.backends import run_graph
from ..speculation.tree import TreeShape


@torch.no_grad()
def check_quantized_graph(path: Path, module: torch.nn.Module, spec: C.GraphSpec, args: tuple) -> dict:
    """The exported graph against the quantized torch module it came from, on the same inputs:
    exact agreement of integer outputs, max abs difference of the others."""
    expected = dict(zip(spec.output_names, module(*args)))
    got = run_graph(path, spec.feeds(args))
    report = {}
    for name, value in expected.items():
        if value.dtype == torch.int64:
            report[name + "_equal"] = bool(torch.equal(got[name], value))
        else:
            report[name + "_max_abs_diff"] = float((got[name].float() - value.float()).abs().max())
    return report


def export_and_check(qtarget, qdrafter, depth: int, out_dir: Path) -> dict:
    """target.onnx and drafter.onnx from the quantized models, each checked against its torch module
    on random inputs of the export's sizes; written beside `out_dir` and renamed in once both are
    (`atomic_output_dir`): a failure leaves no half graph there."""
    with atomic_output_dir(out_dir, None, merge=True) as staging:
        return _export_and_check(qtarget, qdrafter, depth, staging)


def _export_and_check(qtarget, qdrafter, depth: int, out_dir: Path) -> dict:
    generator = torch.Generator().manual_seed(0)
    spec = C.target_graph(qtarget.config, len(qtarget.aux_layer_ids), True)
    report = {"target": export_target(qtarget, out_dir / "target.onnx", True, quantized=True)}
    report["target"]["check"] = check_quantized_graph(
        out_dir / "target.onnx", TargetGraph(qtarget, True).eval(), spec,
        C.example_args(spec, EXAMPLE_SIZES, generator, qtarget.embed_tokens.weight.dtype))
    if qdrafter is not None:
        spec = C.drafter_graph(qdrafter.config, TreeShape.chain(depth), False)
        report["drafter"] = export_drafter(qdrafter, depth, False, out_dir / "drafter.onnx", quantized=True)
        report["drafter"]["check"] = check_quantized_graph(
            out_dir / "drafter.onnx", UnrolledDrafter(qdrafter, depth, False).eval(), spec,
            C.example_args(spec, {**EXAMPLE_SIZES, C.TOKENS: depth + 1}, generator, qdrafter.fc.weight.dtype))
    return report
