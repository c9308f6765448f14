"""The grader: ``teraflops grade LAB``, a lab executed headless and each exercise's result read back.

The check cells of a lab print what :mod:`teraflops.grading.core` makes them print: the exact pass
line, or a one-line ``ExerciseFailed`` / ``NotAttempted`` naming the exercise. :func:`grade` runs
the notebook with nbclient (https://nbclient.readthedocs.io; errors allowed, every cell given a
time limit, so one unfinished exercise does not hide the others), then reads those lines from the
executed cells' outputs (nbformat's output types ``stream`` and ``error``,
https://nbformat.readthedocs.io/en/latest/format_description.html#code-cell-outputs). When a
check cell could not run the learner's code, the learner's own failed cell above it is named
instead (:func:`cell_error`). Every exercise registered for the lab's unit gets a row.
What it returns, and writes for a workshop host, is a :class:`~teraflops.grading.grade_report.GradeReport`.
"""

from __future__ import annotations

import re
from pathlib import Path

from teraflops.launch.notebook import execute_cells, make_client
from teraflops.errors import CourseError
from teraflops.grading import unit01, unit02, unit03, unit04, unit05, unit06  # noqa: F401 - registers the units' exercises
from teraflops.grading.core import PASS_MARK, REGISTRY, SKIP_MARK, Exercise
from teraflops.grading.grade_report import GradeReport, GradeRow, current_user
from teraflops.grading.history import syntax_line

__all__ = ["grade", "unit_of", "cell_error", "GradeReport", "GradeRow"]


def _outputs(cell) -> tuple[list[str], list[tuple[str, str]]]:
    """(stream texts, [(ename, first line of evalue)]) of one executed cell."""
    texts, errors = [], []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            texts.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            lines = [ln for ln in str(out.get("evalue", "")).splitlines() if ln.strip()]
            errors.append((out.get("ename", ""), lines[0] if lines else ""))
    return texts, errors


_CHECK_CALL = re.compile(r"\bcheck\.\w+\(")
_SYNTAX_POSITION = re.compile(r"\s*\([^()]*, line (\d+)\)$")  # IPython: "invalid syntax (123.py, line 3)"
_FRAME_LINE = re.compile(r"Cell In\[\d+\], line (\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cell_error(cell) -> str | None:
    """The learner's own error in one executed code cell, in one line, or ``None`` if it has none.

    A ``SyntaxError`` (or ``IndentationError``) names the line of the cell and shows it, e.g.
    ``SyntaxError: invalid syntax at line 3 of the cell: return m * * 2``; any other exception is its
    name and the first line of its message, with the cell's line where the traceback names one.
    """
    for out in cell.get("outputs", []):
        if out.get("output_type") != "error":
            continue
        ename, evalue = out.get("ename", ""), str(out.get("evalue", "")).strip()
        first = next((ln.strip() for ln in evalue.splitlines() if ln.strip()), "")
        position = _SYNTAX_POSITION.search(first)
        if position:  # SyntaxError and its subclasses: the position is in the message
            return syntax_line(ename, first[:position.start()], int(position.group(1)), cell.source)
        tb = _ANSI.sub("", "\n".join(out.get("traceback", [])))
        frames = _FRAME_LINE.findall(tb)
        where = f" (line {frames[-1]} of the cell)" if len(out.get("traceback", [])) > 1 and frames else ""
        return (f"{ename}: {first}" if first else ename) + where
    return None


def _first_line_of(cell) -> str:
    line = next((ln.strip() for ln in cell.source.split("\n") if ln.strip() and not ln.strip().startswith("#")), "")
    return line if len(line) <= 60 else line[:57] + "..."


def _error_row(ex: Exercise, cells, index: int, errors: list[tuple[str, str]]) -> GradeRow:
    """The row of a check cell that raised something other than its check's own verdict: a timeout, the
    error of the nearest failed cell of the exercise above it (between the previous check cell and this
    one: the learner's own cell, usually), or the check cell's own error."""
    ename, evalue = errors[0]
    if ename == "KeyboardInterrupt":
        return GradeRow(ex.label, "failed", "interrupted: the check ran past the time limit per cell (--timeout)")
    start = max((i for i in range(index) if _CHECK_CALL.search(cells[i].source)), default=-1) + 1
    own = [(c, e) for c, e in ((c, cell_error(c)) for c in cells[start:index]) if e]
    if own:
        c, why = own[-1]
        return GradeRow(ex.label, "failed", f"your cell `{_first_line_of(c)}` raised {why}")
    why = f"{ename}: {evalue}" if evalue else ename
    if ename == "NameError":
        why += " (did the cell that defines it fail, or run past the time limit?)"
    return GradeRow(ex.label, "failed", f"the check cell raised {why}")


def _row_of_check_cell(ex: Exercise, cells, index: int) -> GradeRow | None:
    """What one check cell of ``ex`` says, or None when it says nothing about it (no pass line, no error)."""
    texts, errors = _outputs(cells[index])
    label_prefix = f"{ex.label}: "
    for ename, evalue in errors:
        if ename == "NotAttempted" and evalue.startswith(label_prefix):
            return GradeRow(ex.label, "not attempted")
        if ename == "ExerciseFailed" and evalue.startswith(label_prefix):
            return GradeRow(ex.label, "failed", evalue[len(label_prefix):])
    if errors and not any(e in ("NotAttempted", "ExerciseFailed") for e, _ in errors):
        return _error_row(ex, cells, index, errors)
    if any(f"{PASS_MARK} {ex.label}: passed" in t for t in texts):
        return GradeRow(ex.label, "passed")
    skipped = next((t.split(": skipped: ", 1)[1].strip() for t in texts if f"{SKIP_MARK} {ex.label}: skipped: " in t), None)
    if skipped:  # not passed: this machine could not run the check; the row says why
        return GradeRow(ex.label, "failed", f"skipped here: {skipped}")
    return None


def _result_for(ex: Exercise, cells) -> GradeRow:
    """What the check cells calling ``check.<ex.name>`` printed: the exact pass line, a check error
    naming this exercise, or any other error of that cell. When the check cell could not run the
    learner's code (a ``NameError``, say) and a cell of the exercise (between the previous check
    cell and this one) failed, the error of the nearest such cell is the reason shown."""
    ran = [i for i, c in enumerate(cells) if re.search(rf"\bcheck\.{ex.name}\(", c.source)]
    if not ran:
        return GradeRow(ex.label, "failed", f"no check cell calls check.{ex.name}(...)")
    for index in ran:
        row = _row_of_check_cell(ex, cells, index)
        if row is not None:
            return row
    return GradeRow(ex.label, "failed", "the check cell did not run to its pass line")


UNIT_METADATA = "teraflops"  # notebook metadata {"teraflops": {"unit": N}}; labs carry their solution's


def unit_of(path: Path, nb, unit: int | None = None) -> int:
    """The unit a lab belongs to: ``unit`` when given, else the notebook's metadata
    (``metadata.teraflops.unit``, which solutions and the labs built from them carry), else the
    ``NN_`` prefix of its file name.

    Raises:
        CourseError: none of the three says which unit it is.
    """
    if unit is not None:
        return int(unit)
    meta = nb.metadata.get(UNIT_METADATA, {})
    if isinstance(meta, dict) and isinstance(meta.get("unit"), int) and not isinstance(meta.get("unit"), bool):
        return meta["unit"]
    m = re.match(r"(\d+)_", Path(path).name)
    if not m:
        raise CourseError(f"{Path(path).name}: which unit is this lab? Its metadata does not say and its name does "
                          f"not start with a unit number (NN_). Hint: teraflops grade {Path(path).name} --unit N")
    return int(m.group(1))


def grade(path: str | Path, timeout: int = 600, unit: int | None = None) -> GradeReport:
    """Execute the notebook at ``path`` headless and grade every exercise of its unit.

    Cells run in order; an error does not stop the run and a cell running past ``timeout`` seconds is
    interrupted, so one unfinished exercise does not hide the others. Every exercise registered for
    the unit (``unit``, else read by :func:`unit_of`) gets a row: a missing check cell counts as
    failed. A progress bar (stderr) shows the cell running and for how long.

    Raises:
        CourseError: not a notebook, no way to tell its unit, or a unit without exercises.
    """
    import nbformat

    path = Path(path)
    if not path.is_file():
        raise CourseError(f"no such notebook: {path}")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001 - nbformat raises several types for non-notebooks
        raise CourseError(f"{path} is not a Jupyter notebook ({type(e).__name__})") from None
    unit = unit_of(path, nb, unit)
    exercises = sorted((ex for ex in REGISTRY.values() if ex.unit == unit), key=lambda ex: ex.number)
    if not exercises:
        raise CourseError(f"{path.name}: unit {unit} has no graded exercises "
                          "(grade a lab from labs/, not a lecture)")
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not any(_CHECK_CALL.search(c.source) for c in code):
        raise CourseError(f"{path.name} has no check cells: grade a lab (labs/), not a lecture")
    client = make_client(nb, path, timeout, allow_errors=True)
    execute_cells(client, nb, f"grading {path.name}", stop_on_error=False)
    return GradeReport(path.name, tuple(_result_for(ex, code) for ex in exercises), unit, current_user())
