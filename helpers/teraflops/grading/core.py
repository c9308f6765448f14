"""The check framework: how a check function passes, fails and hints.

A check function is decorated with :func:`exercise`. Called in a notebook it either prints one
pass line, ``✓ Exercise 3 (naive attention): passed``, or raises a one-line error:

* :class:`~teraflops.errors.NotAttempted` when the learner's code still raises
  ``NotImplementedError`` (the lab placeholder), unless the learner's latest cell defining that
  function failed to compile (the kernel then still holds the stub): that is an ``ExerciseFailed``
  naming the error and its line (:mod:`teraflops.grading.history`);
* ``– Exercise 7 (...): skipped: <why>`` when the check raised :class:`~teraflops.errors.ExerciseSkipped`
  (this machine cannot run it: a package or the hardware it needs is missing);
* :class:`~teraflops.errors.ExerciseFailed` naming the exercise, what was wrong (shape, dtype,
  value, max error) and a hint. Any other exception from the learner's code becomes one too.

Each common wrong answer is a mistake model (:func:`holds`) with its hint, revealed with the formula
after a second failure (:func:`reveal`). The grader that runs a whole lab and reads these lines back
is :mod:`teraflops.grading.grader`.
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
import re
from dataclasses import dataclass

import torch

from teraflops.errors import PLACEHOLDER_MESSAGE, CourseError, ExerciseFailed, ExerciseSkipped, NotAttempted
from teraflops.grading import history
from teraflops.machine import detect, triton_mode

PASS_MARK = "✓"
SKIP_MARK = "–"


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
    return PLACEHOLDER_MESSAGE in str(e) or (type(e) is NotImplementedError and not str(e))


def _failed_latest_version(args, kwargs) -> str | None:
    """When the learner's latest cell defining a function handed to the check did not compile, what to
    say instead of "not attempted": the kernel still holds the earlier definition (the stub), so the
    check ran that one (:func:`teraflops.grading.history.failed_definition`)."""
    for value in (*args, *kwargs.values()):
        name = history.function_name(value)
        why = history.failed_definition(name) if name else None
        if why:
            return (f"your latest `{name}` cell did not compile, so this kernel still holds the earlier {name}: "
                    f"{why}. Hint: fix that line, run the cell, then this check again")
    return None


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
            except ExerciseSkipped as e:  # this machine cannot run the check: one line, why (no pass line)
                print(f"{SKIP_MARK} {ex.label}: skipped: {e}")
                return
            except ExerciseFailed as e:
                FAILURES[ex.name] = FAILURES.get(ex.name, 0) + 1
                raise ExerciseFailed(f"{ex.label}: {e}") from None
            except Exception as e:  # noqa: BLE001 - anything the learner's code raised
                stale = _failed_latest_version(args, kwargs) if _looks_unattempted(e) else None
                if stale:
                    FAILURES[ex.name] = FAILURES.get(ex.name, 0) + 1
                    raise ExerciseFailed(f"{ex.label}: {stale}") from None
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
    if triton_mode() == "interpreter":
        return "cpu", torch.float32, 1e-5
    return detect().device, torch.float16, 2e-3


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in fp32 (NaN if got has NaN or inf)."""
    diff = (got.float() - want.float()).abs()
    return float("nan") if not torch.isfinite(got.float()).all() else diff.max().item()


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
