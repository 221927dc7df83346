"""Generated, not listed: every command, each of its path-like arguments, every hostile file state.

For each (command, path) below and each state of hostile.STATES that fits the path (a file or a
directory), a fresh copy of tiny fixtures is put in that state and the command runs as a user that
mode 000 stops. Each run must be refused cleanly: exit 2 with an `error:` line and a `fix:` line
(`validate` may instead report a failed check, exit 1, naming the file), no traceback, no "internal
error", and no file written or changed outside the command's own output.
"""

import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hostile import STATES, share, snapshot, unprivileged, world_dir
from tiny_models import write_tiny_target, write_trained_tiny_drafter

from eagle_export.builder.build import conformance_prompts
from eagle_export.builder.recipe import load_recipe
from eagle_export.cli import main

RECIPE = """\
target: target
drafter: drafter
depth: 2
precision: {target: fp32, drafter: fp32}
profiles:
  batch: {min: 1, opt: 1, max: 2}
  context: {min: 16, opt: 32, max: 64}
"""
BUILD_FILES = ("build", "build/manifest.json", "build/manifest.sha256", "build/target.onnx", "build/drafter.onnx",
               "build/draft_to_target.npy", "build/tokenizer.json")
TARGET_FILES = ("target", "target/config.json", "target/model.safetensors", "target/tokenizer.json")
DRAFTER_FILES = ("drafter", "drafter/config.json", "drafter/model.safetensors")
RUN = ("--prompt", "w5 w6", "--max-new-tokens", "3", "--backend", "onnxruntime")
# command -> (its arguments, with {name} a fixture path; the paths it reads, relative to the fixtures)
COMMANDS = {
    "inspect": (["inspect", "{target}"], TARGET_FILES[:3]),
    "inspect --target": (["inspect", "{drafter}", "--target", "{target}"], DRAFTER_FILES + TARGET_FILES[:2]),
    "inspect build": (["inspect", "{build}"], BUILD_FILES[:2]),
    "validate": (["validate", "{build}"], BUILD_FILES),
    "run": (["run", "{build}", *RUN], BUILD_FILES),
    "bench": (["bench", "{build}", "--dataset", "{prompts.txt}", "--num-prompts", "1", "--max-new-tokens", "2",
               "--backend", "onnxruntime"], ("prompts.txt",)),
    "build": (["build", "--recipe", "{recipe.yaml}", "-o", "{out}"], ("recipe.yaml",) + TARGET_FILES + DRAFTER_FILES),
    "export": (["export", "--target", "{target}", "--draft", "{drafter}", "--depth", "2", "-o", "{out}"],
               TARGET_FILES[:3] + DRAFTER_FILES),
    "export-checkpoint": (["export-checkpoint", "{drafter}", "--target", "{target}", "--precision", "fp32",
                           "-o", "{out}"], DRAFTER_FILES + TARGET_FILES[:3]),
    "export-checkpoint build": (["export-checkpoint", "{build}", "--precision", "fp32", "-o", "{out}"],
                                BUILD_FILES[:2]),
}
DIR_STATES = ("missing", "mode 000", "file for directory", "symlink loop", "empty", "truncated", "wrong type inside")
FILE_STATES = tuple(s for s in STATES if s != "file for directory")
# An output whose parent is in a hostile state (the output itself must be created).
OUTPUT_STATES = ("mode 000", "file for directory", "symlink loop")


@pytest.fixture(scope="module")
def pristine(one_torch_thread):
    """Tiny checkpoints, a recipe, a prompt file and a build of them, readable by any user (a drafter
    trained just enough to match its conventions: the build refuses one that matches none)."""
    with world_dir() as root:
        target = write_tiny_target(root / "target", "llama")
        (root / "recipe.yaml").write_text(RECIPE)
        prompts = conformance_prompts(load_recipe(root / "recipe.yaml"), target)
        write_trained_tiny_drafter(root / "drafter", target, "3.1", prompts, aux=(1, 3, 4), draft_vocab=96, steps=40)
        (root / "prompts.txt").write_text("w5 w6 w7\nw9 w10\n")
        result = CliRunner().invoke(main, ["build", "--recipe", str(root / "recipe.yaml"), "-o", str(root / "build")])
        assert result.exit_code == 0, result.output
        share(root)
        yield root


# States that leave a valid input: a prompt file cut between lines still holds prompts.
VALID = {("bench", "prompts.txt", "truncated")}


def cases():
    for command, (_, paths) in COMMANDS.items():
        for path in paths:
            is_dir = "/" not in path and "." not in path
            for state in DIR_STATES if is_dir else FILE_STATES:
                if (command, path, state) not in VALID:
                    yield command, path, state
        if "{out}" in COMMANDS[command][0]:
            for state in OUTPUT_STATES:
                yield command, "out parent", state


def run_case(pristine: Path, case: Path, command: str, path: str, state: str):
    """Copy the fixtures to `case`, put `path` in `state`, run `command` unprivileged; (result, changed)."""
    shutil.copytree(pristine, case, symlinks=True)
    (case / "build" / "costs.json").unlink(missing_ok=True)
    out = case / "outparent" / "out"
    if path == "out parent":
        (case / "outparent").mkdir()
        STATES[state](case / "outparent")
    else:
        (case / "outparent").mkdir()
        STATES[state](case / path)
    share_except(case, case / ("outparent" if path == "out parent" else path), state)
    names = {"{out}": out, **{f"{{{name}}}": case / name for name in ("target", "drafter", "build", "recipe.yaml",
                                                                      "prompts.txt")}}
    args = [str(names.get(a, a)) for a in COMMANDS[command][0]]
    before = snapshot(case)
    with unprivileged():
        result = CliRunner().invoke(main, args)
    share(case)
    after = snapshot(case)
    changed = sorted(name for name in before.keys() | after.keys()
                     if before.get(name) != after.get(name) and not name.startswith("outparent"))
    return result, changed


def share_except(root: Path, hostile: Path, state: str) -> None:
    """Everything readable by any user, except the path whose mode 000 is the state under test."""
    share(root)
    if state == "mode 000":
        hostile.chmod(0)


@pytest.mark.slow  # ~20 s of cases after its fixture's build, on 2 cores
def test_every_command_refuses_every_hostile_file_state_cleanly(pristine, tmp_path):
    failures, seconds = [], {}
    for i, (command, path, state) in enumerate(cases()):
        case = pristine.parent / f"{pristine.name}-case-{i}"
        start = time.perf_counter()
        try:
            result, changed = run_case(pristine, case, command, path, state)
            seconds[command, path, state] = time.perf_counter() - start
        finally:
            if case.exists():
                share(case)
                shutil.rmtree(case, ignore_errors=True)
        output = result.output
        refused = result.exit_code == 2 and "error: " in output and "  fix: " in output
        reported = command == "validate" and result.exit_code == 1 and "FAIL  artifact hashes" in output
        clean = "Traceback" not in output and "internal error" not in output
        if not (refused or reported) or not clean or changed:
            failures.append(f"{command} with {path} {state}: exit {result.exit_code}, wrote {changed}: "
                            f"{output.strip()[-300:]!r}")
    print(f"{len(seconds)} cases in {sum(seconds.values()):.1f} s; slowest:",
          sorted(seconds.items(), key=lambda kv: -kv[1])[:8])
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures)
