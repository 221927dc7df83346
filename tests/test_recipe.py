"""Recipes: every shipped one validates; every kind of error names its key and line."""

from pathlib import Path

import pytest

from eagle_export.errors import EagleExportError
from eagle_export.recipe import RECIPES_DIR, RecipeError, load_recipe, parse_override, parse_recipe

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
    (BASE + "depth: 8\nprofiles:\n  context: {min: 1, opt: 4, max: 8}\n", "profiles.context.max must exceed depth + 1"),
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
