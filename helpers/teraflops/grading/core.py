"""The check framework and the grader.

A check function is decorated with :func:`exercise`. Called in a notebook it either prints one
pass line, ``✓ Exercise 3 (naive attention): passed``, or raises a one-line error:

* :class:`~teraflops.errors.NotAttempted` when the learner's code still raises
  ``NotImplementedError`` (the lab placeholder);
* :class:`~teraflops.errors.ExerciseFailed` naming the exercise, what was wrong (shape, dtype,
  value, max error) and a hint. Any other exception from the learner's code becomes one too.

:func:`grade` executes a notebook headless (nbclient, errors allowed), reads each check cell's
output, and returns a report; ``teraflops grade`` prints it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CourseError, ExerciseFailed, NotAttempted
from ..tables import table

PASS_MARK = "✓"


@dataclass(frozen=True)
class Exercise:
    name: str  # the check function's name: check cells call ``check.<name>(...)``
    number: int
    title: str

    @property
    def label(self) -> str:
        return f"Exercise {self.number} ({self.title})"


REGISTRY: dict[str, Exercise] = {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _looks_unattempted(e: BaseException) -> bool:
    # A compiled Triton kernel cannot raise: the placeholder surfaces as a compilation error.
    return isinstance(e, NotImplementedError) or "NotImplementedError" in str(e)


def exercise(number: int, title: str):
    """Register a check function as exercise ``number`` and give it the pass/fail protocol."""

    def deco(check_fn):
        ex = Exercise(check_fn.__name__, number, title)
        REGISTRY[ex.name] = ex

        @functools.wraps(check_fn)
        def run(*args, **kwargs):
            try:
                check_fn(*args, **kwargs)
            except NotAttempted:
                raise
            except ExerciseFailed as e:
                raise ExerciseFailed(f"{ex.label}: {e}") from None
            except Exception as e:  # noqa: BLE001 - anything the learner's code raised
                if _looks_unattempted(e):
                    raise NotAttempted(f"{ex.label}: not attempted. Replace the `raise NotImplementedError` "
                                       "line with your code, run that cell, then this check again.") from None
                kind = "" if isinstance(e, CourseError) else f"your code raised {type(e).__name__}: "
                raise ExerciseFailed(f"{ex.label}: {kind}{_first_line(e)}") from None
            print(f"{PASS_MARK} {ex.label}: passed")

        run.exercise = ex
        return run

    return deco


# --- helpers for check functions ------------------------------------------------------------

def fail(message: str):
    """Raise :class:`ExerciseFailed` (the decorator adds the exercise label)."""
    raise ExerciseFailed(message)


def expect_tensor(what: str, got, shape: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fail unless ``got`` is a tensor of ``shape`` (and ``dtype``); returns it."""
    if not isinstance(got, torch.Tensor):
        fail(f"{what} should be a torch.Tensor of shape {tuple(shape)}, got {type(got).__name__}")
    if tuple(got.shape) != tuple(shape):
        fail(f"{what} has shape {tuple(got.shape)}, expected {tuple(shape)}. "
             "Hint: check which dimension you reduce or multiply over")
    if dtype is not None and got.dtype != dtype:
        fail(f"{what} has dtype {got.dtype}, expected {dtype} (the input dtype)")
    return got


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in fp32 (NaN if got has NaN or inf)."""
    diff = (got.float() - want.float()).abs()
    return float("nan") if not torch.isfinite(got.float()).all() else diff.max().item()


# --- grading a notebook ----------------------------------------------------------------------

_CHECK_CALL = re.compile(r"\bcheck\.(\w+)\(")


@dataclass(frozen=True)
class GradeRow:
    exercise: str
    status: str  # "passed", "failed", "not attempted"
    detail: str = ""


@dataclass(frozen=True)
class GradeReport:
    notebook: str
    rows: tuple[GradeRow, ...]

    @property
    def passed(self) -> int:
        return sum(r.status == "passed" for r in self.rows)

    @property
    def all_passed(self) -> bool:
        return bool(self.rows) and self.passed == len(self.rows)

    def table(self) -> str:
        body = [(r.exercise, r.status, r.detail) for r in self.rows]
        return (f"{self.notebook}\n" + table(body, ["exercise", "result", "detail"])
                + f"\nscore: {self.passed}/{len(self.rows)}")


def _cell_result(cell) -> tuple[str, str]:
    text = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            ename, evalue = out.get("ename", ""), _first_line(Exception(out.get("evalue", "")))
            if ename == "NotAttempted":
                return "not attempted", ""
            if ename == "ExerciseFailed":
                return "failed", re.sub(r"^Exercise \d+ \([^)]*\):\s*", "", evalue)
            return "failed", f"{ename}: {evalue}"
        if out.get("output_type") == "stream":
            text.append(out.get("text", ""))
    if any(PASS_MARK in t and "passed" in t for t in text):
        return "passed", ""
    return "failed", "the check cell did not run to its pass line"


def grade(path: str | Path, timeout: int = 600) -> GradeReport:
    """Execute the notebook at ``path`` headless and grade every check cell.

    A check cell is a code cell calling ``check.<exercise>(...)``. Cells run in order; errors do not
    stop execution, so one unfinished exercise does not hide the others.
    """
    import nbformat

    from ..runner import make_client
    from . import unit01  # noqa: F401 - registers the exercises' titles

    path = Path(path)
    if not path.exists():
        raise CourseError(f"no notebook at {path}")
    nb = nbformat.read(path, as_version=4)
    make_client(nb, path, timeout, allow_errors=True).execute()
    rows = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        m = _CHECK_CALL.search(cell.source)
        if not m:
            continue
        ex = REGISTRY.get(m.group(1))
        label = ex.label if ex else m.group(1)
        rows.append(GradeRow(label, *_cell_result(cell)))
    return GradeReport(path.name, tuple(rows))


def grade_notebook(path: str | Path) -> tuple[str, bool]:
    """``teraflops grade``: the printed table and whether every exercise passed."""
    report = grade(path)
    return report.table(), report.all_passed
