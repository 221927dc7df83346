"""Manifest hashes and the atomic build directory."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle_export.errors import EagleExportError
from eagle_export.manifest import (BuiltModel, GraphFile, Manifest, atomic_build_dir, read_manifest, verify_artifacts,
                                   write_manifest)

# The sample build's manifest.json as eagle-export 0.1.0 wrote it before the typed view (its two
# checkpoint paths anonymized): an existing build must still open.
SAMPLE_0_1_0 = Path(__file__).parent / "data" / "manifest_0.1.0_sample.json"


def make_build(root):
    with atomic_build_dir(root / "build") as tmp:
        (tmp / "target.onnx").write_bytes(b"x" * 1000)
        (tmp / "drafter.onnx").write_bytes(b"y" * 500)
        write_manifest(tmp, {"recipe": {"depth": 4}})
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


def test_not_a_build_and_corrupt_manifest(tmp_path):
    with pytest.raises(EagleExportError, match="not a build directory"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{oops")
    with pytest.raises(EagleExportError, match="corrupt"):
        read_manifest(tmp_path)


def test_failure_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_build_dir(tmp_path / "build") as tmp:
            (tmp / "half.onnx").write_bytes(b"1")
            raise RuntimeError("stage failed")
    assert os.listdir(tmp_path) == []


def test_existing_output_needs_force_and_survives_a_failed_rebuild(tmp_path):
    build = make_build(tmp_path)
    with pytest.raises(EagleExportError, match="--force"):
        with atomic_build_dir(build):
            pass
    with pytest.raises(RuntimeError):
        with atomic_build_dir(build, force=True):
            raise RuntimeError("stage failed")
    assert verify_artifacts(build, read_manifest(build)) == []  # the old build is untouched
    with atomic_build_dir(build, force=True) as tmp:
        (tmp / "new.onnx").write_bytes(b"n")
    assert os.listdir(build) == ["new.onnx"] and sorted(os.listdir(tmp_path)) == ["build"]


def test_unwritable_output_directory(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/eagle-export-build"  # even root cannot create directories in /proc
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        target = str(locked / "build")
    with pytest.raises(EagleExportError, match="cannot write the build"):
        with atomic_build_dir(target):
            pass


def test_interrupt_mid_build_leaves_no_partial_output(tmp_path):
    """A real SIGINT (Ctrl-C) to a process in the middle of a build."""
    script = textwrap.dedent(f"""
        import time, pathlib
        import signal  # a shell's background job inherits SIGINT ignored; Ctrl-C must reach Python
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from eagle_export.manifest import atomic_build_dir
        with atomic_build_dir(pathlib.Path({str(tmp_path)!r}) / "build") as tmp:
            (tmp / "target.onnx").write_bytes(b"partial")
            print("started", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode != 0 and os.listdir(tmp_path) == []


def test_a_manifest_written_before_the_typed_view_reads():
    m = Manifest.from_json(json.loads(SAMPLE_0_1_0.read_text()))
    assert (m.depth, m.sampling, m.max_context) == (4, False, 2048)
    assert m.target == BuiltModel("checkpoints/smollm2-135m-instruct", "fp32", "fp32", hidden_size=576,
                                  num_kv_heads=3, head_dim=64, num_layers=30, aux_layer_ids=(2, 15, 27), eos_token_id=2)
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
