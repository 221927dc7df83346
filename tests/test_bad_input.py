"""Bad checkpoints give an EagleExportError that names the problem and the fix, never a torch traceback."""

import ast
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny_models import tiny_drafter_config, write_tiny_drafter, write_tiny_target

from eagle_export.cli import main
from eagle_export.errors import CheckpointError
from eagle_export.models.checkpoint import load_drafter, load_state_dict, load_target
from eagle_export.models.config import DrafterConfig


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("t"), "llama")


def copy_with(src, dst, state=None, config=None):
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    save_file(state if state is not None else load_file(src / "model.safetensors"), str(dst / "model.safetensors"))
    return dst


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json") as e:
        load_target(tmp_path)
    assert "config.json" in e.value.fix


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_target(tmp_path / "nowhere")


def test_unsupported_architecture_lists_the_supported(tmp_path, tiny_target_dir):
    cfg = json.loads((tiny_target_dir / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    path = copy_with(tiny_target_dir, tmp_path / "neox", config=cfg)
    with pytest.raises(CheckpointError, match="unsupported architecture GPTNeoXForCausalLM") as e:
        load_target(path)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in e.value.fix


def test_missing_and_unexpected_weights_are_named(tmp_path, tiny_target_dir):
    state = load_file(tiny_target_dir / "model.safetensors")
    state.pop("model.layers.2.mlp.up_proj.weight")
    state["model.layers.2.mlp.surprise.weight"] = torch.zeros(3)
    path = copy_with(tiny_target_dir, tmp_path / "m", state=state)
    with pytest.raises(CheckpointError) as e:
        load_target(path)
    assert "missing weights: layers.2.mlp.up_proj.weight" in e.value.problem
    assert "unexpected weights: layers.2.mlp.surprise.weight" in e.value.problem


def test_shape_mismatch_names_tensor_expected_and_found(tmp_path, tiny_target_dir):
    state = load_file(tiny_target_dir / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    path = copy_with(tiny_target_dir, tmp_path / "m", state=state)
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_proj\.weight: expected \(32, 64\), found \(48, 64\)"):
        load_target(path)


def test_drafter_hidden_size_or_vocab_that_do_not_fit(tmp_path, tiny_target_dir):
    target = load_target(tiny_target_dir)
    wide = write_tiny_drafter(tmp_path / "wide", "3", target_hidden=96)
    with pytest.raises(CheckpointError, match="expects target hidden size 96, the target has 64"):
        load_drafter(wide, target=target)
    other_vocab = write_tiny_drafter(tmp_path / "vocab", "3", vocab=400)
    with pytest.raises(CheckpointError, match="vocabulary is 400 tokens, the target's 320"):
        load_drafter(other_vocab, target=target)
    deep = write_tiny_drafter(tmp_path / "deep", "3", aux=(1, 3, 9))
    with pytest.raises(CheckpointError, match=r"aux layer ids \[9\] lie beyond the target's 6 layers"):
        load_drafter(deep, target=target)


def test_target_and_drafter_swapped(tmp_path, tiny_target_dir):
    drafter_dir = write_tiny_drafter(tmp_path / "d", "3")
    with pytest.raises(CheckpointError, match="is an EAGLE drafter, not a target"):
        load_target(drafter_dir)
    with pytest.raises(CheckpointError, match="is not an EAGLE drafter"):
        load_drafter(tiny_target_dir)


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_that_would_run_code_is_refused(tmp_path, tiny_target_dir):
    path = tmp_path / "evil"
    path.mkdir()
    (path / "config.json").write_text((tiny_target_dir / "config.json").read_text())
    with open(path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": RunsCode()}, f)
    with pytest.raises(CheckpointError, match="weights-only loading refuses"):
        load_state_dict(path)


def test_plain_tensor_pickle_is_accepted_weights_only(tmp_path, tiny_target_dir):
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text((tiny_target_dir / "config.json").read_text())
    torch.save(load_file(tiny_target_dir / "model.safetensors"), path / "pytorch_model.bin")
    a, b = load_target(tiny_target_dir), load_target(path)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_truncated_safetensors(tmp_path, tiny_target_dir):
    path = copy_with(tiny_target_dir, tmp_path / "cut")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_target(path)


def test_missing_shard_is_named(tmp_path, tiny_target_dir):
    path = copy_with(tiny_target_dir, tmp_path / "idx")
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_target(path)


def test_unsupported_rope_scaling(tmp_path, tiny_target_dir):
    cfg = json.loads((tiny_target_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    path = copy_with(tiny_target_dir, tmp_path / "yarn", config=cfg)
    with pytest.raises(CheckpointError, match="rope scaling type 'yarn' is not supported"):
        load_target(path)


def test_cli_prints_the_error_without_a_traceback(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 2
    assert "error:" in result.output and "fix:" in result.output
    assert "Traceback" not in result.output


# An audit of every error's fix line (issue: a missing recipe's fix offered that same file as the
# example). A fix may format a value its problem also formats only for the reasons listed here;
# anything else must name what to do instead, not the thing that was missing.
REPEATS_ALLOWED = {
    ("build.py", "role"): "names the role (target or drafter), not the missing path",
    ("recipe.py", "role"): "names the role (target or drafter) and its --target / --drafter option, not the missing path",
    ("prompts.py", "', '.join(PROMPT_SETS)"): "the problem says which names exist, the fix offers them",
    ("sample.py", "gguf_path"): "the fix is to delete that corrupt file",
}


def formatted_values(node) -> set[str]:
    if isinstance(node, (ast.Name, ast.Attribute)):
        return {ast.unparse(node)}
    return {ast.unparse(n.value) for n in ast.walk(node) if isinstance(n, ast.FormattedValue)}


def test_no_fix_line_repeats_what_its_problem_names():
    root = Path(__file__).resolve().parent.parent
    errors = ("EagleExportError", "CheckpointError")
    sites, repeats = 0, {}
    for path in sorted((root / "eagle_export").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "func", None)
            if not (isinstance(node, ast.Call) and getattr(name, "id", getattr(name, "attr", None)) in errors):
                continue
            fix = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "fix"), None)
            if node.args and fix is not None:
                sites += 1
                for value in formatted_values(node.args[0]) & formatted_values(fix):
                    repeats[(path.name, value)] = f"{path.name}:{node.lineno}"
    assert sites > 60  # the walk found the error sites
    unexplained = {where: value for (file, value), where in repeats.items() if (file, value) not in REPEATS_ALLOWED}
    assert not unexplained, f"fix lines repeating their problem's value: {unexplained}"


# ---------------------------------------------------------------- build outputs: nothing a user owns is lost

def test_build_force_refuses_what_is_not_a_build_and_the_builds_own_inputs(tmp_path, tiny_target_dir, monkeypatch):
    drafter = write_tiny_drafter(tmp_path / "drafter", "3.1")
    notes = tmp_path / "p"
    notes.mkdir()
    (notes / "notes.txt").write_text("notes")
    pair = ["build", "--target", str(tiny_target_dir), "--drafter", str(drafter), "--force", "-o"]
    monkeypatch.chdir(notes)
    for out, problem in ((str(notes), "not a build made by eagle-export"), (str(drafter), "an input of this build"),
                         (str(tmp_path), "an input of this build"), ("", "not a build made by eagle-export")):
        result = CliRunner().invoke(main, pair + [out])
        assert result.exit_code == 2 and problem in result.output and "fix:" in result.output, (out, result.output)
    assert (notes / "notes.txt").read_text() == "notes"
    assert sorted(p.name for p in drafter.iterdir()) == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------- config fields the models do not implement

@pytest.mark.parametrize("edit, field", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"), ({"mlp_bias": True}, "mlp_bias=True"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"logits_scaling": 8.0}, "logits_scaling=8.0"), ({"attention_bias": True}, "attention_bias=true"),
])
def test_config_fields_the_models_do_not_implement_are_refused(tmp_path, tiny_target_dir, edit, field):
    """Each of these used to be ignored: the graph computed the plain Llama function instead."""
    cfg = {**json.loads((tiny_target_dir / "config.json").read_text()), **edit}
    with pytest.raises(CheckpointError, match=field.replace("(", r"\(")) as e:
        load_target(copy_with(tiny_target_dir, tmp_path / "t", config=cfg))
    assert "does not implement" in e.value.problem


def test_a_drafter_config_with_another_activation_is_refused(tmp_path, tiny_target_dir):
    drafter = write_tiny_drafter(tmp_path / "d", "3.1")
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu_pytorch_tanh"}))
    with pytest.raises(CheckpointError, match="hidden_act='gelu_pytorch_tanh'"):
        load_drafter(drafter, target=load_target(tiny_target_dir))


def test_qwen_sliding_windows_follow_max_window_layers():
    from tiny_models import tiny_target_config

    from eagle_export.models.config import TargetConfig

    def window(**edits):
        return TargetConfig.from_hf({**tiny_target_config("qwen2"), "layer_types": None, **edits}).sliding_window

    layers = tiny_target_config("qwen2")["num_hidden_layers"]
    assert window(use_sliding_window=False, sliding_window=8) is None
    assert window(use_sliding_window=True, sliding_window=8, max_window_layers=0) == 8
    assert window(use_sliding_window=True, sliding_window=8, max_window_layers=layers) is None  # no layer slides
    with pytest.raises(CheckpointError, match=f"sliding window on {layers - 1} of {layers} layers"):
        window(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    qwen3 = {**tiny_target_config("qwen2"), "architectures": ["Qwen3ForCausalLM"], "layer_types": None}
    assert TargetConfig.from_hf({**qwen3, "use_sliding_window": True, "sliding_window": 8,
                                 "max_window_layers": 0}).sliding_window == 8  # was ignored for Qwen3


# ---------------------------------------------------------------- no traceback: each bad input caught where it enters

def test_config_json_of_the_wrong_shape_or_type(tmp_path, tiny_target_dir):
    cfg = json.loads((tiny_target_dir / "config.json").read_text())
    for name, text, problem in (("list", "[1, 2]", "holds a JSON list"),
                                ("typed", json.dumps({**cfg, "hidden_size": "big"}),
                                 'sets hidden_size to "big", which must be a whole number'),
                                ("nested", json.dumps({**cfg, "rope_scaling": [1]}),
                                 "sets rope_scaling to [1], which must be an object"),
                                ("flag", json.dumps({**cfg, "tie_word_embeddings": "false"}),  # bool("false") is True
                                 'sets tie_word_embeddings to "false", which must be true or false'),
                                ("inner", json.dumps({**cfg, "rope_scaling": {"rope_type": "llama3", "factor": "8"}}),
                                 'sets rope_scaling.factor to "8", which must be a number'),
                                ("fraction", json.dumps({**cfg, "num_hidden_layers": 2.5}),
                                 "sets num_hidden_layers to 2.5, which must be a whole number")):
        path = copy_with(tiny_target_dir, tmp_path / name)
        (path / "config.json").write_text(text)
        result = CliRunner().invoke(main, ["inspect", str(path)])
        assert result.exit_code == 2 and problem in result.output and "Traceback" not in result.output, name
    drafter = tiny_drafter_config()
    for key, value, problem in (("eagle_config", {**drafter["eagle_config"], "norm_output": "no"},
                                 'eagle_config.norm_output to "no", which must be true or false'),
                                ("eagle_aux_hidden_state_layer_ids", [1, "3", 4],
                                 'eagle_aux_hidden_state_layer_ids[1] to "3", which must be a whole number')):
        with pytest.raises(CheckpointError, match=re.escape(problem)):
            DrafterConfig.from_hf({**drafter, key: value})
    path = copy_with(tiny_target_dir, tmp_path / "bytes")
    (path / "config.json").write_bytes(b'{"architectures": ["\xff\xfe"]}')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_target(path)


def test_unreadable_weights_are_not_called_missing(tmp_path, tiny_target_dir, monkeypatch):
    import eagle_export.models.checkpoint as checkpoint

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint, "safe_open", denied)  # chmod does not stop root, which runs CI here
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read .*permission denied") as e:
        load_target(tiny_target_dir)
    assert "permissions" in e.value.fix and "re-download" not in e.value.fix


def test_nan_weights_name_the_checkpoint_and_the_tensor(tmp_path, tiny_target_dir):
    state = load_file(tiny_target_dir / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="weight model.layers.1.mlp.up_proj.weight holds NaN") as e:
        load_target(copy_with(tiny_target_dir, tmp_path / "nan", state=state))
    assert "report" not in e.value.fix


def test_an_object_array_vocab_map_is_refused(tmp_path, tiny_target_dir):
    import numpy as np

    drafter = write_tiny_drafter(tmp_path / "d", "3.1", draft_vocab=64)
    weights = load_file(drafter / "model.safetensors")
    weights.pop("d2t")
    save_file(weights, str(drafter / "model.safetensors"))
    np.save(drafter / "d2t.npy", np.array([object()] * 64), allow_pickle=True)
    with pytest.raises(CheckpointError, match="d2t.npy is not a plain integer array"):
        load_drafter(drafter, target=load_target(tiny_target_dir))


def test_bad_recipes_and_overrides_through_the_cli(tmp_path, tiny_target_dir):
    drafter = write_tiny_drafter(tmp_path / "d", "3.1")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {tiny_target_dir}\ndrafter: {drafter}\n")
    cases = [
        (["--set", "depth=!!python/object/apply:os.system ['true']"], "not a plain YAML scalar"),
        (["--set", "target.x=3"], "target is a value, not a section"),
        (["--set", "passes.skip=[1, {a: b}]"], "must list pass names"),
        (["-o", "out\udcff"], "--out is not valid UTF-8"),
    ]
    for args, problem in cases:
        result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), *args])
        assert result.exit_code == 2 and problem in result.output and "Traceback" not in result.output, args
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"target: \xff\xfe\n")
    for path, problem in ((bad, "cannot be read as UTF-8"), (tmp_path, "is a directory")):
        result = CliRunner().invoke(main, ["build", "--recipe", str(path)])
        assert result.exit_code == 2 and problem in result.output, result.output
    assert not (tmp_path / "out\udcff").exists()


@pytest.mark.parametrize("args, problem", [
    (["--batch", "abc"], "--batch 'abc' is not a list"), (["--batch", "0"], "--batch '0' is not a list"),
    (["--batch", "1,,2"], "is not a list"), (["--num-prompts", "0"], "--num-prompts 0 leaves nothing"),
    (["--repeat", "0"], "--repeat 0 leaves nothing"), (["--threads", "-2"], "--threads -2 is not a thread count"),
])
def test_bench_arguments(tmp_path, args, problem):
    result = CliRunner().invoke(main, ["bench", str(tmp_path), *args])
    assert result.exit_code == 2 and problem in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args", [["--num-prompts", "0"], ["--new-tokens", "-4"]])
def test_inspect_check_refuses_an_empty_prompt_set_or_negative_answer_tokens(tmp_path, args):
    """(`--num-prompts 0` ran the check over 0 positions and reported that the drafter "matches no
    convention"; `--new-tokens -4` ran as 0.) Refused before any checkpoint is read."""
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "drafter"), "--target", str(tmp_path / "t"),
                                       "--check", *args])
    assert result.exit_code == 2 and "the check needs 1 prompt or more and 0 answer tokens or more" in result.output
    assert "fix: pass e.g. --num-prompts 16" in result.output and "Traceback" not in result.output


def test_a_manifest_of_the_wrong_shape(tmp_path):
    (tmp_path / "manifest.json").write_text("[1, 2, 3]")
    result = CliRunner().invoke(main, ["validate", str(tmp_path)])
    assert result.exit_code == 2 and "holds a JSON list, not a manifest" in result.output
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "depth": "deep", "models": [1]}))
    result = CliRunner().invoke(main, ["validate", str(tmp_path)])
    assert result.exit_code == 1 and "no artifacts map" in result.output  # a failed check, reported
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "depth": "deep", "models": [1], "artifacts": {}}))
    result = CliRunner().invoke(main, ["validate", str(tmp_path)])
    assert result.exit_code == 2 and "wrong shape" in result.output and "Traceback" not in result.output


def test_a_template_the_sandbox_blocks_and_a_non_utf8_prompt_file(tmp_path, tiny_target_dir):
    from eagle_export.data.prompts import ChatTemplate, conversations
    from eagle_export.errors import EagleExportError

    model = tmp_path / "m"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((tiny_target_dir / "tokenizer.json").read_bytes())
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(EagleExportError, match="sandbox blocks"):
        ChatTemplate(model).encode_chat([{"role": "user", "content": "hi"}])
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(EagleExportError, match="does not parse"):
        ChatTemplate(model)
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"caf\xe9\n")
    with pytest.raises(EagleExportError, match="cannot be read as UTF-8"):
        list(conversations(str(prompts)))


def test_an_unexpected_exception_prints_error_and_a_log_not_a_traceback(monkeypatch):
    import eagle_export.tools.doctor as doctor

    def broken():
        raise RuntimeError("something internal")

    monkeypatch.setattr(doctor, "doctor_report", broken)
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 3 and "error: internal error (RuntimeError: something internal)" in result.output
    log = result.output.split("traceback in ")[1].split()[0]
    assert "Traceback" not in result.output and "RuntimeError" in open(log).read()
    os.unlink(log)


# ---------------------------------------------------------------- second pass (issue 34): bounded, named, nothing left behind

def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, tiny_target_dir):
    """Repro: a 9^9-item alias bomb as passes.skip ran out of memory rendering the expanded list."""
    import time

    bomb = "".join(f"    - &l{i} [{', '.join([f'*l{i - 1}' if i else '1'] * 9)}]\n" for i in range(9))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {tiny_target_dir}\ndrafter: {tiny_target_dir}\npasses:\n  skip:\n{bomb}")
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "uses a YAML alias" in result.output and time.perf_counter() - start < 5
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe), "--set", "passes.skip=[&a [1, 1], *a]"])
    assert result.exit_code == 2 and "--set 'passes.skip=" in result.output and "alias" in result.output
    # A long value without aliases is shown cut, never whole (10^4 items, ~59,000 characters whole: the
    # YAML parser alone took 15 s of CPU on 10^5).
    recipe.write_text(f"target: {tiny_target_dir}\ndrafter: {tiny_target_dir}\npasses:\n  skip: {list(range(10**4))}\n")
    result = CliRunner().invoke(main, ["build", "--recipe", str(recipe)])
    assert result.exit_code == 2 and "(10000 items)" in result.output and len(result.output) < 2000


def test_set_errors_name_the_set_argument_not_a_recipe_line(tmp_path, tiny_target_dir):
    """Repro: `--set depth=...` errors cited "line 4" of a recipe the user never wrote."""
    for value, problem in (("99", "--set depth=99: depth: 99 must be between 1 and"),
                           ("deep", "--set depth='deep': depth: must be int")):
        result = CliRunner().invoke(main, ["build", "--set", f"depth={value}", "-o", str(tmp_path / "out")])
        assert result.exit_code == 2 and problem in result.output and "line 4" not in result.output, result.output
    result = CliRunner().invoke(main, ["build", "--set", "profiles.context.max=4", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--set profiles.context.max=4: profiles.context.max must exceed" in result.output
    assert not (tmp_path / "out").exists()


def test_symlink_loops_and_file_parents_are_named_as_such(tmp_path, tiny_target_dir):
    """Repro: a symlink-loop model.safetensors said "No such file" with the fix "re-download"; a
    symlink-loop config.json said "has no config.json"; `-o /dev/null/build` said "File exists"."""
    for name, wrong in (("model.safetensors", "re-download"), ("config.json", "has no config.json")):
        path = copy_with(tiny_target_dir, tmp_path / name.split(".")[0])
        (path / name).unlink()
        (path / name).symlink_to(name)
        result = CliRunner().invoke(main, ["inspect", str(path)] if name == "config.json"
                                    else ["export", "--target", str(path), "--draft", str(path), "-o", str(tmp_path / "o")])
        assert result.exit_code == 2 and f"{name} is a symbolic link loop" in result.output, result.output
        assert wrong not in result.output and "fix: point the link at the real file" in result.output
    (tmp_path / "afile").write_text("x")
    for out in ("/dev/null/build", str(tmp_path / "afile" / "deeper" / "build")):
        result = CliRunner().invoke(main, ["build", "--target", str(tiny_target_dir), "--drafter", str(tmp_path),
                                           "-o", out])
        assert result.exit_code == 2 and "is a file, not a directory" in result.output, result.output
        assert "File exists" not in result.output


def test_a_failed_build_removes_the_parent_directories_it_created(tmp_path, tiny_target_dir):
    """Repro: `-o new/deeper/build` with a bad target left new/deeper behind."""
    bad = tmp_path / "bad"
    bad.mkdir()
    result = CliRunner().invoke(main, ["build", "--target", str(bad), "--drafter", str(bad),
                                       "-o", str(tmp_path / "new" / "deeper" / "build")])
    assert result.exit_code == 2 and "has no config.json" in result.output, result.output
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_a_closed_pipe_ends_quietly(tmp_path):
    """Repro: `eagle-export inspect BUILD | head` reported an internal error and left a log each time."""
    import subprocess
    import sys
    import tempfile

    logs = set(Path(tempfile.gettempdir()).glob("eagle-export-error-*.log"))
    proc = subprocess.Popen([sys.executable, "-c", "from eagle_export.cli import main; main()", "passes"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before anything is written
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141) and "internal error" not in stderr and "Traceback" not in stderr, stderr
    assert set(Path(tempfile.gettempdir()).glob("eagle-export-error-*.log")) == logs


def test_a_full_disk_is_named_with_the_space_needed_not_a_bug(tmp_path, tiny_target_dir, monkeypatch):
    """Repro: a full disk during an export was reported as an eagle-export bug."""
    import errno

    import eagle_export.export.export as export
    import eagle_export.files as files

    drafter = write_tiny_drafter(tmp_path / "d", "3.1")
    out = tmp_path / "out"

    def full(model, path, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(export, "export_target", full)
    result = CliRunner().invoke(main, ["export", "--target", str(tiny_target_dir), "--draft", str(drafter), "-o", str(out)])
    assert result.exit_code == 2 and f"no space left on the device holding {out}/target.onnx" in result.output
    assert "MiB needed" in result.output and "bug" not in result.output, result.output
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: shutil_usage(0))  # no room at all: refused before
    result = CliRunner().invoke(main, ["export", "--target", str(tiny_target_dir), "--draft", str(drafter),
                                       "-o", str(tmp_path / "out2")])
    assert result.exit_code == 2 and "0 MiB free, about" in result.output and not (tmp_path / "out2").exists()


def test_an_export_that_fails_mid_write_leaves_the_output_directory_as_it_was(tmp_path, tiny_target_dir, monkeypatch):
    """`export -o DIR --force` writes beside DIR and renames each file in once all are written: a
    failure (here the disk fills half way through drafter.onnx) leaves DIR's earlier files whole and
    no half graph. (Written in place, target.onnx was already replaced and drafter.onnx cut short.)"""
    import errno

    import eagle_export.export.export as export

    drafter = write_tiny_drafter(tmp_path / "d", "3.1")
    out = tmp_path / "out"
    out.mkdir()
    (out / "target.onnx").write_text("an earlier export")
    (out / "notes.txt").write_text("mine")
    real = export.export_drafter

    def half_then_full(drafter, speculation, sampling, path, **kw):
        real(drafter, speculation, sampling, path, **kw)
        path.write_bytes(path.read_bytes()[:100])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(export, "export_drafter", half_then_full)
    args = ["export", "--target", str(tiny_target_dir), "--draft", str(drafter), "--depth", "2", "-o", str(out),
            "--force"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and f"no space left on the device holding {out}/drafter.onnx" in result.output
    assert sorted(os.listdir(out)) == ["notes.txt", "target.onnx"], result.output
    assert (out / "target.onnx").read_text() == "an earlier export" and (out / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["d", "out"]  # nothing left beside it either
    monkeypatch.setattr(export, "export_drafter", real)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == ["drafter.onnx", "export_summary.json", "notes.txt", "target.onnx"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "target.onnx").stat().st_size > 1000


def shutil_usage(free):
    import shutil

    return shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free)


@pytest.mark.parametrize("args, option", [
    (["export-checkpoint", "BUILD", "-o", "OUT", "--calib-prompts", "0"], "--calib-prompts"),
    (["export-checkpoint", "BUILD", "-o", "OUT", "--calib-prompts", "-3"], "--calib-prompts"),
    (["quantize", "--target", "T", "--precision", "fp8", "--calib-prompts", "0"], "--calib-prompts"),
    (["quantize", "--target", "T", "--precision", "fp8", "--eval-prompts", "0"], "--eval-prompts"),
    (["quantize", "--target", "T", "--precision", "fp8", "--tau-prompts", "-1"], "--tau-prompts"),
    (["quantize", "--target", "T", "--precision", "fp8", "--continuation-prompts", "-1"], "--continuation-prompts"),
    (["quantize", "--target", "T", "--precision", "fp8", "--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_prompt_counts_a_quantizing_command_cannot_use_are_refused_as_the_line_is_read(tmp_path, args, option):
    """(`export-checkpoint --calib-prompts 0` and `quantize --eval-prompts 0` ended in internal errors
    after loading the models: max() of an empty sequence, torch.cat of an empty list.)"""
    args = [str(tmp_path / a) if a in ("BUILD", "OUT", "T") else a for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output, result.output
    assert "internal error" not in result.output


@pytest.mark.parametrize("minutes", ["nan", "inf", "0", "-1"])
def test_train_drafter_refuses_a_budget_that_never_ends_or_never_starts(tmp_path, minutes):
    """(`--minutes nan` passed the `minutes <= 0` check and trained with no end.)"""
    result = CliRunner().invoke(main, ["train-drafter", "--target", str(tmp_path / "t"), "-o", str(tmp_path / "d"),
                                       "--minutes", minutes])
    assert result.exit_code == 2 and "--minutes and --tokens must be positive (and --minutes finite)" in result.output
    assert os.listdir(tmp_path) == []
