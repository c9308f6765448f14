"""`teraflops run 2` on this machine: ZeRO stages measured, and the summary says what they cost."""

from pathlib import Path

import pytest
from budgets import assert_within

from teraflops import detect
from teraflops.course.runner import format_summary, run_units

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_2_reports_memory_and_communication_by_stage(lecture_out):
    (result,) = run_units([2], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    memory = [h[f"zero{s}_bytes_per_rank"] for s in range(4)]
    comm = [h[f"zero{s}_comm_per_step"] for s in range(4)]
    assert memory[0] > memory[1] >= memory[2] > memory[3] > 0  # each stage holds less ...
    assert comm[3] > 1.4 * comm[2] and abs(comm[0] - comm[2]) <= 0.1 * comm[0]  # ... stage 3 sends 1.5x
    if detect().device == "cpu":
        assert_within(result, 300, 2)
    summary = format_summary(detect(), [result])
    assert "ZeRO stage 3" in summary and "communication per rank" in summary
