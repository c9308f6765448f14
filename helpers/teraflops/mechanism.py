"""Show the lines of a helper that do the work, read from the helper itself.

A lecture measures online softmax, ZeRO's partitioning or a straggler detector by calling a helper;
before the measurement it shows the ten or so lines of that helper that *are* the mechanism, the way
Triton's tutorials and llm.c's ``dev/cuda`` put the kernel in front of the reader. The lines come from
the helper's own source (:func:`inspect.getsource`) when the cell runs, so what a learner reads is what
the measurement ran: they cannot drift apart.

Three ways to choose the lines (:func:`listing`):

* the whole function, method or class, its docstring left out: ``listing(detection.modified_z)``;
* a region between two marker comments placed in the helper's source, for a few lines inside a long
  function (the markers are not shown)::

      # mechanism: online softmax
      m_new = tl.maximum(m_i, tl.max(s, 1))
      ...
      # end mechanism

  ``listing(flash_triton.flash_fwd_tiles, "online softmax")``;
* a line selector, for a helper that carries no markers: ``start`` and ``stop`` are pieces of text of
  the first and the last line to show (``stop`` omitted: to the end of the object).

A marker or a selector that is no longer there is an error (:class:`MechanismError`, one line), never an
empty listing: a refactor that drops a marker fails ``tests/test_mechanism.py``, which runs every
``mechanism.show`` call of the lectures.

:func:`show` displays a listing: in Jupyter as highlighted Python (HTML, with a Markdown code block and
plain text beside it for other front ends), elsewhere as plain text. Its header names the file and line
numbers, so the learner can open the helper at that place.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from teraflops.errors import CourseError

__all__ = ["Listing", "MechanismError", "listing", "show", "START", "END"]

_CSS_CLASS = "teraflops-listing"
_PRE_STYLE = ("font-family: var(--jp-code-font-family, monospace); font-size: var(--jp-code-font-size, 13px); "
              "line-height: var(--jp-code-line-height, 1.3); white-space: pre; word-break: normal; "
              "overflow-x: auto; margin: 0; padding: 4px 8px")

START = "# mechanism:"  # followed by the region's name: "# mechanism: online softmax"
END = "# end mechanism"


class MechanismError(CourseError, LookupError):
    """The lines asked for are not in the object's source: a missing marker or selector, or no source."""


@dataclass(frozen=True)
class Listing:
    """Lines of a helper's source, ready to show.

    Attributes:
        code: the lines, dedented, joined with newlines (no trailing newline).
        path: the source file, relative to the folder above the ``teraflops`` package
            (``"teraflops/model_definition/flash_triton.py"``), or absolute for a file outside it.
        first, last: 1-based line numbers of the first and last line shown, in that file.
        qualname: the object's qualified name (``"Int8Linear.forward"``); the module's name for a module.
        region: the marker's name, ``"start…stop"`` for a selector, ``""`` for the whole object.
        docstring_left_out: whether lines between ``first`` and ``last`` (the docstring) are not shown.
    """

    code: str
    path: str
    first: int
    last: int
    qualname: str
    region: str = ""
    docstring_left_out: bool = False

    @property
    def where(self) -> str:
        """``"teraflops/compilation/fused.py, lines 48–62, in rmsnorm_kernel (docstring left out)"``."""
        lines = f"line {self.first}" if self.first == self.last else f"lines {self.first}–{self.last}"
        return f"{self.path}, {lines}, in {self.qualname}" + (" (docstring left out)" if self.docstring_left_out else "")

    def __str__(self) -> str:
        return f"# {self.where}\n{self.code}"

    def __repr__(self) -> str:  # what a terminal or a text-only front end prints
        return str(self)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython's plain-text display
        p.text(str(self))

    def _repr_markdown_(self) -> str:  # front ends that render Markdown but not HTML
        fence = "````" if "```" in self.code else "```"
        return f"`{self.where}`\n\n{fence}python\n{self.code}\n{fence}\n"

    def _repr_html_(self) -> str:
        """Highlighted by Pygments in JupyterLab's colours (``jupyterlab_pygments``, which nbconvert uses;
        the theme's CSS variables, so dark themes work), with its CSS inline: nbconvert's HTML sets
        ``font-family: inherit`` on output ``<pre>``, which would set a Markdown code block in the
        text font. Lines are not wrapped (``word-break: break-all`` would split words); a long one scrolls."""
        import html

        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        try:
            from jupyterlab_pygments import JupyterStyle as style
        except ImportError:  # pragma: no cover - nbconvert depends on it
            style = "default"
        fmt = HtmlFormatter(style=style, cssclass=_CSS_CLASS)
        body = highlight(self.code, PythonLexer(), fmt).replace("<pre>", f'<pre style="{_PRE_STYLE}">', 1)
        used = set(re.findall(r'class="([\w-]+)"', body))
        rules = [r for r in fmt.get_style_defs(f".{_CSS_CLASS}").splitlines()
                 if r.startswith(f".{_CSS_CLASS} {{") or (r.startswith(f".{_CSS_CLASS} .") and r.split()[1][1:] in used)]
        return (f"<style>{' '.join(rules)}</style>"
                f'<div style="font-size: 0.9em; margin: 2px 0"><code>{html.escape(self.where)}</code></div>{body}')


def _unwrap(obj):
    """The plain Python object whose source to read: a Triton kernel's function (``@triton.jit`` and
    ``@triton.autotune`` keep it in ``.fn``), a property's getter, a method's function."""
    for _ in range(8):
        if isinstance(obj, property):
            obj = obj.fget
        elif inspect.ismethod(obj):
            obj = obj.__func__
        elif not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)) and hasattr(obj, "fn"):
            obj = obj.fn
        else:
            break
    return inspect.unwrap(obj) if inspect.isfunction(obj) else obj


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _relative(path: str) -> str:
    """``.../helpers/teraflops/compilation/fused.py`` → ``teraflops/compilation/fused.py`` (paths outside the package stay whole)."""
    package = Path(__file__).resolve().parent
    try:
        return str(Path(path).resolve().relative_to(package.parent))
    except ValueError:
        return str(path)


def _source(obj) -> tuple[list[str], int, str]:
    """(source lines without newlines, 1-based number of the first, file) of ``obj``."""
    try:
        lines, first = inspect.getsourcelines(obj)
        path = inspect.getsourcefile(obj) or inspect.getfile(obj)
    except (OSError, TypeError) as e:
        raise MechanismError(f"no source for {_name(obj)!r} ({type(obj).__name__}): {str(e).splitlines()[0]}. "
                             "Hint: pass a function, method, class or module defined in a .py file") from None
    return [line.rstrip("\n") for line in lines], max(first, 1), path


def _body(obj, lines: list[str]) -> list[int]:
    """0-based indices of ``lines`` to show for a whole function or class: decorators and signature,
    then the body without its docstring."""
    try:
        tree = ast.parse(textwrap.dedent("\n".join(lines)))
    except SyntaxError:  # e.g. a multi-line string at column 0 inside a method: dedent cannot undo the indent
        raise MechanismError(f"cannot parse the source of {_name(obj)} on its own. Hint: mark the lines to show "
                             f"('{START} NAME' … '{END}') or choose them with start=/stop=") from None
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))),
                None)
    if node is None:
        raise MechanismError(f"{_name(obj)} is not a function or class. Hint: pass a marker name "
                             f"('{START} NAME' in its source) or start=... to choose lines")
    top = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    doc = node.body[0]
    has_doc = (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
               and isinstance(doc.value.value, str))
    keep = list(range(top, node.end_lineno))
    if has_doc and len(node.body) > 1:  # a docstring-only body (an abstract stub) keeps its docstring
        keep = [i for i in keep if not doc.lineno - 1 <= i < doc.end_lineno]
    return keep


def _marked(obj, lines: list[str], name: str) -> list[int]:
    """0-based indices of the lines between ``# mechanism: NAME`` and the next ``# end mechanism``."""
    starts = [i for i, line in enumerate(lines) if line.strip() == f"{START} {name}"]
    if not starts:
        there = [line.strip()[len(START):].strip() for line in lines if line.strip().startswith(START)]
        raise MechanismError(f"{_name(obj)} has no '{START} {name}' marker in its source"
                             + (f" (it has: {', '.join(repr(t) for t in there)})" if there else "")
                             + f". Hint: the marker (and a '{END}' after it) goes on its own line in the helper, "
                             "around the lines to show")
    if len(starts) > 1:
        raise MechanismError(f"{_name(obj)} has {len(starts)} '{START} {name}' markers; a region's name must be unique")
    end = next((i for i in range(starts[0] + 1, len(lines)) if lines[i].strip().startswith(START)
                or lines[i].strip() == END), None)
    if end is None or lines[end].strip() != END:
        raise MechanismError(f"{_name(obj)}: '{START} {name}' has no '{END}' after it (before the next marker). "
                             "Hint: close each region on its own line")
    keep = list(range(starts[0] + 1, end))
    if not any(lines[i].strip() for i in keep):
        raise MechanismError(f"{_name(obj)}: the region '{name}' is empty. Hint: put the lines to show between "
                             "its two markers")
    return keep


def _selected(obj, lines: list[str], start: str | None, stop: str | None) -> list[int]:
    """0-based indices from the first line containing ``start`` to the first line from there containing
    ``stop`` (inclusive; to the end without ``stop``)."""
    i = 0 if start is None else next((n for n, line in enumerate(lines) if start in line), None)
    if i is None:
        raise MechanismError(f"{_name(obj)} has no line containing {start!r}. Hint: the helper changed; "
                             "choose the lines again (start=, stop=) or mark them with a marker comment")
    j = len(lines) - 1 if stop is None else next((n for n in range(i, len(lines)) if stop in lines[n]), None)
    if j is None:
        raise MechanismError(f"{_name(obj)} has no line containing {stop!r} at or after {start!r}. "
                             "Hint: the helper changed; choose the lines again")
    return list(range(i, j + 1))


def listing(obj, marker: str | None = None, *, start: str | None = None, stop: str | None = None) -> Listing:
    """The lines of ``obj``'s source that show its mechanism.

    Args:
        obj: a function, method, class, property, module, or a Triton kernel (``@triton.jit``,
            ``@triton.autotune``: its Python function is read).
        marker: the name of a region marked in the source with ``# mechanism: NAME`` … ``# end mechanism``
            (markers not shown). Not with ``start``/``stop``.
        start, stop: text that the first and the last line to show contain (first match; ``stop`` is
            searched from the ``start`` line on, ``None``: the object's last line).
        Without ``marker``, ``start`` or ``stop``: the whole function or class, docstring left out.

    Returns:
        :class:`Listing`, dedented, with its file and line numbers.

    Raises:
        MechanismError: no source, a marker or selector text not found, a marker without its end, or a
            module without ``marker``/``start`` (one line, with a hint).
    """
    if marker is not None and (start is not None or stop is not None):
        raise MechanismError("choose the lines by a marker or by start/stop, not both. Hint: "
                             "listing(fn, 'NAME') or listing(fn, start='...', stop='...')")
    if marker is not None and (not isinstance(marker, str) or not marker.strip()):
        raise MechanismError(f"marker must be the region's name (a non-empty string), got {marker!r}")
    obj = _unwrap(obj)
    lines, first, path = _source(obj)
    if marker is not None:
        keep, region = _marked(obj, lines, marker.strip()), marker.strip()
    elif start is not None or stop is not None:
        keep, region = _selected(obj, lines, start, stop), f"{start or ''}…{stop or ''}"
    elif inspect.ismodule(obj):
        raise MechanismError(f"module {obj.__name__} is too long to show whole. Hint: pass a marker name or "
                             "start='...' (and stop='...') to choose its lines")
    else:
        keep, region = _body(obj, lines), ""
    while keep and not lines[keep[-1]].strip():  # no trailing blank lines
        keep.pop()
    code = textwrap.dedent("\n".join(lines[i] for i in keep))
    return Listing(code, _relative(path), first + keep[0], first + keep[-1],
                   obj.__name__ if inspect.ismodule(obj) else _name(obj), region,
                   docstring_left_out=len(keep) < keep[-1] - keep[0] + 1)


def show(obj, marker: str | None = None, *, start: str | None = None, stop: str | None = None) -> None:
    """Display :func:`listing` ``(obj, marker, start=, stop=)`` now.

    Under IPython it is displayed at once (highlighted HTML; Markdown and plain text beside it), so
    several calls in one cell each show their lines; elsewhere it is printed. Returns nothing, so a
    cell that ends in ``show(...)`` shows the lines once; :func:`listing` returns them.

    Raises:
        MechanismError: as :func:`listing`.
    """
    found = listing(obj, marker, start=start, stop=stop)
    try:
        from IPython import get_ipython
    except ImportError:  # no IPython installed: a plain script
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        from IPython.display import display

        display(found)
    else:
        print(found)
