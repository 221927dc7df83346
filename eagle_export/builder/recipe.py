"""Build recipes: YAML files validated against a schema, with errors that name the key and its line.

A recipe says what to build: the target and drafter, how to speculate (`depth: K` for a chain of K
drafts, or a `speculation` block for a token tree), the precision of
each model, the batch and context ranges (they become TensorRT optimization profiles), the
calibration set, and the passes to skip. Every field has a default except target and drafter.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from ..errors import EagleExportError
from ..files import is_dir, read_json, read_text
from ..models.contract import MAX_DEPTH, MAX_TREE_NODES
from ..speculation.tree import DynamicTree, Speculation, TreeShape

SPECULATION_KINDS = ("chain", "static_tree", "dynamic_tree")
MODEL_PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "nvfp4")  # what a recipe builds each model in
QUANTIZED = ("fp8", "nvfp4")  # the precisions that go through ModelOpt
CALIBRATION_SETS = ("mt-bench", "sharegpt", "humaneval")
# The packages eagle_export.recipes and eagle_export.samples lie side by side, so a shipped recipe's
# `../samples/...` holds in a checkout and an install. pip installs them as files, and the checkpoint
# loaders read files by path.
RECIPES_DIR = Path(resources.files("eagle_export.recipes"))
SAMPLES_DIR = Path(resources.files("eagle_export.samples"))
SAMPLE_RECIPE = RECIPES_DIR / "smollm2-135m-eagle3.1.yaml"

# key -> (type, default, check) ; nested mappings are dicts of the same shape.
SCHEMA = {
    "name": (str, None, None),
    "derived": (str, None, None),  # how a recipe derived from its pair was made (pair_recipe); None when written
    "target": (str, None, None),
    "drafter": (str, None, None),
    "depth": (int, 4, lambda v: 1 <= v <= MAX_DEPTH or f"must be between 1 and {MAX_DEPTH}"),
    "sampling": (bool, False, None),
    # `depth: K` is the chain shorthand; this block also describes trees (see _speculation). Absent keys
    # stay None so the kinds can tell what was given.
    "speculation": {
        "kind": (str, "chain", lambda v: v in SPECULATION_KINDS or f"must be one of {', '.join(SPECULATION_KINDS)}"),
        "depth": (int, None, lambda v: 1 <= v <= MAX_DEPTH or f"must be between 1 and {MAX_DEPTH}"),
        "branching": (list, None, None),
        "paths": (list, None, None),
        "top_k": (int, None, lambda v: v >= 1 or "must be at least 1"),
        "nodes": (int, None, lambda v: 1 <= v <= MAX_TREE_NODES or f"must be between 1 and {MAX_TREE_NODES}"),
    },
    "precision": {
        "target": (str, "fp16", lambda v: v in MODEL_PRECISIONS or f"must be one of {', '.join(MODEL_PRECISIONS)}"),
        "drafter": (str, "fp16", lambda v: v in MODEL_PRECISIONS or f"must be one of {', '.join(MODEL_PRECISIONS)}"),
        "keep_high_precision": (list, ["lm_head", "fc"], None),
    },
    "profiles": {
        "batch": {"min": (int, 1, None), "opt": (int, 1, None), "max": (int, 4, None)},
        "context": {"min": (int, 16, None), "opt": (int, 1024, None), "max": (int, 2048, None)},
    },
    "calibration": {
        "dataset": (str, "mt-bench", lambda v: v in CALIBRATION_SETS or f"must be one of {', '.join(CALIBRATION_SETS)}"),
        "num_samples": (int, 32, lambda v: v >= 1 or "must be at least 1"),
        "max_tokens": (int, 512, lambda v: v >= 8 or "must be at least 8"),
    },
    # How a quantized build is measured against the unquantized models: prompts of `dataset` that the
    # calibration did not use; greedy continuations of max_new_tokens; tau at the recipe's depth.
    "evaluation": {
        "dataset": (str, "mt-bench", lambda v: v in CALIBRATION_SETS or f"must be one of {', '.join(CALIBRATION_SETS)}"),
        "num_prompts": (int, 4, lambda v: v >= 1 or "must be at least 1"),
        "max_new_tokens": (int, 32, lambda v: v >= 1 or "must be at least 1"),
        "tau": (bool, True, None),
    },
    "passes": {"skip": (list, [], lambda v: all(isinstance(name, str) for name in v)
                        or "must list pass names (see `eagle-export passes`)")},
    "engine": {"workspace_gib": (int, 8, lambda v: v >= 1 or "must be at least 1")},
}
REQUIRED = ("target", "drafter")


class RecipeError(EagleExportError):
    """One or more problems in a recipe, each with its key and line."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        if all(p.startswith("--") for p in problems):  # all the command line's: the flag first, not the recipe's path
            super().__init__("\n  ".join(problems), "pass a value the key takes (the shipped recipes in "
                             "eagle_export/recipes/ show every key)")
            return
        super().__init__(f"recipe {source} is invalid:\n  " + "\n  ".join(problems),
                         "correct the recipe keys named above (see eagle_export/recipes/ for complete examples)")


@dataclass
class Recipe:
    data: dict
    source: str
    base_dir: Path  # relative paths in the recipe are relative to the recipe file

    def __getitem__(self, key):
        return self.data[key]

    @property
    def speculation(self) -> Speculation:
        return Speculation.from_block(self.data["speculation"])

    def resolve_path(self, value: str) -> str:
        """`sample` stays a name; a relative path is taken from the recipe's directory, then from where
        the shipped data lies (so `samples/eagle3.1-smollm2-135m` names a shipped drafter)."""
        if value == "sample" or Path(value).is_absolute():
            return value
        for base in (self.base_dir, SAMPLES_DIR.parent):
            if (base / value).exists():
                return str((base / value).resolve())
        return value


def _lines(node: yaml.Node, prefix: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """1-based line of every key path in a composed YAML document."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            out[path] = key_node.start_mark.line + 1
            _lines(value_node, path, out)
    return out


SHOWN_CHARS = 200  # a value in an error message is cut here: a recipe's value may be any size


def shown(value) -> str:
    """repr(value), at most SHOWN_CHARS characters (a long list is never rendered whole)."""
    if isinstance(value, (list, tuple, dict)) and len(value) > 20:
        items = list(value)[:20]
        return f"{shown(items)[:-1]}, ... ({len(value)} items)]"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"... ({len(text)} characters)"


def _at(lines: dict, path: tuple) -> str:
    """Where a key came from: its recipe line, or the --set argument that gave it (or a key inside it)."""
    for key, where in lines.items():
        if isinstance(where, str) and (key[:len(path)] == path or path[:len(key)] == key):
            return where
    return f"line {lines.get(path, '?')}"


def safe_yaml(text: str, source: str):
    """yaml.safe_load, refusing aliases first: `*alias` nests one node many times, and a few lines of
    them expand to billions of items (a "billion laughs" bomb) before any check could look."""
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text)):
            raise RecipeError(source, ["uses a YAML alias (*name): recipes take plain values only"])
        return yaml.compose(text), yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "somewhere"
        raise RecipeError(source, [f"{where}: not valid YAML ({getattr(e, 'problem', e)})"]) from None


def _check(data: dict, schema: dict, lines: dict, prefix: tuple, problems: list[str]) -> dict:
    result = {}
    for key, value in data.items():
        path = prefix + (key,)
        where = f"{_at(lines, path)}: {'.'.join(map(str, path))}"
        if key not in schema:
            close = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f" (did you mean {'.'.join(map(str, prefix + (close[0],)))}?)" if close else ""
            problems.append(f"{where}: unknown key{hint}")
            continue
        spec = schema[key]
        if isinstance(spec, dict):
            if not isinstance(value, dict):
                problems.append(f"{where}: must be a mapping with keys {', '.join(spec)}")
                continue
            result[key] = _check(value, spec, lines, path, problems)
            continue
        kind, _, check = spec
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            problems.append(f"{where}: must be {kind.__name__}, found {type(value).__name__} {shown(value)}")
            continue
        verdict = check(value) if check else True
        if verdict is not True:
            problems.append(f"{where}: {shown(value)} {verdict}")
            continue
        result[key] = value
    return result


def _with_defaults(data: dict, schema: dict) -> dict:
    out = {}
    for key, spec in schema.items():
        if isinstance(spec, dict):
            out[key] = _with_defaults(data.get(key, {}), spec)
        else:
            out[key] = copy.deepcopy(data.get(key, spec[1]))
    return out


def _check_ranges(data: dict, lines: dict, problems: list[str]) -> None:
    for axis in ("batch", "context"):
        r = data["profiles"][axis]
        if not 1 <= r["min"] <= r["opt"] <= r["max"]:
            problems.append(f"{_at(lines, ('profiles', axis))}: profiles.{axis}: needs 1 <= min <= opt <= max, found "
                            f"min={r['min']} opt={r['opt']} max={r['max']}")
    width = Speculation.from_block(data["speculation"]).verify_width
    if data["profiles"]["context"]["max"] <= width:
        problems.append(f"{_at(lines, ('profiles', 'context'))}: profiles.context.max must exceed "
                        f"the verify width ({width}: the last token and every draft): a verify step alone "
                        "needs that many positions")


def _speculation(data: dict, given: dict, lines: dict, problems: list[str]) -> None:
    """Normalize how to speculate into data["speculation"], one of
        {kind: chain, depth: K}
        {kind: static_tree, parents: [...], depth: D, nodes: N}   (from branching or paths, tree.TreeShape)
        {kind: dynamic_tree, top_k: k, depth: D, nodes: N}        (EAGLE-2: top-k per node, best N kept)
    and set data["depth"] to the drafter graph's unroll depth, so chain builds read `depth` as before.
    `given` is the recipe as written: a top-level `depth` is the chain shorthand, and a tree takes its
    depth from its own block."""
    block, raw = data["speculation"], given.get("speculation") or {}
    kind = block["kind"]
    where = f"{_at(lines, ('speculation',))}: speculation"
    extra = {"chain": ("branching", "paths", "top_k", "nodes"), "static_tree": ("depth", "top_k", "nodes"),
             "dynamic_tree": ("branching", "paths")}[kind]
    for key in extra:
        if key in raw:
            problems.append(f"{where}.{key}: not a key of kind {kind}")
    if kind == "chain":
        depth = block["depth"] or data["depth"]
        if "depth" in given and block["depth"] not in (None, given["depth"]):
            problems.append(f"{where}.depth: {block['depth']} disagrees with depth: {given['depth']} (give one)")
        data["speculation"], data["depth"] = {"kind": "chain", "depth": depth}, depth
        return
    if "depth" in given:
        problems.append(f"{_at(lines, ('depth',))}: depth: is the chain shorthand; a {kind} takes its "
                        "depth from the speculation block")
    if kind == "static_tree":
        if (block["branching"] is None) == (block["paths"] is None):
            problems.append(f"{where}: a static_tree needs branching (e.g. [4, 2, 2, 1]) or paths "
                            "(e.g. [[0], [1], [0, 0]]), one of them")
            return
        try:
            shape = (TreeShape.from_branching(block["branching"]) if block["branching"] is not None
                     else TreeShape.from_paths(block["paths"]))
        except (EagleExportError, TypeError) as e:
            problems.append(f"{where}: {getattr(e, 'problem', e)}")
            return
        # kept a static_tree even when its shape is a chain ([1, 1, 1]): the recipe said tree
        data["speculation"] = {"kind": kind, "parents": list(shape.parents), "depth": shape.depth,
                               "nodes": shape.num_nodes}
    else:
        missing = [key for key in ("top_k", "depth", "nodes") if block[key] is None]
        if missing:
            problems.append(f"{where}: a dynamic_tree needs top_k, depth and nodes (missing {', '.join(missing)})")
            return
        if block["nodes"] < block["depth"]:
            problems.append(f"{where}.nodes: {block['nodes']} nodes cannot reach depth {block['depth']}")
            return
        if data["sampling"]:  # EAGLE-2's top-k expansion is a greedy rule: sampled drafts come from a chain or a static tree
            problems.append(f"{where}: a dynamic_tree drafts greedily; sampling: true needs a chain or a static_tree")
            return
        try:  # nodes beyond the candidates the top-k expansion draws
            data["speculation"] = DynamicTree(block["top_k"], block["depth"], block["nodes"]).to_block()
        except EagleExportError as e:
            problems.append(f"{where}: {e.problem}")
            return
    data["depth"] = data["speculation"]["depth"]


def parse_recipe(text: str, source: str = "<recipe>", base_dir: Path | None = None,
                 overrides: dict | None = None, flags: dict | None = None) -> Recipe:
    """`overrides` {dotted key: value} replace the recipe's values; `flags` {dotted key: how the command
    line spelled it, e.g. "--depth 12"} name them in errors (default: `--set key=value`)."""
    node, data = safe_yaml(text, source)
    if not isinstance(data, dict):
        raise RecipeError(source, ["line 1: a recipe is a YAML mapping of keys to values"])
    lines = _lines(node)
    overrides = overrides or {}
    # An override of how to speculate replaces the recipe's own, whichever way each is spelled: `depth`
    # (the chain shorthand) or the `speculation` block. Otherwise `--set speculation=...` on a recipe
    # with `depth: 4` would be refused for giving both.
    in_block = any(k.split(".")[0] == "speculation" for k in overrides)
    if in_block != ("depth" in overrides):
        data.pop("speculation" if "depth" in overrides else "depth", None)
    for dotted, value in overrides.items():
        _set_dotted(data, dotted, value)
        lines[tuple(dotted.split("."))] = (flags or {}).get(dotted, f"--set {dotted}={shown(value)}")  # not a line
    problems: list[str] = []
    checked = _check(data, SCHEMA, lines, (), problems)
    for key in REQUIRED:
        if key not in data:
            problems.append(f"line -: {key}: required key is missing")
    if problems:
        raise RecipeError(source, problems)
    full = _with_defaults(checked, SCHEMA)
    _speculation(full, data, lines, problems)
    if not problems:
        _check_ranges(full, lines, problems)
    if problems:
        raise RecipeError(source, problems)
    full["name"] = full["name"] or Path(source).stem
    return Recipe(full, source, base_dir or Path.cwd())


def _set_dotted(data: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for i, key in enumerate(keys[:-1]):
        data = data.setdefault(key, {})
        if not isinstance(data, dict):
            raise RecipeError("--set", [f"--set {dotted}: {'.'.join(keys[:i + 1])} is a value, not a section of keys"])
    data[keys[-1]] = value


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load_recipe(path: str | Path | None = None, overrides: dict | None = None, flags: dict | None = None) -> Recipe:
    """A recipe file, or the name of a shipped recipe (`qwen3-8b-eagle3.1`); the sample when None."""
    path = Path(path) if path else SAMPLE_RECIPE
    if not os.path.lexists(path) and str(path) in shipped_recipes():
        path = RECIPES_DIR / f"{path}.yaml"
    if not os.path.lexists(path):
        raise EagleExportError(f"recipe {path} does not exist",
                               "pass the path of a YAML recipe, or the name of a shipped one: "
                               + ", ".join(shipped_recipes()))
    if is_dir(path):  # (a symbolic link loop, or a directory above it that is unreadable, is named here)
        raise EagleExportError(f"recipe {path} is a directory", "pass the recipe's YAML file itself")
    text = read_text(path, "save the recipe as UTF-8 YAML, readable to this user")
    return parse_recipe(text, str(path), path.parent, overrides, flags)


def parse_override(text: str) -> tuple[str, object]:
    """`--set precision.target=fp8` -> ("precision.target", "fp8"); values are read as YAML scalars."""
    if "=" not in text:
        raise EagleExportError(f"override {text!r} lacks '='", "write --set key.path=value, e.g. --set depth=6")
    key, _, value = text.partition("=")
    try:
        return key.strip(), safe_yaml(value, f"--set {key.strip()}")[1]
    except RecipeError as e:  # a tag such as !!python/object, or an alias, is refused here too
        raise EagleExportError(f"--set {shown(text)}: the value is not a plain YAML scalar "
                               f"({'; '.join(e.problems)})",
                               "write a plain value, e.g. --set precision.target=fp8") from None


def pair_recipe(target: str | None, drafter: str | None, overrides: dict | None = None,
                flags: dict | None = None) -> Recipe:
    """The recipe of a pair the user names with --target/--drafter and no --recipe, derived from the
    pair itself rather than inherited from the sample's: its name from the checkpoints' directory
    names; profiles.context from the target's max_position_embeddings (capped at the schema's 2048:
    the KV caches a CPU build allocates); precision fp32 where no TensorRT and GPU can build engines
    (ONNX Runtime on CPU runs fp32 exactly), else fp16; calibration and evaluation on one prompt set
    (mt-bench unless --set calibration.dataset names another), its prompts cut at half the context.
    `derived` records all of this in the manifest, where `inspect` shows it. A target or drafter left
    out is the sample's."""
    from ..environment import nvidia_driver_loaded, tensorrt_version

    sample = load_recipe()
    names = {"target": target or sample["target"], "drafter": drafter or sample["drafter"]}
    dirs = {role: Path(sample.resolve_path(value)) for role, value in names.items()}
    if names["target"] == "sample":
        from ..data.sample import sample_target_dir

        dirs["target"] = sample_target_dir()
    config = read_json(dirs["target"] / "config.json", "pass a Hugging Face checkpoint directory with its config.json") \
        if os.path.lexists(dirs["target"] / "config.json") else {}
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    context = min(positions, 2048) if isinstance(positions, int) and positions > 8 else 2048
    engines = tensorrt_version() is not None and nvidia_driver_loaded()
    precision = "fp16" if engines else "fp32"
    dataset = (overrides or {}).get("calibration.dataset", "mt-bench")
    data = {
        "name": f"{dirs['target'].name}+{dirs['drafter'].name}",
        "target": str(names["target"] if names["target"] == "sample" else dirs["target"].resolve()),
        "drafter": str(dirs["drafter"].resolve()),
        "precision": {"target": precision, "drafter": precision},
        "profiles": {"context": {"min": min(16, context), "opt": min(512, context), "max": context}},
        "calibration": {"dataset": dataset, "num_samples": 16, "max_tokens": max(8, min(256, context // 2))},
        "evaluation": {"dataset": dataset},
        "derived": (f"from the pair: context {context} (the target's max_position_embeddings "
                    f"{positions if positions else 'unstated'}, at most 2048), precision {precision} "
                    f"({'TensorRT and a GPU are here' if engines else 'no TensorRT here: ONNX Runtime runs fp32 exactly'}), "
                    f"calibration and evaluation on {dataset}"),
    }
    return parse_recipe(yaml.safe_dump(data, sort_keys=False), f"the recipe derived from {data['name']}", Path.cwd(),
                        overrides, flags)


def resolve_sources(recipe: Recipe) -> tuple[Path, Path]:
    """The recipe's target and drafter directories, each refused unless it is one (before `build`
    imports torch: a missing checkpoint is said at once)."""
    from ..data.sample import sample_target_dir

    if recipe["target"] == "sample":
        target_dir = sample_target_dir()
    else:
        target_dir = Path(recipe.resolve_path(recipe["target"]))
    drafter_dir = Path(recipe.resolve_path(recipe["drafter"]))
    for role, path in (("target", target_dir), ("drafter", drafter_dir)):
        if not path.is_dir():
            raise EagleExportError(f"the recipe's {role} {path} is not a directory",
                                   f"download the {role} checkpoint and pass its directory: eagle-export build "
                                   f"--{role} DIR (or set `{role}:` in a copy of the recipe)")
    return target_dir, drafter_dir
