"""Validation reports: three check states, and the quantized graphs' pass line (builds: test_build.py)."""

import numpy as np
import pytest

from eagle_export.build.manifest import Agreement
from eagle_export.build.validate import AGREEMENT_MARGIN, _agreement_check, _summary


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
