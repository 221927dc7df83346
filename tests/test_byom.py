"""Bring your own model: a target saved by transformers 5 (chat_template.jinja) or a base model (no
template), a build of a pair other than the sample's (its own recipe), --skip-conformance, FP8/NVFP4
checkpoints exported from a build with its own calibration set, and `train-drafter`."""

import json
import shutil

import pytest
from click.testing import CliRunner
from tiny_models import write_tiny_drafter, write_tiny_target, write_trained_tiny_drafter

from eagle_export.builder.build import conformance_prompts
from eagle_export.builder.recipe import pair_recipe
from eagle_export.cli import main
from eagle_export.tools.checkpoint_export import ROUND_TRIP_TOLERANCE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT_TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"


def transformers5_target(path, chat: bool = True):
    """A tiny Llama whose tokenizer transformers itself saved: with a chat template, transformers 5
    writes it to chat_template.jinja (tokenizer_config.json has no chat_template key); a base model
    has none anywhere."""
    from transformers import PreTrainedTokenizerFast

    write_tiny_target(path, "llama")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="w2", unk_token="w0")
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    (path / "tokenizer_config.json").unlink()
    tokenizer.save_pretrained(path)
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    assert (path / "chat_template.jinja").is_file() == chat
    return path


def trained_drafter(target, path):
    """A tiny drafter trained on the prompts a build checks conventions on, rendered as this target
    renders them (chat template or raw text)."""
    prompts = conformance_prompts(pair_recipe(str(target), str(path.parent / "unused")), target)
    return write_trained_tiny_drafter(path, target, "3.1", prompts, aux=(1, 3, 4), draft_vocab=96)


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def json_line(output: str) -> dict:
    """The JSON record among a command's lines (its progress lines share the output here)."""
    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


def test_a_pair_other_than_the_samples_gets_its_own_recipe(tmp_path):
    target = write_tiny_target(tmp_path / "my-target", "llama", max_position_embeddings=300)
    drafter = write_tiny_drafter(tmp_path / "my-drafter", "3.1")
    recipe = pair_recipe(str(target), str(drafter))
    assert recipe["name"] == "my-target+my-drafter"
    assert recipe["profiles"]["context"] == {"min": 16, "opt": 300, "max": 300}  # the target's positions
    assert recipe["calibration"] == {"dataset": "mt-bench", "num_samples": 16, "max_tokens": 150}
    assert recipe["evaluation"]["dataset"] == "mt-bench" and recipe["precision"]["target"] == "fp32"
    assert "max_position_embeddings 300" in recipe["derived"]
    chosen = pair_recipe(str(target), str(drafter), {"calibration.dataset": "sharegpt"})
    assert chosen["calibration"]["dataset"] == chosen["evaluation"]["dataset"] == "sharegpt"
    assert "on sharegpt" in chosen["derived"]


@pytest.fixture(scope="module")
def chat_build(tmp_path_factory):
    """The transformers-5 chat pair, built with --target/--drafter (no recipe: one derived from it)."""
    root = tmp_path_factory.mktemp("byom")
    target = transformers5_target(root / "chat-target")
    drafter = trained_drafter(target, root / "chat-drafter")
    log = invoke("build", "--target", target, "--drafter", drafter, "-o", root / "build")
    return root, target, drafter, log


def test_a_transformers5_chat_model_passes_check_build_validate_and_run(chat_build):
    root, target, drafter, log = chat_build
    assert "recipe chat-target+chat-drafter, derived from the pair" in log
    assert "note:" not in log  # chat_template.jinja was read: no raw-text fallback
    check = invoke("inspect", drafter, "--target", target, "--check", "--num-prompts", 4)
    assert "as configured" in check and "note:" not in check
    inspected = invoke("inspect", root / "build")
    assert "chat-target+chat-drafter (derived from the pair: context 512" in inspected
    assert "gate skipped" not in inspected
    assert (root / "build" / "chat_template.jinja").is_file()  # run --chat reads it from the build
    assert "FAIL" not in invoke("validate", root / "build")
    run = json_line(invoke("run", root / "build", "--chat", "w5 w6", "--max-new-tokens", 8, "--json"))
    assert run["stats"]["prompt_tokens"] == 5  # "w1 w5 w6 w2 w3": the template from chat_template.jinja


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantized_checkpoints_export_from_a_build_with_its_own_calibration(chat_build, precision):
    """export-checkpoint BUILD with no --calib-prompts calibrates on the build's own calibration set
    (its recipe's: mt-bench, 16 prompts) and must load back with the exported model's logits."""
    root, *_ = chat_build
    out = root / f"ckpt-{precision}"
    log = invoke("export-checkpoint", root / "build", "-o", out, "--format", "vllm", "--precision", precision)
    summary = json.loads((out / "export_summary.json").read_text())
    assert summary["calibration"]["prompts"] == 16 and summary["precision"] == precision
    assert summary["round_trip"]["max_abs_logit_diff"] <= ROUND_TRIP_TOLERANCE, log


@pytest.mark.slow
def test_a_base_model_passes_check_build_validate_and_run(tmp_path):
    target = transformers5_target(tmp_path / "base-target", chat=False)
    drafter = trained_drafter(target, tmp_path / "base-drafter")
    check = invoke("inspect", drafter, "--target", target, "--check", "--num-prompts", 4)
    assert "note: " in check and "no chat template (a base model)" in check
    log = invoke("build", "--target", target, "--drafter", drafter, "-o", tmp_path / "build")
    assert sum("no chat template (a base model)" in line for line in log.splitlines()) == 1
    assert "FAIL" not in invoke("validate", tmp_path / "build")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "build"), "--chat", "w5 w6", "--max-new-tokens", "8",
                                       "--json"])
    assert result.exit_code == 0, result.output
    record = json_line(result.stdout)
    assert record["stats"]["prompt_tokens"] == 2  # the raw text "w5 w6\n\n": no template tokens
    assert "no chat template" in result.stderr


@pytest.mark.slow
def test_skip_conformance_builds_an_untrained_drafter_and_says_so_everywhere(chat_build, tmp_path):
    _, target, _, _ = chat_build
    untrained = write_tiny_drafter(tmp_path / "untrained", "3.1", aux=(1, 3, 4))
    refused = CliRunner().invoke(main, ["build", "--target", str(target), "--drafter", str(untrained), "-o",
                                        str(tmp_path / "refused")])
    assert refused.exit_code == 2 and "matches no convention" in refused.output
    assert "--skip-conformance" in refused.output and not (tmp_path / "refused").exists()
    log = invoke("build", "--target", target, "--drafter", untrained, "-o", tmp_path / "smoke", "--skip-conformance")
    assert "matches no convention" in log and "built anyway (--skip-conformance)" in log
    manifest = json.loads((tmp_path / "smoke" / "manifest.json").read_text())
    assert manifest["conformance"]["gate_skipped"] == "--skip-conformance" and not manifest["conformance"]["matched"]
    assert "gate skipped (--skip-conformance" in invoke("inspect", tmp_path / "smoke")
    assert "FAIL" not in invoke("validate", tmp_path / "smoke")


@pytest.mark.slow
def test_bring_your_own_model_route_end_to_end(tmp_path, monkeypatch):
    """The README's route on a tiny target: train-drafter -> build -> validate -> run -> export-checkpoint.
    The ShareGPT text is the real one (the word tokenizer reads most of it as w0): what is checked is
    that each command takes the previous one's output, and that train-drafter states its quality.
    Training stops at --tokens (a few optimizer steps: what is checked is the route, not how good the
    drafter gets; without it the rest of the minute went to training, ~40 s of this test)."""
    target = transformers5_target(tmp_path / "target")
    log = invoke("train-drafter", "--target", target, "-o", tmp_path / "drafter", "--minutes", 1, "--tokens", 4096)
    summary = json.loads((tmp_path / "drafter" / "train_summary.json").read_text())
    assert f"held-out acc@1 {summary['acc@1']:.3f}" in log and summary["held_out_positions"] > 0
    assert "stopping at step" in log and "min guard" not in log  # --tokens ended training, not the clock
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no work directory left behind
    refused = CliRunner().invoke(main, ["train-drafter", "--target", str(target), "-o", str(tmp_path / "drafter")])
    assert refused.exit_code == 2 and "already exists" in refused.output
    invoke("build", "--target", target, "--drafter", tmp_path / "drafter", "-o", tmp_path / "build",
           "--skip-conformance")
    assert "FAIL" not in invoke("validate", tmp_path / "build")
    invoke("run", tmp_path / "build", "--chat", "w5 w6", "--max-new-tokens", 8)
    invoke("export-checkpoint", tmp_path / "build", "-o", tmp_path / "ckpt", "--format", "vllm")
    shutil.rmtree(tmp_path / "build")


@pytest.mark.slow
def test_the_readme_fp8_export_works_from_the_sample_build(tmp_path):
    """With one torch thread (this module's fixture) the sample's calibrated q/k/v input amax is one
    that fl(amax / 448) x 448 does not give back: before snap_fp8_amaxes it loaded back 0.236 away."""
    invoke("build", "-o", tmp_path / "sample")
    out = tmp_path / "vllm-fp8"
    invoke("export-checkpoint", tmp_path / "sample", "-o", out, "--format", "vllm", "--precision", "fp8")
    summary = json.loads((out / "export_summary.json").read_text())
    assert summary["round_trip"]["max_abs_logit_diff"] <= ROUND_TRIP_TOLERANCE
    assert summary["calibration"]["prompts"] == 16  # the sample recipe's calibration set
