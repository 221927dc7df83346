"""`eagle-export build`, `validate`, `run` and `bench` end to end on tiny models (ONNX Runtime, CPU)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from eagle_export.cli import main
from eagle_export.errors import EagleExportError
from eagle_export.session import open_build
from tiny_models import write_tiny_drafter, write_tiny_target

RECIPE = """\
target: {target}
drafter: {drafter}
depth: 3
sampling: {sampling}
precision: {{target: fp32, drafter: fp32}}
profiles:
  batch: {{min: 1, opt: 1, max: 4}}
  context: {{min: 16, opt: 64, max: 96}}
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return write_tiny_target(root / "target", "llama"), write_tiny_drafter(root / "drafter", "3.1")


def write_recipe(path, sources, sampling=False, **edits):
    text = RECIPE.format(target=sources[0], drafter=sources[1], sampling=str(sampling).lower())
    for key, value in edits.items():
        text = text.replace(f"{key}: ", f"{key}: {value}  # ", 1)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("build")
    recipe = write_recipe(root / "recipe.yaml", sources, sampling=True)
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(root / "out")])
    assert result.exit_code == 0, result.output
    return root / "out", result.output


def test_build_writes_a_complete_manifest(built):
    out, log = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"target.onnx", "drafter.onnx", "drafter_sampling.onnx", "draft_to_target.npy",
            "tokenizer.json"} <= set(manifest["artifacts"])
    assert all(len(a["sha256"]) == 64 for a in manifest["artifacts"].values())
    assert manifest["libraries"]["torch"] and manifest["libraries"]["onnxruntime"]
    assert manifest["models"]["target"]["precision"] == "fp32" and manifest["depth"] == 3
    assert [r["name"] for r in manifest["passes"]["model"]][:2] == ["share_embeddings", "fold_fc_norm_into_target"]
    assert manifest["graphs"]["target"]["nodes_after_passes"] < manifest["graphs"]["target"]["nodes_exported"]
    assert manifest["validation"]["ok"] and len(manifest["validation"]["checks"]) >= 4
    assert set(manifest["stage_seconds"]) >= {"load checkpoints", "model passes", "export ONNX (graph passes + TensorRT lint)"}
    # Without TensorRT: one clear line, and the build still runs on ONNX Runtime.
    assert "TensorRT is not installed: stopped after the ONNX stage" in log
    assert manifest["engines"]["skipped"].startswith("TensorRT is not installed")
    assert "onnxruntime" in manifest["backends"] and "tensorrt" not in manifest["backends"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)


def test_validate_passes_then_names_a_modified_file(built, tmp_path):
    out, _ = built
    result = CliRunner().invoke(main, ["validate", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ok"]
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    data = (copy / "drafter.onnx").read_bytes()
    (copy / "drafter.onnx").write_bytes(data[: len(data) // 3])  # truncated
    result = CliRunner().invoke(main, ["validate", str(copy)])
    assert result.exit_code == 1 and "drafter.onnx" in result.output and "truncated" in result.output
    with pytest.raises(EagleExportError, match="drafter.onnx: .* bytes, the manifest says"):
        open_build(copy)


def test_run_streams_text_and_a_summary_line(built):
    out, _ = built
    result = CliRunner().invoke(main, ["run", str(out), "--prompt", "w5 w17 w33 w101", "--max-new-tokens", "12",
                                       "--backend", "onnxruntime"])
    assert result.exit_code == 0, result.output
    text, summary = result.output.rstrip("\n").rsplit("\n", 1)
    assert len(text.split()) == 12 and all(w.startswith("w") for w in text.split())
    assert "[onnxruntime] 12 tokens in" in summary and "tau" in summary


def test_run_sampling_and_torch_backend(built):
    out, _ = built
    for args in (["--temperature", "0.7", "--top-p", "0.9"], ["--backend", "torch"]):
        result = CliRunner().invoke(main, ["run", str(out), "--chat", "w9 w10", "--max-new-tokens", "6", *args])
        assert result.exit_code == 0, result.output


def test_bench_json_and_plot(built, tmp_path):
    out, _ = built
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\nw8 w9\nw10 w11 w12 w13\nw14\n")
    result = CliRunner().invoke(main, ["bench", str(out), "--dataset", str(prompts), "--batch", "1,2",
                                       "--max-new-tokens", "10", "--json", str(tmp_path / "b.json"),
                                       "--plot", str(tmp_path / "b.png")])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch"] for r in results] == [1, 2]
    for r in results:
        assert {"backend", "device", "batch", "depth", "tau", "acceptance_by_depth", "spec_tokens_per_s",
                "ar_tokens_per_s", "speedup", "time_split", "efficiency"} <= set(r)
        assert r["backend"] == "onnxruntime" and r["depth"] == 3 and len(r["acceptance_by_depth"]) == 3
        assert set(r["time_split"]) >= {"draft", "verify", "host"} and r["tau"] >= 1.0
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_existing_output_is_refused_without_force(built, sources, tmp_path):
    out, _ = built
    recipe = write_recipe(tmp_path / "r.yaml", sources)
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(out)])
    assert result.exit_code == 2 and "already exists" in result.output and "--force" in result.output


def test_failed_build_leaves_no_partial_output(sources, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", (sources[0], tmp_path / "no-such-drafter"))
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "is not a directory" in result.output and "Traceback" not in result.output
    assert sorted(os.listdir(tmp_path)) == ["r.yaml"]


def test_mismatched_pair_is_refused(tmp_path):
    target = write_tiny_target(tmp_path / "t", "llama")
    drafter = write_tiny_drafter(tmp_path / "d", "3", target_hidden=96)
    recipe = write_recipe(tmp_path / "r.yaml", (target, drafter))
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "does not fit target" in result.output
    assert not (tmp_path / "out").exists()


def test_recipe_error_through_the_cli(sources, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", sources)
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "--set", "precision.target=int4",
                                       "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "precision.target: 'int4' must be one of" in result.output


def test_interrupted_build_leaves_nothing(sources, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", sources)
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys
        import eagle_export.export as E
        real = E.export_drafter
        def slow_export(*args, **kwargs):
            print("exporting", flush=True)
            import time; time.sleep(120)
        E.export_drafter = slow_export
        from eagle_export.cli import main
        sys.argv = ["eagle-export", "build", "--recipe", {str(recipe)!r}, "-o", {str(out)!r}]
        main()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "exporting":
            break
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert sorted(os.listdir(tmp_path)) == ["r.yaml"]


def test_engines_for_another_gpu_are_refused(built, tmp_path):
    out, _ = built
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["engines"] = [{"graph": g, "file": f"{g}.sm100.trt10.13.engine", "tensorrt": "10.13.2",
                            "compute_capability": "10.0", "gpu": "B200"} for g in ("target", "drafter")]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EagleExportError, match="no engine in this build fits this machine"):
        open_build(copy, backend="tensorrt")
    opened = open_build(copy, backend="auto")  # auto falls back to ONNX Runtime
    assert opened.runtime.backend.name == "onnxruntime"


def test_fp8_build_quantizes_records_metrics_and_stays_lossless(sources, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", sources).read_text()
    recipe = recipe.replace("precision: {target: fp32, drafter: fp32}",
                            "precision: {target: fp8, drafter: fp8}\ncalibration: {num_samples: 4, max_tokens: 32}")
    (tmp_path / "r.yaml").write_text(recipe)
    result = CliRunner().invoke(main, ["build", "--recipe", str(tmp_path / "r.yaml"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    quant = manifest["quantization"]
    assert quant["target"]["precision"] == "fp8" and quant["target"]["top1_agreement"] > 0.8
    assert quant["drafter"]["kl"] < 0.05 and quant["calibration"]["prompts_used"] == 4
    # Measured on held-out MT-bench prompts: greedy continuations and tau of the built pair.
    assert quant["evaluation"]["prompts_used"] == 4
    assert quant["target"]["continuations"]["continuation_tokens"] > 0
    assert 0.5 < quant["target"]["continuations"]["greedy_agreement"] <= 1.0
    assert 1.0 <= quant["tau_quantized"] <= 5 and 1.0 <= quant["tau_reference"] <= 5
    assert manifest["backends"] == ["onnxruntime"]  # the torch backend runs unquantized builds only
    import onnx

    ops = {n.op_type for n in onnx.load(tmp_path / "out" / "target.onnx").graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    lossless = [c for c in manifest["validation"]["checks"] if c["name"].startswith("lossless")]
    assert lossless and all(c["ok"] for c in lossless)


def test_evaluation_prompts_are_held_out_from_calibration(sources, tmp_path):
    from eagle_export.build import calibration_prompts, evaluation_prompts
    from eagle_export.recipe import load_recipe

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", sources),
                         overrides={"calibration.num_samples": 5, "evaluation.num_prompts": 3})
    target_dir = sources[0]
    calibration = calibration_prompts(recipe, target_dir)
    evaluation = evaluation_prompts(recipe, target_dir, calibration)
    assert len(calibration) == 5 and len(evaluation) == 3
    assert not {tuple(p) for p in calibration} & {tuple(p[:recipe["calibration"]["max_tokens"]]) for p in evaluation}
    every = load_recipe(write_recipe(tmp_path / "r2.yaml", sources), overrides={"calibration.num_samples": 80})
    with pytest.raises(EagleExportError, match="leaving none to evaluate"):
        evaluation_prompts(every, target_dir, calibration_prompts(every, target_dir))
