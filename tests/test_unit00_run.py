"""`teraflops run 0`: the course map runs headless and reports this machine's ceilings."""

import math

import pytest

from teraflops.course import runner
from teraflops.course.stories import STATUSES, STORIES


@pytest.mark.slow
def test_run_unit_0_reports_the_machine_and_its_ceilings(lecture_out):
    [result] = runner.run_units([0], out_dir=lecture_out, html=False)
    assert result.ok, result.error
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    assert {k: e["unit"] for k, e in result.headline.items()} == \
        {"peak_tflops": "TFLOP/s", "bandwidth": "GB/s", "ridge_point": "FLOP/byte"}
    h = {k: v["value"] for k, v in result.headline.items()}
    assert all(math.isfinite(v) and v > 0 for v in h.values()), h
    # the units agree: TFLOP/s over GB/s is 1e3 FLOP per byte (a slip of 1e3-1e12 shows here, at any speed)
    assert h["ridge_point"] == pytest.approx(h["peak_tflops"] * 1e3 / h["bandwidth"], rel=0.01), h
    assert [s.name for s in result.stories] == [s.name for s in STORIES[0]]
    assert all(s.status in STATUSES for s in result.stories)
