"""Every output path of every command (--json, --report, --plot, -o) is checked as the command line is
read, before any work: a directory in a file's place, a file in a directory's place or above it, and a
place this user cannot write are refused; a missing parent is made when the output is written. The
options are walked from the click group, so a new one is covered (or this test names it)."""

import os

import click
import pytest
from click.testing import CliRunner
from hostile import unprivileged, world_dir

from eagle_export.cli import main, output_directory, output_file
from eagle_export.errors import EagleExportError
from eagle_export.output_dir import output_file as check_output_file
from eagle_export.output_dir import write_output

# Path options that name what a command reads; every other path option is an output and must be checked.
INPUT_PATHS = {("inspect", "target"), ("build", "recipe"), ("diagnose", "target"), ("export", "target_dir"),
               ("export", "drafter_dir"), ("quantize", "target_dir"), ("quantize", "drafter_dir"),
               ("export-checkpoint", "target"), ("selftest", "build_dir"), ("train-drafter", "target")}
CHECKS = (output_file, output_directory)


def path_options():
    for name, command in sorted(main.commands.items()):
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, click.Path):
                yield name, param


OUTPUTS = [(name, param.opts[-1], param.callback is output_file) for name, param in path_options()
           if (name, param.name) not in INPUT_PATHS]


def test_every_path_option_is_a_declared_input_or_a_checked_output():
    seen = set()
    for name, param in path_options():
        seen.add((name, param.name))
        if (name, param.name) in INPUT_PATHS:
            assert param.callback not in CHECKS, (name, param.opts)
        else:
            assert param.callback in CHECKS, f"{name} {'/'.join(param.opts)}: an output path without its check"
    assert INPUT_PATHS <= seen, f"stale: {INPUT_PATHS - seen}"
    # the ones the issue names, at least
    assert {(n, o) for n, o, _ in OUTPUTS} >= {("bench", "--json"), ("bench", "--plot"), ("diagnose", "--json"),
                                              ("diagnose", "--plot"), ("selftest", "--report"), ("build", "--out"),
                                              ("export-checkpoint", "--out"), ("quantize", "--json")}


def refused(command, option, value):
    """Only the option is passed: a refusal before click even asks for the command's required
    arguments shows the check runs as the line is read, before any work."""
    result = CliRunner().invoke(main, [command, option, str(value)])
    assert result.exit_code == 2 and "internal error" not in result.output, result.output
    return result.output


@pytest.mark.parametrize("command,option,is_file", OUTPUTS)
def test_each_output_is_checked_before_any_work(tmp_path, command, option, is_file):
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "adir").mkdir()
    out = refused(command, option, tmp_path / "afile" / "x")
    assert "afile is a file, not a directory" in out and "fix: " in out
    if is_file:
        assert "adir is a directory: the output file cannot replace it" in refused(command, option, tmp_path / "adir")
    else:
        assert "afile is a file: the output directory cannot go in its place" in refused(command, option,
                                                                                        tmp_path / "afile")
    with world_dir() as root:
        locked = root / "locked"
        locked.mkdir(mode=0o555)
        with unprivileged():
            out = refused(command, option, locked / "new" / "x.json")
        assert f"cannot write the output {locked}/new/x.json in {locked}" in out
    assert (tmp_path / "afile").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["adir", "afile"]
    assert not os.listdir(tmp_path / "adir")


def test_a_missing_parent_is_made_when_the_output_is_written(tmp_path):
    path = tmp_path / "new" / "deeper" / "x.json"
    assert check_output_file(path) == path and not (tmp_path / "new").exists()  # checked, nothing made yet
    write_output(path, "{}\n")
    assert path.read_text() == "{}\n"
    with world_dir() as root:
        (root / "ro.json").write_text("old")
        (root / "ro.json").chmod(0o444)
        with unprivileged(), pytest.raises(EagleExportError, match="permission denied"):
            check_output_file(root / "ro.json")
        assert (root / "ro.json").read_text() == "old"


def half_then_full_disk(path, data):
    """A write that stops half way with the disk full (what ENOSPC, a quota or a kill mid-write leave)."""
    import errno

    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def test_an_output_file_that_fails_mid_write_leaves_the_users_earlier_file_whole(tmp_path, monkeypatch):
    """--json, --report: written beside and renamed. (Written in place, a full disk cut the user's
    earlier report in half.)"""
    from pathlib import Path

    path = tmp_path / "report.json"
    path.write_text('{"mine": 1}\n')
    monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: half_then_full_disk(self, text.encode()))
    with pytest.raises(EagleExportError, match="no space left") as refused:
        write_output(path, '{"new": "a report much longer than the one it replaces"}\n')
    assert f"holding {path} (" in refused.value.problem  # the file asked for, not the one written beside it
    monkeypatch.undo()
    assert path.read_text() == '{"mine": 1}\n' and os.listdir(tmp_path) == ["report.json"]


def test_a_plot_that_fails_mid_write_leaves_the_users_earlier_file_whole(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    from matplotlib.figure import Figure

    from eagle_export.tools.bench import plot_sweep

    policies = {p: {"decode_speedup": 1.1, "model_speedup": 1.2} for p in ("goodput", "fixed")}
    results = [{"backend": "onnxruntime", "device": "CPU", "batch": 1, "builds": {"b": {
        "speculation": "chain K=3", "break_even_acceptance": 0.4,
        "sweep": [{"acceptance": "0", "policies": policies}, {"acceptance": "0.9", "policies": policies}]}}}]
    path = tmp_path / "sweep.png"
    plot_sweep(results, path)
    mine = path.read_bytes()
    assert mine[:4] == b"\x89PNG"
    monkeypatch.setattr(Figure, "savefig", lambda self, target, **kw: half_then_full_disk(target, mine))
    with pytest.raises(EagleExportError, match="no space left"):
        plot_sweep(results, path)
    assert path.read_bytes() == mine and os.listdir(tmp_path) == ["sweep.png"]


@pytest.mark.parametrize("command", [["bench", "BUILD"], ["diagnose", "BUILD"], ["gpu-kit", "--shapes", "tiny"]])
def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused_before_any_work(tmp_path, monkeypatch, command):
    """(`bench --plot results.txt` measured for minutes, then ended in an internal error.)"""
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, [*command, "--plot", "results.txt"])
    assert result.exit_code == 2 and "internal error" not in result.output, result.output
    assert "--plot results.txt: matplotlib cannot write a .txt file" in result.output
    assert "fix: name the plot with one of the suffixes" in result.output and "png" in result.output
    assert os.listdir(tmp_path) == []  # no report, no model run


@pytest.mark.parametrize("command", [["gpu-kit", "--shapes", "tiny"], ["selftest"]])
def test_an_empty_report_name_is_refused_before_any_work(tmp_path, monkeypatch, command):
    """(`gpu-kit --report ''` made the pair, then failed writing the report to the current directory.)"""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, [*command, "--report", ""])
    assert result.exit_code == 2 and "--report '' names no file" in result.output, result.output
    assert "fix: pass a file name, e.g. --report " in result.output and os.listdir(tmp_path) == []
    assert "pair:" not in result.output
