"""The kernel's input history: did the learner's latest version of a function fail to compile?

In a live notebook a cell that does not compile defines nothing, so the function the check is handed
is still the earlier one, often the lab's stub (``raise NotImplementedError``), and a check would say
"not attempted" about code the learner just wrote. IPython stores every cell's source before it
compiles it (``InteractiveShell.run_cell``: ``history_manager.store_inputs`` comes first, then
``compiler.ast_parse``; the sources are the list ``In`` in the user namespace), so the latest cell
that defines ``name`` can be compiled again here and its error named. Outside IPython (``teraflops
grade`` reads the executed notebook instead: :func:`teraflops.grading.grader.cell_error`) this finds
nothing.
"""

from __future__ import annotations

import ast
import re
import sys


def syntax_line(ename: str, message: str, number: int, source: str) -> str:
    """One line for a compile error: ``SyntaxError: invalid syntax at line 3 of the cell: return m * * 2``.

    ``number`` is the 1-based line of ``source`` (a cell) that Python's error names; the line's code is
    shown when it exists."""
    lines = source.split("\n")
    code = lines[number - 1].strip() if 0 < number <= len(lines) else ""
    return f"{ename}: {message} at line {number} of the cell" + (f": {code}" if code else "")


def function_name(value) -> str | None:
    """The name a learner's function was defined under: a plain function's ``__name__``, a Triton
    kernel's (``triton.jit`` wraps it; the original is ``.fn``); ``None`` for a value."""
    for candidate in (value, getattr(value, "fn", None)):
        name = getattr(candidate, "__name__", None)
        if callable(candidate) and isinstance(name, str) and name.isidentifier():
            return name
    return None


def _shell():
    """This kernel's IPython shell, or ``None`` outside IPython."""
    if "IPython" not in sys.modules:  # no kernel without IPython; importing it costs ~0.3 s
        return None
    from IPython import get_ipython  # lazy: IPython is loaded only inside a kernel

    return get_ipython()


def _cell_inputs() -> list[str]:
    """The sources of the cells run so far in this IPython kernel, oldest first (empty outside one)."""
    shell = _shell()
    inputs = shell.user_ns.get("In", []) if shell is not None else []
    return [s for s in inputs if isinstance(s, str)]


def _as_python(source: str) -> str:
    """A cell's source as IPython compiles it (magics such as ``%timeit`` become calls); unchanged
    outside IPython, or when IPython's own transform fails (the compile below then names the error)."""
    shell = _shell()
    if shell is None or not hasattr(shell, "transform_cell"):
        return source
    try:
        return shell.transform_cell(source)
    except Exception:  # noqa: BLE001 - IPython raises SyntaxError and others for broken cells
        return source


def failed_definition(name: str, inputs: list[str] | None = None) -> str | None:
    """If the latest cell whose source defines ``name`` (``def name(``) does not compile, its error in
    one line (:func:`syntax_line`); else ``None`` (no such cell, or it compiled: the definition in the
    kernel is that cell's).

    ``inputs``: cell sources oldest first; default, this IPython kernel's history (``In``)."""
    inputs = _cell_inputs() if inputs is None else inputs
    defines = re.compile(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", re.MULTILINE)
    latest = next((s for s in reversed(inputs) if defines.search(s)), None)
    if latest is None:
        return None
    try:
        compile(_as_python(latest), "<cell>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as e:  # IndentationError and TabError are SyntaxErrors
        return syntax_line(type(e).__name__, e.msg, e.lineno or 0, latest)
    return None
