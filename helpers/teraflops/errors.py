"""Errors a learner sees as one line in a notebook, not a 40-line traceback.

IPython renders an exception through its ``_render_traceback_`` method when it has one
(see IPython's ``InteractiveShell.showtraceback``); every course error defines it, so a
wrong shape, a wrong dtype or an unfinished exercise reads as a single sentence with a hint.
The cell still fails, so nbval, nbclient and ``teraflops grade`` see the error.
"""

from __future__ import annotations


class CourseError(Exception):
    """Base class: a mistake the learner can fix, explained in one line."""

    def _render_traceback_(self) -> list[str]:  # IPython hook
        return [f"{type(self).__name__}: {self}"]


class ShapeError(CourseError, ValueError):
    """A tensor has the wrong shape; the message names the expected and the actual shape."""


class DTypeError(CourseError, TypeError):
    """A tensor has a dtype the operation does not support."""


class ExerciseFailed(CourseError, AssertionError):
    """A check found a wrong answer; the message names the exercise, what was wrong and a hint."""


class NotAttempted(CourseError, NotImplementedError):
    """The exercise still holds its placeholder (``raise NotImplementedError``)."""


def expect_shape(name: str, tensor, shape: tuple, hint: str = "") -> None:
    """Raise :class:`ShapeError` unless ``tensor.shape == shape`` (``None`` matches any size)."""
    actual = tuple(tensor.shape)
    ok = len(actual) == len(shape) and all(s is None or s == a for s, a in zip(shape, actual))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        msg = f"{name} must have shape {want}, got {actual}"
        raise ShapeError(msg + (f". Hint: {hint}" if hint else ""))
