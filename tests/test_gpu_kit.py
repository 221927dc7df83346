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
    result = CliRunner().invoke(main, ["gpu-kit", "--shapes", "tiny", "--budget-s", "1e9"])  # no step skipped when loaded
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "gpu-kit.json").read_text())
    assert (tmp_path / "gpu-kit.png").read_bytes()[:4] == b"\x89PNG"
    shape = report["shapes"]["tiny"]
    assert shape["pair"]["draft_vocab"] < shape["pair"]["vocab"]  # a draft vocabulary with d2t
    for name, entry in shape["lossless (eager)"].items():  # fp32 on a CPU: every output plain decoding's
        assert entry["identical"] == entry["of"] == entry["identical_to_verify_width"], name
    assert set(shape["costs"]) == {"1", "4"}
    # the plain step's bandwidth: a CPU is in no table of peaks, so it is held against the measured copy
    assert "not in the kit's table" in report["peak_note"] and report["copy_bandwidth_gb_s"] > 0
    kv = 2 * 8 * 2 * 256 * 16 * 4  # a sequence's K and V: 8 layers, 2 KV heads, 256 cached positions, dim 16, fp32
    read = {int(b): curve["bandwidth"]["bytes_per_step"] for b, curve in shape["costs"].items()}
    assert read[4] - read[1] == 3 * kv and 0 < read[1] - kv < shape["pair"]["weight_bytes"]  # the target's, not the drafter's
    for curve in shape["costs"].values():
        bw = curve["bandwidth"]
        assert bw["share_of_peak"] is None and bw["share_of_copy"] > 0
        assert bw["achieved_gb_s"] == pytest.approx(bw["bytes_per_step"] / bw["step_ms"] / 1e6, rel=0.01)
    assert report["cells"] == {"prompts": 2, "new_tokens": 8, "repeats": 2}
    for run in shape["sweep"]:
        build = run["builds"]["kit"]
        assert [rec["acceptance"] for rec in build["sweep"]] == ["0", "0.9", "0.73/0.52/0.35/0.25"]
        for rec in build["sweep"]:
            assert all(p["identical_to_autoregressive"] and p["model_speedup"] > 0 for p in rec["policies"].values())
            for p in rec["policies"].values():  # two passes, their median and spread, and the flag
                assert len(p["speedup_by_pass"]) == 2 and p["repeats_disagree"] == (p["spread_of_passes"] > 0.05)
                split = p["time_split"]  # the synthetic drafts' making: a part of host, told apart
                assert 0 < split["synthetic_per_round_ms"] <= split["host_per_round_ms"]
    export = next(v for k, v in report.items() if k.startswith("export"))
    assert export["greedy_ids_equal"] and export["aux_max_rel_err"] < 1e-4
    assert "error" not in json.dumps(report)
    # Each step says its result, not only "done in N s" (repro: the kit printed no result at all).
    lossless = shape["lossless (eager)"]["batch 1, random drafter"]
    for line in (f"  pair: {shape['pair']['parameters'] / 1e9:.2f}B parameters",
                 f"  lossless (eager): batch 1, random drafter: identical {lossless['identical']}/{lossless['of']} "
                 f"(to verify width {lossless['identical_to_verify_width']}/{lossless['of']}), tau {lossless['tau']:.2f}",
                 f"  costs: batch 1: verify T=1 {shape['costs']['1']['verify_ms']['1']:.2f} ms",
                 "  sweep: batch 1: speedup goodput/fixed 0 ", "greedy ids equal to torch: yes",
                 "host per drafted round (fixed, synthetic drafts' making apart) "):
        assert line in result.output, line
    assert " done in " not in result.output


@pytest.mark.slow
def test_the_tiny_kit_runs_the_exact_steps_through_the_interpreter(tmp_path, monkeypatch):
    """`gpu-kit --exact` on a CPU (Triton's interpreter, set by conftest): the exact lossless step for a
    chain and a dynamic tree, every output plain decoding's, in bf16; the plain step's cost through
    the kernels beside torch's, on the same weights (the interpreter's figure says nothing of a GPU)."""
    monkeypatch.chdir(tmp_path)
    # no budget: a loaded machine must not skip a step (at load 7 the lossless step alone passed 480 s)
    result = CliRunner().invoke(main, ["gpu-kit", "--shapes", "tiny", "--exact", "--plot", "", "--budget-s", "1e9"])
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


def test_peak_bandwidths_come_from_the_table_by_the_cards_name():
    assert gpu_kit.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12  # the SXM part
    assert gpu_kit.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_kit.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_kit.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert gpu_kit.peak_bandwidth("NVIDIA A100-PCIE-40GB") == 1.555e12
    assert gpu_kit.peak_bandwidth("NVIDIA GH200 480GB") is None  # not the H200's, whatever its name holds
    assert gpu_kit.peak_bandwidth("Tesla T4") is None


def test_a_sweep_cell_whose_passes_disagree_is_flagged(monkeypatch):
    """Two passes over the same prompts that read 1.00x and 1.08x: the cell is not to be trusted."""
    def fake_bench(runtimes, prompts, batch, config, acceptances, repeat):
        policies = {"goodput": {"speedup_by_pass": [1.0, 1.08]}, "fixed": {"speedup_by_pass": [1.0, 1.02]}}
        return {"builds": {"kit": {"sweep": [{"acceptance": "0", "policies": policies}]}}}

    monkeypatch.setattr(gpu_kit, "bench", fake_bench)
    [run] = gpu_kit.sweep(None, [[1]], 8, values=(0.0,), batches=(1,))
    policies = run["builds"]["kit"]["sweep"][0]["policies"]
    assert policies["goodput"]["repeats_disagree"] and policies["goodput"]["spread_of_passes"] == 0.08
    assert not policies["fixed"]["repeats_disagree"] and policies["fixed"]["speedup_median_of_passes"] == 1.01


def test_a_card_not_in_the_peak_table_is_said_and_the_copy_bandwidth_reported(tmp_path, monkeypatch):
    """The kit names a device it has no datasheet peak for (here the CPU, as for a GPU missing from the
    table) in its output and report, and still measures the copy every step's bandwidth is held against;
    a card in the table gets its peak and no note."""
    lines = []
    report = gpu_kit.run_kit(["tiny"], tmp_path / "kit.json", None, 1e9, echo=lines.append, export=False,
                             steps={"export"})  # the pair alone: no step of the list runs without export
    note = "CPU is not in the kit's table of peak bandwidths: the plain step is reported against the measured copy only"
    assert report["peak_note"] == note and f"  {note}" in lines
    assert report["peak_bandwidth_gb_s"] is None and report["copy_bandwidth_gb_s"] > 0
    assert (f"  bandwidth references: measured device-to-device copy {report['copy_bandwidth_gb_s']:g} GB/s, "
            "datasheet peak not known") in lines
    assert json.loads((tmp_path / "kit.json").read_text())["copy_bandwidth_gb_s"] == report["copy_bandwidth_gb_s"]
    monkeypatch.setattr(gpu_kit, "peak_bandwidth", lambda device: 4.8e12)
    lines.clear()
    report = gpu_kit.run_kit(["tiny"], tmp_path / "kit.json", None, 1e9, echo=lines.append, export=False,
                             steps={"export"})
    assert report["peak_bandwidth_gb_s"] == 4800 and "peak_note" not in report
    assert any(line.endswith("GB/s, datasheet peak 4800 GB/s") for line in lines), lines
    assert not any("table of peak" in line for line in lines)


@pytest.mark.parametrize("budget", ["nan", "-5"])
def test_a_budget_that_is_no_time_is_refused_before_any_step(tmp_path, monkeypatch, budget):
    """(`--budget-s nan` never stopped a step; `-5` skipped every one and wrote an empty report.)"""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["gpu-kit", "--shapes", "tiny", "--budget-s", budget])
    assert result.exit_code == 2 and f"--budget-s {float(budget)} is not a time budget" in result.output
    assert "fix: pass seconds, 0 or more" in result.output and not (tmp_path / "gpu-kit.json").exists()
