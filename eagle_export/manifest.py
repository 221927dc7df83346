"""The build manifest (what was built, from what, with which proof) and the atomic build directory.

`manifest.json` is written as a plain dict (`write_manifest`); readers that act on it (opening a
build, validating it) go through `Manifest`, a typed view of the fields they need, so a field is
named in one place and an incomplete manifest fails with a clear error. The JSON format is the same.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import glob
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .costs import COSTS_FILE
from .environment import package_version, tensorrt_version
from .engine import Engine
from .errors import EagleExportError
from .files import is_dir, list_dir, read_json, read_text, reading, resolved
from .recipe import QUANTIZED

MANIFEST = "manifest.json"
MANIFEST_HASH = "manifest.sha256"  # the manifest's own sha256, beside it: its fields are covered too
# Not artifacts: the manifest, its hash, and the runtime's per-machine cost cache (timings only: it
# steers the depth policy's speed, never which tokens come out).
UNHASHED = (MANIFEST, MANIFEST_HASH, COSTS_FILE)
# 2: the manifest's own sha256 belongs to the format (a format-2 manifest without it is refused), and
# the target's position count is recorded. 1: before the self-hash (every build reported version
# 0.1.0, so the format number is what tells an old build from one whose hash was stripped).
MANIFEST_FORMAT = 2
OLD_FORMATS = (1,)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with reading(path), open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# The files of a checkpoint directory a loader may read: config, weights, shard index, vocab maps.
SOURCE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".npy")


def source_hashes(checkpoint_dir: str | Path) -> dict[str, str]:
    """sha256 of each file of a checkpoint directory that loading it may read (manifest.source_files)."""
    return {p.name: sha256_file(p) for p in list_dir(checkpoint_dir)
            if p.suffix in SOURCE_SUFFIXES and not is_dir(p)}


def artifact_hashes(build_dir: Path) -> dict[str, dict]:
    """sha256 and size of every file in the build except the manifest, its hash, and the runtime's cost
    cache (written when the build is used, per machine)."""
    out = {}
    for path in sorted(p for p in build_dir.rglob("*") if p.is_file() and p.name not in UNHASHED):
        out[path.relative_to(build_dir).as_posix()] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return out


def library_versions() -> dict[str, str | None]:
    return {"eagle-export": __version__, "torch": package_version("torch"), "onnx": package_version("onnx"),
            "onnxruntime": package_version("onnxruntime") or package_version("onnxruntime-gpu"),
            "onnx-ir": package_version("onnx-ir"), "nvidia-modelopt": package_version("nvidia-modelopt"),
            "tensorrt": tensorrt_version()}


def write_manifest(build_dir: Path, content: dict) -> dict:
    manifest = {"format": MANIFEST_FORMAT, "tool": "eagle-export", "version": __version__,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "libraries": library_versions(), **content, "artifacts": artifact_hashes(build_dir),
                "manifest_hash": MANIFEST_HASH}
    (build_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    write_manifest_hash(build_dir)
    return manifest


def write_manifest_hash(build_dir: Path) -> None:
    """Record manifest.json's sha256 beside it (write_manifest does; so must anyone who edits it on purpose)."""
    (build_dir / MANIFEST_HASH).write_text(sha256_file(build_dir / MANIFEST) + "\n")


def read_manifest(build_dir: str | Path) -> dict:
    build_dir = Path(build_dir)
    path = build_dir / MANIFEST
    if not is_dir(build_dir):
        raise EagleExportError(f"{build_dir} is not a directory", "pass a directory made by `eagle-export build`")
    if not os.path.lexists(path):
        raise EagleExportError(f"{build_dir} has no {MANIFEST}: it is not a build directory",
                               "pass a directory made by `eagle-export build`")
    try:
        manifest = read_json(path, "rebuild with `eagle-export build --force`")
    except EagleExportError as e:
        raise EagleExportError(e.problem.replace("is not valid JSON", "is corrupt"), e.fix) from None
    if not isinstance(manifest, dict):
        raise EagleExportError(f"{path} holds a JSON {type(manifest).__name__}, not a manifest",
                               "rebuild with `eagle-export build --force`")
    if manifest.get("format") not in (MANIFEST_FORMAT, *OLD_FORMATS):
        raise EagleExportError(f"{path} has manifest format {str(manifest.get('format'))[:40]}, this tool reads "
                               f"{', '.join(map(str, (MANIFEST_FORMAT, *OLD_FORMATS)))}",
                               "rebuild with this version of eagle-export")
    return manifest


def old_format_note(manifest: dict) -> str | None:
    """What `validate` and `inspect` say of a manifest of an older format: its fields are trusted as old."""
    if manifest.get("format") == MANIFEST_FORMAT:
        return None
    return (f"manifest format {manifest.get('format')} (an older eagle-export, before builds hashed their own "
            f"manifest): its fields are not covered by a hash; rebuild to get format {MANIFEST_FORMAT}")


@dataclass(frozen=True)
class Agreement:
    """How often a quantized model's top-1 agreed with the unquantized one's at build time
    (manifest.quantization.<role>), over this many positions."""
    top1_agreement: float
    positions: int


@dataclass(frozen=True)
class BuiltModel:
    """manifest.models.<role>, with the checkpoint it came from (manifest.sources.<role>)."""
    source: str
    precision: str
    dtype: str
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1  # the drafter graph's one layer (recorded for the target only)
    aux_layer_ids: tuple[int, ...] = ()
    eos_token_id: int | tuple[int, ...] | None = None
    agreement: Agreement | None = None  # quantized models only
    vocab_size: int | None = None  # recorded for the target only
    max_positions: int | None = None  # the target's max_position_embeddings (recorded since format 2)

    @property
    def quantized(self) -> bool:
        return self.precision in QUANTIZED


@dataclass(frozen=True)
class GraphFile:
    """manifest.graphs.<graph>: the ONNX file and how it was exported."""
    file: str
    return_logits: bool = False  # target
    sampling: bool = False  # drafter


@dataclass(frozen=True)
class Manifest:
    """A typed view of a build's manifest.json; `data` is the JSON as written."""
    data: dict
    depth: int
    sampling: bool
    max_context: int
    target: BuiltModel
    drafter: BuiltModel
    target_graph: GraphFile
    drafter_graph: GraphFile
    drafter_sampling_graph: GraphFile | None
    engines: tuple[Engine, ...]
    engines_skipped: str | None  # why there are none
    skipped_passes: tuple[str, ...]
    evaluation_prompts: tuple[tuple[int, ...], ...]  # a quantized build's held-out prompts (none before 0.1)
    artifacts: dict[str, dict]
    source_files: dict[str, dict[str, str]]  # role -> {file: sha256} of its checkpoint (none before 0.2)
    delta: float | None = None  # a quantized target's width noise in top-2 margins (manifest.quantization.delta)

    @property
    def speculation(self):
        """What the drafter graph proposes: a chain depth K, a TreeShape or a DynamicTree (builds
        before trees record none: a chain of `depth`)."""
        from .tree import speculation_of

        return speculation_of(self.data.get("speculation") or {"kind": "chain", "depth": self.depth})

    @classmethod
    def read(cls, build_dir: str | Path) -> Manifest:
        return cls.from_json(read_manifest(build_dir), Path(build_dir) / MANIFEST)

    @classmethod
    def from_json(cls, data: dict, where: str | Path = MANIFEST) -> Manifest:
        try:
            quantization = data["quantization"]

            def model(role: str) -> BuiltModel:
                m = data["models"][role]
                measured = quantization.get(role)
                return BuiltModel(
                    data["sources"][role], m["precision"], m["dtype"], m["hidden_size"], m["num_kv_heads"],
                    m["head_dim"], m.get("num_layers", 1), tuple(m.get("aux_layer_ids", ())),
                    tuple(m["eos_token_id"]) if isinstance(m.get("eos_token_id"), list) else m.get("eos_token_id"),
                    Agreement(measured["top1_agreement"], measured["positions"]) if measured else None,
                    m.get("vocab_size"), m.get("max_position_embeddings"))

            def graph(name: str) -> GraphFile | None:
                g = data["graphs"].get(name)
                if g is None:
                    return None
                return GraphFile(g["file"], g.get("return_logits", False), g.get("sampling", False))

            engines = data["engines"]
            return cls(
                data, data["depth"], data["sampling"], data["max_context"], model("target"), model("drafter"),
                graph("target"), graph("drafter"), graph("drafter_sampling"),
                tuple(Engine(e["graph"], e["file"], e["tensorrt"], e["compute_capability"], e.get("gpu", "?"))
                      for e in engines) if isinstance(engines, list) else (),
                None if isinstance(engines, list) else engines.get("skipped", ""),
                tuple(data["passes"]["skipped_by_recipe"]),
                tuple(tuple(p) for p in quantization.get("evaluation", {}).get("prompt_ids", ())),
                data["artifacts"], data.get("source_files", {}),
                float(quantization["delta"]["delta"]) if "delta" in quantization else None)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EagleExportError(f"{where} is incomplete or of the wrong shape ({type(e).__name__}: {e})",
                                   "rebuild with `eagle-export build --force`") from None

    @property
    def models(self) -> dict[str, BuiltModel]:
        return {"target": self.target, "drafter": self.drafter}

    @property
    def quantized_roles(self) -> set[str]:
        return {role for role, m in self.models.items() if m.quantized}

    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.target.eos_token_id
        return eos if isinstance(eos, tuple) else ((eos,) if eos is not None else ())


def contradictions(manifest: Manifest) -> list[str]:
    """Values of a manifest that contradict its graphs or its model, whatever any hash says: a context
    limit beyond the graphs' context profile (what the engines were built for) or the target's
    position count, end-of-sequence ids outside the target's vocabulary. Empty when consistent."""
    problems = []
    context = manifest.max_context
    profile = ((manifest.data.get("recipe") or {}).get("profiles") or {}).get("context") or {}
    positions = manifest.target.max_positions
    if not isinstance(context, int) or isinstance(context, bool) or context < 2:
        problems.append(f"max_context {str(context)[:40]} is not a context length")
    else:
        if isinstance(profile.get("max"), int) and context > profile["max"]:
            problems.append(f"max_context {context} exceeds the graphs' context profile (max {profile['max']})")
        if isinstance(positions, int) and context > positions:
            problems.append(f"max_context {context} exceeds the target's {positions} positions")
    vocab = manifest.target.vocab_size
    bad = [i for i in manifest.eos_ids if not isinstance(i, int) or isinstance(vocab, int) and not 0 <= i < vocab]
    if bad:
        problems.append(f"eos_token_id {str(bad)[:80]} lies outside the target's vocabulary [0, {vocab})")
    return problems


def _inside(build_dir: Path, name) -> bool:
    """A plain relative name that stays inside the build (no absolute path, no .., no link out)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return False
    try:
        return (build_dir / name).resolve().is_relative_to(build_dir.resolve())
    except RuntimeError:  # a link loop: inside, and named as a loop where the file is read
        return True


def verify_artifacts(build_dir: str | Path, manifest: dict) -> list[str]:
    """Problems with the build's files: missing, resized, with another hash, unlisted (every file the
    runtime may read must be listed), named outside the build, and a manifest edited since it was
    written (its own sha256 beside it). Empty when intact."""
    build_dir = Path(build_dir)
    problems = []
    hash_file = build_dir / MANIFEST_HASH
    # Format 2 carries its hash whatever the manifest says: deleting both cannot switch the check off.
    if manifest.get("format") == MANIFEST_FORMAT or manifest.get("manifest_hash") or hash_file.exists():
        recorded = read_text(hash_file).strip() if os.path.lexists(hash_file) else None
        if recorded is None:
            problems.append(f"{MANIFEST_HASH}: missing (a format-{MANIFEST_FORMAT} manifest carries its own "
                            "sha256: removed after the build)")
        elif recorded != sha256_file(build_dir / MANIFEST):
            problems.append(f"{MANIFEST}: its sha256 is not the one in {MANIFEST_HASH} (edited after the build, "
                            "or the hash file removed)")
    artifacts = manifest.get("artifacts")
    if not isinstance(artifacts, dict):
        return problems + [f"{MANIFEST}: no artifacts map"]
    outside = [name for name in artifacts if not _inside(build_dir, name)]
    problems += [f"{name!r}: names a file outside the build" for name in outside]
    referenced = [g.get("file") for g in (manifest.get("graphs") or {}).values() if isinstance(g, dict)]
    engines = manifest.get("engines")
    referenced += [e.get("file") for e in engines if isinstance(e, dict)] if isinstance(engines, list) else []
    problems += [f"{name!r}: the manifest runs it but does not list it as an artifact"
                 for name in referenced if name not in artifacts]
    on_disk = sorted(p.relative_to(build_dir).as_posix() for p in build_dir.rglob("*") if p.is_file())
    problems += [f"{name}: not listed in the manifest (added after the build)" for name in on_disk
                 if name not in artifacts and name not in UNHASHED]
    for name, meta in artifacts.items():
        if name in outside:
            continue  # never stat'ed or hashed: its size would leak
        path = build_dir / name
        if not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int):
            problems.append(f"{name}: its manifest entry is not {{sha256, bytes}}")
            continue
        if not os.path.lexists(path):
            problems.append(f"{name}: missing")
            continue
        with reading(path, "rebuild it with `eagle-export build --force`"):  # a loop, a directory, mode 000: named
            size = path.stat().st_size
        if size != meta["bytes"]:
            problems.append(f"{name}: {size} bytes, the manifest says {meta['bytes']} (truncated or modified)")
        elif sha256_file(path) != meta["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest (modified)")
    return problems


def is_build_dir(path: Path) -> bool:
    """A build this tool made: a readable manifest.json that says so. Only these may be replaced."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("tool") == "eagle-export"
    except (OSError, ValueError, AttributeError):
        return False


BUILD_OUTPUT = ("a build made by eagle-export (a directory with its manifest.json)", is_build_dir)


def output_place(out_dir) -> Path:
    """`out_dir` resolved, once its nearest existing parent is known to be a directory this user may
    write in (a file, a link loop or a locked directory there is named before any work)."""
    out_dir = resolved(out_dir)
    above = next(d for d in (out_dir.parent, *out_dir.parents) if os.path.lexists(d))
    if not is_dir(above):
        raise EagleExportError(f"{above} is a file, not a directory: the output {out_dir} cannot go inside it",
                               "choose an -o whose parent is a directory")
    if not os.access(above, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise EagleExportError(f"cannot write the output in {above} (permission denied)",
                               "choose an output directory you can write to (-o)")
    return out_dir


def check_output(out_dir: Path, inputs=(), force: bool = False, replaceable=BUILD_OUTPUT) -> list[str]:
    """Refuse an output that would destroy what the user owns; return warnings. `--force` replaces
    only what `replaceable` = (description, test) recognises as this tool's own output, never an
    input of the build or a directory holding one (`-o ''` is the current directory)."""
    for source in inputs:
        source = resolved(source)
        if out_dir == source or out_dir in source.parents:
            what = "is" if out_dir == source else f"holds {source}, which is"
            raise EagleExportError(f"the output {out_dir} {what} an input of this build",
                                   "choose an -o outside the checkpoints the build reads")
    if out_dir.exists() or out_dir.is_symlink():
        if not force:
            raise EagleExportError(f"{out_dir} already exists", "pass --force to replace it, or choose another -o")
        description, test = replaceable
        if not out_dir.is_dir() or not test(out_dir):
            raise EagleExportError(f"{out_dir} exists and is not {description}: --force replaces only those",
                                   "choose another -o, or move that directory away yourself")
    return [f"the output {out_dir} lies inside the input {source}: the checkpoint directory now holds a build"
            for source in map(resolved, inputs) if source in out_dir.parents]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def sweep_leftovers(out_dir: Path) -> list[Path]:
    """Remove what a killed build (SIGKILL, power loss) left beside `out_dir`: `.NAME.partial-PID-*`
    of a dead process, and `.NAME.old-PID` (a replaced build) once `out_dir` exists again."""
    removed = []
    for kind in ("partial", "old"):
        prefix = f".{out_dir.name}.{kind}-"
        for path in out_dir.parent.glob(glob.escape(prefix) + "*"):
            pid = path.name[len(prefix):].split("-")[0]
            if not path.is_dir() or path.is_symlink() or not pid.isdigit() or _process_alive(int(pid)):
                continue
            if kind == "old" and not out_dir.is_dir():
                continue  # killed between its two renames: this may be the only copy of the old build
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_empty(directories) -> None:
    """Remove these directories (deepest first) where still empty: those a failed build created."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C, so the partial build is removed


def verify_sources(manifest: Manifest) -> tuple[list[str], list[str]]:
    """(changed, unavailable): how the checkpoints the build was made from differ from their hashes
    in the manifest, and those that cannot be compared (gone, or no hashes recorded)."""
    changed, unavailable = [], []
    for role, model in manifest.models.items():
        recorded = manifest.source_files.get(role)
        if not Path(model.source).is_dir():
            unavailable.append(f"the {role} checkpoint {model.source} is gone")
        elif recorded is None:
            unavailable.append(f"the build recorded no hashes of the {role} checkpoint (made by an older eagle-export)")
        else:
            now = source_hashes(model.source)
            files = sorted(name for name in recorded.keys() | now.keys() if recorded.get(name) != now.get(name))
            if files:
                how = {name: "added" if name not in recorded else "gone" if name not in now else "modified"
                       for name in files}
                changed.append(f"the {role} checkpoint {model.source} changed since the build: "
                               + ", ".join(f"{name} ({how[name]})" for name in files))
    return changed, unavailable


@contextlib.contextmanager
def atomic_build_dir(out_dir: str | Path, force: bool = False, inputs=(), replaceable=BUILD_OUTPUT, warn=None):
    """Yield a temporary directory beside `out_dir`; rename it into place only if the body succeeds.

    A failure, Ctrl-C or SIGTERM removes the temporary directory, so no half build is ever left. An
    existing output is replaced only with `force`, only if it is this tool's own (`check_output`), and
    only once the new build is complete. Without `force` the final rename cannot replace a build that
    another process finished meanwhile (POSIX rename refuses a non-empty directory)."""
    out_dir = output_place(out_dir)
    for message in check_output(out_dir, inputs, force, replaceable):
        (warn or print)(f"warning: {message}")
    parent = out_dir.parent
    created = [d for d in (parent, *parent.parents) if not os.path.lexists(d)]  # deepest first
    try:
        parent.mkdir(parents=True, exist_ok=True)
        sweep_leftovers(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=parent))
    except OSError as e:
        _remove_empty(created)
        raise EagleExportError(f"cannot write the build beside {out_dir} ({e.strerror})",
                               "choose an output directory you can write to (-o)") from None
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's private 0700 would outlive the rename
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        yield tmp
        if force and (out_dir.exists() or out_dir.is_symlink()):
            check_output(out_dir, (), force, replaceable)  # still ours, whatever happened meanwhile
            old = parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out_dir)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
                raise EagleExportError(f"{out_dir} appeared while this build ran (another build to the same -o "
                                       "finished first); it was kept and this build discarded",
                                       "pass --force to replace it, or choose another -o") from None
    except BaseException:  # includes KeyboardInterrupt and SIGTERM: the partial build goes, whatever stopped it
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)  # and the parent directories it made for the output
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def inspect_build(path: str | Path) -> dict:
    """`eagle-export inspect BUILD`: what a build holds, from its manifest (nothing is loaded): the
    pair and precisions, how it speculates (the verify width its target calls take), its graphs and
    engines, and whether it validated."""
    from .tree import describe

    path = Path(path)
    manifest = Manifest.from_json(read_manifest(path), path / MANIFEST)
    data = manifest.data
    speculation = manifest.speculation
    nodes = speculation if isinstance(speculation, int) else speculation.num_nodes
    validation = data.get("validation", {})
    engines = data.get("engines", {})
    report = {
        "kind": "build", "path": str(path), "recipe": data.get("recipe", {}).get("name"), "created": data.get("created"),
        "target": f"{data['sources']['target']} ({data['models']['target']['precision']})",
        "drafter": f"{data['sources']['drafter']} ({data['models']['drafter']['precision']})",
        "speculation": describe(speculation), "depth": manifest.depth, "nodes": nodes, "verify_width": nodes + 1,
        "sampling": manifest.sampling, "max_context": manifest.max_context, "backends": data.get("backends"),
        "graphs": sorted(g["file"] for g in data.get("graphs", {}).values()),
        "engines": engines.get("skipped") or sorted(engines),
        "lossless_delta": data.get("quantization", {}).get("delta", {}).get("delta"),
        "validation": _validation_line(validation.get("checks", []), validation.get("ok")),
        "warnings": [note for note in [old_format_note(data)] if note] + contradictions(manifest),
    }
    return report


def _validation_line(checks: list[dict], ok) -> str:
    """What the build's own validation found. It compared the graphs with the models in memory, so
    `eagle-export validate` lists one check more: the source checkpoints' hashes."""
    passed, skipped = sum(c["ok"] is True for c in checks), sum(c["ok"] is None for c in checks)
    return (f"{passed} of {len(checks)} checks passed when built" + (f", {skipped} skipped" if skipped else "")
            + ("" if ok else ", FAILED") + " (`eagle-export validate` re-runs them against the source checkpoints)")
