"""`teraflops run 5` on this machine: peak busbw, the fitted alpha and beta, accumulation's cut."""

from pathlib import Path

import pytest
from budgets import assert_within

from teraflops import detect
from teraflops.course.runner import format_summary, run_units

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_5_reports_peak_busbw_alpha_and_beta(lecture_out):
    (result,) = run_units([5], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert h["peak_busbw_all_reduce"] > 0 and h["alpha"] > 0 and h["beta"] > 0
    assert h["accumulate_sample_cut"] == pytest.approx(4.0, rel=1e-6)
    if detect().device == "cpu":
        assert_within(result, 300, 5)
    summary = format_summary(detect(), [result])
    assert "busbw" in summary and "alpha" in summary and "beta" in summary
