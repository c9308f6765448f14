"""`teraflops run 2` on this machine: ZeRO stages measured, and the summary says what they cost."""

import math
from pathlib import Path

import pytest

from teraflops import detect
from teraflops.course.runner import format_summary, run_units
from teraflops.course.stories import STATUSES, STORIES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_2_reports_memory_and_communication_by_stage(lecture_out):
    (result,) = run_units([2], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert all(math.isfinite(v) for v in h.values()), h
    assert all(result.headline[f"zero{s}_{what}"]["unit"] == "MB" for s in range(4) for what in ("bytes_per_rank", "comm_per_step"))
    # bytes held and sent are counted, not timed: exact at any load
    memory = [h[f"zero{s}_bytes_per_rank"] for s in range(4)]
    comm = [h[f"zero{s}_comm_per_step"] for s in range(4)]
    assert memory[0] > memory[1] > memory[2] >= memory[3] > 0  # each stage holds less at its peak ...
    assert comm[3] > 1.4 * comm[2] and abs(comm[0] - comm[2]) <= 0.1 * comm[0]  # ... stage 3 sends 1.5x
    assert h["staleness_speedup"] > 0 and h["overlap_speedup"] > 0  # ratios of times: units, not verdicts
    assert [s.name for s in result.stories] == [s.name for s in STORIES[2]]
    assert all(s.status in STATUSES for s in result.stories)
    summary = format_summary(detect(), [result])
    assert "ZeRO stage 3" in summary and "communication per rank" in summary
    assert all(s.line() in summary for s in result.stories)
