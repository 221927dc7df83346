"""The package as users install it: sdist -> wheel -> a fresh virtual environment, run from an empty directory.

The release path (`python -m build` does the same): the sdist is built from a copy of the sources,
the wheel from the sdist, so both must carry the recipes and sample drafters. The wheel goes into a
new venv that reaches this environment's packages (torch and the rest) through a .pth file, and
every command runs from an empty directory, so nothing can come from the checkout. No network:
the build uses the installed setuptools (`--no-build-isolation`), the install takes no dependency.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tiny_models import write_tiny_target, write_trained_tiny_drafter

from eagle_export.builder.build import conformance_prompts
from eagle_export.builder.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "eagle_export")

pytestmark = pytest.mark.slow


def run(args, cwd, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, wheel): the wheel built from the sdist, installed into a fresh venv."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy: the build writes build/ and egg-info beside its sources

    def left_out(folder, names):
        return [n for n in names if n == "__pycache__" or Path(folder) == ROOT and n not in SOURCES]

    shutil.copytree(ROOT, src, ignore=left_out)
    run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(root / 'dist')!r})"],
        cwd=src)
    (sdist,) = (root / "dist").glob("*.tar.gz")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", root / "dist", sdist], cwd=root)
    (wheel,) = (root / "dist").glob("*.whl")

    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    # This environment's packages (torch, onnx, ...) after the venv's own: the installed eagle_export wins.
    outer = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site / "outer_environment.pth").write_text("\n".join(outer) + "\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], cwd=root)
    return venv, wheel


def test_wheel_carries_the_recipes_and_sample_drafters(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for drafter in ("eagle3-smollm2-135m", "eagle3.1-smollm2-135m"):
        assert {f"eagle_export/samples/{drafter}/config.json", f"eagle_export/samples/{drafter}/model.safetensors"} <= names
    assert "eagle_export/recipes/smollm2-135m-eagle3.1.yaml" in names
    assert "eagle_export/passes/fold_norms.py" in names
    assert wheel.stat().st_size < 60e6, f"the wheel weighs {wheel.stat().st_size / 1e6:.1f} MB"


def test_installed_command_runs_from_an_empty_directory(installed, tmp_path):
    venv, _ = installed
    cli, python = venv / "bin" / "eagle-export", venv / "bin" / "python"
    empty = tmp_path / "empty"
    empty.mkdir()
    where = run([python, "-c", "import eagle_export.builder.recipe as r; print(r.__file__); print(r.SAMPLES_DIR)"], cwd=empty)
    module, samples = where.split()
    assert module.startswith(str(venv)) and samples.startswith(str(venv)), where

    assert "Usage: eagle-export" in run([cli, "--help"], cwd=empty)
    assert "can build:" in run([cli, "doctor"], cwd=empty)
    assert "fold_fc_norm" in run([cli, "passes"], cwd=empty)
    shipped = json.loads(run([cli, "inspect", "--json", Path(samples) / "eagle3.1-smollm2-135m"], cwd=empty))
    assert shipped["kind"] == "drafter" and shipped["eagle_version"] == "3.1", shipped

    # The tiny checkpoints with no recipe: the build derives one from the pair (not the sample's).
    # The drafter is trained briefly on the prompts the build checks conventions on (a random one
    # matches no convention and is refused).
    sources = tmp_path / "sources"
    target = write_tiny_target(sources / "target", "llama")
    prompts = conformance_prompts(load_recipe(None, {"target": str(target), "drafter": str(sources / "drafter")}),
                                  target)
    drafter = write_trained_tiny_drafter(sources / "drafter", target, "3.1", prompts, aux=(1, 3, 4), draft_vocab=96)
    log = run([cli, "build", "--target", target, "--drafter", drafter, "-o", "b",
               "--set", "profiles.context.opt=64", "--set", "profiles.context.max=96"], cwd=empty)
    assert "built b:" in log, log
    manifest = json.loads((empty / "b" / "manifest.json").read_text())
    # a pair other than the sample's gets its own recipe, derived from the pair (named for its checkpoints)
    assert manifest["recipe"]["name"] == "target+drafter" and manifest["recipe"]["derived"], manifest["recipe"]
    assert manifest["validation"]["ok"]
    assert sorted(os.listdir(empty)) == ["b"]
