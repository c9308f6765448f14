"""Errors a learner sees as one line in a notebook, not a 40-line traceback.

IPython renders an exception through its ``_render_traceback_`` method when it has one
(see IPython's ``InteractiveShell.showtraceback``); every course error defines it, so a
wrong shape, a wrong dtype or an unfinished exercise reads as a single sentence with a hint.
The cell still fails, so nbval, nbclient and ``teraflops grade`` see the error.
"""

from __future__ import annotations

import sys


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


class ExerciseSkipped(CourseError):
    """A check cannot run on this machine (a package or the hardware it needs is missing); the message says why."""


def expect_shape(name: str, tensor, shape: tuple, hint: str = "") -> None:
    """Raise :class:`ShapeError` unless ``tensor.shape == shape`` (``None`` matches any size)."""
    actual = tuple(tensor.shape)
    ok = len(actual) == len(shape) and all(s is None or s == a for s, a in zip(shape, actual))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        msg = f"{name} must have shape {want}, got {actual}"
        raise ShapeError(msg + (f". Hint: {hint}" if hint else ""))


# The lab placeholder's message (teraflops.course.labs.PLACEHOLDER writes it); kept here so that importing
# the package does not import the lab builder.
PLACEHOLDER_MESSAGE = "Exercise: replace this line with your code"


def _placeholder_handler(shell, etype, value, tb, tb_offset=None):
    """IPython custom exception handler: an unfinished exercise, reached from any cell (a check, or a
    cell that uses the learner's function to print or plot), reads as one line, and so does every
    course error (:func:`_show_one_line`). Any other ``NotImplementedError`` is shown as IPython shows it. IPython 9 does
    not display what a handler returns, so the handler shows it (``_showtraceback``: ipykernel sends
    it as the cell's error)."""
    if isinstance(value, CourseError):
        _show_one_line(shell, etype, value, value._render_traceback_()[0])
        return None
    if str(value) != PLACEHOLDER_MESSAGE:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None
    frames, name = tb, None
    while frames is not None:  # the innermost frame is the learner's unfinished function
        name, frames = frames.tb_frame.f_code.co_name, frames.tb_next
    where = f"{name}() is" if name and name != "<module>" else "this exercise is"
    _show_one_line(shell, etype, value, f"NotImplementedError: {where} not written yet. Hint: finish that exercise "
                   "(replace its raise NotImplementedError line), run its cell, then rerun this one")
    return None


def _show_one_line(shell, etype, value, line: str) -> None:
    """A course error's one line, wrapped at spaces only. JupyterLab shows a cell's error (and any
    text output) in a ``<pre>`` styled ``word-break: break-all``, which splits words and numbers
    ("0.\n694"); so in a kernel the line is shown as HTML (``white-space: pre-wrap; word-break:
    normal``, plain text beside it for other front ends) and the error itself, which still fails the
    cell for nbval, nbclient and ``teraflops grade`` (its ``evalue`` unchanged), reads its name only."""
    import html

    from IPython.display import display

    if type(shell).__name__ != "ZMQInteractiveShell":  # a terminal wraps at its own width
        shell._showtraceback(etype, value, [line])
        return
    display({"text/plain": line,
             "text/html": '<pre class="teraflops-message" style="white-space: pre-wrap; word-break: normal; '
                          'overflow-wrap: normal; margin: 0; padding: 2px 4px; '
                          f'background: var(--jp-rendermime-error-background)">{html.escape(line)}</pre>'}, raw=True)
    shell._showtraceback(etype, value, [f"{etype.__name__} (above)"])


def install_notebook_hooks() -> bool:
    """In an IPython kernel, make the lab placeholder's ``NotImplementedError`` and every course error a
    one-line message wrapped at spaces
    (``InteractiveShell.set_custom_exc``). The cell still fails, so nbval, nbclient and ``teraflops
    grade`` see the error. Returns whether a shell was found; outside IPython it does nothing."""
    if "IPython" not in sys.modules:  # no kernel without IPython; importing it here costs ~0.3 s
        return False
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    shell.set_custom_exc((NotImplementedError, CourseError), _placeholder_handler)
    return True
