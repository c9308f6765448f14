"""Labs are generated from solutions, never edited by hand.

In a solution notebook, code between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (nbgrader's
markers, https://nbgrader.readthedocs.io) is replaced in the lab by one line at the marker's
indentation::

    raise NotImplementedError("Exercise: replace this line with your code")

Cells tagged ``solution-only`` are dropped, all outputs and execution counts are cleared. A
solution's metadata names its unit (``{"teraflops": {"unit": N}}``, :data:`UNIT_KEY`); the lab keeps
it, so ``teraflops grade`` knows the unit of a copy under any file name. A lab's setup cells
(:mod:`teraflops.course.setup_cell`) are its solution's, with links to the lab.
``teraflops labs build`` writes ``labs/`` from ``solutions/``; ``teraflops labs check`` reports
every lab that differs from what build would write (CI fails on drift).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

from teraflops.course import setup_cell
from teraflops.course.runner import make_client
from teraflops.errors import PLACEHOLDER_MESSAGE, CourseError

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PLACEHOLDER = f'raise NotImplementedError("{PLACEHOLDER_MESSAGE}")'
SOLUTION_ONLY_TAG = "solution-only"
UNIT_KEY = "teraflops"  # notebook metadata: {"teraflops": {"unit": N}} (read by grading.grader.unit_of)
# Like nbgrader, any comment line naming the marker counts, whatever its case or number of '#'.
_MARKER = re.compile(r"^\s*#+\s*(BEGIN|END)\s+SOLUTION\s*$", re.IGNORECASE)
_ANY_MARKER = re.compile(r"(BEGIN|END)\s+SOLUTION", re.IGNORECASE)


def strip_solution(source: str, where: str = "cell") -> str:
    """Replace each marked region of ``source`` by the placeholder line.

    Raises:
        CourseError: unbalanced or nested markers (message names ``where``).
    """
    out, inside = [], False
    for i, line in enumerate(source.split("\n"), 1):  # "\n" only: other line breaks may sit in strings
        marker = _MARKER.match(line.rstrip("\r"))
        kind = marker.group(1).upper() if marker else None
        if kind == "BEGIN":
            if inside:
                raise CourseError(f"{where}, line {i}: nested {BEGIN}")
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + PLACEHOLDER)
        elif kind == "END":
            if not inside:
                raise CourseError(f"{where}, line {i}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise CourseError(f"{where}: {BEGIN} is never closed")
    for i, line in enumerate(out, 1):
        if _ANY_MARKER.search(line):
            raise CourseError(f"{where}, line {i}: {line.strip()!r} looks like a solution marker but is not one; "
                              f"write '{BEGIN}' or '{END}' alone on its line")
    return "\n".join(out)


def lab_from_solution(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The lab notebook for a solution notebook (a new object; the input is not modified)."""
    lab = copy.deepcopy(solution)
    cells = []
    for i, cell in enumerate(lab.cells):
        if SOLUTION_ONLY_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        if cell.cell_type == "code":
            cell.source = strip_solution(cell.source, f"{name}, cell {i}")
            cell.outputs = []
            cell.execution_count = None
        elif _ANY_MARKER.search(cell.source):
            raise CourseError(f"{name}, cell {i}: solution markers only work in code cells; tag the "
                              f"cell '{SOLUTION_ONLY_TAG}' to keep it out of the lab")
        cells.append(cell)  # cell ids are kept: a lab cell has its solution cell's id
    lab.cells = cells
    return lab


def _render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb, version=4) + "\n"


def _pairs(root: Path):
    root = Path(root)
    for sol in sorted((root / "solutions").glob("*.ipynb")):
        yield sol, root / "labs" / sol.name


def expected_lab(solution_path: Path) -> str:
    """The exact text ``labs build`` writes for one solution notebook."""
    solution_path = Path(solution_path)
    lab = lab_from_solution(nbformat.read(solution_path, as_version=4), solution_path.name)
    url = setup_cell.source_url(solution_path.parent.parent)  # the lab's links open the lab, not its solution
    return _render(setup_cell.with_setup(lab, f"labs/{solution_path.name}", url))


def build_labs(root: str | Path = ".") -> list[Path]:
    """Write ``labs/<name>.ipynb`` for each ``solutions/<name>.ipynb`` under ``root``; returns the paths."""
    written = []
    for sol, lab in _pairs(Path(root)):
        lab.parent.mkdir(exist_ok=True)
        lab.write_text(expected_lab(sol), encoding="utf-8")
        written.append(lab)
    return written


def check_labs(root: str | Path = ".") -> list[str]:
    """Problems that make the committed labs differ from their solutions (empty list: in sync)."""
    problems = []
    root = Path(root)
    pairs = list(_pairs(root))
    if not pairs:
        problems.append(f"no solution notebooks under {root / 'solutions'}")
    for sol, lab in pairs:
        if not lab.exists():
            problems.append(f"{lab} is missing: run `teraflops labs build`")
        elif lab.read_text(encoding="utf-8") != expected_lab(sol):
            problems.append(f"{lab} differs from what {sol} generates: run `teraflops labs build`")
    for sol, _ in pairs:
        prefix = re.match(r"(\d+)_", sol.name)
        unit = nbformat.read(sol, as_version=4).metadata.get(UNIT_KEY, {}).get("unit")
        if prefix and unit != int(prefix.group(1)):
            problems.append(f"{sol} should carry its unit in its metadata ({UNIT_KEY}.unit = {int(prefix.group(1))}, "
                            f"found {unit!r}): labs copy it, and teraflops grade reads it")
    names = {s.name for s, _ in pairs}
    for lab in sorted((root / "labs").glob("*.ipynb")):
        if lab.name not in names:
            problems.append(f"{lab} has no solution in {root / 'solutions'}")
    return problems


CHECKED = "# NBVAL_CHECK_OUTPUT"


def refresh_outputs(path: str | Path, timeout: int = 600) -> Path:
    """Execute the notebook at ``path`` and save it with outputs kept only on cells marked
    ``# NBVAL_CHECK_OUTPUT`` (the ones nbval compares); every other output is cleared.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (the file is left untouched).
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    make_client(nb, path, timeout).execute()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)  # run timestamps: churn in every diff
        if CHECKED not in cell.source:
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)  # widget state (progress bars, plots in widgets) is output too
    path.write_text(_render(nb), encoding="utf-8")
    return path


def refresh_all(root: str | Path = ".") -> list[Path]:
    """``teraflops labs refresh``: refresh lectures and solutions, then rebuild the labs."""
    root = Path(root)
    done = [refresh_outputs(p) for p in sorted((root / "notebooks").glob("*.ipynb"))]
    done += [refresh_outputs(p) for p in sorted((root / "solutions").glob("*.ipynb"))]
    return done + build_labs(root)
