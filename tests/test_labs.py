"""Labs are generated from solutions; shipped labs fail every check; solutions pass every check."""

import json
from pathlib import Path

import nbformat
import pytest

from teraflops.course import labs
from teraflops.errors import CourseError
from teraflops.grading.core import REGISTRY
from teraflops.grading.grader import grade

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_labs_are_in_sync_with_solutions():
    assert labs.check_labs(ROOT) == []


def test_check_labs_reports_drift(tmp_path):
    for d in ("solutions", "labs"):
        (tmp_path / d).mkdir()
    src = SOLUTIONS[0]
    (tmp_path / "solutions" / src.name).write_text(src.read_text())
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())  # the setup cells' source
    labs.build_labs(tmp_path)
    assert labs.check_labs(tmp_path) == []
    lab = tmp_path / "labs" / src.name
    nb = json.loads(lab.read_text())
    nb["cells"][0]["source"] = ["edited by hand"]
    lab.write_text(json.dumps(nb))
    assert any("differs" in p for p in labs.check_labs(tmp_path))


def test_strip_solution_keeps_indentation_and_scaffold():
    src = "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n"
    assert labs.strip_solution(src) == f"def f(x):\n    y = 1\n    {labs.PLACEHOLDER}\n"


@pytest.mark.parametrize("src", ["### BEGIN SOLUTION\nx", "x\n### END SOLUTION",
                                 "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION"])
def test_unbalanced_markers_are_errors(src):
    with pytest.raises(CourseError):
        labs.strip_solution(src)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_labs_hold_no_solution_code_or_outputs(solution):
    lab = nbformat.read(ROOT / "labs" / solution.name, as_version=4)
    text = "\n".join(c.source for c in lab.cells)
    assert labs.BEGIN not in text and labs.END not in text
    assert all(not c.get("outputs") for c in lab.cells if c.cell_type == "code")
    n_checks = sum("check." in c.source for c in lab.cells if c.cell_type == "code")
    assert text.count(labs.PLACEHOLDER) >= n_checks > 0


@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_shipped_lab_fails_every_exercise_check(solution, monkeypatch):
    # The checks use their own cases whatever the preset; the tiny preset only shrinks the lab's
    # demonstration cells (training runs, sweeps), which a shipped lab runs for nothing.
    monkeypatch.setenv("TERAFLOPS_PRESET", "tiny")
    report = grade(ROOT / "labs" / solution.name)
    assert report.rows, "no check cells found"
    assert all(r.status == "not attempted" for r in report.rows), report.table()
    assert not report.all_passed and "score: 0/" in report.table()


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_solution_passes_every_exercise_check(solution):
    """Every exercise of the unit has a check cell in the solution whose stored output is its pass
    line. nbval (``--nbval-lax``) executes the solution and compares exactly those outputs, so a
    solution that stops passing fails there; this test makes sure nothing is left unchecked,
    without executing the solution a second time."""
    from teraflops.grading import unit01, unit02, unit03, unit04, unit05, unit06  # noqa: F401 - registers the exercises

    nb = nbformat.read(solution, as_version=4)
    unit = int(solution.name[:2])
    stored = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and "check." in cell.source:
            assert labs.CHECKED in cell.source, f"a check cell without # NBVAL_CHECK_OUTPUT:\n{cell.source}"
            stored[cell.source] = "".join(o.get("text", "") for o in cell.outputs)
    for ex in (ex for ex in REGISTRY.values() if ex.unit == unit):
        cells = [src for src in stored if f"check.{ex.name}(" in src]
        assert cells, f"{solution.name}: no check cell for {ex.label}"
        assert f"✓ {ex.label}: passed" in stored[cells[0]], f"{solution.name}: stored output of {ex.label} " \
            f"is not its pass line (run `teraflops labs refresh`): {stored[cells[0]]!r}"


def test_marker_spelling_variants_are_stripped():
    for begin in ("### BEGIN  SOLUTION", "# begin solution", "##\tBEGIN SOLUTION"):
        out = labs.strip_solution(f"def f():\n    {begin}\n    return 42\n    ### END SOLUTION\r\n")
        assert "42" not in out and labs.PLACEHOLDER in out


@pytest.mark.parametrize("marker", ["BEGIN SOLUTION", "### BEGIN SOLUTION (exercise 4)"])
def test_near_miss_markers_are_errors_not_leaks(marker):
    with pytest.raises(CourseError, match="looks like a solution marker|without"):
        labs.strip_solution(f"def f():\n    {marker}\n    return 42\n    ### END SOLUTION\n")


@pytest.mark.slow
def test_an_unfinished_exercise_reads_as_one_line_in_any_cell():
    """A cell that uses the learner's unfinished function (not only its check) fails in one line; other
    NotImplementedErrors keep their traceback; the cell still fails, so graders see it."""
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[
        new_code_cell(f"import teraflops\ndef busbw(a, c, n):\n    {labs.PLACEHOLDER}"),
        new_code_cell("print(busbw(1.0, 'all_reduce', 4))"),
        new_code_cell("raise NotImplementedError('a library feature')"),
        new_code_cell("print('next cell runs')"),
    ])
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    NotebookClient(nb, allow_errors=True, kernel_name="python3", timeout=120).execute()
    (line, mine), (other,), (ok,) = (c.outputs for c in nb.cells[1:])
    # the line as text and as HTML that wraps at spaces only (teraflops.errors._show_one_line)
    assert line.output_type == "display_data" and "busbw() is not written yet. Hint:" in line.data["text/plain"]
    assert "word-break: normal" in line.data["text/html"]
    assert mine.output_type == "error" and mine.ename == "NotImplementedError"
    assert mine.traceback == ["NotImplementedError (above)"]
    assert other.output_type == "error" and len(other.traceback) > 1  # IPython's usual traceback
    assert ok.text == "next cell runs\n"
