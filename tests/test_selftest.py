"""`eagle-export selftest --gpu` where there is no GPU: one line, exit 0; its step runner and the
steps a fake can stand in for."""

import json

import pytest
import torch
from click.testing import CliRunner

from eagle_export import environment
from eagle_export.cli import main
from eagle_export.errors import EagleExportError
from eagle_export.speculation.tree import TreeShape
from eagle_export.tools import doctor, selftest


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(main, ["selftest", "--gpu", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0
    assert result.output.splitlines() == [doctor.NO_GPU_SELFTEST]
    assert not (tmp_path / "r.json").exists()


def test_every_step_is_one_line_and_one_entry_of_the_report_and_a_failure_exits_1(tmp_path, monkeypatch):
    def refused(state):
        raise EagleExportError("target.engine: input past_key has shape (1,), outside optimization profile 1", "x")

    steps = [("environment", lambda s: (True, "torch 2.x")), ("build", lambda s: (True, "engines")),
             ("out-of-profile input", refused), ("FP8 tactics", lambda s: (None, "not an FP8 build"))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(environment, "nvidia_driver_loaded", lambda: True)
    monkeypatch.setattr(selftest, "STEPS", steps)
    result = CliRunner().invoke(main, ["selftest", "--gpu", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "ok   environment: torch 2.x", "ok   build: engines",
        "FAIL out-of-profile input: EagleExportError: target.engine: input past_key has shape (1,), outside "
        "optimization profile 1", "-    FP8 tactics: not an FP8 build", f"report: {tmp_path / 'r.json'}"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] is False and [s["ok"] for s in report["steps"]] == [True, True, False, None]


def test_a_failed_build_step_stops_the_steps_that_need_engines(tmp_path, monkeypatch):
    later = []
    steps = [("build", lambda s: (False, "no engines")), ("engine I/O", lambda s: later.append(1) or (True, ""))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(environment, "nvidia_driver_loaded", lambda: True)
    monkeypatch.setattr(selftest, "STEPS", steps)
    report = selftest.selftest(None, tmp_path / "r.json", echo=lambda line: None)
    assert not later and report["ok"] is False and len(report["steps"]) == 1


def test_the_builds_selftest_makes_are_removed_when_it_ends(tmp_path, monkeypatch):
    """The sample and the tree twin are built into a scratch folder that does not outlive the run."""
    made = []

    def build(state):
        state["build_dir"] = state["scratch"] / "sample"
        state["build_dir"].mkdir()
        made.append(state["build_dir"])
        return True, "built"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(environment, "nvidia_driver_loaded", lambda: True)
    monkeypatch.setattr(selftest, "STEPS", [("build", build)])
    report = selftest.selftest(None, tmp_path / "r.json", echo=lambda line: None)
    assert report["ok"] is True and made and not made[0].exists() and not made[0].parent.exists()


def test_a_build_without_engines_still_runs_the_steps_that_need_none(tmp_path, monkeypatch):
    """No TensorRT: the build holds ONNX graphs only; the torch CUDA-graph check and the bench still run."""
    (tmp_path / "manifest.json").write_text("{}")
    ran = []
    steps = [(name, lambda s, name=name: ran.append(name) or (True, "")) for name, _ in selftest.STEPS]
    steps[1] = ("build", lambda s: (False, "EagleExportError: no TensorRT engines"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(environment, "nvidia_driver_loaded", lambda: True)
    monkeypatch.setattr(selftest, "STEPS", steps)
    report = selftest.selftest(tmp_path, tmp_path / "r.json", echo=lambda line: None)
    assert ran == ["environment", "NVFP4 gating", "torch CUDA graphs lossless", "bench", "tree vs chain"]
    skipped = [s["step"] for s in report["steps"] if s["fact"] == "skipped: the build has no TensorRT engines"]
    assert skipped == ["engine I/O", "TensorRT vs ONNX Runtime CPU", "lossless loop x50", "out-of-profile input",
                       "FP8 tactics", "ONNX Runtime CUDA"]


@pytest.mark.parametrize("cc, ok", [("9.0", True), ("8.6", True), ("10.0", None)])
def test_nvfp4_gating_step_below_and_at_compute_capability_10(monkeypatch, cc, ok):
    monkeypatch.setattr(selftest, "gpu_info", lambda: {"name": "GPU", "compute_capability": cc})
    got, fact = selftest.nvfp4_refused({})
    assert got is ok
    assert ("needs compute capability 10.0+" in fact) if ok else "builds NVFP4" in fact


def test_engine_io_step_compares_the_engines_profiles_and_dtypes_with_the_computed_ones(tmp_path, monkeypatch):
    """On the fake TensorRT: engines built from the recipe's profiles pass; an engine built with
    another context limit is named, tensor by tensor."""
    from types import SimpleNamespace as NS

    import onnx
    from onnx import helper
    from test_engine_plan import DEPTH, PROFILES, fake_sessions
    from tiny_models import tiny_drafter_config, tiny_target_config

    from eagle_export.models.config import DrafterConfig, TargetConfig
    from eagle_export.models.contract import drafter_graph, target_graph
    from eagle_export.runtime.backends import TensorRTBackend

    graph_specs = (target_graph(TargetConfig.from_hf(tiny_target_config("llama")), 3, return_logits=False),
                   drafter_graph(DrafterConfig.from_hf(tiny_drafter_config("3.1")), TreeShape.chain(DEPTH), sampling=False))
    for graph, spec in zip(("target", "drafter"), graph_specs):
        elem = {"int64": onnx.TensorProto.INT64, "bool": onnx.TensorProto.BOOL}
        inputs = [helper.make_tensor_value_info(t.name, elem.get(t.dtype, onnx.TensorProto.FLOAT16), list(t.shape))
                  for t in spec.inputs]
        onnx.save(helper.make_model(helper.make_graph([], graph, inputs, [])), tmp_path / f"{graph}.onnx")

    def state(profiles):
        backend = TensorRTBackend(tmp_path / "target.engine", tmp_path / "drafter.engine", DEPTH, has_logits=False)
        manifest = NS(speculation=TreeShape.chain(DEPTH), profiles=profiles, target=NS(dtype="fp16", vocab_size=320),
                      drafter=NS(dtype="fp16"),
                      target_graph=NS(file="target.onnx"), drafter_graph=NS(file="drafter.onnx"))
        return {"opened": NS(manifest=manifest, runtime=NS(backend=backend)), "build_dir": tmp_path}

    fake_sessions(monkeypatch, tmp_path, graph_specs)
    assert selftest.engine_io(state(PROFILES)) == (True, "every profile shape and input dtype as computed")
    smaller = {**PROFILES, "context": {"min": 16, "opt": 256, "max": 512}}
    ok, fact = selftest.engine_io(state(smaller))
    assert ok is False and "target/prefill past_key: ((6, 1, 2, 1, 16), (6, 2, 2, 1, 16), (6, 8, 2, 1024, 16)) != " \
                           "((6, 1, 2, 1, 16), (6, 2, 2, 1, 16), (6, 8, 2, 512, 16))" in fact
