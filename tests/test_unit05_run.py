"""`teraflops run 5` on this machine: peak busbw, the fitted alpha and beta, accumulation's cut."""

import math
from pathlib import Path

import pytest

from teraflops import detect
from teraflops.course.runner import format_summary, run_units
from teraflops.course.stories import STATUSES, STORIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_5_reports_peak_busbw_alpha_and_beta(lecture_out):
    (result,) = run_units([5], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert all(math.isfinite(v) for v in h.values()), h
    assert {k: result.headline[k]["unit"] for k in ("peak_busbw_all_reduce", "alpha", "beta")} == \
        {"peak_busbw_all_reduce": "GB/s", "alpha": "µs", "beta": "ns/byte"}
    assert h["peak_busbw_all_reduce"] > 0 and 0 <= h["alpha_beta_r2"] <= 1  # a fit's R² (alpha and beta: any sign a fit gives)
    assert h["accumulate_sample_cut"] == pytest.approx(4.0, rel=1e-6)  # bytes counted: exact
    assert [s.name for s in result.stories] == [s.name for s in STORIES[5]]
    assert all(s.status in STATUSES for s in result.stories)
    summary = format_summary(detect(), [result])
    assert "busbw" in summary and "alpha" in summary and "beta" in summary
    assert all(s.line() in summary for s in result.stories)
