"""The command line: --help on every command, --version, inspect's report."""

import json

import click
import pytest
from click.testing import CliRunner
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export import __version__
from eagle_export.cli import main


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_python_dash_m_runs_the_command_line():
    """Repro: `python -m eagle_export.cli --version` imported the module and exited 0 with no output."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "eagle_export.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout == f"eagle-export, version {__version__}\n", out


def test_help_on_every_command():
    runner = CliRunner()
    assert runner.invoke(main, ["--help"]).exit_code == 0
    for name in main.commands:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return write_tiny_target(root / "target", "smollm2"), write_tiny_drafter(root / "drafter", "3.1")


def test_inspect_target_json(pair):
    result = CliRunner().invoke(main, ["inspect", str(pair[0]), "--json"])
    report = json.loads(result.output)
    assert report["kind"] == "target" and report["architecture"] == "LlamaForCausalLM"
    assert (report["num_layers"], report["hidden_size"], report["vocab_size"]) == (6, 64, 320)
    # tied embeddings are counted once: embed 320*64, 6 layers, final norm
    per_layer = (64 * 64 * 2 + 64 * 32 * 2) + 3 * 64 * 128 + 2 * 64  # q,o + k,v (2 kv heads); mlp; norms
    assert report["num_parameters"] == 320 * 64 + 6 * per_layer + 64
    assert report["warnings"] == []


def test_inspect_drafter_json(pair):
    result = CliRunner().invoke(main, ["inspect", str(pair[1]), "--json", "--target", str(pair[0])])
    report = json.loads(result.output)
    assert report["kind"] == "drafter" and report["eagle_version"] == "3.1"
    assert report["eagle_version_keys"] == {"fc_norm": True, "norm_output": True}
    assert report["aux_layer_ids"] == [1, 3, 4] and report["layer_numbering"] == "vllm"
    assert (report["draft_vocab_size"], report["target_hidden_size"]) == (96, 64)
    assert report["warnings"] == []


def test_inspect_warns_about_a_misfit(tmp_path, pair):
    drafter = write_tiny_drafter(tmp_path / "d", "3", aux=(1, 3, 11), target_hidden=96)
    report = json.loads(CliRunner().invoke(main, ["inspect", str(drafter), "--json", "--target",
                                                  str(pair[0])]).output)
    text = " ".join(report["warnings"])
    assert "[11] lie beyond the target's 6 layers" in text
    assert "expects target hidden size 96" in text


HEAVY = ("torch", "onnx", "onnx_ir", "modelopt", "transformers")
LIGHT_PROBE = """
import sys
from eagle_export.cli import main
try:
    main(sys.argv[1:], prog_name="eagle-export")
except SystemExit:
    pass
print("heavy:", sorted(m for m in {heavy!r} if m in sys.modules))
"""


def light_command_imports(args, env=None) -> list[str]:
    """The heavy libraries a fresh interpreter has imported after running `eagle-export ARGS`."""
    import os
    import subprocess
    import sys

    probe = LIGHT_PROBE.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    return out.stdout.splitlines()[-1]


@pytest.mark.parametrize("args", [
    ["--help"], ["run", "--help"], ["run", "some-build"], ["run", "some-build", "--prompt", "a", "--chat", "b"],
    ["build", "--recipe", "no-such-recipe.yaml"], ["build", "--recipe", "llama-3.1-8b-eagle3"],
    ["validate", "--help"], ["doctor"], ["selftest", "--gpu"],
    ["selftest"], ["inspect", "--help"],
    # usage errors (they took 2-5 s, importing torch first): a missing build, a bad setting, a missing prompt file
    ["validate", "builds/nope"], ["inspect", "builds/nope"], ["run", "builds/nope", "--prompt", "a"],
    ["run", "builds/nope", "--prompt", "a", "--max-new-tokens", "-3"], ["run", "builds/nope", "--chat", "a",
                                                                        "--temperature", "nan"],
    ["bench", "builds/nope"], ["bench", "builds/nope", "--dataset", "missing.txt"],
    ["bench", "builds/nope", "--max-new-tokens", "0"],
    ["diagnose", "builds/nope", "--dataset", "missing.txt"], ["build", "--depth", "12"],
    ["build", "--set", "precision.target=fp9"]])
def test_commands_that_need_no_model_import_no_heavy_library(args):
    """torch alone takes 1-2 s to import on an idle 2-core machine and 5-10 s under load: usage errors,
    help, doctor and selftest without a GPU must answer without it (on this CPU-only machine)."""
    from eagle_export.environment import nvidia_driver_loaded

    if nvidia_driver_loaded() and args[0] in ("doctor", "selftest"):
        pytest.skip("a GPU machine: doctor and selftest probe the GPU through torch there")
    assert light_command_imports(args) == "heavy: []"


def test_usage_errors_are_checked_before_the_build_is_opened(tmp_path):
    """A bad setting is said even for a real build directory (an empty manifest would not open): the
    checks run before the build is read, so they cannot wait on torch."""
    (tmp_path / "manifest.json").write_text("{}")
    for args, problem in ((["run", str(tmp_path), "--prompt", "a", "--max-new-tokens", "-3"], "max_new_tokens is -3"),
                          (["bench", str(tmp_path), "--dataset", "missing.txt"], "prompt file missing.txt not found")):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and f"error: {problem}" in result.output, result.output


def test_inspect_of_a_missing_path_names_builds_too(tmp_path):
    """Repro: `inspect builds/nope` said "pass a Hugging Face checkpoint directory", forgetting that
    inspect reads builds too (and `run builds/nope` names builds)."""
    for path, what in ((tmp_path / "nope", "does not exist"), (tmp_path, "holds neither manifest.json (a build) nor "
                                                                          "config.json (a checkpoint)")):
        result = CliRunner().invoke(main, ["inspect", str(path)])
        assert result.exit_code == 2 and f"error: {path} {what}" in result.output
        assert "a build directory (made by `eagle-export build`) or a checkpoint directory" in result.output


def test_ctrl_c_prints_one_line_and_exits_130(monkeypatch):
    """Repro: Ctrl-C printed click's bare "Aborted!" and exited 1; a shell reports 128 + SIGINT."""
    from eagle_export.tools import doctor

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(doctor, "doctor_report", interrupted)
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 130 and result.output == "interrupted (Ctrl-C)\n"


def test_sigint_to_a_running_command_exits_130():
    """The same through a real SIGINT to a process: Python turns it into KeyboardInterrupt wherever the
    command is (here: asleep inside `doctor`)."""
    import signal
    import subprocess
    import sys

    probe = ("import signal, sys, time\nfrom eagle_export.tools import doctor\n"
             # a shell's background job inherits SIGINT ignored (Python then installs no handler): as a terminal's
             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "def report():\n    print('ready', flush=True)\n    time.sleep(60)\n"
             "doctor.doctor_report = report\nfrom eagle_export.cli import main\nmain(['doctor'])\n")
    process = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err == "interrupted (Ctrl-C)\n" and "Aborted" not in out + err


@pytest.mark.parametrize("args, problem", [
    (["--depth", "12"], "--depth 12: depth: 12 must be between 1 and 8"),
    (["--set", "depth=12"], "--set depth=12: depth: 12 must be between 1 and 8"),
    (["--set", "precision.target=fp9"], "--set precision.target='fp9': precision.target: 'fp9' must be one of"),
    (["--set", "depth.x=1"], "--set depth.x: depth is a value, not a section of keys")])
def test_a_flags_error_names_the_flag_first_as_it_was_typed(args, problem):
    """Repro: `build --depth 12` said "recipe .../eagle_export/recipes/smollm2-135m-eagle3.1.yaml is
    invalid: --set depth=12: ...": the package's recipe path first, and a flag the user did not type."""
    result = CliRunner().invoke(main, ["build", *args])
    assert result.exit_code == 2 and result.output.startswith(f"error: {problem}"), result.output
    assert "recipes/smollm2" not in result.output.splitlines()[0]


def test_the_light_import_probe_sees_a_heavy_import():
    """The probe above could pass by never looking: a command that does load the models is seen."""
    assert "torch" in light_command_imports(["passes"])


@pytest.mark.parametrize("mine", [None, "ACTIVE"])
def test_the_command_line_has_torchs_idle_threads_wait_passively_before_torch_loads(mine):
    """torch's OpenMP workers spinning after a parallel region took the cores ONNX Runtime's calls
    needed: the command line chooses passive waiting before anything imports torch (libgomp reads the
    setting once, when torch loads it), and a user's own choice stands."""
    import os
    import subprocess
    import sys

    probe = ("import os, sys; import eagle_export.cli; "
             "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if mine is not None:
        env["OMP_WAIT_POLICY"] = mine
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.split() == ["False", mine or "PASSIVE"], out.stderr


def test_every_option_of_every_command_says_what_it_does():
    for name, command in main.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.help, f"{name} {param.opts[-1]} has no help text"


def test_selftest_without_gpu_flag_runs_the_only_suite(tmp_path):
    result = CliRunner().invoke(main, ["selftest", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "no CUDA GPU" in result.output or (tmp_path / "r.json").exists()


def test_a_shipped_recipe_whose_checkpoint_is_missing_points_to_build_target(tmp_path):
    """The fix names --target (a shipped recipe lives inside the installed package: not a file to edit)."""
    result = CliRunner().invoke(main, ["build", "--recipe", "llama-3.1-8b-eagle3", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "target checkpoints/Llama-3.1-8B-Instruct is not a directory" in result.output
    assert "eagle-export build --target DIR" in result.output and "Traceback" not in result.output
