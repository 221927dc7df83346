"""One integrity gate (`check_build`) for every command that reads a build: an edited manifest or
artifact is refused by each exactly as `run` refuses it, and a source checkpoint changed since the
build is refused by each command that reads it unless told to proceed (then said in one line).
The builds here are small stand-ins (the gate refuses before any model loads); the source case
exports a real tiny drafter."""

import json

import pytest
from click.testing import CliRunner
from test_manifest import SAMPLE_0_1_0, make_build
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.builder.manifest import (
    BUILD_OUTPUT,
    BuildMismatch,
    Manifest,
    check_build,
    read_manifest,
    source_hashes,
    write_manifest,
)
from eagle_export.cli import main
from eagle_export.output_dir import atomic_output_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Every command of the CLI is in exactly one of these two. A command that reads a build: its
# arguments, with {build} and {tmp} filled in, that reach the gate (they are otherwise valid).
READS_BUILD = {
    "run": ["{build}", "--prompt", "hello"],
    "validate": ["{build}"],
    "bench": ["{build}"],
    "inspect": ["{build}"],
    "diagnose": ["{build}"],
    "export-checkpoint": ["{build}", "-o", "{tmp}/out"],
    "selftest": ["--build", "{build}", "--report", "{tmp}/r.json"],
}
TAKES_NO_BUILD = {"build", "doctor", "export", "gpu-kit", "passes", "quantize", "sample-target", "train-drafter"}
# Where validate differs: it reports the mismatch as its failed first check (exit 1), not a refusal.
REPORTS = {"validate"}


def invoke(command, build, tmp_path, *more):
    args = [a.format(build=build, tmp=tmp_path) for a in READS_BUILD[command]]
    return CliRunner().invoke(main, [command, *args, *more])


def test_every_command_is_declared_as_reading_a_build_or_not():
    """A command added to the CLI fails here until it is declared: a reader of builds must then pass
    the gate tests below (its arguments in READS_BUILD), the others must take no build-like path."""
    commands = set(main.commands)
    assert READS_BUILD.keys() | TAKES_NO_BUILD == commands, (
        f"undeclared commands: {sorted(commands - READS_BUILD.keys() - TAKES_NO_BUILD)}; stale: "
        f"{sorted((READS_BUILD.keys() | TAKES_NO_BUILD) - commands)}")
    assert not READS_BUILD.keys() & TAKES_NO_BUILD
    for name in TAKES_NO_BUILD:
        for param in main.commands[name].params:
            assert "build" not in param.name or param.name == "build_dir" and name == "build", (name, param.name)
            assert "source" not in param.name, (name, param.name)


def edited_manifest(build):
    data = json.loads((build / "manifest.json").read_text())
    data["sources"]["drafter"] = "/somewhere/else"  # a hand edit that would redirect a reader
    (build / "manifest.json").write_text(json.dumps(data))


def rewritten_artifact(build):
    path = build / "drafter.onnx"
    path.write_bytes(b"z" * path.stat().st_size)  # same size: only the hash tells


@pytest.mark.parametrize("tamper", [edited_manifest, rewritten_artifact])
def test_every_reader_refuses_an_edited_build_exactly_as_run_does(tmp_path, tamper):
    build = make_build(tmp_path)
    tamper(build)
    with pytest.raises(Exception) as gate:
        check_build(build)
    message = gate.value.problem
    assert "does not match its manifest" in message
    run = invoke("run", build, tmp_path)
    assert run.exit_code == 2 and f"error: {message}" in run.output, run.output
    for command in READS_BUILD:
        result = invoke(command, build, tmp_path)
        if command in REPORTS:
            assert result.exit_code == 1 and message.split(": ", 1)[1] in result.output, (command, result.output)
        else:
            assert result.exit_code == 2, (command, result.output)
            assert result.output == run.output, command  # the same refusal, word for word
        assert not (tmp_path / "out").exists() and not (tmp_path / "r.json").exists()


@pytest.fixture(scope="module")
def sourced(tmp_path_factory):
    """A stand-in build of a real tiny pair: its manifest names the checkpoints and their hashes."""
    root = tmp_path_factory.mktemp("sourced")
    target = write_tiny_target(root / "target", "llama")
    drafter = write_tiny_drafter(root / "drafter", "3.1")
    data = json.loads(SAMPLE_0_1_0.read_text())
    data["sources"] = {"target": str(target), "drafter": str(drafter)}
    data["source_files"] = {"target": source_hashes(target), "drafter": source_hashes(drafter)}
    data["recipe"]["calibration"]["num_samples"] = 2
    data["models"]["drafter"]["precision"] = "fp32"
    with atomic_output_dir(root / "build", BUILD_OUTPUT) as tmp:
        (tmp / "target.onnx").write_bytes(b"x" * 100)
        (tmp / "drafter.onnx").write_bytes(b"y" * 100)
        write_manifest(tmp, Manifest.from_json(data))
    return root / "build", drafter


def test_a_changed_source_is_refused_unless_told_then_said(sourced, tmp_path):
    build, drafter = sourced
    assert check_build(build, sources=True).drafter.source == str(drafter)  # unchanged: passes
    config = drafter / "config.json"
    original = config.read_text()
    try:
        config.write_text(original.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 2e-05'))
        for command, more in (("export-checkpoint", ()), ("diagnose", ("--num-prompts", "1"))):
            result = invoke(command, build, tmp_path, *more)
            assert result.exit_code == 2, (command, result.output)
            assert (f"error: {command} reads the checkpoints the build was made from, and they are not the build's: "
                    f"the drafter checkpoint {drafter} changed since the build: config.json (modified)") in result.output
            assert "--allow-changed-sources" in result.output and not (tmp_path / "out").exists()
        told = invoke("export-checkpoint", build, tmp_path, "--allow-changed-sources")
        assert told.exit_code == 0, told.output
        notes = [line for line in told.output.splitlines() if "--allow-changed-sources" in line]
        assert len(notes) == 1 and notes[0].startswith("note: --allow-changed-sources: reading the checkpoints as "
                                                       "they are now") and "config.json (modified)" in notes[0]
        exported = json.loads((tmp_path / "out" / "config.json").read_text())
        assert exported["rms_norm_eps"] == 2e-05  # the drafter as it is now, as the note said
    finally:
        config.write_text(original)


def test_the_gate_is_the_only_reader_of_a_builds_manifest():
    """No module outside the gate turns a build's manifest.json into fields: a new reader that did
    would skip the hashes (`Manifest.read` and `read_manifest` are the gate's raw parts)."""
    from pathlib import Path

    import eagle_export

    root = Path(eagle_export.__file__).parent
    readers = {p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if "Manifest.read(" in p.read_text() or "read_manifest(" in p.read_text()}
    # build_dir: only the build's own writer opens it unverified (verify=False), right after writing it.
    assert readers == {"builder/manifest.py", "builder/build_dir.py"}
    assert read_manifest  # (imported: the raw part named above)


def test_every_artifact_rewritten_in_place_is_named(tmp_path):
    """Each artifact in turn (the graphs, the vocabulary map, the tokenizer, one in a folder) gets one
    byte changed, its size kept: the hash alone must tell, whichever file it is."""
    with atomic_output_dir(tmp_path / "build", BUILD_OUTPUT) as tmp:
        for name, size in (("target.onnx", 1000), ("drafter.onnx", 500), ("draft_to_target.npy", 64),
                           ("tokenizer.json", 30), ("engines/target.plan", 40)):
            (tmp / name).parent.mkdir(exist_ok=True)
            (tmp / name).write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
        write_manifest(tmp, Manifest.from_json(json.loads(SAMPLE_0_1_0.read_text())))
    build = tmp_path / "build"
    names = sorted(read_manifest(build)["artifacts"])
    assert len(names) == 5
    for name in names:
        original = (build / name).read_bytes()
        (build / name).write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(BuildMismatch) as err:
            check_build(build)
        assert err.value.problems == [f"{name}: sha256 differs from the manifest (modified)"]
        (build / name).write_bytes(original)
    assert check_build(build).artifacts.keys() == set(names)
