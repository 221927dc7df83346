"""`inspect --check`: each convention a config can misstate is named when the numbers say so.

Two tiny drafters are trained briefly on a tiny target (tiny_models.write_trained_tiny_drafter), so
each has conventions that are right: the ones it was trained under. Each mutation writes a copy
whose config.json (or vocabulary map) misstates one of them; the check must name that field, and
must name nothing for the drafters as trained.
"""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import token_sequences, write_tiny_drafter, write_tiny_target, write_trained_tiny_drafter

from eagle_export.builder.conformance import conformance_check
from eagle_export.errors import CheckpointError, EagleExportError
from eagle_export.models.checkpoint import load_drafter, load_target, save_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A 7-layer target: L-3 = 4 and L-4 = 3. The EAGLE-3 drafter is trained on (1, 2, 3), Edge-LLM's
# L-4 capture, with a reduced draft vocabulary; the EAGLE-3.1 one on (1, 2, 4) with the full one.
AUX = {"3": (1, 2, 3), "3.1": (1, 2, 4)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    target_dir = write_tiny_target(root / "target", "llama", num_hidden_layers=7, initializer_range=0.4)
    sequences = token_sequences()
    drafters = {
        "3": write_trained_tiny_drafter(root / "d3", target_dir, "3", sequences, aux=AUX["3"], draft_vocab=160),
        "3.1": write_trained_tiny_drafter(root / "d31", target_dir, "3.1", sequences, aux=AUX["3.1"]),
    }
    return target_dir, drafters, sequences


def check(target_dir, drafter_dir, sequences):
    target = load_target(target_dir)
    return conformance_check(target, load_drafter(drafter_dir, target=target), sequences, new_tokens=0)


def mutate(src, dst, config=None, state=None):
    """A copy of drafter `src` with config.json edited by `config(dict)` and the weights by `state(dict)`."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if state:
        weights = load_file(dst / "model.safetensors")
        state(weights)
        save_file(weights, dst / "model.safetensors")
    return dst


def set_key(key, value):
    def edit(cfg):
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return edit


def set_aux(ids):
    def edit(cfg):
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(ids)
    return edit


@pytest.mark.slow
@pytest.mark.parametrize("version", ["3", "3.1"])
def test_drafters_as_trained_pass_cleanly(pair, version):
    target_dir, drafters, sequences = pair
    report = check(target_dir, drafters[version], sequences)
    assert report["ok"] and report["matched"] and not report["findings"], report["findings"]
    configured = report["readings"][0]
    assert configured["reading"] == "as configured" and min(configured["acc@1"]) > 0.9
    assert report["aux_layer_ids"] == list(AUX[version])


def shuffled_vocab_map(weights):
    """A non-trivial d2t for a drafter trained on draft ids = target ids (a permutation's offsets)."""
    vocab = weights["lm_head.weight"].shape[0]
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    weights["d2t"] = perm - torch.arange(vocab)
    weights["t2d"] = torch.ones(vocab, dtype=torch.bool)


MUTATIONS = {  # name: (version, config edit, weights edit, the field the check must name)
    "aux ids numbered one higher": ("3", set_aux([2, 3, 4]), None, "eagle_aux_hidden_state_layer_ids"),
    "aux ids read in TorchSpec numbering": ("3.1", set_key("layer_numbering", "torchspec"), None,
                                            "eagle_aux_hidden_state_layer_ids"),
    "L-3 written for an L-4 capture": ("3", set_aux([1, 2, 4]), None, "eagle_aux_hidden_state_layer_ids"),
    "EAGLE-3 said to feed back post-norm": ("3", set_key("norm_output", True), None, "norm_output"),
    "EAGLE-3.1 said to feed back pre-norm": ("3.1", set_key("norm_output", None), None, "norm_output"),
    "norm_before_residual on an EAGLE-3": ("3", set_key("norm_before_residual", True), None, "norm_before_residual"),
    "norm_before_residual on an EAGLE-3.1": ("3.1", set_key("norm_before_residual", True), None,
                                             "norm_before_residual"),
    "norm_before_fc on an EAGLE-3": ("3", set_key("norm_before_fc", True), None, "norm_before_fc"),
    "norm_before_fc on an EAGLE-3.1": ("3.1", set_key("norm_before_fc", True), None, "norm_before_fc"),
    "a vocabulary map the drafter was not trained with": ("3.1", None, shuffled_vocab_map, "d2t"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_misstated_convention_is_named(pair, tmp_path, name):
    target_dir, drafters, sequences = pair
    version, config, state, field = MUTATIONS[name]
    report = check(target_dir, mutate(drafters[version], tmp_path / "d", config, state), sequences)
    named = {f["field"]: f for f in report["findings"]}
    assert field in named and not report["ok"], report["readings"]
    assert named[field]["interval"][0] > 0 and named[field]["gain"] > report["min_gain"]
    assert field in named[field]["message"] or "aux layer ids" in named[field]["message"] \
        or "d2t" in named[field]["message"]


@pytest.fixture(scope="module")
def close_layers(tmp_path_factory):
    """A target whose layers change the residual stream little (initializer_range 0.02, as real
    ones are initialized), so neighbouring layers' states are alike, as in the sample target: an
    EAGLE-3.1 drafter trained on (1, 2, 4) keeps most of its top-1 when read one layer off."""
    root = tmp_path_factory.mktemp("close_layers")
    target_dir = write_tiny_target(root / "target", "llama", num_hidden_layers=7, initializer_range=0.02)
    sequences = token_sequences()
    return target_dir, write_trained_tiny_drafter(root / "d31", target_dir, "3.1", sequences, aux=(1, 2, 4)), sequences


def test_aux_ids_one_off_are_named_where_acc1_barely_moves(close_layers, tmp_path):
    """A fixed acc@1 margin (0.05) missed this: the shifted config's acc@1 is within 0.05 of the
    right reading's at both steps, yet the target's tokens get clearly more probability under it."""
    target_dir, drafter_dir, sequences = close_layers
    assert check(target_dir, drafter_dir, sequences)["findings"] == []
    report = check(target_dir, mutate(drafter_dir, tmp_path / "d", set_aux([2, 3, 5])), sequences)
    right = next(r for r in report["readings"] if r["value"] == [1, 2, 4])
    configured = report["readings"][0]
    assert max(a - c for a, c in zip(right["acc@1"], configured["acc@1"])) < 0.05, report["readings"]
    named = {f["field"]: f for f in report["findings"]}
    assert "eagle_aux_hidden_state_layer_ids" in named and not report["ok"], report["readings"]
    finding = named["eagle_aux_hidden_state_layer_ids"]
    assert finding["value"] == [1, 2, 4] and finding["interval"][0] > 0 and finding["gain"] > report["min_gain"]
    assert "aux layer ids were [1, 2, 4]" in finding["message"] and "nats per position" in finding["message"]


@pytest.mark.slow
def test_fc_norm_folded_and_dropped_is_named(pair, tmp_path):
    """An exporter that folds EAGLE-3.1's fc_norm gains into fc and drops the key leaves a drafter
    that still needs its aux states normalized: it behaves as if fc_norm were true."""
    from eagle_export.passes.fold_norms import fold_fc_norm_gains

    target_dir, drafters, sequences = pair
    target = load_target(target_dir)
    drafter = load_drafter(drafters["3.1"], target=target)
    fold_fc_norm_gains(drafter)
    drafter.fc_norm = None
    config = json.loads((drafters["3.1"] / "config.json").read_text())
    config.pop("fc_norm")
    save_drafter(drafter, tmp_path / "folded", config=config)
    report = check(target_dir, tmp_path / "folded", sequences)
    # A norm over the concatenation recovers part of it too; the per-aux norm recovers the most.
    assert report["findings"][0]["field"] == "fc_norm", report["readings"]
    assert "behaves as if fc_norm were true" in report["findings"][0]["message"]


@pytest.mark.parametrize("version, config, state, words", [
    ("3.1", set_key("fc_norm", None), None, ["fc_norm.*", "fc_norm: true"]),
    ("3", set_key("fc_norm", True), None, ["fc_norm: true", "no fc_norm"]),
    ("3", None, lambda w: w.__setitem__("d2t", w["d2t"] + torch.arange(len(w["d2t"]))), ["d2t", "absolute"]),
])
def test_a_config_the_weights_contradict_is_named_at_load(pair, tmp_path, version, config, state, words):
    target_dir, drafters, _ = pair
    with pytest.raises(CheckpointError) as e:
        load_drafter(mutate(drafters[version], tmp_path / "d", config, state), target=load_target(target_dir))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_random_drafter_matches_no_convention(pair, tmp_path):
    target_dir, _, sequences = pair
    drafter_dir = write_tiny_drafter(tmp_path / "random", "3.1", aux=AUX["3.1"])
    report = check(target_dir, drafter_dir, sequences)
    assert not report["matched"] and not report["ok"]
    assert max(r["acc@1"][0] for r in report["readings"]) < report["min_acc"]


@pytest.mark.slow
def test_cli_check_passes_the_drafter_and_fails_a_misstated_one_with_strict(pair, tmp_path):
    from click.testing import CliRunner

    from eagle_export.cli import main

    target_dir, drafters, sequences = pair
    prompts = tmp_path / "prompts.txt"  # the tiny tokenizer reads "w<id>" words back as the ids
    prompts.write_text("\n".join(" ".join(f"w{i}" for i in ids) for ids in sequences) + "\n")
    args = ["--target", str(target_dir), "--check", "--strict", "--prompts", str(prompts)]
    ok = CliRunner().invoke(main, ["inspect", str(drafters["3"]), *args])
    assert ok.exit_code == 0, ok.output
    assert "conformance ok" in ok.output and "as configured" in ok.output
    bad = mutate(drafters["3"], tmp_path / "bad", set_key("norm_before_residual", True))
    result = CliRunner().invoke(main, ["inspect", str(bad), *args])
    assert result.exit_code == 1
    assert "this drafter behaves as if norm_before_residual were false" in result.output
    lenient = CliRunner().invoke(main, ["inspect", str(bad), "--target", str(target_dir), "--check", "--prompts",
                                        str(prompts), "--json"])
    assert lenient.exit_code == 0 and json.loads(lenient.output)["conformance"]["findings"]


def test_a_rebuild_of_the_same_pair_reuses_the_conformance_result(tmp_path, monkeypatch):
    """The check (the longest build stage on 2 cores) runs once per pair of checkpoint files and
    prompts; a changed file or prompt runs it again, and a refused drafter is never remembered."""
    from eagle_export.builder import build

    calls = []
    passed = {"prompts": 1, "positions": 9, "new_tokens": 0, "aux_layer_ids": [1, 2, 3], "findings": [],
              "readings": [{"reading": "as configured", "field": None, "value": None, "acc@1": [0.58, 0.57],
                            "positions": 9, "gain": [0.0, 0.0], "interval": [[0.0, 0.0], [0.0, 0.0]]}],
              "matched": True, "ok": True, "min_gain": 0.01, "level": 0.95, "min_acc": 0.05}
    verdict = {"result": passed}
    monkeypatch.setattr(build, "conformance_prompts", lambda recipe, target: prompts["now"])
    monkeypatch.setattr(build, "conformance_check", lambda t, d, p, n, eos: calls.append(p) or verdict["result"])
    prompts = {"now": [[1, 2, 3]]}
    files = {"target": {"model.safetensors": "aa"}, "drafter": {"model.safetensors": "bb"}}
    lines = []

    def stage(source_files):
        target = SimpleNamespace(config=SimpleNamespace(eos_ids=()))  # the build's loaded models (unused here)
        return build.conformance_stage(None, tmp_path, tmp_path, source_files, target, None, lines.append)

    assert stage(files) == passed and stage(files) == passed and len(calls) == 1
    kept = build.conformance.cache_file(files, prompts["now"])
    assert kept.stat().st_mode & 0o077 != 0  # the user's umask, not mkstemp's private 0600
    assert sum("its result reused" in line for line in lines) == 1
    stage({**files, "drafter": {"model.safetensors": "cc"}})
    prompts["now"] = [[1, 2, 4]]
    stage(files)
    assert len(calls) == 3
    verdict["result"] = {**passed, "matched": False}
    files = {**files, "target": {"model.safetensors": "dd"}}
    for _ in range(2):
        with pytest.raises(EagleExportError, match="matches no convention"):
            stage(files)
    assert len(calls) == 5


def row(acc, gain, interval):
    return {"reading": "last aux id L-4 (Edge-LLM)", "field": "eagle_aux_hidden_state_layer_ids", "value": [2, 15, 26],
            "acc@1": acc, "gain": gain, "interval": interval}


def test_a_reading_with_lower_acc_is_never_named_whatever_its_log_probability():
    """The sample's own figures (8 prompts): L-4 gains +0.019 nats at step 1 with its interval above 0, and
    its acc@1 is lower at both steps (0.574 / 0.570 against 0.580 / 0.576): not a better reading. The
    same gain with acc@1 at least the configured one's is named. Planted: the rule without the acc@1
    condition (the previous one) names the sample's L-4 reading."""
    from eagle_export.builder.conformance import MIN_GAIN, named

    configured = [0.5799, 0.5759]
    sample = row([0.574, 0.57], [0.0048, 0.0192], [[-0.0089, 0.0174], [0.0058, 0.0314]])
    assert not named(sample, configured)
    assert named(row([0.5799, 0.58], [0.0048, 0.0192], [[-0.0089, 0.0174], [0.0058, 0.0314]]), configured)
    assert not named(row([0.6, 0.6], [0.0048, MIN_GAIN / 2], [[-0.0089, 0.0174], [0.001, 0.01]]), configured)

    def previous_rule(r, configured):
        return any(r["interval"][k][0] > 0 and r["gain"][k] > MIN_GAIN for k in range(2))

    assert previous_rule(sample, configured)  # the planted rule fails this test's first assertion


def test_the_gate_says_which_reading_passed_it():
    """acc@1 0.045 as configured is below MIN_ACC (0.05); an alternative at 0.06 clears it: the gate
    passes, names that reading, and the line says so (it said nothing before). A configured reading
    that clears the gate is the one named, whatever an alternative reaches."""
    from eagle_export.builder.conformance import MIN_ACC, gate, gate_line

    rows = [row([0.045, 0.04], [0, 0], [[0, 0], [0, 0]]), row([0.06, 0.05], [0.1, 0.1], [[0.05, 0.2], [0.05, 0.2]]),
            row([0.02, 0.02], [-1, -1], [[-2, -1], [-2, -1]])]
    rows[0]["reading"], rows[1]["reading"] = "as configured", "aux ids one higher"
    assert gate(rows) is rows[1]
    result = {"readings": rows, "min_acc": MIN_ACC, "matched_by": {"reading": "aux ids one higher", "acc@1": 0.06}}
    line = gate_line(result)
    assert "0.045 as configured is below 0.05" in line and "passed by the reading \"aux ids one higher\" (acc@1 0.060)" in line
    rows[0]["acc@1"] = [0.05, 0.04]
    assert gate(rows) is rows[0]
    assert gate_line({**result, "matched_by": {"reading": "as configured", "acc@1": 0.05}}) == ""
    rows[0]["acc@1"], rows[1]["acc@1"] = [0.01, 0.0], [0.049, 0.0]
    assert gate(rows) is None
