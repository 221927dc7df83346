"""`eagle-export build`, `validate`, `run` and `bench` end to end on tiny models (ONNX Runtime, CPU)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from hostile import share, snapshot, unprivileged, world_dir
from lifetime import watch_drafter_exports
from planting import plant
from random_policy import RandomDepth
from safetensors.torch import load_file, save_file
from test_validate import stale_aux_row
from tiny_models import write_tiny_drafter, write_tiny_target, write_trained_tiny_drafter

from eagle_export.builder.build import conformance_prompts
from eagle_export.builder.build_dir import OpenBuild, open_build
from eagle_export.builder.manifest import Manifest, write_manifest_hash
from eagle_export.builder.recipe import load_recipe
from eagle_export.cli import main
from eagle_export.errors import EagleExportError
from eagle_export.runtime.runtime import GenerationConfig

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
    """A tiny target and a drafter trained briefly on the prompts the build checks conventions on
    (a random drafter matches no convention and is refused)."""
    root = tmp_path_factory.mktemp("src")
    target = write_tiny_target(root / "target", "llama")
    recipe = load_recipe(write_recipe(root / "recipe.yaml", (target, root / "drafter")))
    prompts = conformance_prompts(recipe, target)
    return target, write_trained_tiny_drafter(root / "drafter", target, "3.1", prompts, aux=(1, 3, 4), draft_vocab=96)


def write_recipe(path, sources, sampling=False, **edits):
    text = RECIPE.format(target=sources[0], drafter=sources[1], sampling=str(sampling).lower())
    for key, value in edits.items():
        text = text.replace(f"{key}: ", f"{key}: {value}  # ", 1)
    path.write_text(text)
    return path


# What the `built` build held when each drafter graph's export began: (target, its first layer, the
# embedding table the drafter shares) alive, as loaded by the build.
ALIVE_AT_DRAFTER_EXPORT = []


@pytest.fixture(scope="module")
def built(tmp_path_factory, sources):
    import eagle_export.builder.build as build_module

    root = tmp_path_factory.mktemp("build")
    recipe = write_recipe(root / "recipe.yaml", sources, sampling=True)
    with pytest.MonkeyPatch.context() as patch:
        alive = watch_drafter_exports(patch, build_module)
        result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(root / "out")])
    ALIVE_AT_DRAFTER_EXPORT[:] = alive
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
    t0 = manifest["validation"]["lossless"]["t0"]  # unquantized: verify-width greedy is plain decoding
    assert t0["ok"] and t0["tau"]["oracle_batch3"] == 4 and t0["tau"]["anti_batch1"] == 1
    conformance = manifest["conformance"]
    assert conformance["ok"] and conformance["readings"][0]["reading"] == "as configured"
    assert "drafter conventions: acc@1" in log
    assert set(manifest["stage_seconds"]) >= {"load checkpoints", "model passes", "export ONNX (graph passes + TensorRT lint)"}
    # Without TensorRT: one clear line, and the build still runs on ONNX Runtime.
    assert "TensorRT is not installed: stopped after the ONNX stage" in log
    assert manifest["engines"]["skipped"].startswith("TensorRT is not installed")
    assert "onnxruntime" in manifest["backends"] and "tensorrt" not in manifest["backends"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)
    assert Manifest.read(out).to_json() == manifest  # one type both ways: what build wrote reads back whole


def test_the_build_frees_the_target_before_the_drafter_graphs_and_validates_against_the_sources(built):
    """The drafter graphs (one proto each in torch's exporter, ~3 x their weights) are exported beside the
    drafter and the table it shares, not the whole target; validation then loads the pair again from
    the sources, which it first checks against the hashes the build recorded."""
    out, _ = built
    assert ALIVE_AT_DRAFTER_EXPORT == [(False, False, True)] * 2  # greedy and sampling drafters
    checks = {c["name"]: c for c in json.loads((out / "manifest.json").read_text())["validation"]["checks"]}
    assert checks["source checkpoints"]["ok"]
    assert checks["target graph vs torch"]["ok"] and checks["drafter graph vs torch"]["ok"]


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


def current_umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_run_streams_text_and_a_summary_line(built):
    out, _ = built
    result = CliRunner().invoke(main, ["run", str(out), "--prompt", "w5 w17 w33 w101", "--max-new-tokens", "12",
                                       "--backend", "onnxruntime"])
    assert result.exit_code == 0, result.output
    text, summary, why = result.stdout.rstrip("\n").rsplit("\n", 2)
    assert len(text.split()) == 12 and all(w.startswith("w") for w in text.split())
    assert "[onnxruntime] 12 tokens in" in summary and "tau" in summary
    # the last line says why it did or did not speculate: what was accepted against what would pay here
    assert why.startswith("speculation (goodput): drafter called in ") and "acceptance" in why


def test_run_takes_the_verify_policy_by_its_name_and_its_former_one(built):
    out, _ = built
    runs = [CliRunner().invoke(main, ["run", str(out), "--prompt", "w5 w17 w33", "--max-new-tokens", "6",
                                      "--backend", "onnxruntime", flag, "fixed"])
            for flag in ("--verify-policy", "--depth-policy")]
    assert [r.exit_code for r in runs] == [0, 0], runs[0].output + runs[1].output
    assert runs[0].stdout.split("\n")[0] == runs[1].stdout.split("\n")[0]  # the same text
    assert all("speculation: fixed" in r.stdout for r in runs)


def test_runs_first_cost_measurement_says_so_once(built):
    out, _ = built
    (out / "costs.json").unlink(missing_ok=True)
    args = ["run", str(out), "--prompt", "w5 w17", "--max-new-tokens", "4", "--backend", "onnxruntime"]
    first, second = CliRunner().invoke(main, args), CliRunner().invoke(main, args)
    assert first.exit_code == second.exit_code == 0, first.output
    assert first.stderr.count("measuring what a drafter call and a verify call") == 1
    assert "measured in" in first.stderr and "measuring" not in second.stderr  # cached: said once
    assert oct((out / "costs.json").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def test_run_json_prints_one_object_per_request(built):
    out, _ = built
    prompts = ["w5 w17 w33 w101", "w9"]
    result = CliRunner().invoke(main, ["run", str(out), "--prompt", prompts[0], "--prompt", prompts[1],
                                       "--max-new-tokens", "10", "--backend", "onnxruntime", "--json"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    opened = open_build(out, backend="onnxruntime")
    config = GenerationConfig(max_new_tokens=10, eos_ids=opened.eos_ids)
    assert [r["request"] for r in records] == [0, 1]
    for prompt, record in zip(prompts, records):
        [expected] = opened.runtime.generate([opened.encode(prompt)], config)  # the Python API's result
        stats = record["stats"]
        assert record["tokens"] == expected.tokens and record["text"] == expected.text
        assert record["finish_reason"] == expected.finish_reason and record["backend"] == "onnxruntime"
        assert stats["new_tokens"] == len(record["tokens"]) and stats["prompt_tokens"] == len(opened.encode(prompt))
        assert stats["rounds"] == len(stats["accepted_per_round"]) == len(stats["verified_per_round"]) >= 1
        assert stats["tau"] == pytest.approx(1 + sum(stats["accepted_per_round"]) / stats["rounds"], abs=1e-4)
        assert len(stats["acceptance_by_depth"]) == opened.runtime.depth
        rounds = list(zip(stats["accepted_per_round"], stats["verified_per_round"]))
        for d, a in enumerate(stats["acceptance_by_depth"], 1):  # a depth no round checked: null, never 0
            assert (a is None) == (not any(m >= d - 1 and k >= d for m, k in rounds))
        assert record["speculation"].startswith("speculation (goodput)")
        seconds = stats["seconds"]
        assert seconds["prefill"] + seconds["draft"] + seconds["verify"] <= seconds["total"] + 1e-3
        assert stats["tokens_per_s"] == pytest.approx(stats["new_tokens"] / seconds["total"], rel=0.01)


def test_bench_plot_without_matplotlib_names_the_extra_before_measuring(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = CliRunner().invoke(main, ["bench", str(tmp_path / "no-build"), "--plot", str(tmp_path / "b.png")])
    assert result.exit_code == 2, result.output
    assert "--plot needs matplotlib" in result.output and "pip install 'eagle-export[plot]'" in result.output


def on_a_terminal(args) -> tuple[str, str]:
    """(stdout, stderr) of the command with stderr on a pseudo-terminal, as a user at a terminal runs it
    (stdout piped, as when it is redirected to a log)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a new pty has 0 columns
    proc = subprocess.Popen([sys.executable, "-c", "from eagle_export.cli import main; main()", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []

    def read():  # drain the terminal while the command runs, so it never blocks on a full buffer
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the command closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    stdout = proc.communicate(timeout=300)[0]
    reader.join()
    os.close(master)
    assert proc.returncode == 0, stdout + b"".join(chunks).decode()
    return stdout, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_progress_bar_on_a_terminal_and_none_in_logs(built, tmp_path):
    out, log = built
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\nw8 w9\n")
    bench = ["bench", out, "--dataset", prompts, "--max-new-tokens", "4"]
    bar = re.compile(r"batch 1: +\d+%\|.*\| *\d+/2 \[\d\d:\d\d<(\?|\d\d:\d\d)")  # count and ETA
    stdout, terminal = on_a_terminal(bench)
    assert bar.search(terminal), terminal
    assert "\r" not in stdout and "batch 1: autoregressive" in stdout
    stdout, terminal = on_a_terminal(["--quiet", *bench])
    assert "batch 1" not in terminal and "\r" not in terminal and "batch 1: autoregressive" in stdout
    assert "\r" not in log and "[8/8] manifest done" in log  # the build's log, not on a terminal: stage lines only


@pytest.mark.parametrize("batch", [1, 3])
def test_onnxruntime_loop_is_lossless_whatever_depth_a_policy_chooses(built, batch):
    """The exported graphs under random depth decisions: plain steps (the drafter then catches up on
    more than K+1 rows at once), k = 0 after a drafter call, verify calls of every T in 1..K+1, and
    caches that grow on the way."""
    opened = open_build(built[0], backend="onnxruntime", verify=False)
    opened.runtime.cache_step = 8  # the caches grow every few rounds
    prompts = [opened.encode(p) for p in ("w5 w17 w33 w101", "w9", "w12 w13 w14 w15 w16 w17 w18")][:batch]
    config = GenerationConfig(max_new_tokens=30)
    plain = opened.runtime.generate(prompts, config, speculative=False)
    for seed in range(2):
        policy = RandomDepth(3, seed=seed, draft_rate=0.5)
        results = opened.runtime.generate(prompts, config, verify_policy=policy)
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        assert {None, 0, 1, 2, 3} <= set(policy.chosen)


def test_run_sampling_and_torch_backend(built):
    out, _ = built
    for args in (["--temperature", "0.7", "--top-p", "0.9"], ["--backend", "torch"]):
        result = CliRunner().invoke(main, ["run", str(out), "--chat", "w9 w10", "--max-new-tokens", "6", *args])
        assert result.exit_code == 0, result.output


def test_run_refuses_nonsense_generation_settings(built):
    out, _ = built
    for args, problem in ((["--temperature", "nan"], "temperature is nan"), (["--top-p", "0"], "top_p is 0.0"),
                          (["--max-new-tokens", "-1"], "max_new_tokens is -1")):
        result = CliRunner().invoke(main, ["run", str(out), "--prompt", "w5 w6", "--backend", "onnxruntime", *args])
        assert result.exit_code == 2 and f"error: {problem}" in result.output and "fix:" in result.output, args


def test_a_refused_run_writes_nothing_into_the_build(built, tmp_path):
    """Repro: `run --temperature nan` measured the costs and wrote costs.json before refusing."""
    copy = _copy_build(built[0], tmp_path)
    (copy / "costs.json").unlink(missing_ok=True)
    before = snapshot(copy)
    for args in (["--temperature", "nan"], ["--prompt", "w1 " * 200]):
        result = CliRunner().invoke(main, ["run", str(copy), "--prompt", "w5 w6", "--backend", "onnxruntime", *args])
        assert result.exit_code == 2 and "fix:" in result.output, result.output
        assert snapshot(copy) == before, args


def test_a_stripped_manifest_hash_is_refused_and_contradicting_values_are_named(built, tmp_path):
    """Repro: deleting manifest.sha256 and the manifest_hash key switched the self-check off, and an
    edited context limit and eos ids then ran. Format 2 carries its hash; an older format is accepted
    only as old (and said so), and values that contradict the graphs or the model are refused anyway."""
    copy = _copy_build(built[0], tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["models"]["target"]["max_position_embeddings"] == 512

    def write(**edits):
        (copy / "manifest.json").write_text(json.dumps({**manifest, **edits}))

    del manifest["manifest_hash"]
    (copy / "manifest.sha256").unlink()
    target = {**manifest["models"]["target"], "eos_token_id": list(range(1, 11))}
    write(max_context=100000, models={**manifest["models"], "target": target})
    result = CliRunner().invoke(main, ["validate", str(copy)])
    assert result.exit_code == 1 and "manifest.sha256: missing" in result.output, result.output
    with pytest.raises(EagleExportError, match="manifest.sha256: missing"):
        open_build(copy, backend="onnxruntime")
    write(format=1, max_context=100000)  # passed off as an older build: the values are still checked
    result = CliRunner().invoke(main, ["validate", str(copy)])
    assert result.exit_code == 1 and "FAIL  manifest values: max_context 100000 exceeds the graphs' context " \
                                     "profile (max 96)" in result.output, result.output
    with pytest.raises(EagleExportError, match="contradicts its graphs or its model: max_context 100000"):
        open_build(copy, backend="onnxruntime")
    write(format=1, models={**manifest["models"], "target": {**target, "eos_token_id": [5, 320]}})
    with pytest.raises(EagleExportError, match=r"eos_token_id \[320\] lies outside the target's vocabulary"):
        open_build(copy, backend="onnxruntime")
    write(format=1)  # an honest older build: opens, and run, validate and inspect say it is old
    open_build(copy, backend="onnxruntime")
    ran = CliRunner().invoke(main, ["run", str(copy), "--prompt", "w5 w6", "--prompt", "w7", "--max-new-tokens", "2",
                                    "--backend", "onnxruntime"])
    assert ran.exit_code == 0 and ran.stderr.count("predates self-hashing") == 1, ran.output  # once, not per request
    assert f"`eagle-export build --recipe RECIPE -o {copy} --force`" in ran.stderr
    report = json.loads(CliRunner().invoke(main, ["inspect", str(copy), "--json"]).output)
    assert any(w.startswith("manifest format 1 (an older eagle-export") for w in report["warnings"])
    result = CliRunner().invoke(main, ["validate", str(copy), "--json"])
    assert result.exit_code == 0 and "manifest format 1" in json.loads(result.output)["checks"][0]["detail"]


def test_an_object_array_vocab_map_in_a_build_is_refused_by_name(built, tmp_path):
    """Repro: draft_to_target.npy replaced by a pickled object array (hashes updated) made `run` exit 3."""
    import numpy as np

    from eagle_export.builder.manifest import artifact_hashes

    copy = _copy_build(built[0], tmp_path)
    np.save(copy / "draft_to_target.npy", np.array([object()] * 96), allow_pickle=True)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "artifacts": artifact_hashes(copy)}))
    write_manifest_hash(copy)  # a consistent build with a hostile file in it
    result = CliRunner().invoke(main, ["run", str(copy), "--prompt", "w5", "--backend", "onnxruntime"])
    assert result.exit_code == 2 and "draft_to_target.npy is not a plain .npy array" in result.output, result.output
    assert "rebuild" in result.output and "Traceback" not in result.output


def test_unreadable_checkpoint_files_and_artifacts_are_named(built, sources):
    """Repro: config.json, model.safetensors or the checkpoint directory at mode 000 failed `build`
    with an internal error (exit 3) in the source hashing; drafter.onnx at mode 000 failed `run`."""
    with world_dir() as root:
        shutil.copytree(built[0], root / "build")
        for role, path in zip(("target", "drafter"), sources):
            shutil.copytree(path, root / role)
        recipe = write_recipe(root / "r.yaml", (root / "target", root / "drafter"))
        share(root)
        for locked in ("drafter/config.json", "drafter/model.safetensors", "target", "build/drafter.onnx"):
            (root / locked).chmod(0)
            args = (["run", str(root / "build"), "--prompt", "w5", "--backend", "onnxruntime"]
                    if locked.startswith("build") else ["build", "--recipe", str(recipe), "-o", str(root / "out")])
            with unprivileged():
                result = CliRunner().invoke(main, args)
            (root / locked).chmod(0o777 if (root / locked).is_dir() else 0o666)
            assert result.exit_code == 2, (locked, result.output)
            assert "permission denied" in result.output and locked.split("/")[-1] in result.output, result.output
            assert "fix: fix its permissions" in result.output and "internal error" not in result.output
            assert not (root / "out").exists()


def test_the_torch_backend_refuses_sources_changed_since_the_build(built, sources, tmp_path):
    """The torch backend rebuilds the models from the recorded checkpoints: a changed checkpoint must
    be refused by name, and validate must say the source changed instead of blaming a graph."""
    out, _ = built
    copy, src = tmp_path / "copy", tmp_path / "src"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    src.mkdir()
    for role, path in zip(("target", "drafter"), sources):
        subprocess.run(["cp", "-r", str(path), str(src / role)], check=True)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["sources"] = {"target": str(src / "target"), "drafter": str(src / "drafter")}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    write_manifest_hash(copy)  # a deliberate edit: the build now reads its sources from the copies
    assert set(manifest["source_files"]["drafter"]) >= {"config.json", "model.safetensors"}
    open_build(copy, backend="torch")  # unchanged: opens
    weights = load_file(src / "drafter" / "model.safetensors")
    weights["fc.weight"] = weights["fc.weight"] * 1.01
    save_file(weights, str(src / "drafter" / "model.safetensors"))
    with pytest.raises(EagleExportError, match="drafter checkpoint .* changed since the build: model.safetensors "
                                               r"\(modified\)") as err:
        open_build(copy, backend="torch")
    assert "onnxruntime" in err.value.fix
    result = CliRunner().invoke(main, ["validate", str(copy), "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 1 and report["failures"][0].startswith("source checkpoints: the drafter checkpoint")
    assert len(report["failures"]) == 1  # no graph is blamed
    # Gone: the build's own files still verify, the torch comparisons are skipped with the reason.
    subprocess.run(["rm", "-r", str(src)], check=True)
    result = CliRunner().invoke(main, ["validate", str(copy), "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 0 and report["checks"][0]["ok"] and "is gone" in report["skipped"][0]
    assert "Traceback" not in result.output


def test_bench_json_and_plot(built, tmp_path):
    out, _ = built
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\nw8 w9\nw10 w11 w12 w13\nw14\n")
    result = CliRunner().invoke(main, ["bench", str(out), "--dataset", str(prompts), "--batch", "1,2",
                                       "--max-new-tokens", "10", "--repeat", "2", "--json", str(tmp_path / "b.json"),
                                       "--plot", str(tmp_path / "b.png")])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch"] for r in results] == [1, 2]
    for r in results:
        # --repeat 2: every batch of the 4 prompts twice, each a ratio in the median
        assert r["repeat"] == 2 and all(p["batches"] == 2 * 4 // r["batch"] for p in r["builds"][str(out)]["policies"].values())
        assert {"backend", "device", "batch", "ar_tokens_per_s", "ar_step_ms", "builds"} <= set(r)
        assert r["backend"] == "onnxruntime" and list(r["builds"]) == [str(out)]
        b = r["builds"][str(out)]
        assert b["depth"] == 3 and b["speculation"] == "chain K=3" and b["verify_width"] == 4
        assert list(b["costs"]["verify_ms"]) == list(b["costs"]["draft_ms"]) == ["1", "2", "3", "4"]
        assert all(ms > 0 for ms in b["costs"]["verify_ms"].values())
        assert set(b["policies"]) == {"goodput", "fixed"}
        for name, p in b["policies"].items():
            assert {"tau", "acceptance_by_depth", "depth_histogram", "spec_tokens_per_s", "speedup", "time_split",
                    "efficiency", "verify_width_mean", "round_cost_in_steps"} <= set(p)
            assert len(p["acceptance_by_depth"]) == 3 and p["tau"] >= 1.0
            assert set(p["time_split"]) >= {"draft", "verify", "host"}
            assert p["identical_to_autoregressive"] is True
            assert sum(p["depth_histogram"].values()) >= p["rounds"] > 0
            assert 1 <= p["verify_width_mean"] <= 4 and p["round_cost_in_steps"] > 0
        assert b["policies"]["fixed"]["depth_histogram"] == {"0": 0, "1": 0, "2": 0, "3": sum(
            b["policies"]["fixed"]["depth_histogram"].values())}
        assert b["policies"]["fixed"]["verify_width_mean"] == 4  # a chain of 3 verified whole: 4 tokens a call
        # A round without drafts is timed the way a plain step is: fixed has none (its rounds all draft,
        # the prompts end far from the context limit), plain decoding has only those.
        assert r["ar_round_ms"] > 0 and b["policies"]["fixed"]["plain_round_ms"] is None
        goodput = b["policies"]["goodput"]
        assert (goodput["plain_round_ms"] is None) == (goodput["draft_calls"] == goodput["rounds"])
        assert len(goodput["trust"]) == b["depth"] and all(t > 0 for t in goodput["trust"])  # per depth
        assert "trust" not in b["policies"]["fixed"]
        (rows, ms), = b["costs"]["catch_up_ms"].items()  # the drafter catching up, which prices the probes
        assert int(rows) > max(map(int, b["costs"]["draft_ms"])) and ms > 0
    assert "goodput" in result.output and "fixed" in result.output and "verify of T=1..4 tokens" in result.output
    # A progress line as each batch finishes (8 batches of 1, 4 of 2: --repeat 2), each run's speedup so far;
    # the last one of a batch size is the whole run's, the headline of each policy's line.
    progress = [line for line in result.output.splitlines() if "; speedup so far " in line]
    assert [line.split(" batches")[0] for line in progress] == (
        [f"batch size 1: {i}/8" for i in range(1, 9)] + [f"batch size 2: {i}/4" for i in range(1, 5)])
    for r, last in zip(results, (progress[7], progress[11])):
        policies = r["builds"][str(out)]["policies"]
        assert last.endswith(f"goodput {policies['goodput']['speedup']:.2f}x, fixed {policies['fixed']['speedup']:.2f}x"
                             ) or last.endswith(f"fixed {policies['fixed']['speedup']:.2f}x")
        for name, p in policies.items():
            assert (f"speedup {p['speedup']:.2f}x (whole run); median over {p['batches']} batches "
                    f"{p['speedup_median_over_batches']:.2f}x" in result.output)
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert "costs.json" in os.listdir(out)  # measured once, cached in the build per backend and machine
    assert result.output.count("outputs identical to plain decoding: yes") == 4  # 2 batch sizes x 2 policies
    # bench measures the curves it uses in its own run; --reuse-costs reads the cached ones as they are.
    cache = json.loads((out / "costs.json").read_text())
    for entry in cache["entries"].values():
        entry["verify_s"]["1"] = {t: 9.0 for t in entry["verify_s"]["1"]}
    (out / "costs.json").write_text(json.dumps(cache))
    for flags, stale in ((["--reuse-costs"], True), ([], False)):
        args = ["bench", str(out), "--dataset", str(prompts), "--num-prompts", "1", "--max-new-tokens", "4",
                "--json", str(tmp_path / "c.json"), *flags]
        assert CliRunner().invoke(main, args).exit_code == 0
        verify_ms = json.loads((tmp_path / "c.json").read_text())["builds"][str(out)]["costs"]["verify_ms"]
        assert (verify_ms["1"] == 9000.0) == stale, flags
    # two builds of one target whose cached curves disagree: --reuse-costs is refused, a fresh run is not
    other = tmp_path / "copy"
    shutil.copytree(out, other)
    cache = json.loads((other / "costs.json").read_text())
    for entry in cache["entries"].values():
        entry["verify_s"]["1"] = {t: 3 * s for t, s in entry["verify_s"]["1"].items()}
    (other / "costs.json").write_text(json.dumps(cache))
    args = ["bench", str(out), str(other), "--dataset", str(prompts), "--num-prompts", "1", "--max-new-tokens", "4"]
    refused = CliRunner().invoke(main, args + ["--reuse-costs"])
    assert refused.exit_code == 2 and "cached cost curves disagree" in refused.output and "3.00x" in refused.output
    assert CliRunner().invoke(main, args).exit_code == 0


@pytest.mark.slow
def test_selftest_tree_step_builds_a_dynamic_tree_twin_and_benches_both(built, monkeypatch, tmp_path):
    """`selftest --gpu`'s tree step on a CPU (ONNX Runtime): the build's twin drafting a dynamic tree
    is built from the same sources (greedy, though the build samples), and both run side by side,
    every output equal to plain decoding."""
    from eagle_export.tools import selftest

    out, _ = built
    opened = open_build(out)
    prompts = [opened.encode(t) for t in ("w5 w6 w7", "w8 w9", "w10 w11 w12 w13", "w14")]
    monkeypatch.setattr(selftest, "chat_prompts", lambda template, name, count: prompts[:count])
    monkeypatch.setattr(OpenBuild, "chat_template", lambda self: None)  # the tiny build has none
    state = {"build_dir": out, "scratch": tmp_path}
    ok, fact = selftest.tree_vs_chain(state)
    assert ok is True, fact
    figures = state["tree_vs_chain"]
    assert set(figures) == {f"onnxruntime batch {b} {name} {p}" for b in (1, 4) for name in ("chain", "tree")
                            for p in ("goodput", "fixed")}
    assert figures["onnxruntime batch 1 tree fixed"]["verify_width"] == 17  # the 16-node tree, whole
    assert figures["onnxruntime batch 1 chain fixed"]["verify_width"] == 4


def test_inspect_says_what_a_build_holds(built):
    out, _ = built
    result = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["kind"] == "build" and report["speculation"] == "chain K=3"
    assert (report["depth"], report["nodes"], report["verify_width"], report["sampling"]) == (3, 3, 4, True)
    assert report["graphs"] == ["drafter.onnx", "drafter_sampling.onnx", "target.onnx"]
    checks = json.loads((out / "manifest.json").read_text())["validation"]["checks"]
    assert report["validation"].startswith(f"{len(checks)} of {len(checks)} checks passed when built")
    assert report["target"].endswith("(fp32)")
    text = CliRunner().invoke(main, ["inspect", str(out)]).output  # as a reader writes it: no Python reprs
    assert "graphs                   drafter.onnx, drafter_sampling.onnx, target.onnx\n" in text
    assert "[" not in text and "'" not in text and "None" not in text
    result = CliRunner().invoke(main, ["inspect", str(out), "--check", "--target", str(out)])
    assert result.exit_code == 2 and "not a build" in result.output


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


def test_a_drafter_matching_no_convention_is_refused(sources, tmp_path, monkeypatch):
    """Refused by the conformance stage, which checks the build's own loaded models: each checkpoint
    is loaded once (before: a second fp32 copy of both, beside the build's)."""
    import eagle_export.export.loader as loader_module
    import eagle_export.models.checkpoint as checkpoint_module

    loads = []
    for name in ("load_target", "load_drafter"):
        original = getattr(checkpoint_module, name)
        counted = lambda *a, _original=original, _name=name, **k: loads.append(_name) or _original(*a, **k)
        for module in (checkpoint_module, loader_module):  # every pair is loaded through loader.load_pair
            monkeypatch.setattr(module, name, counted)
    drafter = write_tiny_drafter(tmp_path / "random", "3.1")  # random weights: near zero under every reading
    recipe = write_recipe(tmp_path / "r.yaml", (sources[0], drafter))
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "matches no convention" in result.output and "--check" in result.output
    assert not (tmp_path / "out").exists()
    assert sorted(loads) == ["load_drafter", "load_target"]


def test_the_export_command_writes_the_graphs_a_build_writes(built, tmp_path):
    """One pair loader: `eagle-export export` at the build's depth and dtype writes its graphs byte for
    byte (before, export skipped the model passes and wrote other graphs)."""
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    sources = manifest["sources"]
    result = CliRunner().invoke(main, ["export", "--target", sources["target"], "--draft", sources["drafter"],
                                       "--depth", str(manifest["depth"]), "--dtype", "fp32", "--sampling",
                                       "-o", str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    for graph in ("target.onnx", "drafter.onnx", "drafter_sampling.onnx"):
        assert (tmp_path / "export" / graph).read_bytes() == (out / graph).read_bytes(), graph


def test_export_checkpoint_from_a_build_keeps_its_conformance_record(built, tmp_path):
    out, _ = built
    result = CliRunner().invoke(main, ["export-checkpoint", str(out), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "ckpt" / "export_summary.json").read_text())
    assert summary["conformance"] == json.loads((out / "manifest.json").read_text())["conformance"]
    assert summary["source"]["build"] == str(out) and summary["round_trip"]["max_abs_logit_diff"] == 0.0


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


STATIC_TREE = "{kind: static_tree, branching: [2, 2, 1]}"


@pytest.fixture(scope="module")
def tree_build(sources, tmp_path_factory):
    """build(speculation) -> a build of the tiny pair with that speculation, made once for the tests
    that read it (a test that writes into it copies it first)."""
    made = {}

    def build(speculation: str):
        if speculation not in made:
            root = tmp_path_factory.mktemp("tree")
            recipe = root / "r.yaml"
            recipe.write_text(write_recipe(recipe, sources).read_text().replace("depth: 3\n",
                                                                                f"speculation: {speculation}\n"))
            result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(root / "out")])
            assert result.exit_code == 0, result.output
            made[speculation] = root / "out"
        return made[speculation]
    return build


@pytest.mark.slow
@pytest.mark.parametrize("speculation", [STATIC_TREE, "{kind: dynamic_tree, top_k: 2, depth: 3, nodes: 6}"],
                         ids=["static", "dynamic"])
def test_tree_builds_validate_and_decode_losslessly(tree_build, speculation):
    """build -> validate (its lossless loop runs on the tree graphs) -> run on both backends: the
    greedy output of tree speculation equals plain decoding's."""
    out = tree_build(speculation)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["speculation"]["kind"] in speculation and manifest["validation"]["ok"]
    for backend in ("onnxruntime", "torch"):
        opened = open_build(out, backend=backend, verify_policy="fixed")
        assert opened.runtime.backend.verify_width == manifest["speculation"]["nodes"] + 1
        prompts = [opened.encode("Hello there"), opened.encode("One two three four")]
        config = GenerationConfig(max_new_tokens=16)
        spec = opened.runtime.generate(prompts, config)
        plain = opened.runtime.generate(prompts, config, speculative=False)
        assert [r.tokens for r in spec] == [r.tokens for r in plain], backend

@pytest.mark.slow
def test_bench_compares_a_chain_and_a_tree_side_by_side(built, tree_build, tmp_path):
    """`bench CHAIN TREE`: one table for both builds of one target, each with its speculation, verify
    widths and costs, both identical to plain decoding; builds of another target are refused."""
    chain, _ = built
    tree = tmp_path / "tree"
    shutil.copytree(tree_build(STATIC_TREE), tree)  # (bench saves its costs into the build)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\nw8 w9\nw10 w11 w12 w13\n")
    result = CliRunner().invoke(main, ["bench", str(chain), str(tree), "--dataset", str(prompts), "--batch", "1,2",
                                       "--max-new-tokens", "10", "--json", str(tmp_path / "b.json"),
                                       "--plot", str(tmp_path / "b.png")])
    assert result.exit_code == 0, result.output
    for r in json.loads((tmp_path / "b.json").read_text()):
        assert list(r["builds"]) == [str(chain), str(tree)]
        t = r["builds"][str(tree)]
        assert t["speculation"] == "static tree depth 3 (10 nodes)" and t["nodes"] == 10 and t["verify_width"] == 11
        assert list(t["costs"]["verify_ms"]) == [str(w) for w in range(1, 12)]  # priced up to the tree's width
        for b in r["builds"].values():
            for p in b["policies"].values():
                assert p["identical_to_autoregressive"] is True and p["tau"] >= 1.0
        assert t["policies"]["fixed"]["verify_width_mean"] == 11  # the whole tree every round
    assert "static tree depth 3 (10 nodes)" in result.output and "chain K=3" in result.output
    report = json.loads(CliRunner().invoke(main, ["inspect", str(tree), "--json"]).output)
    assert report["speculation"] == "static tree depth 3 (10 nodes)" and report["verify_width"] == 11
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    # another target: refused before anything is measured
    other = tmp_path / "other"
    shutil.copytree(tree, other)
    data = json.loads((other / "manifest.json").read_text())
    data["models"]["target"]["precision"] = "fp16"
    (other / "manifest.json").write_text(json.dumps(data))
    write_manifest_hash(other)
    result = CliRunner().invoke(main, ["bench", str(chain), str(other), "--dataset", str(prompts)])
    assert result.exit_code == 2 and "different targets" in result.output and "Traceback" not in result.output


def test_interrupted_build_leaves_nothing(sources, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", sources)
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys
        import signal  # a shell's background job inherits SIGINT ignored; Ctrl-C must reach Python
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import eagle_export.export.export as E
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


def test_the_manifest_keeps_every_key_a_0_1_0_build_wrote(built):
    """The typed view reads manifests; the JSON itself is unchanged: a build made now writes every key
    the sample build of eagle-export 0.1.0 wrote (artifact and stage names aside, which vary)."""
    from pathlib import Path

    def paths(d, prefix=()):
        for key, value in d.items():
            yield prefix + (key,)
            if isinstance(value, dict) and key not in ("artifacts", "stage_seconds"):
                yield from paths(value, prefix + (key,))

    old = json.loads((Path(__file__).parent / "data" / "manifest_0.1.0_sample.json").read_text())
    new = json.loads((built[0] / "manifest.json").read_text())
    assert set(paths(old)) <= set(paths(new))


def test_engines_for_another_gpu_are_refused(built, tmp_path):
    out, _ = built
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["engines"] = [{"graph": g, "file": f"{g}.sm100.trt10.13.engine", "tensorrt": "10.13.2",
                            "compute_capability": "10.0", "gpu": "B200"} for g in ("target", "drafter")]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EagleExportError, match="no engine in this build fits this machine"):
        open_build(copy, backend="tensorrt", verify=False)  # (the engine files are not there to hash)
    opened = open_build(copy, backend="auto", verify=False)  # auto falls back to ONNX Runtime
    assert opened.runtime.backend.name == "onnxruntime"


def with_engines_that_do_not_load(built, tmp_path, monkeypatch):
    """A copy of the build with engines for this (faked) GPU and TensorRT, whose files TensorRT
    cannot deserialize (as after a TensorRT patch upgrade); the manifest re-signed."""
    import fake_tensorrt

    import eagle_export.builder.build_dir as build_dir
    from eagle_export.builder.manifest import sha256_file

    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(built[0]), str(copy)], check=True)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["engines"] = [{"graph": g, "file": f"{g}.sm90.trt10.13.engine", "tensorrt": "10.13.2",
                            "compute_capability": "9.0", "gpu": "H100"} for g in ("target", "drafter")]
    for engine in manifest["engines"]:
        (copy / engine["file"]).write_bytes(b"built by another TensorRT")
        manifest["artifacts"][engine["file"]] = {"sha256": sha256_file(copy / engine["file"]), "bytes": 25}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    write_manifest_hash(copy)
    monkeypatch.setattr(build_dir, "gpu_info", lambda: {"name": "H100", "compute_capability": "9.0"})
    monkeypatch.setattr(build_dir, "tensorrt_version", lambda: "10.13.3")
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt.module({}))  # deserializes nothing
    return copy


def test_auto_falls_back_to_onnxruntime_with_one_line_when_an_engine_does_not_load(built, tmp_path, monkeypatch,
                                                                                    capsys):
    copy = with_engines_that_do_not_load(built, tmp_path, monkeypatch)
    with pytest.raises(EagleExportError, match="TensorRT cannot load target.sm90.trt10.13.engine"):
        open_build(copy, backend="tensorrt")
    capsys.readouterr()
    opened = open_build(copy, backend="auto")  # before: the load error aborted `auto`
    assert opened.runtime.backend.name == "onnxruntime"
    assert capsys.readouterr().err.splitlines() == [
        "note: running on ONNX Runtime, not TensorRT: TensorRT cannot load target.sm90.trt10.13.engine (another "
        "TensorRT version or GPU, or a corrupt file)"]


def test_validate_runs_the_lossless_loop_on_the_engines_too(built, tmp_path, monkeypatch):
    """A build with engines runs the lossless loop on TensorRT as well; here they cannot load, so that
    check is skipped with the reason, never passed (on a GPU it runs: `eagle-export selftest --gpu`)."""
    import eagle_export.builder.validate as validate

    copy = with_engines_that_do_not_load(built, tmp_path, monkeypatch)
    backends = []
    real_open_build = validate.open_build
    monkeypatch.setattr(validate, "open_build", lambda path, backend, **kw: backends.append(backend)
                        or real_open_build(path, backend=backend, **kw))
    monkeypatch.setattr(validate, "verify_sources", lambda manifest: ([], ["sources not checked in this test"]))
    report = validate.validate_build_dir(copy, quick=True)
    assert backends == ["onnxruntime", "tensorrt"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["lossless: speculative == autoregressive (onnxruntime)"]["ok"] is True
    assert checks["lossless loop (tensorrt)"]["status"] == "skipped"
    assert checks["lossless loop (tensorrt)"]["detail"].startswith(
        "not run: the engines do not load here: TensorRT cannot load target.sm90.trt10.13.engine")


def quantized_build(sources, root, precision: str):
    """A tiny build with both models at `precision`, calibrated on 4 prompts."""
    recipe = write_recipe(root / "r.yaml", sources).read_text()
    recipe = recipe.replace("precision: {target: fp32, drafter: fp32}",
                            f"precision: {{target: {precision}, drafter: {precision}}}\n"
                            "calibration: {num_samples: 4, max_tokens: 32}")
    (root / "r.yaml").write_text(recipe)
    result = CliRunner().invoke(main, ["build", "--recipe", str(root / "r.yaml"), "-o", str(root / "out")])
    assert result.exit_code == 0, result.output
    return root / "out", result.output


@pytest.fixture(scope="module")
def fp8_built(tmp_path_factory, sources):
    return quantized_build(sources, tmp_path_factory.mktemp("fp8"), "fp8")


GRAPH_CHECKS = ("quantized target graph vs unquantized torch", "quantized drafter graph vs unquantized torch")


def test_fp8_build_quantizes_records_metrics_and_stays_lossless(fp8_built):
    out, _ = fp8_built
    manifest = json.loads((out / "manifest.json").read_text())
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

    ops = {n.op_type for n in onnx.load(out / "target.onnx").graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    tiers = [c for c in manifest["validation"]["checks"] if c["name"][:2] in ("T0", "T1", "T2", "T3")]
    assert len(tiers) == 4 and all(c["ok"] for c in tiers)
    # The graphs were run against the unquantized models on the recorded prompts; nothing was skipped.
    prompt_ids = quant["evaluation"]["prompt_ids"]
    assert len(prompt_ids) == 4 and all(isinstance(i, int) for p in prompt_ids for i in p)
    checks = {c["name"]: c for c in manifest["validation"]["checks"]}
    assert all(checks[name]["status"] == "passed" and "1/4 prompts" in checks[name]["detail"]
               for name in GRAPH_CHECKS)
    assert manifest["validation"]["skipped"] == [] and all(c["ok"] is True for c in checks.values())
    assert Manifest.read(out).to_json() == manifest


T0 = "T0 synthetic drafters, exact (onnxruntime)"
T1 = "T1 exact at the verify width (onnxruntime)"
T2 = "T2 divergence from width-1 decoding explained (onnxruntime)"
T3 = "T3 acceptance kept (onnxruntime)"


def test_fp8_build_measures_delta_and_records_every_tier(fp8_built):
    out, log = fp8_built
    manifest = json.loads((out / "manifest.json").read_text())
    delta = manifest["quantization"]["delta"]
    # Measured on the built graph at call widths 1 and K+1 over the calibration prompts (depth 3).
    assert delta["widths"] == [1, 4] and delta["prompts"] == 4 and delta["positions"] > 0
    assert delta["quantile"] == 0.999 and 0 <= delta["delta"] <= delta["max_margin_shift"]
    assert f"delta {delta['delta']:.3g}" in log and "eps" not in manifest["quantization"]
    quant = manifest["quantization"]
    assert quant["tau_drafter_ratio"] == quant["tau_quantized"] / quant["tau_unquantized_drafter"]
    lossless = manifest["validation"]["lossless"]
    assert lossless["contract"] == "tiered" and lossless["verify_width"] == 4
    assert lossless["t0"]["ok"] and lossless["t1"]["ok"] and lossless["t2"] == {"ok": True, "delta": delta["delta"]}
    assert lossless["t3"]["pair_ratio"] >= 0.95 and lossless["t3"]["drafter_ratio"] >= 0.95
    # oracle: every draft accepted (tau K+1), anti: none (tau 1), at batch 1 and 3
    assert {k: v for k, v in lossless["t0"]["tau"].items() if not k.startswith("random")} == {
        "oracle_batch1": 4, "anti_batch1": 1, "oracle_batch3": 4, "anti_batch3": 1}
    for record in lossless["prompts"]:  # per prompt: d, the margin there, delta, the identical prefix
        assert set(record["t2"]) >= {"d", "margin", "delta", "identical_prefix", "explained"}
        assert record["t2"]["explained"] and 0 <= record["t2"]["identical_prefix"] <= 1
    checks = {c["name"]: c for c in manifest["validation"]["checks"]}
    assert all(checks[name]["status"] == "passed" for name in (T0, T1, T2, T3)), checks
    assert not any("eps" in name or "noisy" in c["detail"] for name, c in checks.items())


def _copy_build(out, tmp_path, edit=None):
    """A copy of a build; `edit(manifest)` changes its manifest, re-hashed as a consistent build's."""
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    if edit is not None:
        manifest = json.loads((copy / "manifest.json").read_text())
        edit(manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        write_manifest_hash(copy)
    return copy


def _off_by_one_accept(original):
    """Accept one draft more than the target's argmax agreed with."""
    def accept(node_ids, parents, greedy):
        accepted, path = original(node_ids, parents, greedy)
        return (accepted + 1).clamp(max=path.shape[1]), path
    return accept


def _cache_row_one_early(original):
    """Write each call's new K/V rows one slot before the sequence's length."""
    return lambda keys, values, out, starts, counts, live: original(
        keys, values, out, (starts - 1).clamp(min=0), counts, live)


def _rejected_row_left(original):
    """Commit the verify call's first rows in call order instead of the accepted path's: where the
    path skips a rejected sibling (a tree), that rejected row is left in the cache."""
    return lambda out, rows: original(out, torch.arange(rows.shape[1]).expand_as(rows))


# The runtime function each mutation replaces (`planting.plant`: wherever the runtime's modules bind it).
MUTATED = {_off_by_one_accept: "greedy_accepted_path", _cache_row_one_early: "_write_rows",
           _rejected_row_left: "_gather_rows", stale_aux_row: "_append_rows"}


def _plant(monkeypatch, mutation):
    plant(monkeypatch, MUTATED[mutation], mutation)


def _failed(report):
    return {c["name"].split(" (")[0].split()[0] for c in report["checks"] if c["ok"] is False}


@pytest.mark.parametrize("mutation, tiers", [(_off_by_one_accept, {"T0", "T1"}),
                                             (_cache_row_one_early, {"T1", "T2"}),
                                             (stale_aux_row, {"T0"})],
                         ids=["acceptance off by one", "K/V row one slot early", "stale aux row fed to the drafter"])
def test_planted_runtime_bugs_fail_the_tiers(fp8_built, monkeypatch, mutation, tiers):
    """The mutation test: the quantized build's tiers must catch a broken loop (T0 or T1 each; a
    cache bug T2 too), while its graphs stay sound."""
    from eagle_export.builder.validate import validate_build_dir

    out, _ = fp8_built
    _plant(monkeypatch, mutation)
    report = validate_build_dir(out, quick=True)
    failed = _failed(report)
    assert not report["ok"] and failed & {"T0", "T1"} and tiers <= failed, report["failures"]
    assert not any(name.startswith("quantized") for name in failed)  # only the loop is at fault


def test_t1_is_not_applicable_where_the_probe_finds_a_row_with_other_bits(fp8_built, monkeypatch):
    """A backend that gives a row other bits at another place in the call cannot make T1 exact: it is
    skipped with the probe's figures, never failed (the loop is not at fault) nor passed."""
    import eagle_export.builder.validate as validate

    out, _ = fp8_built
    probe = validate.position_variance
    seen = []

    def varied(*args, **kw):
        found = probe(*args, **kw)
        seen.append(found)
        return {**found, "differing": 3, "max_logit_difference": 0.5}

    monkeypatch.setattr(validate, "position_variance", varied)
    report = validate.validate_build_dir(out, quick=True)
    t1 = next(c for c in report["checks"] if c["name"] == T1)
    assert report["ok"] and t1["status"] == "skipped" and t1["ok"] is None
    rows = seen[0]["rows"]  # every row of 2 prompts x 16 reference tokens, each window of K+1 = 4 rows
    assert rows == 2 * (16 * 4 - (1 + 2 + 3)) and seen[0]["view_slots"][0] == seen[0]["view_slots"][1]
    assert t1["detail"].startswith("not applicable on onnxruntime: a row's bits depend on its place in a width-4 "
                                   "call") and f"3 of {rows} rows" in t1["detail"]
    assert report["lossless"]["t1"]["position_variance"]["differing"] == 3


@pytest.mark.slow
def test_a_rejected_row_left_in_the_cache_fails_t0_t1_and_t2_on_a_tree(sources, tmp_path, monkeypatch):
    from eagle_export.builder.validate import validate_build_dir

    recipe = write_recipe(tmp_path / "r.yaml", sources).read_text().replace(
        "depth: 3\n", "speculation: {kind: static_tree, branching: [2, 2, 1]}\n")
    (tmp_path / "r.yaml").write_text(recipe.replace(
        "precision: {target: fp32, drafter: fp32}",
        "precision: {target: fp8, drafter: fp8}\ncalibration: {num_samples: 4, max_tokens: 32}"))
    result = CliRunner().invoke(main, ["build", "--recipe", str(tmp_path / "r.yaml"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    _plant(monkeypatch, _rejected_row_left)
    report = validate_build_dir(tmp_path / "out", quick=True)
    failed = _failed(report)
    assert failed & {"T0", "T1"} and "T2" in failed, report["failures"]


def test_a_build_made_before_the_tiers_says_which_it_cannot_run(fp8_built, tmp_path):
    out, _ = fp8_built

    def older(manifest):  # as the eps-era eagle-export wrote it
        quant = manifest["quantization"]
        quant["eps"] = {"eps": 1e-6}
        for key in ("delta", "tau_unquantized_drafter", "tau_drafter_ratio"):
            del quant[key]

    result = CliRunner().invoke(main, ["validate", str(_copy_build(out, tmp_path, older))])
    assert result.exit_code == 0, result.output
    assert f"ok    {T0}" in result.output and f"ok    {T1}" in result.output
    assert f"SKIP  {T2}: not run: the build recorded no delta (made before the tiered contract)" in result.output
    assert f"SKIP  {T3}:" in result.output and "against its unquantized self (made before it)" in result.output


def test_a_quantized_build_whose_target_graph_returns_no_logits_validates_without_t2(fp8_built, tmp_path):
    """A target graph without its logits output (exported with return_logits false, or made by hand):
    T1's probe reads the greedy ids and new K/V the graph has, T2 (margins) is skipped and says why.
    (It ended in `internal error (KeyError: 'logits')`.)"""
    import onnx

    from eagle_export.builder.manifest import artifact_hashes

    out, _ = fp8_built
    copy = _copy_build(out, tmp_path)
    graph = onnx.load(copy / "target.onnx")
    outputs = [o for o in graph.graph.output if o.name != "logits"]
    assert len(outputs) == len(graph.graph.output) - 1
    del graph.graph.output[:]
    graph.graph.output.extend(outputs)
    onnx.save(graph, copy / "target.onnx")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["artifacts"] = artifact_hashes(copy)
    manifest["graphs"]["target"]["return_logits"] = False
    (copy / "manifest.json").write_text(json.dumps(manifest))
    write_manifest_hash(copy)
    result = CliRunner().invoke(main, ["validate", str(copy)])
    assert result.exit_code == 0 and "internal error" not in result.output, result.output
    assert f"ok    {T1}" in result.output and "probed on their greedy ids and new K/V" in result.output
    assert f"SKIP  {T2}: not run: the target graph returns no logits" in result.output


def scale_first_fp8_weight(path, factor: float) -> None:
    """Multiply the scale of the first FP8 weight's DequantizeLinear (a Constant node) by `factor`."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model = onnx.load(path)
    fp8 = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN}
    scale = next(n.input[1] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in fp8)
    tensor = next(n for n in model.graph.node if n.op_type == "Constant" and n.output[0] == scale).attribute[0].t
    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * factor, tensor.name))
    onnx.save(model, path)


def test_fp8_validation_fails_a_graph_with_a_bad_weight_scale(fp8_built, tmp_path):
    from eagle_export.builder.manifest import artifact_hashes

    out, _ = fp8_built
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    scale_first_fp8_weight(copy / "target.onnx", 1000.0)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["artifacts"] = artifact_hashes(copy)  # a consistent build with a wrong graph in it
    (copy / "manifest.json").write_text(json.dumps(manifest))
    write_manifest_hash(copy)
    result = CliRunner().invoke(main, ["validate", str(copy)])
    assert result.exit_code == 1, result.output
    assert f"FAIL  {GRAPH_CHECKS[0]}: greedy agreement" in result.output
    assert f"ok    {GRAPH_CHECKS[1]}" in result.output
    # The lossless loop runs this same graph on both sides, so it cannot see the fault.
    assert f"ok    {T1}" in result.output


def test_a_quantized_build_without_recorded_prompts_skips_its_graph_checks(fp8_built, tmp_path):
    from eagle_export.builder.validate import validate_build_dir

    out, _ = fp8_built
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["quantization"]["evaluation"]["prompt_ids"]  # as an older eagle-export wrote it
    del manifest["manifest_hash"]
    manifest["format"] = 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "manifest.sha256").unlink()
    report = validate_build_dir(copy, quick=True)
    skipped = {c["name"]: c for c in report["checks"] if c["status"] == "skipped"}
    # T3 measures tau on those held-out prompts too: without them it is skipped and says so
    assert report["ok"] and set(skipped) == set(GRAPH_CHECKS) | {T3} and len(report["skipped"]) == 3
    assert all(c["ok"] is None and "recorded no evaluation prompt ids" in c["detail"]
               for name, c in skipped.items() if name != T3)
    assert "measured no tau" in skipped[T3]["detail"]


@pytest.mark.slow  # ~30 s on 2 cores
def test_nvfp4_build_runs_its_lossless_loop_on_torch_over_its_graphs_weights(sources, tmp_path):
    """ONNX Runtime has no FP4 kernels: the loop runs on the torch backend over the NVFP4 weights read
    from the build's own graphs, and says so; nothing is skipped."""
    out, log = quantized_build(sources, tmp_path, "nvfp4")
    assert "validation 8/8 checks passed" in log  # the source checkpoints, hashed before the reference is loaded
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backends"] == ["torch"] and manifest["quantization"]["delta"]["backend"] == "torch"
    checks = {c["name"]: c for c in manifest["validation"]["checks"]}
    assert all(checks[name]["status"] == "passed" for name in GRAPH_CHECKS)
    assert all(checks[tier.replace("onnxruntime", "torch")]["status"] == "passed" for tier in (T0, T1, T2, T3))
    assert manifest["validation"]["skipped"] == [] and manifest["validation"]["lossless"]["backend"] == "torch"
    result = CliRunner().invoke(main, ["validate", str(out)])  # every recorded prompt, in onnx.reference
    assert result.exit_code == 0, result.output
    assert "SKIP" not in result.output and f"ok    {T1.replace('onnxruntime', 'torch')}" in result.output
    assert f"ok    {GRAPH_CHECKS[0]}: greedy agreement" in result.output and "4/4 prompts" in result.output
    with pytest.raises(EagleExportError, match="no FP4 kernels"):
        open_build(out, backend="onnxruntime")


def test_evaluation_prompts_are_held_out_from_calibration(sources, tmp_path):
    from eagle_export.builder.build import calibration_prompts, evaluation_prompts
    from eagle_export.builder.recipe import load_recipe
    from eagle_export.data.prompts import ChatTemplate

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", sources),
                         overrides={"calibration.num_samples": 5, "evaluation.num_prompts": 3})
    template = ChatTemplate(sources[0])
    calibration = calibration_prompts(recipe, template)
    evaluation = evaluation_prompts(recipe, template, calibration)
    assert len(calibration) == 5 and len(evaluation) == 3
    assert not {tuple(p) for p in calibration} & {tuple(p[:recipe["calibration"]["max_tokens"]]) for p in evaluation}
    every = load_recipe(write_recipe(tmp_path / "r2.yaml", sources), overrides={"calibration.num_samples": 80})
    with pytest.raises(EagleExportError, match="leaving none to evaluate"):
        evaluation_prompts(every, template, calibration_prompts(every, template))


def test_bench_synthetic_acceptance_and_its_sweep(built, tmp_path):
    """--acceptance: the real drafter runs, its drafts are replaced; every line and field says synthetic, the
    output is plain decoding's, and the cost model's promise stands beside the measurement."""
    out, _ = built
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\nw8 w9\n")
    common = ["bench", str(out), "--dataset", str(prompts), "--max-new-tokens", "12"]
    result = CliRunner().invoke(main, [*common, "--acceptance", "0.9,0.6", "--json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    assert "SYNTHETIC acceptance 0.9/0.6/0.6" in result.output
    r = json.loads((tmp_path / "a.json").read_text())
    assert r["synthetic"]["acceptance"] == ["0.9/0.6/0.6"]
    b = r["builds"][str(out)]
    assert b["break_even_acceptance"] is None or 0 <= b["break_even_acceptance"] <= 1  # None: it never pays
    for p in b["policies"].values():
        assert p["identical_to_autoregressive"] and p["identical_to_verify_width"]
        assert p["model_speedup"] > 0 and p["efficiency_vs_model"] > 0
    assert b["policies"]["fixed"]["tau"] > 1.5  # the synthetic drafts were accepted (the trained drafter's are rarely)
    result = CliRunner().invoke(main, [*common, "--batch", "1,2", "--acceptance-sweep", "--num-prompts", "2",
                                       "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])
    assert result.exit_code == 0, result.output
    assert "break-even acceptance" in result.output and "NO: OUTPUT DIFFERS" not in result.output
    for r in json.loads((tmp_path / "s.json").read_text()):
        sweep = r["builds"][str(out)]["sweep"]
        assert [rec["acceptance"] for rec in sweep] == ["0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8",
                                                       "0.9", "0.95"]
        assert sweep[0]["policies"]["fixed"]["tau"] == 1.0  # acceptance 0: nothing accepted
        model = [rec["policies"]["fixed"]["model_speedup"] for rec in sweep]
        assert model == sorted(model)  # the model's promise grows with acceptance
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("args", "problem"), [
    (["--acceptance", "1.2"], "outside [0, 1]"), (["--acceptance", "0.5,0.5,0.5,0.5"], "drafts to depth 3"),
    (["--acceptance", "x"], "not a number"), (["--acceptance", "0.5", "--acceptance-sweep"], "both given")])
def test_bad_acceptance_is_refused_before_anything_is_measured(built, args, problem):
    out, _ = built
    result = CliRunner().invoke(main, ["bench", str(out), *args])
    assert result.exit_code == 2 and problem in result.output and "fix:" in result.output
    assert "Traceback" not in result.output


def test_a_batch_larger_than_the_prompts_is_refused_before_anything_is_measured(built, tmp_path):
    """(`--batch 4` over 2 prompts measured batches of 2 and reported them, with batch-4 cost curves, as batch 4.)"""
    out, _ = built
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\nw8 w9\n")
    result = CliRunner().invoke(main, ["bench", str(out), "--dataset", str(prompts), "--batch", "1,4",
                                       "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 2 and "internal error" not in result.output, result.output
    assert f"--batch 1,4 asks for more prompts a batch than --num-prompts 16 of {prompts} gives (2)" in result.output
    assert "fix: pass --num-prompts 4 or more" in result.output and "or a smaller --batch" in result.output
    assert not (tmp_path / "b.json").exists() and "autoregressive" not in result.output


def test_run_has_no_synthetic_acceptance(built):
    """A measurement tool, never a generation mode: run refuses the option as unknown."""
    out, _ = built
    result = CliRunner().invoke(main, ["run", str(out), "--prompt", "w5", "--acceptance", "0.7"])
    assert result.exit_code == 2 and "No such option '--acceptance'" in result.output


def test_validate_hands_over_each_check_as_it_finishes(built, monkeypatch):
    """`eagle-export validate` prints a check when it finishes: the graph checks are out before the
    lossless loop (the slowest) starts, and what was streamed is the report, in its order."""
    from eagle_export.builder import validate

    seen, seen_before_loop = [], []
    loop = validate._lossless
    monkeypatch.setattr(validate, "_lossless", lambda *a, **k: seen_before_loop.extend(seen) or loop(*a, **k))
    report = validate.validate_build_dir(built[0], quick=True, on_check=lambda *check: seen.append(check))
    assert seen == [(c["name"], c["ok"], c["detail"]) for c in report["checks"]]
    assert [name for name, _, _ in seen_before_loop] == [
        "artifact hashes", "source checkpoints", "target graph vs torch", "drafter graph vs torch"]


def test_inspect_of_a_build_imports_no_heavy_library(built):
    """`inspect BUILD` reads the manifest alone: it answers without torch, onnx or modelopt."""
    from test_cli import light_command_imports

    assert light_command_imports(["inspect", str(built[0])]) == "heavy: []"


def test_a_broken_builds_fix_rebuilds_that_build_and_sampling_names_the_torch_backend(built, tmp_path):
    """Repro: a corrupt build's fix was `eagle-export build --force`, which rebuilds builds/sample with the
    sample recipe; and `--temperature 0.7` on a build ONNX Runtime cannot sample with did not say that the
    torch backend samples today."""
    from eagle_export.builder.build_dir import sampling_fix
    from eagle_export.builder.manifest import Manifest

    copy = _copy_build(built[0], tmp_path)
    (copy / "draft_to_target.npy").write_bytes(b"broken")
    result = CliRunner().invoke(main, ["run", str(copy), "--prompt", "w5 w6"])
    assert result.exit_code == 2 and "does not match its manifest" in result.output
    data = json.loads((copy / "manifest.json").read_text())
    assert (f"fix: rebuild it: `eagle-export build --recipe RECIPE --target {data['sources']['target']} --drafter "
            f"{data['sources']['drafter']} -o {copy} --force` (RECIPE: the file of recipe {data['recipe']['name']!r})"
            in result.output), result.output
    manifest = Manifest.read(built[0])
    hint = "rebuild it: `eagle-export build --recipe RECIPE -o OUT --force`"
    assert sampling_fix(manifest, "onnxruntime", hint) == (
        "pass --backend torch (it samples today: it runs this build's models from their checkpoints), use "
        "--temperature 0, or rebuild it: `eagle-export build --recipe RECIPE --set sampling=true -o OUT --force`")
    assert "--backend torch" not in sampling_fix(manifest, "torch", hint)
    fp8 = replace(manifest, target=replace(manifest.target, precision="fp8"))  # the torch backend refuses FP8
    assert "--backend torch" not in sampling_fix(fp8, "onnxruntime", hint)
    opened = open_build(built[0], backend="onnxruntime", verify=False)
    assert opened.runtime.cannot_sample_fix.startswith("pass --backend torch")  # what check_requests says
    # A graph that will not load (unchecked here: verify=False) names the same rebuild, not the generic one.
    shutil.copy(built[0] / "draft_to_target.npy", copy / "draft_to_target.npy")
    (copy / "target.onnx").write_bytes(b"not a graph")
    with pytest.raises(EagleExportError, match="ONNX Runtime cannot load target.onnx") as e:
        open_build(copy, backend="onnxruntime", verify=False)
    assert f" -o {copy} --force`" in e.value.fix and "`eagle-export build --force`" not in e.value.fix
