"""The course's main job on real input: `teraflops run 1` on this machine, and what it reports."""

from pathlib import Path

import nbformat
import pytest
from budgets import assert_within

from teraflops.course.runner import format_summary, run_units
from teraflops import detect

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_unit_1_meets_the_acceptance_numbers(lecture_out):
    (result,) = run_units([1], out_dir=lecture_out, root=ROOT)
    assert result.ok, result.error
    # the check cells, compared as nbval compares them: CI executes each lecture once, here, not under nbval too
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    assert h["compute_bound_ops"] >= 1 and h["memory_bound_ops"] >= 2
    assert h["attn_memory_ratio"] >= 4
    assert h["ridge_point"] > 0 and h["achieved_tflops"] > 0
    if detect().device == "cpu":
        assert_within(result, 180, 1)
    assert (lecture_out / "01_model_definition.html").exists()
    summary = format_summary(detect(), [result])
    assert "ridge point" in summary and "naive/flash" in summary


@pytest.mark.parametrize("folder", ["notebooks", "solutions", "labs"])
def test_committed_notebooks_keep_only_checked_outputs(folder):
    for path in sorted((ROOT / folder).glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and "# NBVAL_CHECK_OUTPUT" not in cell.source:
                assert not cell.outputs, f"{path.name} cell {i} has outputs committed; run `teraflops labs refresh`"
