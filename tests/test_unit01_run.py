"""The course's main job on real input: `teraflops run 1` on this machine, and what it reports."""

import math
from pathlib import Path

import nbformat
import pytest

from teraflops.course.runner import format_summary, run_units
from teraflops.course.stories import STATUSES, STORIES
from teraflops import detect

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_1_reports_its_numbers_and_tells_its_stories(lecture_out):
    (result,) = run_units([1], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    units = {"peak_tflops": "TFLOP/s", "bandwidth_gbs": "GB/s", "ridge_point": "FLOP/byte", "achieved_tflops": "TFLOP/s",
             "compute_bound_ops": "", "launch_floor_us": "µs", "attn_memory_ratio": "×", "triton_vs_sdpa": "×"}
    assert {k: result.headline[k]["unit"] for k in units} == units
    h = {k: v["value"] for k, v in result.headline.items()}
    assert all(math.isfinite(v) for v in h.values()), h
    assert h["ridge_point"] > 0 and h["achieved_tflops"] > 0
    roofline_ops = int(result.headline["memory_bound_ops"]["unit"].split()[-1])  # "of N"
    assert 0 <= h["compute_bound_ops"] and 0 <= h["memory_bound_ops"] and \
        h["compute_bound_ops"] + h["memory_bound_ops"] <= roofline_ops  # counts of the roofline's ops
    # peak bytes come from the allocator, not the clock: a load does not change them (naive holds the N² scores)
    assert h["attn_memory_ratio"] >= 4
    assert [s.name for s in result.stories] == [s.name for s in STORIES[1]]
    assert all(s.status in STATUSES for s in result.stories)
    assert (lecture_out / "01_model_definition.html").exists()
    summary = format_summary(detect(), [result])
    assert "ridge point" in summary and "naive/flash" in summary
    assert all(s.line() in summary for s in result.stories)


@pytest.mark.parametrize("folder", ["notebooks", "solutions", "labs"])
def test_committed_notebooks_keep_only_checked_outputs(folder):
    for path in sorted((ROOT / folder).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and "# NBVAL_CHECK_OUTPUT" not in cell.source:
                assert not cell.outputs, f"{path.name} cell {i} has outputs committed; run `teraflops labs refresh`"
