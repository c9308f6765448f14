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

import copy
import functools
import math
import numbers
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
    unit: int  # from the module name: grading.unit01 → 1

    @property
    def label(self) -> str:
        return f"Exercise {self.number} ({self.title})"


REGISTRY: dict[str, Exercise] = {}


def _first_line(e: BaseException) -> str:
    """The line of an exception's message worth showing: the first, except for Triton compilation
    errors, whose first line is only a source position (``at 20:8:``) and whose last line says why."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if type(e).__name__ == "CompilationError" or re.fullmatch(r"at \d+:\d+:", lines[0]):
        return lines[-1]
    return lines[0]


def _looks_unattempted(e: BaseException) -> bool:
    """Only the lab's own placeholder counts (a NotImplementedError raised by torch does not). A
    compiled Triton kernel cannot raise, so there it surfaces inside a compilation error."""
    from ..labs import PLACEHOLDER_MESSAGE

    return PLACEHOLDER_MESSAGE in str(e) or (type(e) is NotImplementedError and not str(e))


def exercise(number: int, title: str):
    """Register a check function as exercise ``number`` and give it the pass/fail protocol."""

    def deco(check_fn):
        unit = int(re.search(r"unit(\d+)$", check_fn.__module__).group(1))
        ex = Exercise(check_fn.__name__, number, title, unit)
        REGISTRY[ex.name] = ex

        @functools.wraps(check_fn)
        def run(*args, **kwargs):
            _RUNNING.append(ex.name)
            try:
                check_fn(*args, **kwargs)
            except NotAttempted:
                raise
            except ExerciseFailed as e:
                FAILURES[ex.name] = FAILURES.get(ex.name, 0) + 1
                raise ExerciseFailed(f"{ex.label}: {e}") from None
            except Exception as e:  # noqa: BLE001 - anything the learner's code raised
                if _looks_unattempted(e):
                    raise NotAttempted(f"{ex.label}: not attempted. Replace the `raise NotImplementedError` "
                                       "line with your code, run that cell, then this check again.") from None
                FAILURES[ex.name] = FAILURES.get(ex.name, 0) + 1
                hint = _hint_for(e, getattr(check_fn, "hints", {}))
                if isinstance(e, CourseError):
                    detail = _first_line(e)
                else:
                    message = f": {_first_line(e)}" if str(e).strip() else " (with no message)"
                    detail = f"your code raised {type(e).__name__}{message}"
                raise ExerciseFailed(f"{ex.label}: {detail}{hint}") from None
            finally:
                _RUNNING.pop()
            print(f"{PASS_MARK} {ex.label}: passed")

        run.exercise = ex
        return run

    return deco


FAILURES: dict[str, int] = {}  # check name -> failures so far in this kernel (process)
_RUNNING: list[str] = []  # the check running now (innermost last)
AGAIN = "(if it fails again, the hint shows the formula)"


def reveal(what_is_wrong: str, formula: str) -> str:
    """A hint that names the mistake first and hands over the answer only on a repeated failure.

    The first failure of a check in this kernel gets ``what_is_wrong`` and a note that the formula
    follows on the next failure; every later failure of the same check gets
    ``"<what_is_wrong>; <formula>"``. Outside a check (no check running) the formula is shown.
    """
    name = _RUNNING[-1] if _RUNNING else None
    if name is not None and FAILURES.get(name, 0) == 0:
        return f"{what_is_wrong} {AGAIN}"
    return f"{what_is_wrong}; {formula}"


def _hint_for(e: BaseException, hints: dict[str, str]) -> str:
    """A check function may carry ``hints``: {substring of the error: hint}. First match wins."""
    text = f"{type(e).__name__}: {e}"
    for needle, hint in hints.items():
        if needle in text:
            return f". Hint: {hint}"
    return ""


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


def expect_number(what: str, got, unit: str) -> float:
    """Fail unless ``got`` is a real number (or a one-element tensor); returns it as a float."""
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, numbers.Real) or isinstance(got, bool):
        fail(f"{what} should return a number ({unit}), got {type(got).__name__}")
    return float(got)


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    """|a − b| within ``rel`` of |b|."""
    return abs(a - b) <= rel * max(abs(b), 1e-30)


def check_cases(fn, what: str, unit: str, cases, reference, mistakes, default_hint: str, describe, compare) -> None:
    """Call ``fn(*case)`` for every case and compare with ``reference(*case)``.

    On a mismatch, fail on the first wrong case with the hint of the first mistake that holds for
    *every* answer given, so that a mistake is named only when it fits all the evidence; else
    ``default_hint`` (the formula), shown only from the check's second failure (:func:`reveal`). ``mistakes``: ``(holds(got, want, case) -> bool, hint)`` pairs;
    ``describe(case)`` and ``compare(got, want)`` word the message.
    """
    answers = [(expect_number(what, fn(*case), unit), reference(*case), case) for case in cases]
    wrong = [a for a in answers if not close(a[0], a[1])]
    if not wrong:
        return
    got, want, case = wrong[0]
    hint = next((h for holds, h in mistakes if all(holds(*a) for a in answers)), None) or reveal(
        "your answers fit none of the usual mistakes; recheck each term against the exercise text", default_hint)
    fail(f"for {describe(case)}: {compare(got, want)}. Hint: {hint}")


def kernel_setting() -> tuple[str, torch.dtype, float]:
    """(device, dtype, tolerance) for checking a learner's Triton kernel: fp32 within 1e-5 on the CPU
    under Triton's interpreter (which has no bf16/fp16 math); fp16 within 2e-3 when compiled on a GPU."""
    from ..machine import detect, triton_mode

    if triton_mode() == "interpreter":
        return "cpu", torch.float32, 1e-5
    return detect().device, torch.float16, 2e-3


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in fp32 (NaN if got has NaN or inf)."""
    diff = (got.float() - want.float()).abs()
    return float("nan") if not torch.isfinite(got.float()).all() else diff.max().item()


# --- grading a notebook ----------------------------------------------------------------------

@dataclass(frozen=True)
class GradeRow:
    exercise: str
    status: str  # "passed", "failed", "not attempted"
    detail: str = ""


@dataclass(frozen=True)
class GradeReport:
    notebook: str
    rows: tuple[GradeRow, ...]
    unit: int | None = None

    @property
    def passed(self) -> int:
        return sum(r.status == "passed" for r in self.rows)

    @property
    def all_passed(self) -> bool:
        return bool(self.rows) and self.passed == len(self.rows)

    def table(self) -> str:
        """Exercise and result in a table; the reason for each failure on its own line below it."""
        body = [(r.exercise, r.status + (f" [{i}]" if r.detail else "")) for i, r in enumerate(self.rows, 1)]
        notes = [f"[{i}] {r.detail}" for i, r in enumerate(self.rows, 1) if r.detail]
        return "\n".join([self.notebook, table(body, ["exercise", "result"]), *notes,
                          f"score: {self.passed}/{len(self.rows)}"])

    def as_json(self) -> dict:
        """``teraflops grade --json``: ``{"notebook", "unit", "checks": [{"name", "passed", "message"}],
        "passed", "total"}``; ``message`` is the failure's reason, ``"not attempted"``, or ``""``."""
        checks = [{"name": r.exercise, "passed": r.status == "passed",
                   "message": r.detail or ("" if r.status == "passed" else r.status)} for r in self.rows]
        return {"notebook": self.notebook, "unit": self.unit, "checks": checks,
                "passed": self.passed, "total": len(self.rows)}


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
        lines = cell.source.split("\n")
        position = _SYNTAX_POSITION.search(first)
        if position:  # SyntaxError and its subclasses: the position is in the message
            first = first[:position.start()]
            number = int(position.group(1))
            code = lines[number - 1].strip() if 0 < number <= len(lines) else ""
            return f"{ename}: {first} at line {number} of the cell" + (f": {code}" if code else "")
        tb = _ANSI.sub("", "\n".join(out.get("traceback", [])))
        frames = _FRAME_LINE.findall(tb)
        where = f" (line {frames[-1]} of the cell)" if len(out.get("traceback", [])) > 1 and frames else ""
        return (f"{ename}: {first}" if first else ename) + where
    return None


def _first_line_of(cell) -> str:
    line = next((ln.strip() for ln in cell.source.split("\n") if ln.strip() and not ln.strip().startswith("#")), "")
    return line if len(line) <= 60 else line[:57] + "..."


def _result_for(ex: Exercise, cells) -> GradeRow:
    """What the check cells calling ``check.<ex.name>`` printed: the exact pass line, a check error
    naming this exercise, or any other error of that cell. When the check cell could not run the
    learner's code (a ``NameError``, say) and a cell of the exercise (between the previous check
    cell and this one) failed, the error of the nearest such cell is the reason shown."""
    ran = [i for i, c in enumerate(cells) if re.search(rf"\bcheck\.{ex.name}\(", c.source)]
    if not ran:
        return GradeRow(ex.label, "failed", f"no check cell calls check.{ex.name}(...)")
    label_prefix = f"{ex.label}: "
    for index in ran:
        cell = cells[index]
        texts, errors = _outputs(cell)
        for ename, evalue in errors:
            if ename == "NotAttempted" and evalue.startswith(label_prefix):
                return GradeRow(ex.label, "not attempted")
            if ename == "ExerciseFailed" and evalue.startswith(label_prefix):
                return GradeRow(ex.label, "failed", evalue[len(label_prefix):])
        if errors and not any(e in ("NotAttempted", "ExerciseFailed") for e, _ in errors):
            ename, evalue = errors[0]
            if ename == "KeyboardInterrupt":
                return GradeRow(ex.label, "failed", "interrupted: the check ran past the time limit per cell (--timeout)")
            start = max((i for i in range(index) if _CHECK_CALL.search(cells[i].source)), default=-1) + 1
            own = [(c, cell_error(c)) for c in cells[start:index]]
            own = [(c, e) for c, e in own if e]
            if own:  # the nearest failed cell above the check: the exercise's own cell, usually
                c, why = own[-1]
                return GradeRow(ex.label, "failed", f"your cell `{_first_line_of(c)}` raised {why}")
            why = f"{ename}: {evalue}" if evalue else ename
            if ename == "NameError":
                why += " (did the cell that defines it fail, or run past the time limit?)"
            return GradeRow(ex.label, "failed", f"the check cell raised {why}")
        if any(f"{PASS_MARK} {ex.label}: passed" in t for t in texts):
            return GradeRow(ex.label, "passed")
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

    from ..runner import execute_cells, make_client
    from . import unit01, unit02, unit03, unit04, unit05, unit06  # noqa: F401 - registers the units' exercises

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
    return GradeReport(path.name, tuple(_result_for(ex, code) for ex in exercises), unit)


def grade_notebook(path: str | Path, timeout: int = 600, unit: int | None = None) -> tuple[str, bool]:
    """``teraflops grade``: the printed table and whether every exercise passed."""
    report = grade(path, timeout=timeout, unit=unit)
    return report.table(), report.all_passed


def finite_answer(fn, what: str, unit: str, describe):
    """``fn`` called on a copy of each case (a learner may sort a list in place), whose answer must be
    a finite number: nan or inf fails at once, naming the case (``describe(case)``)."""
    def call(*case):
        got = expect_number(what, fn(*copy.deepcopy(case)), unit)
        if not math.isfinite(got):
            fail(f"for {describe(case)}: got {got}, expected a finite number ({unit}). "
                 "Hint: look for a division by zero")
        return got
    return call


def holds(formula):
    """A mistake model for :func:`check_cases`: the learner's answer is ``formula(*case)`` to 1e-6."""
    def matches(got, want, case):
        try:
            return close(got, float(formula(*case)))
        except (ArithmeticError, ValueError, IndexError):  # the wrong version cannot answer the case
            return False
    return matches
