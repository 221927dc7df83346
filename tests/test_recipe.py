"""Recipes: every shipped one validates; every kind of error names its key and line."""

from pathlib import Path

import pytest

from eagle_export.builder.recipe import RECIPES_DIR, RecipeError, load_recipe, parse_override, parse_recipe
from eagle_export.errors import EagleExportError

SHIPPED = sorted(RECIPES_DIR.glob("*.yaml"))


def test_three_recipes_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {"smollm2-135m-eagle3.1", "llama-3.1-8b-eagle3", "qwen3-8b-eagle3.1"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert 1 <= recipe["depth"] <= 8 and recipe["target"] and recipe["drafter"]


def test_sample_recipe_is_the_default_and_points_at_the_sample():
    recipe = load_recipe()
    assert recipe["target"] == "sample"
    assert Path(recipe.resolve_path(recipe["drafter"])).name == "eagle3.1-smollm2-135m"


def test_a_shipped_recipe_loads_by_name():
    assert load_recipe("qwen3-8b-eagle3.1")["target"] == load_recipe(RECIPES_DIR / "qwen3-8b-eagle3.1.yaml")["target"]


def test_a_missing_recipe_names_the_shipped_ones_not_itself(tmp_path):
    missing = tmp_path / "smollm2-135m-eagle3.1.yaml"
    with pytest.raises(EagleExportError) as e:
        load_recipe(missing)
    assert str(missing) in e.value.problem and str(missing) not in e.value.fix
    assert all(name in e.value.fix for name in ("smollm2-135m-eagle3.1", "qwen3-8b-eagle3.1", "llama-3.1-8b-eagle3"))


def errors_of(text):
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, "r.yaml")
    return e.value.problems


BASE = "target: t\ndrafter: d\n"


@pytest.mark.parametrize("text,expected", [
    (BASE + "depth: 12\n", "line 3: depth: 12 must be between 1 and 8"),
    (BASE + "depth: four\n", "line 3: depth: must be int, found str 'four'"),
    (BASE + "depth: true\n", "line 3: depth: must be int, found bool True"),
    (BASE + "precison:\n  target: fp8\n", "line 3: precison: unknown key (did you mean precision?)"),
    (BASE + "precision:\n  target: int3\n", "line 4: precision.target: 'int3' must be one of fp32, fp16, bf16, fp8, nvfp4"),
    (BASE + "precision: fp8\n", "line 3: precision: must be a mapping"),
    (BASE + "profiles:\n  batch: {min: 4, opt: 2, max: 1}\n", "profiles.batch: needs 1 <= min <= opt <= max"),
    (BASE + "depth: 8\nprofiles:\n  context: {min: 1, opt: 4, max: 8}\n", "profiles.context.max must exceed the verify width (9"),
    ("drafter: d\n", "target: required key is missing"),
    (BASE + "depth: [1\n", "not valid YAML"),
    ("- a\n- b\n", "a recipe is a YAML mapping"),
    (BASE + "calibration:\n  num_samples: 0\n", "line 4: calibration.num_samples: 0 must be at least 1"),
])
def test_each_kind_of_error_names_key_and_line(text, expected):
    assert any(expected in p for p in errors_of(text)), errors_of(text)


def test_all_problems_are_reported_at_once():
    problems = errors_of(BASE + "depth: 0\nsampling: maybe\nnope: 1\n")
    assert len(problems) == 3


def test_overrides_are_validated_like_the_file():
    recipe = parse_recipe(BASE, overrides=dict([parse_override("precision.target=fp8"), parse_override("depth=6")]))
    assert recipe["precision"]["target"] == "fp8" and recipe["depth"] == 6
    with pytest.raises(RecipeError, match="depth: 99 must be between 1 and 8"):
        parse_recipe(BASE, overrides={"depth": 99})


def test_missing_recipe_file(tmp_path):
    from eagle_export.errors import EagleExportError

    with pytest.raises(EagleExportError, match="does not exist"):
        load_recipe(tmp_path / "none.yaml")


# ------------------------------------------------------------------ speculation: chains and trees

def test_depth_is_the_chain_shorthand():
    assert parse_recipe(BASE)["speculation"] == {"kind": "chain", "depth": 4}
    recipe = parse_recipe(BASE + "depth: 6\n")
    assert recipe["speculation"] == {"kind": "chain", "depth": 6} and recipe["depth"] == 6
    recipe = parse_recipe(BASE + "speculation: {kind: chain, depth: 3}\n")
    assert recipe["speculation"] == {"kind": "chain", "depth": 3} and recipe["depth"] == 3


def test_static_trees_from_branching_or_paths():
    recipe = parse_recipe(BASE + "speculation: {kind: static_tree, branching: [2, 2, 1]}\n")
    assert recipe["speculation"] == {"kind": "static_tree", "parents": [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5],
                                     "depth": 3, "nodes": 10}
    assert recipe["depth"] == 3  # the drafter graph unrolls the tree's depth
    by_paths = parse_recipe(BASE + "speculation:\n  kind: static_tree\n  paths: [[0], [1], [0, 0]]\n")
    assert by_paths["speculation"] == {"kind": "static_tree", "parents": [-1, -1, 0], "depth": 2, "nodes": 3}


def test_dynamic_trees():
    recipe = parse_recipe(BASE + "speculation: {kind: dynamic_tree, top_k: 4, depth: 5, nodes: 16}\n")
    assert recipe["speculation"] == {"kind": "dynamic_tree", "top_k": 4, "depth": 5, "nodes": 16}
    assert recipe["depth"] == 5


@pytest.mark.parametrize("text, message", [
    ("depth: 4\nspeculation: {kind: chain, depth: 5}\n", "speculation.depth: 5 disagrees with depth: 4"),
    ("speculation: {kind: chain, depth: 4, nodes: 8}\n", "speculation.nodes: not a key of kind chain"),
    ("speculation: {kind: beam}\n", "speculation.kind: 'beam' must be one of chain, static_tree, dynamic_tree"),
    ("speculation: {kind: static_tree}\n", "needs branching (e.g. [4, 2, 2, 1]) or paths"),
    ("speculation: {kind: static_tree, branching: [2], paths: [[0]]}\n", "one of them"),
    ("speculation: {kind: static_tree, branching: [4, 4, 4]}\n", "a tree of 84 nodes and depth 3 is too large"),
    ("speculation: {kind: static_tree, branching: [2, 0]}\n", "is not a list of positive widths"),
    ("speculation: {kind: static_tree, paths: [[0], [1, 0]]}\n", "whose prefixes are paths too"),
    ("speculation: {kind: static_tree, paths: [3]}\n", "speculation:"),
    ("speculation: {kind: static_tree, branching: [2], depth: 1}\n", "speculation.depth: not a key of kind static_tree"),
    ("depth: 3\nspeculation: {kind: static_tree, branching: [2]}\n", "depth: is the chain shorthand"),
    ("speculation: {kind: dynamic_tree, top_k: 4}\n", "needs top_k, depth and nodes (missing depth, nodes)"),
    ("speculation: {kind: dynamic_tree, top_k: 4, depth: 6, nodes: 3}\n", "3 nodes cannot reach depth 6"),
    ("speculation: {kind: dynamic_tree, top_k: 4, depth: 6, nodes: 99}\n", "nodes: 99 must be between 1 and 64"),
    ("sampling: true\nspeculation: {kind: dynamic_tree, top_k: 4, depth: 2, nodes: 8}\n", "a dynamic_tree drafts greedily"),
    ("speculation: {kind: dynamic_tree, top_k: 4, depth: 3, nodes: 36}\nprofiles:\n  context: {min: 1, opt: 8, max: 36}\n",
     "profiles.context.max must exceed the verify width (37"),
    ("speculation: {kind: dynamic_tree, top_k: 4, depth: 2, nodes: 40}\n",
     "speculation: dynamic tree top_k=4, depth=2, nodes=40 is out of range"),
])
def test_bad_speculation_blocks_name_the_key(text, message):
    problems = errors_of(BASE + text)
    assert any(message in p for p in problems), problems


def test_a_tree_from_the_command_line():
    recipe = parse_recipe(BASE, overrides={"speculation.kind": "static_tree", "speculation.branching": [3, 1]})
    assert recipe["speculation"]["nodes"] == 6 and recipe["depth"] == 2


def test_an_override_of_how_to_speculate_replaces_the_recipes_own_spelling():
    """`--set speculation=...` on a recipe that says `depth: 4` (the sample) builds the tree, and
    `--set depth=6` / `--depth 6` on a tree recipe builds a chain of 6; giving both in one place is
    still refused."""
    tree = {"speculation": parse_override("speculation={kind: static_tree, branching: [8, 1]}")[1]}
    recipe = parse_recipe(BASE + "depth: 4\n", overrides=tree)
    assert recipe["speculation"]["kind"] == "static_tree" and recipe["speculation"]["nodes"] == 16
    assert recipe["depth"] == 2
    recipe = parse_recipe(BASE + "speculation: {kind: dynamic_tree, top_k: 4, depth: 3, nodes: 8}\n",
                          overrides={"depth": 6})
    assert recipe["speculation"] == {"kind": "chain", "depth": 6} and recipe["depth"] == 6
    with pytest.raises(RecipeError, match="depth: is the chain shorthand"):
        parse_recipe(BASE + "depth: 4\nspeculation: {kind: static_tree, branching: [2]}\n")
