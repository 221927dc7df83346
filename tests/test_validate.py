"""Validation reports: three check states, and the quantized graphs' pass line (builds: test_build.py)."""

import numpy as np
import pytest
from planting import plant

from eagle_export.builder.manifest import Agreement
from eagle_export.builder.validate import AGREEMENT_MARGIN, _agreement_check, _summary, _synthetic_tier


def test_a_skipped_check_is_neither_passed_nor_failed():
    report = _summary([("hashes", True, "6 files"), ("lossless loop", None, "no FP4 kernels"),
                       ("graph", np.bool_(True), "agreement 1.0")])
    assert report["ok"] and report["failures"] == [] and report["skipped"] == ["lossless loop: no FP4 kernels"]
    assert [c["status"] for c in report["checks"]] == ["passed", "skipped", "passed"]
    assert [c["ok"] for c in report["checks"]] == [True, None, True]
    failed = _summary([("graph", np.bool_(False), "agreement 0.2"), ("lossless loop", None, "no FP4 kernels")])
    assert not failed["ok"] and failed["failures"] == ["graph: agreement 0.2"] and len(failed["skipped"]) == 1


def check(agreement: float, positions: int, agree: float, prompts: int, checked: int):
    """The target's pass line: build-time `agreement` over `positions` positions of 4 recorded prompts."""
    return _agreement_check("target", Agreement(agreement, positions), 4, agree, prompts, checked)


def test_pass_line_is_the_margin_when_every_recorded_position_was_checked():
    name, ok, detail = check(0.9, 120, 0.9 - AGREEMENT_MARGIN + 1e-6, 4, 120)
    assert ok and name == "quantized target graph vs unquantized torch"
    assert f"pass >= {0.9 - AGREEMENT_MARGIN:.4f}" in detail and "sampling 0.000" in detail and "4/4 prompts" in detail
    assert not check(0.9, 120, 0.9 - AGREEMENT_MARGIN - 1e-3, 4, 120)[1]


def test_a_sample_of_the_positions_lowers_the_line_by_its_standard_error():
    # One prompt of a tiny model strays from the all-prompts agreement by more than the margin
    # (0.727 against 0.791 over 115 positions, measured on the NVFP4 tiny build): that must pass.
    _, ok, detail = check(0.7913, 115, 0.7273, 1, 22)
    assert ok and "1/4 prompts" in detail
    floors = [float(check(0.8, 120, 0.0, 1, n)[2].split("pass >= ")[1].split()[0])
              for n in (10, 30, 100, 120)]
    assert floors == sorted(floors) and floors[-1] == pytest.approx(0.8 - AGREEMENT_MARGIN, abs=1e-4)
    # A broken graph still fails a one-prompt check.
    assert not check(0.95, 115, 0.5, 1, 22)[1]


# ---------------------------------------------------------------- T0 on a tiny pair (torch backend)

PROMPTS = [[5, 17, 33, 101, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [42, 3]]


@pytest.fixture(scope="module", params=["chain", "tree"])
def runtime(request, tmp_path_factory):
    import torch
    from tiny_models import write_tiny_drafter, write_tiny_target

    from eagle_export.export.unrolled import TargetGraph, UnrolledDrafter
    from eagle_export.models.checkpoint import load_drafter, load_target
    from eagle_export.runtime.backends import TorchBackend
    from eagle_export.runtime.runtime import SpeculativeRuntime
    from eagle_export.speculation.tree import TreeShape

    torch.set_grad_enabled(False)
    target = load_target(write_tiny_target(tmp_path_factory.mktemp("t"), "llama"), aux_layer_ids=(1, 3, 4))
    drafter = load_drafter(write_tiny_drafter(tmp_path_factory.mktemp("d"), "3.1"), target=target)
    speculation = 3 if request.param == "chain" else TreeShape.from_branching([2, 2, 1])
    backend = TorchBackend(TargetGraph(target, True), UnrolledDrafter(drafter, speculation, False))
    yield SpeculativeRuntime.for_models(backend, target, drafter, max_context=256, verify_policy="fixed")
    torch.set_grad_enabled(True)


def stale_aux_row(original):
    """A planted bug in `_append_rows` (`original`; every path's pending rows, the device round's included):
    each sequence's newest drafter row keeps whatever aux state the pending buffer held in that slot before
    (an earlier round's row, or zeros)."""
    import torch

    def append(ids, aux_rows, count, tokens, aux, rows, added):
        newest, width, batch = count + added - 1, aux_rows.shape[1], torch.arange(len(count))
        held = torch.where((newest < width)[:, None], aux_rows[batch, newest.clamp(0, width - 1)], 0)
        original(ids, aux_rows, count, tokens, aux, rows, added)
        fresh = added > 0
        aux_rows[batch[fresh], newest[fresh]] = held[fresh]
    return append


def test_t0_checks_every_drafter_call_against_the_accepted_path(runtime):
    (name, ok, detail), record = _synthetic_tier(runtime, PROMPTS, exact_plain=True)
    assert ok, detail
    assert "the drafter fed the accepted path's rows (token, aux state) at every call" in detail


def test_a_stale_aux_row_fed_to_the_drafter_fails_t0(runtime, monkeypatch):
    """Greedy output stays the target's (the stale row only changes drafts, which verification
    rejects): only the check of the drafter's input rows sees it."""
    plant(monkeypatch, "_append_rows", stale_aux_row)
    (_, ok, detail), record = _synthetic_tier(runtime, PROMPTS, exact_plain=True)
    assert not ok and "aux state at position" in detail, detail
    assert not any("changed the output" in p for p in record["problems"])  # the output alone never shows it
