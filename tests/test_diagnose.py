"""`eagle-export diagnose`: each figure on a hand-made case whose value is known (uniform and forced
attention, a fixed final-norm gain, a flat lm_head, hand-made reliability bins), live acceptance
against the reference loop itself, and the command on a tiny pair."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from click.testing import CliRunner
from tiny_models import write_tiny_drafter, write_tiny_target

from eagle_export.cli import main
from eagle_export.models.checkpoint import load_drafter, load_target
from eagle_export.speculation.eager import speculative_generate
from eagle_export.speculation.stats import acceptance_by_depth
from eagle_export.tools.diagnose import chain_figures, diagnose, reliability

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = (1, 3, 4)
VOCAB, DRAFT_VOCAB = 24, 12
PROMPTS = [[5, 17, 3, 9], [1, 2, 3, 4, 5, 6, 7], [11, 0, 23, 7, 7, 19]]
DEPTH, NEW = 4, 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("diagnose")
    target_dir = write_tiny_target(root / "target", "smollm2", seed=0, vocab_size=VOCAB)
    target = load_target(target_dir, aux_layer_ids=AUX)
    drafter_dirs = {v: write_tiny_drafter(root / f"drafter{v}", v, seed=1, vocab=VOCAB, draft_vocab=DRAFT_VOCAB)
                    for v in ("3", "3.1")}
    drafters = {v: load_drafter(d, target=target) for v, d in drafter_dirs.items()}
    return target, drafters, target_dir, drafter_dirs


def answered(target, prompt):
    """The prompt, the target's greedy continuation (no EOS cut) and the aux states of all but the last token."""
    sequence = prompt + target.generate_greedy(prompt, NEW + DEPTH)
    k, v = target.empty_cache(1, 0)
    _, aux, _, _ = target(torch.tensor([sequence[:-1]]), torch.arange(len(sequence) - 1)[None], k, v,
                          torch.tensor([0]))
    return sequence, aux


def figures_of(drafter, target, prompt):
    sequence, aux = answered(target, prompt)
    figures, correct, _ = chain_figures(drafter, sequence, aux, len(prompt), NEW, DEPTH)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + correct.shape[1])
    return figures, correct, positions, sequence, aux


@pytest.mark.parametrize("version", ["3", "3.1"])
def test_uniform_attention_splits_mass_by_key_count(models, version):
    """q and k projections of zero: every visible key scores the same, so the chain at p at step k
    (p+1 step-0 keys, k of its own) puts 1/(p+1+k) on the sink, p/(p+1+k) on the prefix, k/(p+1+k) on the chain."""
    target, drafters, _, _ = models
    drafter = copy.deepcopy(drafters[version])
    with torch.no_grad():
        drafter.midlayer.self_attn.q_proj.weight.zero_()
        drafter.midlayer.self_attn.k_proj.weight.zero_()
    figures, _, positions, _, _ = figures_of(drafter, target, PROMPTS[1])
    for k in range(DEPTH):
        keys = (positions + 1 + k).double()
        torch.testing.assert_close(figures["sink_mass"][k].double(), 1 / keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(figures["prefix_mass"][k].double(), positions / keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(figures["chain_mass"][k].double(), k / keys, atol=1e-6, rtol=0)


def test_attention_forced_onto_position_0_reports_sink_mass_1(models):
    target, drafters, _, _ = models
    drafter = copy.deepcopy(drafters["3.1"])

    def onto_position_0(module, args, weights):
        forced = torch.zeros_like(weights)
        forced[..., 0] = 1.0
        return forced

    drafter.midlayer.self_attn.weights_tap.register_forward_hook(onto_position_0)  # before the probe's hook
    figures, _, _, _, _ = figures_of(drafter, target, PROMPTS[0])
    for k in range(DEPTH):
        assert torch.equal(figures["sink_mass"][k], torch.ones_like(figures["sink_mass"][k]))
        assert float(figures["prefix_mass"][k].abs().max()) == 0.0 and float(figures["chain_mass"][k].abs().max()) == 0.0


def test_hidden_rms_is_fc_output_then_the_fed_back_state(models):
    """EAGLE-3.1 feeds back norm(h): with a final-norm gain of 2.5 everywhere its RMS is 2.5 from depth 2
    on. EAGLE-3 feeds back h itself: the state entering step k is the layer output of step k-1. Depth 1
    is fc's output, computed here directly."""
    target, drafters, _, _ = models
    post = copy.deepcopy(drafters["3.1"])
    with torch.no_grad():
        post.norm.weight.fill_(2.5)
    figures, _, positions, _, aux = figures_of(post, target, PROMPTS[2])
    fc_out = post.fuse_aux(aux)[0, positions]
    torch.testing.assert_close(figures["hidden_rms"][0], fc_out.pow(2).mean(-1).sqrt(), rtol=1e-5, atol=1e-6)
    for k in range(1, DEPTH):
        torch.testing.assert_close(figures["hidden_rms"][k], torch.full_like(figures["hidden_rms"][k], 2.5),
                                   rtol=1e-4, atol=0)
    pre, _, _, _, _ = figures_of(drafters["3"], target, PROMPTS[2])
    for k in range(1, DEPTH):
        torch.testing.assert_close(pre["hidden_rms"][k], pre["layer_out_rms"][k - 1])
        assert not torch.allclose(pre["hidden_rms"][k], pre["hidden_rms"][k - 1])  # it does move


def test_flat_draft_distribution_and_teacher_forced_acceptance(models):
    """lm_head of zero: every draft id scores the same, so the entropy is log(Vd), the confidence 1/Vd and
    the draft is draft id 0 at every step; it is accepted teacher-forced exactly where the label is its token
    (here the first token of the answer, which the target repeats for a while, then leaves)."""
    target, drafters, _, _ = models
    drafter = copy.deepcopy(drafters["3"])
    token = target.generate_greedy(PROMPTS[1], 1)[0]
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
        drafter.d2t[0] = token
    figures, correct, positions, sequence, _ = figures_of(drafter, target, PROMPTS[1])
    assert correct.any() and not correct.all()  # the case tells a label off by one from the right one
    for k in range(DEPTH):
        torch.testing.assert_close(figures["entropy"][k], torch.full_like(figures["entropy"][k], math.log(DRAFT_VOCAB)))
        torch.testing.assert_close(figures["confidence"][k], torch.full_like(figures["confidence"][k], 1 / DRAFT_VOCAB))
        expected = torch.tensor([sequence[p + k + 2] == token for p in positions.tolist()])
        assert torch.equal(correct[k], expected)


def test_reliability_bins_and_calibration_error():
    confidence = torch.tensor([0.05, 0.15, 0.15, 0.95, 1.0])
    correct = torch.tensor([False, True, False, True, True])
    rows, ece = reliability(confidence, correct, bins=10)
    filled = {i: (r["count"], r["confidence"], r["accuracy"]) for i, r in enumerate(rows) if r["count"]}
    assert filled == {0: (1, 0.05, 0.0), 1: (2, 0.15, 0.5), 9: (2, 0.975, 1.0)}
    assert ece == pytest.approx(1 / 5 * 0.05 + 2 / 5 * 0.35 + 2 / 5 * 0.025)


def test_live_acceptance_is_the_loops(models):
    """A drafter that always proposes the token the target repeats most (long accepted chains): the live
    acceptance by depth equals that of the reference draft-verify loop run on the same prompts."""
    target, drafters, _, _ = models
    answers = [target.generate_greedy(p, NEW) for p in PROMPTS]
    common = max(set(sum(answers, [])), key=sum(answers, []).count)
    drafter = copy.deepcopy(drafters["3"])
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
        drafter.d2t[0] = common
    report = diagnose(target, {"constant": drafter}, {"tiny": PROMPTS}, DEPTH, NEW)
    accepted = sum((speculative_generate(target, drafter, p, NEW, DEPTH).accepted for p in PROMPTS), [])
    live = [r["acceptance_live"] for r in report["drafters"]["constant"]["sets"]["tiny"]["depths"]]
    expected = acceptance_by_depth(accepted, DEPTH)
    assert max(accepted) >= 2  # the case is not vacuous
    assert live == [None if math.isnan(e) else round(e, 4) for e in expected]
    rounds = [r["live_rounds"] for r in report["drafters"]["constant"]["sets"]["tiny"]["depths"]]
    assert rounds == [sum(m >= k for m in accepted) for k in range(DEPTH)] and rounds[0] == len(accepted)


def test_diagnose_command_on_a_tiny_pair(models, tmp_path):
    _, _, target_dir, drafter_dirs = models
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w17 w3 w9\nw11 w7 w7 w19 w4\n")
    out, png = tmp_path / "new" / "d.json", tmp_path / "d.png"  # a missing folder is made when written
    result = CliRunner().invoke(main, ["diagnose", str(drafter_dirs["3"]), str(drafter_dirs["3.1"]), "--target",
                                       str(target_dir), "--dataset", str(prompts), "--depth", "3",
                                       "--max-new-tokens", "8", "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [e["version"] for e in report["drafters"].values()] == ["EAGLE-3", "EAGLE-3.1"]
    rows = report["drafters"]["drafter3.1"]["sets"][str(prompts)]["depths"]
    assert [r["depth"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sink_mass"] + r["prefix_mass"] + r["chain_mass"] == pytest.approx(1.0, abs=1e-3)
        assert sum(b["count"] for b in r["reliability"]) == report["drafters"]["drafter3.1"]["sets"][str(prompts)]["chains"]
    assert "acc tf" in result.output and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A progress line per prompt, each drafter's live acceptance by depth so far (repro: 12 minutes silent);
    # the last one is the report's.
    progress = [line for line in result.output.splitlines() if line.startswith(f"diagnose {prompts}: ")]
    assert [line.split(" prompts;")[0][-3:] for line in progress] == ["1/2", "2/2"]
    live = {name: " ".join("nan" if r["acceptance_live"] is None else f"{r['acceptance_live']:.2f}"
                           for r in entry["sets"][str(prompts)]["depths"]) for name, entry in report["drafters"].items()}
    assert progress[-1].endswith(f"live acceptance at depth 1..3 drafter3 {live['drafter3']}; drafter3.1 "
                                 f"{live['drafter3.1']}"), (progress[-1], live)


def test_the_old_spelling_mtbench_is_read_as_mt_bench(models, tmp_path):
    """One name for the prompt set (mt-bench); `mtbench`, the spelling of samples/ runs, still works at the CLI."""
    _, _, target_dir, drafter_dirs = models
    out = tmp_path / "d.json"
    result = CliRunner().invoke(main, ["diagnose", str(drafter_dirs["3"]), "--target", str(target_dir), "--dataset",
                                       "mtbench", "--num-prompts", "1", "--depth", "2", "--max-new-tokens", "4",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert list(json.loads(out.read_text())["drafters"]["drafter3"]["sets"]) == ["mt-bench"]


def test_diagnose_refuses_bad_input(models, tmp_path):
    _, _, target_dir, drafter_dirs = models
    result = CliRunner().invoke(main, ["diagnose", str(drafter_dirs["3"])])
    assert result.exit_code == 2 and "pass --target" in result.output
    result = CliRunner().invoke(main, ["diagnose", str(drafter_dirs["3"]), "--target", str(target_dir), "--depth", "0"])
    assert result.exit_code == 2 and "--depth 0" in result.output and "fix:" in result.output


def test_quantized_drafters_beside_their_sources(models, tmp_path):
    """--quantize fp8: each drafter again, ModelOpt FP8 with lm_head and fc kept, on the same answers: fc's
    output (depth 1's hidden RMS) is the source's exactly, the quantized layer's output is not, but close."""
    _, _, target_dir, drafter_dirs = models
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w17 w3 w9\nw11 w7 w7 w19 w4\n")
    out = tmp_path / "d.json"
    result = CliRunner().invoke(main, ["diagnose", str(drafter_dirs["3.1"]), "--target", str(target_dir), "--dataset",
                                       str(prompts), "--depth", "2", "--max-new-tokens", "6", "--quantize", "fp8",
                                       "--calib-prompts", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())["drafters"]
    assert list(report) == ["drafter3.1", "drafter3.1 (fp8)"]
    source, fp8 = (report[n]["sets"][str(prompts)]["depths"][0] for n in report)
    assert fp8["hidden_rms"] == source["hidden_rms"]
    assert fp8["layer_out_rms"] != source["layer_out_rms"]
    assert fp8["layer_out_rms"] == pytest.approx(source["layer_out_rms"], rel=0.1)
