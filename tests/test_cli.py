"""The command line: --help on every command, --version, inspect's report."""

import json

import pytest
from click.testing import CliRunner

from eagle_export import __version__
from eagle_export.cli import main
from tiny_models import write_tiny_drafter, write_tiny_target


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_help_on_every_command():
    runner = CliRunner()
    assert runner.invoke(main, ["--help"]).exit_code == 0
    for name in main.commands:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return write_tiny_target(root / "target", "smollm2"), write_tiny_drafter(root / "drafter", "3.1")


def test_inspect_target_json(pair):
    result = CliRunner().invoke(main, ["inspect", str(pair[0]), "--json"])
    report = json.loads(result.output)
    assert report["kind"] == "target" and report["architecture"] == "LlamaForCausalLM"
    assert (report["num_layers"], report["hidden_size"], report["vocab_size"]) == (6, 64, 320)
    # tied embeddings are counted once: embed 320*64, 6 layers, final norm
    per_layer = (64 * 64 * 2 + 64 * 32 * 2) + 3 * 64 * 128 + 2 * 64  # q,o + k,v (2 kv heads); mlp; norms
    assert report["num_parameters"] == 320 * 64 + 6 * per_layer + 64
    assert report["warnings"] == []


def test_inspect_drafter_json(pair):
    result = CliRunner().invoke(main, ["inspect", str(pair[1]), "--json", "--target", str(pair[0])])
    report = json.loads(result.output)
    assert report["kind"] == "drafter" and report["eagle_version"] == "3.1"
    assert report["eagle_version_keys"] == {"fc_norm": True, "norm_output": True}
    assert report["aux_layer_ids"] == [1, 3, 4] and report["layer_numbering"] == "vllm"
    assert (report["draft_vocab_size"], report["target_hidden_size"]) == (96, 64)
    assert report["warnings"] == []


def test_inspect_warns_about_a_misfit(tmp_path, pair):
    drafter = write_tiny_drafter(tmp_path / "d", "3", aux=(1, 3, 11), target_hidden=96)
    report = json.loads(CliRunner().invoke(main, ["inspect", str(drafter), "--json", "--target",
                                                  str(pair[0])]).output)
    text = " ".join(report["warnings"])
    assert "[11] lie beyond the target's 6 layers" in text
    assert "expects target hidden size 96" in text
