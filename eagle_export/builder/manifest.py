"""The build manifest: what was built, from what, with which proof.

One type both ways: `build` constructs a `Manifest` and `write_manifest` writes its `to_json()`;
every reader of a build (run, validate, bench, inspect, diagnose, export-checkpoint, selftest,
`open_build`) gets it from `check_build`, the one integrity gate: the manifest's own hash and every
artifact's are checked on the raw dict before any field is trusted, and the source checkpoints'
hashes where the reader loads them. An incomplete manifest fails with a clear error.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from .. import __version__
from ..cache import is_temporary
from ..engine.engine import Engine
from ..environment import package_version, tensorrt_version
from ..errors import EagleExportError
from ..files import is_dir, list_dir, read_json, read_text, reading
from ..runtime.costs import COSTS_FILE
from ..speculation.tree import Speculation
from .recipe import QUANTIZED, RECIPES_DIR, SAMPLE_RECIPE, load_recipe, shipped_recipes

MANIFEST = "manifest.json"
MANIFEST_HASH = "manifest.sha256"  # the manifest's own sha256, beside it: its fields are covered too
# Not artifacts: the manifest, its hash, and the runtime's per-machine cost cache (timings only: it
# steers the verify policy's speed, never which tokens come out), with the temporary file a process
# killed while writing it leaves (cache.is_temporary: read by nothing).
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


def write_manifest(build_dir: Path, manifest: Manifest) -> Manifest:
    """Write `manifest` as build_dir's manifest.json, stamped now (format, version, libraries) and
    listing every file of the build with its hash; its own sha256 beside it."""
    manifest = replace(
        manifest, format=MANIFEST_FORMAT, version=__version__, libraries=library_versions(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        artifacts=artifact_hashes(build_dir))
    (build_dir / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    write_manifest_hash(build_dir)
    return manifest


def write_manifest_hash(build_dir: Path) -> None:
    """Record manifest.json's sha256 beside it (write_manifest does; so must anyone who edits it on purpose)."""
    (build_dir / MANIFEST_HASH).write_text(sha256_file(build_dir / MANIFEST) + "\n")


def rebuild_hint(build_dir: str | Path, recipe: dict | None = None, sources: dict | None = None) -> str:
    """The fix for a build that cannot be used: the `eagle-export build` that remakes this directory,
    with the recipe (a shipped one by name), --target, --drafter, --depth and each --set it was made
    from, read from its manifest's `recipe` (the recipe as built, overrides applied) and `sources`;
    the shipped recipe's own values are left out. A recipe file of the user's is not recorded by path:
    the command says RECIPE, with the checkpoints (its other values are the file's). Without a manifest
    (one that cannot be read, which --force would not replace either) it says to move the directory
    away and build again. A tree given by --set on a shipped recipe is not spelled out (its normalized
    form is no recipe key)."""
    out = shlex.quote(str(build_dir))
    if not isinstance(recipe, dict) or not isinstance(sources, dict):
        return (f"move {build_dir} away (its manifest cannot be read, so --force would not replace it), then build "
                f"it again: `eagle-export build --recipe RECIPE --target DIR --drafter DIR -o {out}` with the "
                "recipe and checkpoints it was made from")
    name, args = str(recipe.get("name")), ["eagle-export build"]
    try:
        shipped = load_recipe(name).data if name in shipped_recipes() else None
    except EagleExportError:  # a shipped recipe this version cannot read: every value is spelled out
        shipped = None
    if shipped is None:
        args.append("--recipe RECIPE")
    elif (RECIPES_DIR / f"{name}.yaml") != SAMPLE_RECIPE:
        args.append(f"--recipe {name}")
    base = shipped or {}
    for role in ("target", "drafter"):
        if recipe.get(role) != base.get(role):
            source = recipe.get(role) if recipe.get(role) == "sample" else sources.get(role) or recipe.get(role)
            args.append(f"--{role} {shlex.quote(str(source))}")
    changed = {} if shipped is None else {key: value for key, value in _leaves(recipe).items()
                                           if value != _leaves(base).get(key)}  # (a recipe file holds its own)
    speculation = recipe.get("speculation")
    if "depth" in changed and (speculation.get("kind") if isinstance(speculation, dict) else "chain") == "chain":
        args.append(f"--depth {recipe.get('depth')}")
    for key, value in changed.items():
        if key.split(".")[0] not in ("name", "target", "drafter", "depth", "speculation"):
            args.append(f"--set {shlex.quote(f'{key}={json.dumps(value) if not isinstance(value, str) else value}')}")
    command = " ".join(args) + f" -o {out} --force"
    return f"rebuild it: `{command}`" + (f" (RECIPE: the file of recipe {name!r})" if shipped is None else "")


def _leaves(data: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a nested recipe dict; a list is one value."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def require_build(build_dir: str | Path) -> None:
    """Name a missing or unreadable build before a command imports torch (a usage error answers at
    once); no field is read here: the command still passes `check_build` when it opens the build."""
    read_manifest(build_dir)


def read_manifest(build_dir: str | Path) -> dict:
    build_dir = Path(build_dir)
    path = build_dir / MANIFEST
    if not is_dir(build_dir):
        raise EagleExportError(f"{build_dir} is not a directory", "pass a directory made by `eagle-export build`")
    if not os.path.lexists(path):
        raise EagleExportError(f"{build_dir} has no {MANIFEST}: it is not a build directory",
                               "pass a directory made by `eagle-export build`")
    try:
        manifest = read_json(path, rebuild_hint(build_dir))
    except EagleExportError as e:
        raise EagleExportError(e.problem.replace("is not valid JSON", "is corrupt"), e.fix) from None
    if not isinstance(manifest, dict):
        raise EagleExportError(f"{path} holds a JSON {type(manifest).__name__}, not a manifest",
                               rebuild_hint(build_dir))
    if manifest.get("format") not in (MANIFEST_FORMAT, *OLD_FORMATS):
        raise EagleExportError(f"{path} has manifest format {str(manifest.get('format'))[:40]}, this tool reads "
                               f"{', '.join(map(str, (MANIFEST_FORMAT, *OLD_FORMATS)))}",
                               "rebuild with this version of eagle-export")
    return manifest


def old_format_note(manifest: Manifest, build_dir: str | Path = "BUILD") -> str | None:
    """What `run`, `validate` and `inspect` say of a manifest of an older format: its fields are trusted as old."""
    if manifest.format == MANIFEST_FORMAT:
        return None
    name = manifest.recipe.get("name") if isinstance(manifest.recipe, dict) else None
    return (f"manifest format {manifest.format} (an older eagle-export, before builds hashed their own "
            f"manifest): this build predates self-hashing, so an edit to its manifest goes unnoticed; "
            f"`eagle-export build --recipe RECIPE -o {build_dir} --force` (RECIPE: the recipe it was built from"
            + (f", {str(name)[:80]!r} in its manifest" if name else "") + f") refreshes it to format {MANIFEST_FORMAT}")


@dataclass(frozen=True)
class Agreement:
    """How often a quantized model's top-1 agreed with the unquantized one's at build time
    (manifest.quantization.<role>), over this many positions."""
    top1_agreement: float
    positions: int


# manifest.models.<role>: the keys each role records, in the order written (BuiltModel's fields but
# `source`, which manifest.sources holds, and `agreement`, which manifest.quantization holds)
MODEL_KEYS = {
    "target": ("architecture", "num_layers", "hidden_size", "num_kv_heads", "head_dim", "vocab_size",
               "aux_layer_ids", "precision", "dtype", "eos_token_id", "max_position_embeddings"),
    "drafter": ("eagle_version", "hidden_size", "num_kv_heads", "head_dim", "draft_vocab_size", "precision", "dtype"),
}


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
    architecture: str | None = None  # the target's
    eagle_version: str | None = None  # the drafter's
    draft_vocab_size: int | None = None  # the drafter's

    @property
    def quantized(self) -> bool:
        return self.precision in QUANTIZED

    @classmethod
    def from_json(cls, model: dict, source: str, measured: dict | None) -> BuiltModel:
        eos = model.get("eos_token_id")
        return cls(source, model["precision"], model["dtype"], model["hidden_size"], model["num_kv_heads"],
                   model["head_dim"], model.get("num_layers", 1), tuple(model.get("aux_layer_ids", ())),
                   tuple(eos) if isinstance(eos, list) else eos,
                   Agreement(measured["top1_agreement"], measured["positions"]) if measured else None,
                   model.get("vocab_size"), model.get("max_position_embeddings"), model.get("architecture"),
                   model.get("eagle_version"), model.get("draft_vocab_size"))

    def to_json(self, role: str) -> dict:
        values = {**{f.name: getattr(self, f.name) for f in fields(self)},
                  "max_position_embeddings": self.max_positions, "aux_layer_ids": list(self.aux_layer_ids),
                  "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id}
        return {key: values[key] for key in MODEL_KEYS[role]}


@dataclass(frozen=True)
class GraphFile:
    """manifest.graphs.<graph>: the ONNX file, how it was exported, and the export's report (node
    counts, pass results, lint findings, seconds: shown, never acted on)."""
    file: str
    return_logits: bool = False  # target
    sampling: bool = False  # drafter
    report: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, data: dict) -> GraphFile:
        report = {k: v for k, v in data.items() if k not in ("file", "return_logits", "sampling")}
        return cls(data["file"], data.get("return_logits", False), data.get("sampling", False), report)

    def to_json(self, graph: str) -> dict:
        own = {"return_logits": self.return_logits} if graph == "target" else {"sampling": self.sampling}
        return {"file": self.file, **own, **self.report}


@dataclass(frozen=True)
class Manifest:
    """A build's manifest.json, both ways: `build` constructs one and writes `to_json()`
    (`write_manifest`); readers get it from `Manifest.read` / `from_json`, which name an incomplete
    manifest with a clear error. Report sections (quantization, conformance, validation, passes,
    stage seconds) are kept as the JSON objects their stages write: they are shown and checked by
    the code that wrote them, not interpreted here."""
    recipe: dict  # the normalized recipe it was built from
    speculation: Speculation
    sampling: bool
    max_context: int
    target: BuiltModel
    drafter: BuiltModel
    graphs: dict[str, GraphFile]  # target, drafter (and drafter_sampling)
    engines: tuple[Engine, ...]
    engines_skipped: str | None  # why there are none
    backends: tuple[str, ...]
    source_files: dict[str, dict[str, str]]  # role -> {file: sha256} of its checkpoint (none before 0.2)
    passes: dict  # {model: [pass records], skipped_by_recipe: [names]}
    quantization: dict  # per-role agreement, delta, evaluation prompts; {skipped: why} when unquantized
    conformance: dict | None = None
    validation: dict | None = None
    stage_seconds: dict | None = None
    # written by write_manifest
    artifacts: dict[str, dict] = field(default_factory=dict)
    format: int | None = MANIFEST_FORMAT
    version: str | None = None
    created: str | None = None
    libraries: dict | None = None

    @property
    def depth(self) -> int:
        """The drafter graph's unroll depth (written as `depth`, which builds before trees hold alone)."""
        return self.speculation.depth

    @property
    def target_graph(self) -> GraphFile:
        return self.graphs["target"]

    @property
    def drafter_graph(self) -> GraphFile:
        return self.graphs["drafter"]

    @property
    def drafter_sampling_graph(self) -> GraphFile | None:
        return self.graphs.get("drafter_sampling")

    @property
    def profiles(self) -> dict:
        """The recipe's batch and context ranges: what the engines' profiles were built for."""
        return self.recipe["profiles"]

    @property
    def skipped_passes(self) -> tuple[str, ...]:
        return tuple(self.passes["skipped_by_recipe"])

    @property
    def evaluation_prompts(self) -> tuple[tuple[int, ...], ...]:
        """A quantized build's held-out prompts (none before 0.1)."""
        return tuple(tuple(p) for p in self.quantization.get("evaluation", {}).get("prompt_ids", ()))

    @property
    def delta(self) -> float | None:
        """A quantized target's width noise in top-2 margins (quantization.delta)."""
        return float(self.quantization["delta"]["delta"]) if "delta" in self.quantization else None

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

    @property
    def target_identity(self) -> tuple:
        """What makes two builds' plain decoding the same: the target checkpoint's files and its precision."""
        return str(sorted((self.source_files.get("target") or {}).items())), self.target.precision

    @classmethod
    def read(cls, build_dir: str | Path) -> Manifest:
        """The fields as written, unchecked: commands read a build through `check_build`."""
        return cls.from_json(read_manifest(build_dir), Path(build_dir) / MANIFEST)

    @classmethod
    def from_json(cls, data: dict, where: str | Path = MANIFEST) -> Manifest:
        try:
            quantization, engines = data["quantization"], data["engines"]
            models = {role: BuiltModel.from_json(data["models"][role], data["sources"][role],
                                                 quantization.get(role)) for role in MODEL_KEYS}
            return cls(
                data.get("recipe", {}), Speculation.from_block(data.get("speculation"), data["depth"]),
                data["sampling"], data["max_context"], models["target"], models["drafter"],
                {name: GraphFile.from_json(g) for name, g in data["graphs"].items()},
                tuple(Engine(e["graph"], e["file"], e["tensorrt"], e["compute_capability"], e.get("gpu", "?"))
                      for e in engines) if isinstance(engines, list) else (),
                None if isinstance(engines, list) else engines.get("skipped", ""),
                tuple(data.get("backends", ())), data.get("source_files", {}), data["passes"], quantization,
                data.get("conformance"), data.get("validation"), data.get("stage_seconds"), data["artifacts"],
                data.get("format"), data.get("version"), data.get("created"), data.get("libraries"))
        except (KeyError, TypeError, ValueError, AttributeError, EagleExportError) as e:
            raise EagleExportError(f"{where} is incomplete or of the wrong shape ({type(e).__name__}: {e})",
                                   rebuild_hint(Path(where).parent, data.get("recipe"), data.get("sources"))
                                   if isinstance(data, dict) and data.get("tool") == "eagle-export"
                                   else rebuild_hint(Path(where).parent)) from None

    def to_json(self) -> dict:
        data = {"format": self.format, "tool": "eagle-export", "version": self.version, "created": self.created,
                "libraries": self.libraries, "recipe": self.recipe,
                "sources": {role: m.source for role, m in self.models.items()}, "source_files": self.source_files,
                "depth": self.depth, "speculation": self.speculation.to_block(), "sampling": self.sampling,
                "max_context": self.max_context,
                "models": {role: m.to_json(role) for role, m in self.models.items()},
                "graphs": {name: g.to_json(name) for name, g in self.graphs.items()}, "passes": self.passes,
                "quantization": self.quantization,
                "engines": [asdict(e) for e in self.engines] if self.engines_skipped is None
                else {"skipped": self.engines_skipped},
                "conformance": self.conformance, "backends": list(self.backends), "validation": self.validation,
                "stage_seconds": self.stage_seconds, "artifacts": self.artifacts, "manifest_hash": MANIFEST_HASH}
        return {key: value for key, value in data.items() if value is not None}


def contradictions(manifest: Manifest) -> list[str]:
    """Values of a manifest that contradict its graphs or its model, whatever any hash says: a context
    limit beyond the graphs' context profile (what the engines were built for) or the target's
    position count, end-of-sequence ids outside the target's vocabulary. Empty when consistent."""
    problems = []
    context = manifest.max_context
    profile = (manifest.recipe.get("profiles") or {}).get("context") or {}
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
                 if name not in artifacts and name not in UNHASHED and not is_temporary(name, COSTS_FILE)]
    rebuild = rebuild_hint(build_dir, manifest.get("recipe"), manifest.get("sources"))
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
        with reading(path, rebuild):  # a loop, a directory, mode 000: named
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


# what `build --force` may replace (output_dir.check_output)
BUILD_OUTPUT = ("a build made by eagle-export (a directory with its manifest.json)", is_build_dir)


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


class BuildMismatch(EagleExportError):
    """A build whose files or manifest differ from what was built; `problems` lists each difference."""

    def __init__(self, path: Path, problems: list[str], rebuild: str | None = None):
        super().__init__(f"{path} does not match its manifest: " + "; ".join(problems),
                         rebuild or "rebuild it with `eagle-export build --force`")
        self.problems = problems


ALLOW_CHANGED_SOURCES = "--allow-changed-sources"


def check_sources(manifest: Manifest, allow_changed: bool = False, reader: str = "this command",
                  instead: str = "", build_dir: str | Path = "BUILD") -> None:
    """Refuse to read a build's source checkpoints unless each file has the sha256 the build recorded
    (other weights would pass silently for the build's); with `allow_changed`, read them as they are
    and say so in one line on stderr. `instead`: another way out, put first in the fix."""
    changed, unavailable = verify_sources(manifest)
    if not (changed or unavailable):
        return
    found = "; ".join(changed + unavailable)
    if not allow_changed:
        raise EagleExportError(f"{reader} reads the checkpoints the build was made from, and they are not the "
                               f"build's: {found}",
                               f"{instead}restore those checkpoints, pass {ALLOW_CHANGED_SOURCES} to read them as "
                               "they are now, or " + rebuild_hint(build_dir, manifest.recipe,
                                                                  {r: m.source for r, m in manifest.models.items()}))
    print(f"note: {ALLOW_CHANGED_SOURCES}: reading the checkpoints as they are now, not as built ({found})",
          file=sys.stderr)


def check_build(path: str | Path, sources: bool = False, allow_changed_sources: bool = False,
                reader: str = "this command") -> Manifest:
    """The integrity gate every reader of a build passes: the manifest's own sha256 and every
    artifact's (`verify_artifacts`, on the raw dict before any field is read: an edited manifest
    could point anywhere), then, with `sources`, the source checkpoints' (`check_sources`).
    Raises BuildMismatch naming each difference."""
    path = Path(path)
    data = read_manifest(path)
    problems = verify_artifacts(path, data)
    if problems:
        raise BuildMismatch(path, problems, rebuild_hint(path, data.get("recipe"), data.get("sources")))
    manifest = Manifest.from_json(data, path / MANIFEST)
    if sources:
        check_sources(manifest, allow_changed_sources, reader, build_dir=path)
    return manifest


def inspect_build(path: str | Path) -> dict:
    """`eagle-export inspect BUILD`: what a build holds, from its manifest (nothing is loaded): the
    pair and precisions, how it speculates (the verify width its target calls take), its graphs and
    engines, and whether it validated."""
    from ..speculation.tree import describe

    path = Path(path)
    manifest = check_build(path)
    speculation = manifest.speculation
    validation = manifest.validation or {}
    report = {
        "kind": "build", "path": str(path), "recipe": manifest.recipe.get("name") + (f" (derived {manifest.recipe['derived']})"
                                                 if manifest.recipe.get("derived") else ""), "created": manifest.created,
        "target": f"{manifest.target.source} ({manifest.target.precision})",
        "drafter": f"{manifest.drafter.source} ({manifest.drafter.precision})",
        "speculation": describe(speculation), "depth": manifest.depth, "nodes": speculation.num_nodes,
        "verify_width": speculation.verify_width,
        "sampling": manifest.sampling, "max_context": manifest.max_context, "backends": list(manifest.backends),
        "graphs": sorted(g.file for g in manifest.graphs.values()),
        "engines": manifest.engines_skipped or sorted(e.file for e in manifest.engines),
        "lossless_delta": manifest.delta,
        "drafter_conventions": _conformance_line(manifest.conformance),
        "validation": _validation_line(validation.get("checks", []), validation.get("ok")),
        "warnings": [note for note in [old_format_note(manifest, path)] if note] + contradictions(manifest),
    }
    return report


def _conformance_line(result: dict | None) -> str:
    """What the build's check of the drafter's conventions found, and whether its gate was skipped."""
    if not result:
        return "not recorded"
    acc = result["readings"][0]["acc@1"]
    line = (f"acc@1 {acc[0]:.3f} / {acc[1]:.3f} at steps 0 / 1 as configured; "
            + ("matches no convention" if not result.get("matched") else
               f"{len(result.get('findings', []))} field(s) named" if result.get("findings") else "no field named"))
    if result.get("gate_skipped"):
        line += f"; gate skipped ({result['gate_skipped']}: a pipeline smoke test, not a drafter to serve)"
    return line


def _validation_line(checks: list[dict], ok) -> str:
    """What the build's own validation found. It compared the graphs with the models in memory, so
    `eagle-export validate` lists one check more: the source checkpoints' hashes."""
    passed, skipped = sum(c["ok"] is True for c in checks), sum(c["ok"] is None for c in checks)
    return (f"{passed} of {len(checks)} checks passed when built" + (f", {skipped} skipped" if skipped else "")
            + ("" if ok else ", FAILED") + " (`eagle-export validate` re-runs them against the source checkpoints)")
