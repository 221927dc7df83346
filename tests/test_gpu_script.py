"""scripts/gpu_exact.sh, the one script a GPU sitting runs, checked on the CPU: a sitting is rare and
short, and a misspelled option or a wrong fallback found there costs it. The script runs for real
(bash, its arithmetic, its fallbacks) with `python3` on its PATH a stand-in that records every call
(arguments and the environment switches) and answers as told; each recorded call is then parsed by
the parser that would read it on the GPU (`eagle-export gpu-kit`'s click command and its checks,
`scripts/gpu_probe.py`'s argparse, pytest's files). Planted: a misspelled option and a test file that
is not there both fail the check; the native tests failing with PDL send every later step to
EAGLE_EXPORT_NO_PDL=1, and the reductions failing with and without it to the two-kernel path."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from eagle_export.cli import KIT_STEPS, main
from eagle_export.tools.gpu_kit import check_acceptances, check_shapes, check_steps

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_exact.sh"
SWITCHES = ("EAGLE_EXPORT_NO_PDL", "EAGLE_EXPORT_TWO_KERNEL_REDUCTIONS", "TRITON_INTERPRET")

# The stand-in python3: appends {"argv", "env"} to $FAKE_LOG, fails a pytest call whose files are all in
# $FAKE_FAIL (a space-separated list, "file:switch" failing only while the switch is unset).
FAKE = """#!{python}
import json, os, sys
switches = {switches!r}
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in switches}}}}) + "\\n")
if sys.argv[1:3] == ["-m", "pytest"]:
    files = [a for a in sys.argv[3:] if a.startswith("tests/")]
    for rule in os.environ.get("FAKE_FAIL", "").split():
        name, _, switch = rule.partition(":")
        if name in files and not (switch and os.environ.get(switch) == "1"):
            print("1 failed"); sys.exit(1)
    print("passed")
"""


def _run(tmp_path, script=SCRIPT, fail=""):
    """Run `script` with the stand-in python3; its recorded calls and its output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE.format(python=sys.executable, switches=SWITCHES))
    fake.chmod(0o755)
    log, out = tmp_path / "calls.jsonl", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(log), FAKE_FAIL=fail, OUT=str(out))
    done = subprocess.run(["bash", str(script), "400"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


@functools.lru_cache(maxsize=None)
def _probe_parser():
    spec = importlib.util.spec_from_file_location("gpu_probe_for_test", ROOT / "scripts" / "gpu_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parser()


def _check(argv: list[str]) -> str:
    """Parse one recorded call as the GPU machine would; what it runs, in a word."""
    if argv[0] == "-c":
        return "check"
    if argv[:2] == ["-m", "pytest"]:
        files = [a for a in argv[2:] if a.startswith("tests/")]
        assert files and all((ROOT / f).is_file() for f in files), f"pytest of missing files: {argv}"
        return "pytest"
    if argv[:3] == ["-m", "eagle_export.cli", "gpu-kit"]:
        command = main.get_command(click.Context(main), "gpu-kit")
        with command.make_context("gpu-kit", list(argv[3:])) as ctx:  # unknown options, bad types: click.UsageError
            params = ctx.params
        check_shapes(params["shapes"])
        check_steps(params["steps"], KIT_STEPS)
        if params["sweep_values"]:
            check_acceptances(params["sweep_values"])
        assert params["budget_s"] > 0, argv
        return "gpu-kit"
    if argv[0] == "scripts/gpu_probe.py":
        args = _probe_parser().parse_args(argv[1:])
        assert args.budget_s > 0, argv
        return f"probe {args.what}"
    raise AssertionError(f"a python3 call the check does not know: {argv}")


def test_every_call_of_the_gpu_script_parses_on_the_gpu(tmp_path):
    done, calls = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    ran = [_check(call["argv"]) for call in calls]
    assert ran.count("gpu-kit") == 2 and ran.count("pytest") == 3, ran
    assert [r for r in ran if r.startswith("probe")] == ["probe pdl", "probe reduction", "probe linear",
                                                         "probe attention"], ran
    assert all(call["env"]["TRITON_INTERPRET"] == "0" for call in calls)
    assert not any(call["env"]["EAGLE_EXPORT_NO_PDL"] for call in calls)
    assert "done after" in done.stdout


def test_a_misspelled_option_or_a_missing_test_file_fails_the_check(tmp_path):
    """Planted: the script as it would be with three typos (one run); the check refuses each of those calls."""
    text = SCRIPT.read_text()
    planted = tmp_path / "scripts" / "gpu_exact.sh"
    planted.parent.mkdir()
    for wrong, right in (("--new-tokens 16", "--new-token 16"), ("py reduction --budget-s", "py reductions --budget-s"),
                         ("tests/test_kernels.py", "tests/test_kernel.py")):
        assert wrong in text
        text = text.replace(wrong, right)
    planted.write_text(text)
    _, calls = _run(tmp_path, planted)
    refused = []
    for call in calls:
        try:
            _check(call["argv"])
        except (click.UsageError, SystemExit, AssertionError):
            refused.append(call["argv"])
    assert len(refused) == 3, refused
    assert {"--new-token", "reductions", "tests/test_kernel.py"} <= {a for argv in refused for a in argv}


@pytest.mark.parametrize(("fail", "no_pdl", "two_kernel"), [
    ("tests/test_kernels.py:EAGLE_EXPORT_NO_PDL", "1", None),
    ("tests/test_kernel_reductions.py", None, "1"),
], ids=["PDL at fault", "reductions at fault"])
def test_the_gpu_script_falls_back_on_what_failed(tmp_path, fail, no_pdl, two_kernel):
    done, calls = _run(tmp_path, fail=fail)
    assert done.returncode == 0, done.stderr
    later = [c for c in calls if c["argv"][:1] != ["-c"] and c["argv"][:2] != ["-m", "pytest"]]
    assert later and all(c["env"]["EAGLE_EXPORT_NO_PDL"] == no_pdl for c in later), [c["env"] for c in later]
    assert all(c["env"]["EAGLE_EXPORT_TWO_KERNEL_REDUCTIONS"] == two_kernel for c in later)
    said = done.stdout
    assert ("PDL FAILED" in said) == (no_pdl == "1") and ("FUSED REDUCTIONS FAILED" in said) == (two_kernel == "1")
