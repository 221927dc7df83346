"""Manifest hashes and the atomic build directory."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from eagle_export.errors import EagleExportError
from eagle_export.manifest import atomic_build_dir, read_manifest, verify_artifacts, write_manifest


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
