"""`teraflops run 6`: every unit's workload gets its unit's verdict, on this machine, headless."""

from pathlib import Path

import pytest
from budgets import assert_within

from teraflops import detect
from teraflops.course.runner import run_units

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_6_names_each_units_bottleneck(lecture_out):
    (result,) = run_units([6], out_dir=lecture_out, root=ROOT, html=False)
    assert result.ok, result.error
    # the check cell prints one ✓ line per unit workload; nbval's comparison of it is done here
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert h["verdicts_matched"] == 6
    assert h["zero3_communication_share"] > 50 and h["straggler_waiting_share"] > 50
    if detect().device == "cpu":
        assert_within(result, 300, 6)
