"""Manifest hashes and the atomic build directory."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle_export.builder.manifest import (
    BUILD_OUTPUT,
    BuiltModel,
    GraphFile,
    Manifest,
    read_manifest,
    verify_artifacts,
    write_manifest,
    write_manifest_hash,
)
from eagle_export.errors import EagleExportError
from eagle_export.output_dir import atomic_output_dir, sweep_leftovers

# The sample build's manifest.json as eagle-export 0.1.0 wrote it before the typed view (its two
# checkpoint paths anonymized): an existing build must still open.
SAMPLE_0_1_0 = Path(__file__).parent / "data" / "manifest_0.1.0_sample.json"


def make_build(root):
    with atomic_output_dir(root / "build", BUILD_OUTPUT) as tmp:
        (tmp / "target.onnx").write_bytes(b"x" * 1000)
        (tmp / "drafter.onnx").write_bytes(b"y" * 500)
        write_manifest(tmp, Manifest.from_json(json.loads(SAMPLE_0_1_0.read_text())))
    return root / "build"


def test_intact_build_verifies(tmp_path):
    build = make_build(tmp_path)
    manifest = read_manifest(build)
    assert set(manifest["artifacts"]) == {"target.onnx", "drafter.onnx"}
    assert manifest["libraries"]["torch"] and verify_artifacts(build, manifest) == []


def test_truncated_and_modified_files_are_named(tmp_path):
    build = make_build(tmp_path)
    manifest = read_manifest(build)
    (build / "target.onnx").write_bytes(b"x" * 10)
    (build / "drafter.onnx").write_bytes(b"z" * 500)
    problems = verify_artifacts(build, manifest)
    assert any(p.startswith("target.onnx: 10 bytes") and "truncated" in p for p in problems)
    assert any(p.startswith("drafter.onnx: sha256 differs") for p in problems)
    (build / "drafter.onnx").unlink()
    assert "drafter.onnx: missing" in verify_artifacts(build, manifest)


def test_a_killed_cache_write_leaves_a_file_no_check_counts_and_nothing_else_passes(tmp_path):
    """A process killed while writing costs.json leaves write_cache's temporary file: read by nothing,
    it is not an added artifact; any other unlisted name still is (no hole for a user's own file)."""
    build = make_build(tmp_path)
    manifest = read_manifest(build)
    (build / "costs.json").write_text("{}")
    (build / ".costs.json.k3_x9q0a.tmp").write_text('{"format"')
    assert verify_artifacts(build, manifest) == []
    for name in (".costs.json.k3_x9q0a.tmp.onnx", ".costs.json.toolongname.tmp", ".target.onnx.k3_x9q0a.tmp",
                 "costs.json.k3_x9q0a.tmp", "sub/.costs.json.k3_x9q0a.tmp"):
        (build / name).parent.mkdir(exist_ok=True)
        (build / name).write_text("x")
        assert verify_artifacts(build, manifest) == [f"{name}: not listed in the manifest (added after the build)"]
        (build / name).unlink()


def test_not_a_build_and_corrupt_manifest(tmp_path):
    with pytest.raises(EagleExportError, match="not a build directory"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{oops")
    with pytest.raises(EagleExportError, match="corrupt"):
        read_manifest(tmp_path)


def test_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_output_dir(tmp_path / "build", BUILD_OUTPUT) as tmp:
            (tmp / "half.onnx").write_bytes(b"1")
            raise RuntimeError("stage failed")
    assert os.listdir(tmp_path) == []


def test_existing_output_needs_force_and_survives_a_failed_rebuild(tmp_path):
    build = make_build(tmp_path)
    with pytest.raises(EagleExportError, match="--force"):
        with atomic_output_dir(build, BUILD_OUTPUT):
            pass
    with pytest.raises(RuntimeError):
        with atomic_output_dir(build, BUILD_OUTPUT, force=True):
            raise RuntimeError("stage failed")
    assert verify_artifacts(build, read_manifest(build)) == []  # the old build is untouched
    with atomic_output_dir(build, BUILD_OUTPUT, force=True) as tmp:
        (tmp / "new.onnx").write_bytes(b"n")
    assert os.listdir(build) == ["new.onnx"] and sorted(os.listdir(tmp_path)) == ["build"]


def test_unwritable_output_directory(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/eagle-export-build"  # even root cannot create directories in /proc
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = str(locked / "build")
    with pytest.raises(EagleExportError, match="cannot write"):
        with atomic_output_dir(target, BUILD_OUTPUT):
            pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_mid_build_leaves_no_partial_output(tmp_path, sig):
    """A real Ctrl-C (SIGINT), or SIGTERM (timeout, a container stop, a scheduler's preemption), to a
    process in the middle of a build."""
    script = textwrap.dedent(f"""
        import time, pathlib
        import signal  # a shell's background job inherits SIGINT ignored; Ctrl-C must reach Python
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from eagle_export.builder.manifest import BUILD_OUTPUT
        from eagle_export.output_dir import atomic_output_dir
        with atomic_output_dir(pathlib.Path({str(tmp_path)!r}) / "build", BUILD_OUTPUT) as tmp:
            (tmp / "target.onnx").write_bytes(b"partial")
            print("started", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0 and os.listdir(tmp_path) == []
    assert sig != signal.SIGTERM or proc.returncode == 128 + signal.SIGTERM  # as a shell reports a TERM exit


def edit_manifest(build, change, rehash=True):
    manifest = read_manifest(build)
    change(manifest)
    (build / "manifest.json").write_text(json.dumps(manifest))
    if rehash:
        write_manifest_hash(build)
    return read_manifest(build)


def test_every_file_is_listed_and_every_listed_name_stays_inside(tmp_path):
    build = make_build(tmp_path)
    (tmp_path / "outside.onnx").write_bytes(b"o" * 4321)
    (build / "tokenizer.json").write_text("{}")  # dropped in after the build
    assert verify_artifacts(build, read_manifest(build)) == ["tokenizer.json: not listed in the manifest (added "
                                                             "after the build)"]
    (build / "tokenizer.json").unlink()
    listed = read_manifest(build)["artifacts"]
    emptied = edit_manifest(build, lambda m: m.update(artifacts={}))  # verification must not turn off
    assert sorted(verify_artifacts(build, emptied)) == [
        "'drafter.onnx': the manifest runs it but does not list it as an artifact",
        "'target.onnx': the manifest runs it but does not list it as an artifact",
        "drafter.onnx: not listed in the manifest (added after the build)",
        "target.onnx: not listed in the manifest (added after the build)"]
    edit_manifest(build, lambda m: m.update(artifacts=listed))
    for name in ("../outside.onnx", str(tmp_path / "outside.onnx")):
        moved = edit_manifest(build, lambda m: m.update(graphs={"target": {"file": name}}, artifacts={
            **listed, name: {"sha256": "0" * 64, "bytes": 4321}}))
        problems = verify_artifacts(build, moved)
        assert problems == [f"{name!r}: names a file outside the build"] and "4321" not in " ".join(problems)
    unlisted = edit_manifest(build, lambda m: m.update(artifacts=listed, graphs={"target": {"file": "../outside.onnx"}}))
    assert verify_artifacts(build, unlisted) == ["'../outside.onnx': the manifest runs it but does not list it as an "
                                                 "artifact"]


def test_an_edited_manifest_is_caught_by_its_hash(tmp_path):
    build = make_build(tmp_path)
    assert (build / "manifest.sha256").is_file() and read_manifest(build)["manifest_hash"] == "manifest.sha256"
    edited = edit_manifest(build, lambda m: m["recipe"].update(depth=7), rehash=False)
    assert verify_artifacts(build, edited) == ["manifest.json: its sha256 is not the one in manifest.sha256 (edited "
                                               "after the build, or the hash file removed)"]
    (build / "manifest.sha256").unlink()
    assert len(verify_artifacts(build, edited)) == 1
    from eagle_export.builder.validate import validate_build_dir

    report = validate_build_dir(build)  # no traceback: one failed check, nothing else trusted
    assert not report["ok"] and [c["name"] for c in report["checks"]] == ["artifact hashes"]


def test_force_replaces_only_a_build_of_ours(tmp_path):
    mine = tmp_path / "p"
    mine.mkdir()
    (mine / "notes.txt").write_text("notes")
    other = tmp_path / "q"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"tool": "something-else"}))
    afile = tmp_path / "f.txt"
    afile.write_text("keep")
    for out in (mine, other, afile):
        with pytest.raises(EagleExportError, match="not a build made by eagle-export") as err:
            with atomic_output_dir(out, BUILD_OUTPUT, force=True) as tmp:
                (tmp / "x.onnx").write_bytes(b"x")
        assert "--force replaces only" in err.value.problem
    assert (mine / "notes.txt").read_text() == "notes" and (other / "manifest.json").is_file()
    assert afile.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["f.txt", "p", "q"]


def test_force_never_replaces_an_input_or_a_directory_holding_one(tmp_path):
    drafter = tmp_path / "ckpt" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    (drafter / "manifest.json").write_text(json.dumps({"tool": "eagle-export"}))  # even one that looks like ours
    for out in (drafter, drafter.parent, tmp_path):
        with pytest.raises(EagleExportError, match="an input of this build"):
            with atomic_output_dir(out, BUILD_OUTPUT, force=True, inputs=[drafter]):
                pass
    assert (drafter / "config.json").is_file()
    warnings = []
    with atomic_output_dir(drafter / "build", BUILD_OUTPUT, inputs=[drafter], warn=warnings.append) as tmp:
        (tmp / "x.onnx").write_bytes(b"x")
    assert len(warnings) == 1 and "inside the input" in warnings[0] and (drafter / "build" / "x.onnx").is_file()


def test_a_second_build_to_the_same_output_fails_and_keeps_the_first(tmp_path):
    """Two builds to one -o without --force: the one that finishes second is refused at its rename
    (no check-then-rename window), the first stays whole, and nothing partial is left."""
    with pytest.raises(EagleExportError, match="appeared while this build ran") as err:
        with atomic_output_dir(tmp_path / "build", BUILD_OUTPUT) as tmp:
            (tmp / "second.onnx").write_bytes(b"2")
            make_build(tmp_path)  # the other build finishes first
    assert "--force" in err.value.fix
    build = tmp_path / "build"
    assert verify_artifacts(build, read_manifest(build)) == [] and sorted(os.listdir(tmp_path)) == ["build"]


def test_a_killed_builds_leftovers_are_swept_safely(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".build.partial-{dead_pid}-abc"
    live = tmp_path / f".build.partial-{os.getpid()}-abc"  # a build still running
    odd = tmp_path / ".build.partial-notapid"
    other = tmp_path / f".other.partial-{dead_pid}-abc"  # another output's
    old = tmp_path / f".build.old-{dead_pid}"  # killed between its two renames: the only copy of the old build
    for d in (stale, live, odd, other, old):
        d.mkdir()
        (d / "f").write_text("x")
    assert sweep_leftovers(tmp_path / "build") == [stale]
    make_build(tmp_path)
    assert sweep_leftovers(tmp_path / "build") == [old]  # once the output exists again, the old copy may go
    assert sorted(os.listdir(tmp_path)) == sorted(["build", live.name, odd.name, other.name])


def test_a_manifest_written_before_the_typed_view_reads():
    m = Manifest.from_json(json.loads(SAMPLE_0_1_0.read_text()))
    assert (m.depth, m.sampling, m.max_context) == (4, False, 2048)
    assert m.target == BuiltModel("checkpoints/smollm2-135m-instruct", "fp32", "fp32", hidden_size=576,
                                  num_kv_heads=3, head_dim=64, num_layers=30, aux_layer_ids=(2, 15, 27), eos_token_id=2,
                                  vocab_size=49152, architecture="LlamaForCausalLM")
    assert m.drafter.source == "samples/eagle3.1-smollm2-135m" and m.drafter.num_kv_heads == 3
    assert m.drafter.num_layers == 1 and m.target.agreement is None and not m.quantized_roles
    assert m.target_graph == GraphFile("target.onnx") and m.drafter_graph == GraphFile("drafter.onnx")
    assert m.drafter_sampling_graph is None and m.skipped_passes == () and m.evaluation_prompts == ()
    assert m.engines == () and m.engines_skipped.startswith("TensorRT is not installed")
    assert m.eos_ids == (2,) and set(m.artifacts) == {"target.onnx", "drafter.onnx", "draft_to_target.npy",
                                                      "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def test_an_incomplete_manifest_is_named_with_the_fix(tmp_path):
    data = json.loads(SAMPLE_0_1_0.read_text())
    del data["models"]["target"]["head_dim"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EagleExportError, match="manifest.json is incomplete .*head_dim") as err:
        Manifest.read(tmp_path)
    assert "--force" in err.value.fix


def _rebuilt_recipe(hint: str, monkeypatch):
    """The recipe the command inside `hint` (between backticks) loads, through the command line itself."""
    import shlex

    from click.testing import CliRunner

    import eagle_export.builder.recipe as recipe_module
    from eagle_export.cli import main

    command = shlex.split(hint.split("`")[1])
    assert command[:2] == ["eagle-export", "build"]
    loaded = []

    def stop(recipe):  # the sources are not needed: the recipe as loaded is the question
        loaded.append(recipe)
        raise EagleExportError("stopped before the build")

    monkeypatch.setattr(recipe_module, "resolve_sources", stop)
    result = CliRunner().invoke(main, command[1:])
    assert "stopped before the build" in result.output, result.output
    return command, loaded[0]


def test_a_rebuild_hint_is_the_command_that_remakes_that_build(tmp_path, monkeypatch):
    """Repro: every corrupt build's fix was `eagle-export build --force`, which rebuilds builds/sample
    with the sample recipe, not the broken build. The hint's command, run through the command line,
    loads the very recipe the build was made from (overrides included) and writes to its directory;
    a hint that dropped one override would load another recipe."""
    from eagle_export.builder.manifest import rebuild_hint
    from eagle_export.builder.recipe import load_recipe

    drafter = tmp_path / "my drafter"
    overrides = {"depth": 6, "precision.target": "fp8", "calibration.num_samples": 3, "drafter": str(drafter),
                 "precision.keep_high_precision": ["lm_head"]}
    made = load_recipe(None, overrides).data
    out = tmp_path / "my build"
    hint = rebuild_hint(out, made, {"target": "/unused/sample/dir", "drafter": str(drafter)})
    command, loaded = _rebuilt_recipe(hint, monkeypatch)
    assert loaded.data == made
    assert command[-3:] == ["-o", str(out), "--force"] and "--recipe" not in command  # the sample recipe: the default
    assert "--depth" in command and "--target" not in command  # the sample target stays `sample`
    shipped = load_recipe("qwen3-8b-eagle3.1", {"target": str(tmp_path / "t"), "drafter": str(drafter)}).data
    command, loaded = _rebuilt_recipe(rebuild_hint(out, shipped, {"target": str(tmp_path / "t"),
                                                                  "drafter": str(drafter)}), monkeypatch)
    assert loaded.data == shipped and command[2:4] == ["--recipe", "qwen3-8b-eagle3.1"]


def test_a_rebuild_hint_without_a_shipped_recipe_or_a_readable_manifest(tmp_path):
    """A recipe file of the user's cannot be named from the manifest (its path is not recorded): the
    command says RECIPE and which recipe that is. A manifest that cannot be read is not one --force
    replaces (see BUILD_OUTPUT): the fix says to move the directory away."""
    from eagle_export.builder.manifest import rebuild_hint

    hint = rebuild_hint(tmp_path, {"name": "mine", "target": "/t", "drafter": "/d", "depth": 2},
                        {"target": "/t", "drafter": "/d"})
    assert f"--recipe RECIPE --target /t --drafter /d -o {tmp_path} --force`" in hint
    assert "(RECIPE: the file of recipe 'mine')" in hint
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(EagleExportError) as e:
        read_manifest(tmp_path)
    assert e.value.fix.startswith(f"move {tmp_path} away (its manifest cannot be read, so --force would not replace")
    assert not BUILD_OUTPUT[1](tmp_path)  # the reason: --force would refuse it
