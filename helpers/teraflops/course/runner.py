"""Run the lecture notebooks headless and summarise what they measured: ``teraflops run``.

Each lecture notebook ``notebooks/NN_name.ipynb`` (``NN`` is the unit number) is executed in a fresh
Jupyter kernel with nbclient, one cell at a time behind a progress bar. The executed notebook, with
its outputs, is written to ``<out_dir>/NN_name.ipynb`` and rendered to ``<out_dir>/NN_name.html``.
A failing cell stops that notebook only: the failure (cell index, exception name and message) is
recorded, the partially executed notebook is still written, and the next notebook runs.

Headline numbers come from :mod:`teraflops.headlines`: the kernel inherits ``TERAFLOPS_REPORT``
pointing at ``<out_dir>/NN_name.report.json``, which the notebook fills with ``headlines.record``.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from teraflops import headlines
from teraflops.course import stories as story_list
from teraflops.errors import CourseError
from teraflops.launch.notebook import CellFailure, CellStall, execute_cells, make_client, one_line
from teraflops.machine import LoadMonitor, Machine, busy_warning

__all__ = [
    "CellFailure",
    "CellStall",
    "NotebookResult",
    "course_root",
    "find_notebooks",
    "run_notebook",
    "run_units",
    "format_summary",
]

_NOTEBOOK_NAME = re.compile(r"^(\d{2,})_.+\.ipynb$")
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # helpers/teraflops/course/../../..


@dataclass
class NotebookResult:
    """Outcome of one notebook.

    Attributes:
        name: file stem, e.g. ``"03_matmul"``.
        seconds: wall time from kernel start to the last cell run.
        ok: every cell ran without error.
        error: the failure when not ``ok``, else ``None``.
        headline: entries from :mod:`teraflops.headlines` (key -> value, unit, label).
        takeaway: the notebook's one-line verdict (:func:`teraflops.headlines.takeaway`), if it gave one.
        executed: path of the executed notebook.
        html: path of the HTML rendering, ``None`` if not requested or it failed.
        html_error: one line if the HTML export failed.
        stalls: cells whose answer reached the run :data:`STALL_SECONDS` or more after the kernel sent it.
        load: the 1-minute load average while it ran, ``{"mean", "max", "cores"}``
            (:class:`teraflops.machine.LoadMonitor`).
        mismatches: checked cells (``# NBVAL_CHECK_OUTPUT``) whose output differs from the committed
            notebook's (:func:`checked_output_mismatches`), one line each; the run is then a warning,
            not ``ok`` (:attr:`status`).
        stories: the unit's claims about live measurements (:mod:`teraflops.course.stories`), evaluated
            on ``headline`` under ``load``; one that contradicts makes the run ``FAILED``.
        not_run_checked: checked cells that never ran because the notebook stopped first
            (:func:`mark_not_run`: the executed notebook says "not run" there, never the committed ✓).
        error_log: the failure's whole message and traceback (a compiler's output, say), when it failed.
    """

    name: str
    seconds: float
    ok: bool
    error: CellFailure | None = None
    headline: dict[str, dict] = field(default_factory=dict)
    takeaway: str | None = None
    executed: Path | None = None
    html: Path | None = None
    html_error: str | None = None
    stalls: list[CellStall] = field(default_factory=list)
    load: dict = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    stories: list[story_list.StoryResult] = field(default_factory=list)
    not_run_checked: list[int] = field(default_factory=list)
    error_log: Path | None = None

    def failure_lines(self) -> list[str]:
        """At most two lines on a failure: where and the line that names the cause, then where the whole
        log is and which checked cells did not run; nothing when it did not fail."""
        if self.error is None:
            return []
        more = [f"full log: {self.error_log}"] if self.error_log else []
        if self.not_run_checked:
            cells = ", ".join(str(i) for i in self.not_run_checked)
            more.append(f"not run: checked cell{'s' if len(self.not_run_checked) > 1 else ''} {cells}")
        return [str(self.error)] + (["; ".join(more)] if more else [])

    @property
    def contradicted(self) -> list[story_list.StoryResult]:
        """The stories this run's measurements contradict (on a machine that was not busy)."""
        return [s for s in self.stories if s.status == story_list.CONTRADICTS]

    @property
    def status(self) -> str:
        """``"ok"``, ``"WARNING"`` (ran, but a checked cell's output differs from the committed one) or
        ``"FAILED"`` (a cell failed, or a story's measurements contradict it: :attr:`contradicted`).
        A story that cannot tell changes nothing."""
        return "FAILED" if not self.ok or self.contradicted else "WARNING" if self.mismatches else "ok"

    def warnings(self) -> list[str]:
        """One line per checked cell whose output differs, naming the unit and the cell."""
        m = _NOTEBOOK_NAME.match(f"{self.name}.ipynb")
        unit = f"unit {int(m.group(1))} ({self.name})" if m else self.name
        return [one_line(f"WARNING: {unit} {line.split(':', 1)[0]}: checked output differs from the committed "
                          f"one ({line.split(':', 1)[1].strip()})", 300) for line in self.mismatches]


def course_root() -> Path:
    """The folder holding ``notebooks/``: the current directory if it has one, else the repo root
    this package was installed from (``helpers/teraflops/../..``)."""
    cwd = Path.cwd()
    for candidate in (cwd, _PACKAGE_ROOT):
        if (candidate / "notebooks").is_dir():
            return candidate
    raise CourseError(
        f"no notebooks/ folder in {cwd} or in {_PACKAGE_ROOT}; run from the course repository"
    )


def find_notebooks(root: Path | None = None) -> dict[int, list[Path]]:
    """Lecture notebooks under ``root/notebooks`` by unit number (sorted by unit, then name)."""
    nb_dir = Path(root if root is not None else course_root()) / "notebooks"
    if not nb_dir.is_dir():
        raise CourseError(f"no notebooks/ folder in {nb_dir.parent}")
    found: dict[int, list[Path]] = {}
    for path in sorted(nb_dir.glob("*.ipynb")):
        m = _NOTEBOOK_NAME.match(path.name)
        if m:
            found.setdefault(int(m.group(1)), []).append(path)
    return dict(sorted(found.items()))


LONG_TRACEBACK = 40  # lines: a failing cell's traceback longer than this is a dump, shown as its cause line


def shorten_failure(nb, failure: CellFailure, log: Path | None) -> None:
    """In the executed notebook (and so its HTML), a failing cell whose error output runs over
    :data:`LONG_TRACEBACK` lines (a compiler's output) shows the line that names the cause and where the
    whole log is, instead of the dump."""
    if failure.cell_index is None or failure.cell_index >= len(nb.cells):
        return
    for out in nb.cells[failure.cell_index].get("outputs", []):
        if out.get("output_type") == "error" and sum(t.count("\n") + 1 for t in out.get("traceback", [])) > LONG_TRACEBACK:
            out["evalue"] = failure.evalue
            out["traceback"] = [f"{failure.ename}: {failure.evalue}"] + ([f"full log: {log}"] if log else [])


NOT_RUN = "not run: this lecture stopped at {where} (see the failure above); nothing below it ran"


def mark_not_run(nb, failure: CellFailure) -> list[int]:
    """After ``failure``, make the executed notebook say what did not run: every code cell after the
    failing one (every cell when the kernel never started) loses the outputs and execution count it
    carried from the committed notebook, and a checked cell (``# NBVAL_CHECK_OUTPUT``) shows
    :data:`NOT_RUN` instead of its committed result. Returns the indices of those checked cells."""
    import nbformat

    first = 0 if failure.cell_index is None else failure.cell_index + 1
    where = "its kernel's start" if failure.cell_index is None else f"cell {failure.cell_index}"
    checked = []
    for i, cell in enumerate(nb.cells[first:], start=first):
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        if cell.source.lstrip().startswith(CHECK_MARK):
            cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text=NOT_RUN.format(where=where) + "\n")]
            checked.append(i)
    return checked


def run_notebook(
    path: Path, out_dir: Path, timeout_per_cell: int = 600, html: bool = True, env: dict[str, str] | None = None
) -> NotebookResult:
    """Execute one notebook, write it (and its HTML) to ``out_dir``; never raises on cell errors.
    ``env`` is added to the kernel's environment (the run's shared ceilings, say)."""
    import nbformat

    path = Path(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = path.stem
    report_path = (out_dir / f"{name}.report.json").resolve()
    report_path.unlink(missing_ok=True)

    nb = nbformat.read(path, as_version=4)
    client = make_client(nb, path, timeout_per_cell)

    start = time.perf_counter()
    stalls: list[CellStall] = []
    with LoadMonitor() as load:
        failures = execute_cells(client, nb, name, stop_on_error=True,
                                 env={**(env or {}), headlines.ENV_VAR: str(report_path)}, stalls=stalls)
    failure = failures[0] if failures else None
    seconds = time.perf_counter() - start

    result = NotebookResult(name=name, seconds=seconds, ok=failure is None, error=failure, stalls=stalls,
                            load=load.summary())
    try:
        result.headline = headlines.read(report_path)
        result.takeaway = headlines.read_takeaway(report_path)
    except ValueError as e:  # unreadable report file: keep the run, say why
        result.headline = {}
        if result.error is None:
            result.ok = False
            result.error = CellFailure(None, "ReportError", one_line(str(e)))
    m = _NOTEBOOK_NAME.match(path.name)
    result.stories = story_list.evaluate_unit(int(m.group(1)) if m else None, result.headline, result.load)

    if failure is not None:
        result.not_run_checked = mark_not_run(nb, failure)
        if failure.detail:
            result.error_log = out_dir / f"{name}.error.txt"
            result.error_log.write_text(failure.detail + "\n", encoding="utf-8")
        shorten_failure(nb, failure, result.error_log)
    result.executed = out_dir / f"{name}.ipynb"
    nbformat.write(nb, result.executed)
    if result.ok:  # a stopped notebook's later checked cells are empty: its failure says enough
        try:
            result.mismatches = checked_output_mismatches(result.executed, path)
        except CourseError as e:  # not comparable (edited meanwhile): say so rather than hide it
            result.mismatches = [f"cell -: {one_line(str(e))}"]
    if html:
        try:
            from nbconvert import HTMLExporter

            body, _ = HTMLExporter().from_notebook_node(nb)
            result.html = out_dir / f"{name}.html"
            result.html.write_text(body, encoding="utf-8")
        except Exception as e:  # a rendering problem must not lose the run
            result.html = None
            result.html_error = f"{type(e).__name__}: {one_line(str(e))}"
    return result


def run_units(
    units: list[int] | None = None,
    out_dir: str | os.PathLike = "build",
    timeout_per_cell: int = 600,
    html: bool = True,
    root: Path | None = None,
) -> list[NotebookResult]:
    """Execute the lecture notebooks of ``units`` (all present if ``None``), in unit order.

    Args:
        units: unit numbers, e.g. ``[1, 3]``; ``None`` runs every ``notebooks/NN_*.ipynb``.
        out_dir: where executed notebooks, HTML and report files go (created if needed).
        timeout_per_cell: seconds before a cell counts as failed.
        html: also write an HTML rendering of each executed notebook.
        root: course root holding ``notebooks/``; default :func:`course_root`.

    Raises:
        CourseError: a requested unit has no notebook (the message lists the available units),
            or there are no notebooks at all.
    """
    root = Path(root) if root is not None else course_root()
    found = find_notebooks(root)
    available = ", ".join(f"{u:02d}" for u in found) or "none"
    if not found:
        raise CourseError(f"no lecture notebooks (NN_name.ipynb) in {root / 'notebooks'}")
    if units is None:
        selected = list(found)
    else:
        missing = [u for u in units if u not in found]
        if missing:
            which = ", ".join(f"{u:02d}" for u in missing)
            units_word = "units" if len(missing) > 1 else "unit"
            raise CourseError(
                f"no notebook for {units_word} {which} in {root / 'notebooks'}; "
                f"available units: {available}"
            )
        selected = list(dict.fromkeys(units))  # keep the order given, drop repeats
    env = machine_context(Path(out_dir))
    return [
        run_notebook(path, Path(out_dir), timeout_per_cell=timeout_per_cell, html=html, env=env)
        for unit in selected
        for path in found[unit]
    ]


MACHINE_FILE = "machine.json"  # in out_dir: {"ceilings": Ceilings.to_json(), "ceilings_source": str, "busy_warning": str | None}


def machine_context(out_dir: Path) -> dict[str, str]:
    """Before the first notebook of a run: sample whether other processes keep the CPUs busy
    (:func:`teraflops.machine.busy_warning`) and measure the ceilings once
    (:func:`teraflops.ceilings.measure_ceilings`, the preset's probe); write both to
    ``out_dir/machine.json`` (the report card reads it) and the ceilings to ``out_dir/ceilings.json``.
    Returns the environment that hands the ceilings to every notebook's kernel
    (``$TERAFLOPS_CEILINGS``), so that all units of one run share one roof."""
    import json

    from teraflops import ceilings  # lazy: torch-free start of `teraflops grade`/`labs`, which import the runner

    out_dir.mkdir(parents=True, exist_ok=True)
    busy = busy_warning()
    c = ceilings.measure_ceilings()
    shared = (out_dir / "ceilings.json").resolve()
    shared.write_text(json.dumps(c.to_json()) + "\n")
    (out_dir / MACHINE_FILE).write_text(json.dumps({"ceilings": c.to_json(), "ceilings_source": c.source, "busy_warning": busy}, indent=1) + "\n")
    return {ceilings.SHARED_ENV: str(shared)}


def format_value(value: float) -> str:
    """``value`` to 3 significant digits, without an exponent between 1e-3 and 1e6."""
    v = float(value)
    if v == 0:
        return "0"
    if v.is_integer() and abs(v) < 1e6:
        return str(int(v))  # counts read as counts
    if not math.isfinite(v):
        return str(v)
    rounded = float(f"{v:.3g}")
    if 1e-3 <= abs(rounded) < 1e6:
        decimals = max(0, 2 - math.floor(math.log10(abs(rounded))))
        return f"{rounded:.{decimals}f}"
    return f"{v:.3g}"


def load_text(load: dict) -> str:
    """``"load 4.2 (max 6.1) on 2 cores"`` from :meth:`teraflops.machine.LoadMonitor.summary`."""
    return f"load {load['mean']:.1f} (max {load['max']:.1f}) on {load['cores']} cores"


def _headline_lines(headline: dict[str, dict]) -> list[str]:
    """One line per headline number: label, value to 3 significant digits, unit; columns aligned."""
    entries = list(headline.values())
    if not entries:
        return []
    label_w = max(len(str(e.get("label", ""))) for e in entries)
    values = [format_value(e["value"]) for e in entries]
    value_w = max(len(v) for v in values)
    return [f"{str(e.get('label', '')):<{label_w}}  {v:>{value_w}}" + (f" {e['unit']}" if e.get("unit") else "")
            for e, v in zip(entries, values)]


def _details(r: NotebookResult) -> list[str]:
    """What the summary says of one notebook, a line each: its failure, differing checked outputs,
    stalls, stories, headline numbers, a failed HTML export and the load it ran under."""
    details = r.failure_lines() + r.warnings() + [f"STALLED: {st}" for st in r.stalls]
    details += [one_line(st.line(), 300) for st in r.stories] + _headline_lines(r.headline)
    if r.html_error:
        details.append(f"(HTML export failed: {r.html_error})")
    if r.load:
        details.append(load_text(r.load))
    return details or ["-"]


def _footer(results: list[NotebookResult]) -> str:
    folders = sorted({str(r.executed.parent.resolve()) for r in results if r.executed})
    passed = sum(r.status == "ok" for r in results)
    warned = sum(r.status == "WARNING" for r in results)
    also = f" ({warned} ran with a checked output that differs: see WARNING)" if warned else ""
    contradicted = sum(bool(r.contradicted) for r in results)
    if contradicted:
        also += f" ({contradicted} measured what the lecture says cannot happen: see CONTRADICTS)"
    return f"{passed}/{len(results)} notebooks ok{also}; outputs in {', '.join(folders) or '-'}"


def format_summary(machine: Machine, results: list[NotebookResult]) -> str:
    """A plain-text table: the machine, then one row per notebook with status, time, its failure and
    stalled cells (:class:`CellStall`, by cell and time) if any, a ``WARNING:`` line per checked cell
    whose output differs from the committed one (status ``WARNING``, not ``ok``), one line per story
    (``holds: …``, ``can't tell (why): …``, ``CONTRADICTS: …``: :meth:`StoryResult.line`), its headline
    numbers (one per line) and the load it ran under, then the output folder(s)."""
    lines = [f"machine: {machine.summary()}"]
    if not results:
        return "\n".join(lines + ["no notebooks ran"])
    name_w = max(len("notebook"), *(len(r.name) for r in results))
    status_w, time_w = len("WARNING"), len("time (s)")
    header = f"{'notebook':<{name_w}}  {'status':<{status_w}}  {'time (s)':>{time_w}}  headline"
    rule = "-" * max(len(header), 60)
    lines += [header, rule]
    pad = " " * (name_w + status_w + time_w + 6)
    for r in results:
        first, *rest = _details(r)
        lines.append(f"{r.name:<{name_w}}  {r.status:<{status_w}}  {r.seconds:>{time_w}.1f}  {first}".rstrip())
        lines += [(pad + d).rstrip() for d in rest]
    return "\n".join(lines + [rule, _footer(results)])


CHECK_MARK = "# NBVAL_CHECK_OUTPUT"  # nbval's marker: the cell's outputs are compared with the committed ones


def _output_texts(cell) -> list[tuple[str, str]]:
    """A code cell's outputs as nbval compares them: streams by name, results and displays by their
    plain text, errors by name and value."""
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append((o.name, o.text))
        elif o.output_type in ("execute_result", "display_data"):
            out.append((o.output_type, o.get("data", {}).get("text/plain", "")))
        elif o.output_type == "error":
            out.append(("error", f"{o.ename}: {o.evalue}"))
    merged: list[tuple[str, str]] = []
    for kind, text in out:  # consecutive chunks of one stream are one output, however they were flushed
        if merged and kind in ("stdout", "stderr") and merged[-1][0] == kind:
            merged[-1] = (kind, merged[-1][1] + text)
        else:
            merged.append((kind, text))
    return merged


def checked_output_mismatches(executed: Path | str, committed: Path | str) -> list[str]:
    """The check cells (first line ``# NBVAL_CHECK_OUTPUT``) of ``executed`` whose outputs differ from
    those committed in ``committed``: what ``pytest --nbval-lax`` would report, from a notebook that
    ``teraflops run`` already executed (so CI runs each lecture once). One line per differing cell.

    Raises:
        CourseError: the two notebooks do not have the same cells (not the same notebook).
    """
    import nbformat

    ran, kept = nbformat.read(executed, as_version=4), nbformat.read(committed, as_version=4)
    if [c.source for c in ran.cells] != [c.source for c in kept.cells]:
        raise CourseError(f"{executed} and {committed} do not hold the same cells. "
                          "Hint: compare an executed notebook with the file it was executed from")
    bad = []
    for i, (a, b) in enumerate(zip(ran.cells, kept.cells)):
        if a.cell_type == "code" and a.source.lstrip().startswith(CHECK_MARK):
            got, want = _output_texts(a), _output_texts(b)
            if got != want:
                bad.append(f"cell {i}: expected {want!r}, got {got!r}")
    return bad
