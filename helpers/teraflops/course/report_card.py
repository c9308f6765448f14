"""The report card: one HTML page at the end of ``teraflops run`` that a reader takes in at a glance.

It holds the machine (:meth:`teraflops.machine.Machine.summary`), the ceilings the run measured once
and every unit used, and the busy-machine warning if the run began on a busy machine (both from
``machine.json``, :func:`teraflops.course.runner.machine_context`); then one section per notebook, titled by
its unit's question (:data:`QUESTIONS`, README's "The question" column): its one-line takeaway
(:func:`teraflops.headlines.takeaway`), status, time and the load it ran under, any stalled cell, its
stories (:mod:`teraflops.course.stories`: holds, can't tell and why, or contradicts), at most
:data:`~teraflops.headlines.MAX_HEADLINES` headline numbers (:func:`teraflops.headlines.record`) and its
headline figure, embedded, with its caption. The figure is the first PNG output of the cell whose
metadata tags include ``"headline"`` (its caption: that cell's ``metadata.caption``), else the
notebook's first PNG.

Reference results measured on a real GPU, where the package ships them
(``helpers/teraflops/reference/<gpu>.json``: ``{"gpu": name, "teraflops": version, "notebooks":
{notebook: {key: {"value", "unit", "label"}}}}``), appear beside the learner's numbers, labelled
with the GPU they came from. They are only ever the output of the course's own ``teraflops run``
on that GPU; the page says so when there are none.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from teraflops import __version__
from teraflops.course.runner import MACHINE_FILE, NotebookResult, format_value, load_text
from teraflops.course.stories import CANT_TELL, CONTRADICTS, HOLDS
from teraflops.headlines import MAX_HEADLINES

REFERENCE_DIR = Path(__file__).resolve().parents[1] / "reference"
HEADLINE_TAG = "headline"
# The question each unit answers: README's "The units" table, "The question" column (a test keeps them equal).
QUESTIONS = {
    0: "Which layer answers which question, and in what order do I descend?",
    1: "Is this a math problem, a memory problem, or a framework inefficiency?",
    2: "Are my GPUs exchanging information efficiently?",
    3: "Why are 30 % of my GPUs idle?",
    4: "Am I getting the most throughput per GPU dollar?",
    5: "What are the physical limits, and how do I work around them?",
    6: "Is this workload compute-, memory-, overhead- or communication-bound, or waiting?",
}

_STYLE = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
h1{font-size:1.6rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.2rem .8rem;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}.fail{color:#b00}.ok{color:#070}
img{max-width:100%;border:1px solid #eee;margin-top:.5rem}.note{color:#666;font-size:.9rem}
.takeaway{font-size:1.05rem;font-weight:600}.warn{color:#a60}figure{margin:0}figcaption{color:#444;font-size:.9rem}
h2 small{color:#888;font-weight:normal;font-size:.8rem}"""


def load_references(directory: Path = REFERENCE_DIR) -> list[dict]:
    """Reference results shipped with the package (``[]`` when none); malformed files are skipped."""
    refs = []
    for path in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("notebooks"), dict) and data.get("gpu"):
            refs.append(data)
    return refs


def _headline(executed):
    import nbformat

    if executed is None or not Path(executed).exists():
        return None
    cells = [c for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"]
    tagged = [c for c in cells if HEADLINE_TAG in c.get("metadata", {}).get("tags", [])]
    for cell in tagged + cells:
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png")
            if png:
                return (png if isinstance(png, str) else "".join(png)), cell.get("metadata", {}).get("caption")
    return None


def unit_of(name: str) -> int | None:
    """The unit number of a notebook name ``NN_topic``, or None."""
    head = name.split("_", 1)[0]
    return int(head) if head.isdigit() else None


def read_machine(out_dir: Path | str | None) -> dict:
    """``machine.json`` of a run (:func:`teraflops.course.runner.machine_context`), or ``{}``."""
    try:
        data = json.loads((Path(out_dir) / MACHINE_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return {}
    return data if isinstance(data, dict) else {}


def _ceilings_line(c: dict, source: str | None = None) -> str:
    peak, bw = float(c["peak_flops"]), float(c["bandwidth"])
    return (f"<b>Ceilings</b> (measured once at the start of this run, {html.escape(str(c['device']))}, "
            f"{html.escape(str(c['dtype']))}; every unit used these): peak {format_value(peak / 1e12)} TFLOP/s, "
            f"copy bandwidth {format_value(bw / 1e9)} GB/s, ridge point {format_value(peak / bw)} FLOP/byte"
            + (f"; {html.escape(str(source))}" if source not in (None, "measured") else "")
            + (f" <span class='warn'>(measured at load {float(c['load']):.1f}, spread {float(c.get('spread', 0)):.0%}"
               " between repeats: too busy to trust; verdicts placed on them may be off)</span>"
               if c.get("load") is not None and source in (None, "measured") else ""))


def _row(entry: dict, refs: list[tuple[str, dict | None]]) -> str:
    unit = html.escape(entry.get("unit", ""))
    cells = [f"<td>{html.escape(str(entry.get('label', '')))}</td>",
             f"<td class='num'>{format_value(entry['value'])} {unit}</td>"]
    for _, ref in refs:
        cells.append(f"<td class='num'>{format_value(ref['value'])} {html.escape(ref.get('unit', ''))}</td>"
                     if ref else "<td class='num'>–</td>")
    return "<tr>" + "".join(cells) + "</tr>"


_STORY_CLASS = {HOLDS: "ok", CANT_TELL: "warn", CONTRADICTS: "fail"}


def _stories(results) -> str:
    """The unit's stories (:mod:`teraflops.course.stories`) as a list, one line each, coloured by status."""
    items = "".join(f"<li class='{_STORY_CLASS.get(s.status, 'warn')}'>{html.escape(s.line())}</li>" for s in results)
    return f"<p><b>What the lecture claims, on this run's measurements:</b></p><ul class='stories'>{items}</ul>"


def _status(r: NotebookResult) -> str:
    """The unit's status in one span: ok, its failure (at most two lines), contradicted claims or the
    checked outputs that differ."""
    if r.status == "ok":
        return "<span class='ok'>ok</span>"
    if not r.ok:
        return "<span class='fail'>failed: " + "<br>".join(html.escape(ln) for ln in r.failure_lines()) + "</span>"
    if r.contradicted:
        return f"<span class='fail'>failed: the measurements contradict {len(r.contradicted)} of the lecture's claims</span>"
    return "<span class='fail'>" + "<br>".join(html.escape(w) for w in r.warnings()) + "</span>"


def _headline_table(r: NotebookResult, references: list[dict]) -> str:
    """The unit's headline numbers (at most :data:`MAX_HEADLINES`, those meant for the card) beside each
    reference GPU's."""
    refs = [(ref["gpu"], ref["notebooks"].get(r.name, {})) for ref in references]
    head = "<tr><th>headline</th><th>this machine</th>" + "".join(
        f"<th>reference: {html.escape(gpu)}</th>" for gpu, _ in refs) + "</tr>"
    shown = [(k, e) for k, e in r.headline.items() if e.get("card", True)][:MAX_HEADLINES]
    body = "".join(_row(e, [(gpu, entries.get(key)) for gpu, entries in refs]) for key, e in shown)
    return f"<table>{head}{body}</table>"


def _section(r: NotebookResult, references: list[dict]) -> list[str]:
    """One unit's part of the card: its question, takeaway, status, stalls, stories, numbers, figure and link."""
    unit = unit_of(r.name)
    title = f"Unit {unit}: {QUESTIONS[unit]}" if unit in QUESTIONS else r.name
    parts = [f"<h2>{html.escape(title)} <small>{html.escape(r.name)}</small></h2>"]
    if r.takeaway:
        parts.append(f"<p class='takeaway'>{html.escape(r.takeaway)}</p>")
    load = f" · {html.escape(load_text(r.load))}" if r.load else ""
    parts.append(f"<p>{_status(r)} · {r.seconds:.0f} s{load}</p>")
    parts += [f"<p class='warn'><b>Stalled:</b> {html.escape(str(stall))}</p>" for stall in r.stalls]
    if r.stories:
        parts.append(_stories(r.stories))
    if r.headline:
        parts.append(_headline_table(r, references))
    found = _headline(r.executed)
    if found:
        png, caption = found
        img = f"<img alt='headline figure of {html.escape(r.name)}' src='data:image/png;base64,{png}'>"
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        parts.append(f"<figure>{img}{cap}</figure>")
    if r.html:
        parts.append(f"<p class='note'>The whole notebook: <a href='{html.escape(Path(r.html).name)}'>"
                     f"{html.escape(Path(r.html).name)}</a></p>")
    return parts


def _machine_lines(machine, results: list[NotebookResult], references: list[dict], context: dict) -> list[str]:
    """The card's head: the machine, the run's ceilings, how many notebooks ran clean, a busy machine, and
    whether reference results ship."""
    passed = sum(r.status == "ok" for r in results)
    parts = [f"<p><b>Machine:</b> {html.escape(machine.summary())}<br>"]
    if isinstance(context.get("ceilings"), dict):
        try:
            parts.append(_ceilings_line(context["ceilings"], context.get("ceilings_source")) + "<br>")
        except (KeyError, ValueError, TypeError, ZeroDivisionError):
            pass
    parts.append(f"<b>Notebooks:</b> {passed}/{len(results)} ran without error or warning, "
                 f"{sum(r.seconds for r in results):.0f} s in all.</p>")
    if context.get("busy_warning"):
        parts.append(f"<p class='warn'><b>Busy machine:</b> {html.escape(str(context['busy_warning']))}</p>")
    if not references:
        parts.append("<p class='note'>No reference results from a real GPU ship with this version of the course, "
                     "so there is nothing to set your numbers beside.</p>")
    return parts


def render(machine, results: list[NotebookResult], references: list[dict] | None = None,
           context: dict | None = None) -> str:
    """The report card's HTML for ``results`` of ``teraflops run`` on ``machine``; ``context`` is the
    run's ``machine.json`` (:func:`read_machine`: ceilings, busy warning)."""
    references = load_references() if references is None else references
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Tensors to Teraflops: report card</title>",
             f"<style>{_STYLE}</style></head><body><h1>Tensors to Teraflops: report card</h1>"]
    parts += _machine_lines(machine, results, references, context or {})
    for r in results:
        parts += _section(r, references)
    parts.append("</body></html>")
    return "\n".join(parts)


def results_json(machine, results: list[NotebookResult]) -> dict:
    """This run's headline numbers in the reference format of the module docstring; ``"gpu"`` is the
    GPU's name, or ``None`` on a CPU (a CPU run is never a reference). ``"stories"`` adds each
    notebook's evaluated stories (:meth:`teraflops.course.stories.StoryResult.to_json`), which a
    reference reader ignores."""
    return {"gpu": machine.gpu_name, "teraflops": __version__,
            "notebooks": {r.name: r.headline for r in results if r.ok and r.headline},
            "stories": {r.name: [s.to_json() for s in r.stories] for r in results if r.stories}}


def write(machine, results: list[NotebookResult], out_dir: Path | str, references: list[dict] | None = None) -> Path:
    """Write :func:`render` to ``<out_dir>/report_card.html`` and :func:`results_json` to
    ``<out_dir>/results.json``; return the page's path. On a GPU, ``results.json`` is the file a
    maintainer ships as ``helpers/teraflops/reference/<gpu>.json``: the course's own output."""
    path = Path(out_dir) / "report_card.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(machine, results, references, read_machine(out_dir)))
    (path.parent / "results.json").write_text(json.dumps(results_json(machine, results), indent=1) + "\n")
    return path
