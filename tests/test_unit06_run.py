"""`teraflops run 6`: every unit's workload is triaged on this machine, headless, and its story told."""

import math
from pathlib import Path

import pytest

from teraflops.course.runner import run_units
from teraflops.course.stories import STATUSES, STORIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_6_triages_each_units_workload(lecture_out):
    (result,) = run_units([6], out_dir=lecture_out, root=ROOT, html=False)
    assert result.ok, result.error
    # the check cell prints each workload's unit and the bottleneck that unit teaches; compared here
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert all(math.isfinite(v) for v in h.values()), h
    assert result.headline["verdicts_matched"]["unit"] == "of 6"
    assert 0 <= h["verdicts_matched"] <= 6
    assert h["verdicts_matched"] == sum(h[f"triage_matches_{n}"] for n in
                                        ("matmul", "naive_attention", "zero3", "straggler", "decode", "allreduce"))
    assert 0 <= h["zero3_communication_share"] <= 100 and 0 <= h["straggler_waiting_share"] <= 100  # shares of a step
    assert [s.name for s in result.stories] == [s.name for s in STORIES[6]]
    assert all(s.status in STATUSES for s in result.stories)
