"""The GPU kit (`eagle-export gpu-kit`): on a CPU with the tiny shape every step runs and the report holds
what a GPU run reports; the graphs a CUDA graph captures make no host synchronisation."""

import json

import pytest
import torch
from click.testing import CliRunner

from eagle_export.cli import main
from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
from eagle_export.speculation.tree import DynamicTree, TreeShape
from eagle_export.tools import gpu_kit

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.mark.slow
def test_the_tiny_kit_runs_every_step_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_kit, "SWEEP", (0.0, 0.9))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["gpu-kit", "--shapes", "tiny"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "gpu-kit.json").read_text())
    assert (tmp_path / "gpu-kit.png").read_bytes()[:4] == b"\x89PNG"
    shape = report["shapes"]["tiny"]
    assert shape["pair"]["draft_vocab"] < shape["pair"]["vocab"]  # a draft vocabulary with d2t
    for name, entry in shape["lossless (eager)"].items():  # fp32 on a CPU: every output plain decoding's
        assert entry["identical"] == entry["of"] == entry["identical_to_verify_width"], name
    assert set(shape["costs"]) == {"1", "4"}
    for run in shape["sweep"]:
        build = run["builds"]["kit"]
        assert [rec["acceptance"] for rec in build["sweep"]] == ["0", "0.9", "0.73/0.52/0.35/0.25"]
        for rec in build["sweep"]:
            assert all(p["identical_to_autoregressive"] and p["model_speedup"] > 0 for p in rec["policies"].values())
    export = next(v for k, v in report.items() if k.startswith("export"))
    assert export["greedy_ids_equal"] and export["aux_max_rel_err"] < 1e-4
    assert "error" not in json.dumps(report)


@pytest.mark.slow
def test_the_tiny_kit_runs_the_exact_steps_through_the_interpreter(tmp_path, monkeypatch):
    """`gpu-kit --exact` on a CPU (Triton's interpreter, set by conftest): the exact lossless step for a
    chain and a dynamic tree, every output plain decoding's, in bf16; the plain step's cost through
    the kernels beside torch's, on the same weights (the interpreter's figure says nothing of a GPU)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["gpu-kit", "--shapes", "tiny", "--exact", "--plot", ""])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "gpu-kit.json").read_text())
    assert report["exact"] and report["dtype"] == "bfloat16" and "error" not in json.dumps(report)
    shape = report["shapes"]["tiny"]
    entries = shape["exact lossless (eager)"]
    assert {name.split(",")[0] for name in entries} == {"chain", "dynamic tree"}
    for name, entry in entries.items():
        assert entry["identical"] == entry["of"] == 2 and entry["tau"] > 1, name  # drafts accepted: wide calls
    cost = shape["exact cost"]["batch 1"]
    assert cost["torch_ms"] > 0 and cost["exact_ms"] > 0 and "sweep" not in shape


def test_without_a_gpu_real_shapes_say_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["gpu-kit"])
    assert result.exit_code == 0 and result.output.count("\n") == 1 and "no CUDA GPU" in result.output
    assert not (tmp_path / "gpu-kit.json").exists()


def test_unknown_shapes_are_refused_with_the_list():
    result = CliRunner().invoke(main, ["gpu-kit", "--shapes", "gemma-7b"])
    assert result.exit_code == 2 and "llama-3.1-8b" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("speculation", [4, TreeShape.from_branching([2, 2, 1]), DynamicTree(3, 3, 6)],
                         ids=["chain", "static tree", "dynamic tree"])
def test_graphs_make_no_host_synchronisation(speculation):
    """A CUDA graph capture fails on any op that reads a tensor's value on the host (on an H200 the
    drafter's capture did, at `step_mask.all()`). On the meta device such an op raises, so running every
    graph there proves, on a CPU, that the capture has none."""
    target, drafter = gpu_kit.random_pair("tiny", "cpu", torch.float32)
    target, drafter = target.to("meta"), drafter.to("meta")
    drafter.share_embeddings(target.embed_tokens)
    b, w, slots = 2, 5, 256
    d, t = drafter.config, target.config

    def meta(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device="meta")

    lens = meta(b, dtype=torch.int64)
    for sampling in (False, True) if not isinstance(speculation, DynamicTree) else (False,):
        graph = UnrolledDrafter(drafter, speculation, sampling)
        extra = [meta(b), meta(b, graph.tree.num_nodes)] if sampling else []
        graph(meta(b, w, dtype=torch.int64), meta(b, w, target.aux_width), lens,
              meta(1, b, d.num_kv_heads, slots, d.head_dim), meta(1, b, d.num_kv_heads, slots, d.head_dim), lens, *extra)
    kv = meta(t.num_layers, b, t.num_kv_heads, slots, t.head_dim)
    TargetGraph(target, True)(meta(b, w, dtype=torch.int64), meta(b, w, dtype=torch.int64), kv, kv, lens,
                              meta(b, w, w, dtype=torch.bool))
