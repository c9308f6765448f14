"""The course site: the lectures as ``teraflops run`` executed them, to read without running anything.

``teraflops site`` turns a run's folder (``build/``: executed ``NN_name.ipynb`` and
``report_card.html``, :mod:`teraflops.course.runner`) into static HTML under ``build/site/``: one page
per executed lecture with its outputs and figures, one per lab (its text and code, unexecuted), the
report card, and the course's guide (``README.md`` and the pages of ``docs/``, links between them kept). Open ``build/site/index.html``; nothing is executed and nothing is fetched.

The builder is Sphinx with MyST-NB (https://myst-nb.readthedocs.io), ``nb_execution_mode = "off"``:
pure Python (``pip install -e ".[site]"``), and everything a page loads ships inside the two packages
(the Alabaster theme, Sphinx's own scripts), so the build and the pages work offline. Jupyter Book 2
(mystmd) was the alternative: it needs Node.js and fetches its theme at build time.

Widgets: an executed notebook keeps each widget's *final* state in its metadata (nbclient's
``store_widget_state``; Jupyter's widget-state schema,
https://ipywidgets.readthedocs.io/en/stable/embedding.html), but the plain-text fallback of the view is
its *first* frame (tqdm's ``0/5 [00:00<?, ?it/s]``). Rendering the widgets for real needs their
JavaScript from a CDN, so :func:`static_widgets` replaces each widget view by static HTML of its final
state instead: a progress bar at its last value, a slider's value, an Output widget's outputs.
"""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import nbformat

from teraflops.course.runner import course_root
from teraflops.errors import CourseError

__all__ = ["build", "static_widgets", "lectures_in", "WIDGET_VIEW"]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
_LECTURE = re.compile(r"(\d\d)_\w+\.ipynb$")
_BAR_CELLS = 10  # tqdm's default bar in a terminal of its own width is wider; 10 reads well in a page

_CONF = '''\
# Written by teraflops.course.site: Sphinx + MyST-NB over already executed notebooks, offline.
project = "Tensors to Teraflops"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # the notebooks are teraflops run's, executed already
nb_ipywidgets_js = {}  # widget views are static HTML (teraflops.course.site.static_widgets): no CDN script
html_theme = "alabaster"
html_theme_options = {"font_family": "sans-serif", "head_font_family": "sans-serif", "page_width": "1180px"}
html_extra_path = ["extra"]
html_copy_source = False
html_show_sourcelink = False
exclude_patterns = ["_build"]
suppress_warnings = ["mystnb.unknown_mime_type", "myst.header", "myst.xref_missing"]
myst_heading_anchors = 3  # README's and the docs' links to a heading (page.md#quickstart)
'''


def lectures_in(build_dir: Path) -> list[Path]:
    """The executed lecture notebooks in ``build_dir`` (``NN_name.ipynb``), by name."""
    return sorted(p for p in Path(build_dir).glob("*.ipynb") if _LECTURE.match(p.name))


def _state(nb) -> dict:
    return nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


_BOXES = ("HBoxModel", "VBoxModel", "BoxModel", "GridBoxModel", "AccordionModel", "TabModel")


def _render_box(name: str, s: dict, models: dict, depth: int) -> tuple[str, str]:
    """A container: its children rendered in place, side by side (HBox) or stacked."""
    parts = [_render_widget(c, models, depth + 1) for c in s.get("children", [])]
    tag = "span" if name == "HBoxModel" else "div"
    page = f"<div class='static-widget {name[:-5].lower()}'>" + "".join(f"<{tag}>{h}</{tag}>" for h, _ in parts) + "</div>"
    if name != "HBoxModel":
        return page, "\n".join(t for _, t in parts if t)
    text = ""  # a bar abuts its neighbours, as tqdm writes it ("steps: 100%|███| 5/5"); other widgets get a space
    for _, t in (p for p in parts if p[1]):
        text += t if not text or t.startswith("|") or text.endswith("|") else " " + t
    return page, text


def _render_progress(s: dict) -> tuple[str, str]:
    """A progress bar at its final value."""
    low, high, value = float(s.get("min", 0)), float(s.get("max", 100)), float(s.get("value", 0))
    share = (value - low) / (high - low) if high > low else 1.0
    filled = round(max(0.0, min(1.0, share)) * _BAR_CELLS)
    text = f"|{'█' * filled}{' ' * (_BAR_CELLS - filled)}|"  # tqdm's own text beside it has the percentage
    return f"<progress value='{value - low:g}' max='{high - low:g}'></progress>", text


def _render_value(s: dict) -> tuple[str, str]:
    """Any other widget: its description and value (a dropdown's chosen label, a range as low–high)."""
    value = s.get("value", s.get("label", ""))
    labels, index = s.get("_options_labels"), s.get("index")
    if isinstance(labels, list) and isinstance(index, int) and 0 <= index < len(labels):  # Dropdown and kin
        value = labels[index]
    label = str(s.get("description", ""))
    if isinstance(value, (list, tuple)):
        value = "–".join(str(v) for v in value)
    text = f"{label}: {value}" if label else str(value)
    return f"<span class='static-widget-value'>{html.escape(text)}</span>", text


def _render_widget(model_id: str, models: dict, depth: int = 0) -> tuple[str, str]:
    """(HTML, plain text) of one widget model's final state; children rendered in place."""
    model = models.get(model_id.removeprefix("IPY_MODEL_"))
    if model is None or depth > 20:
        return "", ""
    name, s = model.get("model_name", ""), model.get("state", {})
    if name in _BOXES:
        return _render_box(name, s, models, depth)
    if name in ("HTMLModel", "HTMLMathModel"):
        value = str(s.get("value", ""))
        return value, html.unescape(re.sub(r"<[^>]+>", "", value)).replace("\u2007", " ")  # tqdm pads with figure spaces
    if name in ("FloatProgressModel", "IntProgressModel"):
        return _render_progress(s)
    if name == "OutputModel":
        shown = [_output_html(o) for o in s.get("outputs", [])]
        return "".join(h for h, _ in shown), "\n".join(t for _, t in shown if t)
    return _render_value(s)


def _output_html(out: dict) -> tuple[str, str]:
    """(HTML, text) of one output that an Output widget holds."""
    if out.get("output_type") == "stream":
        text = out.get("text", "")
        return f"<pre>{html.escape(text)}</pre>", text
    data = out.get("data", {})
    if "image/png" in data:
        return f"<img alt='figure' src='data:image/png;base64,{''.join(data['image/png'])}'>", ""
    if "text/html" in data:
        return "".join(data["text/html"]), ""
    text = "".join(data.get("text/plain", ""))
    return f"<pre>{html.escape(text)}</pre>", text


def static_widgets(nb: nbformat.NotebookNode) -> int:
    """Replace every widget view in ``nb``'s outputs (in place) by HTML and text of the widget's final
    state from the notebook's widget-state metadata; returns how many were replaced. A view whose model
    the metadata lacks keeps no widget output, only a note saying so (never the first frame)."""
    models, replaced = _state(nb), 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            view = data.get(WIDGET_VIEW)
            if not view:
                continue
            page, text = _render_widget(str(view.get("model_id", "")), models)
            if not (page or text):
                page = text = "(an interactive widget: run the notebook to use it)"
            out["data"] = {"text/html": page or f"<pre>{html.escape(text)}</pre>", "text/plain": text}
            replaced += 1
    nb.metadata.pop("widgets", None)
    return replaced


def _index(lectures: list[Path], lab_names: list[str], card: bool, guide: list[str] = ()) -> str:
    lines = ["# Tensors to Teraflops", "",
             "The course's lectures as `teraflops run` executed them on the machine named in the report card: "
             "every number and figure below was measured there. The labs are shown as a learner gets them, "
             "unexecuted.", ""]
    if card:
        lines += ["<a href='report_card.html'>The report card</a>: the machine, each unit's headline numbers and figure.", ""]
    lines += ["```{toctree}", ":caption: Lectures", ":maxdepth: 1", ""] + [f"lectures/{p.stem}" for p in lectures] + ["```", ""]
    if lab_names:
        lines += ["```{toctree}", ":caption: Labs", ":maxdepth: 1", ""] + [f"labs/{n}" for n in lab_names] + ["```", ""]
    if guide:
        lines += ["```{toctree}", ":caption: The course's guide", ":maxdepth: 1", ""] + list(guide) + ["```", ""]
    return "\n".join(lines)


def guide_pages(root: Path) -> list[Path]:
    """The course's guide: ``README.md`` and ``docs/*.md`` (README's "Where next" links), in that order."""
    readme = root / "README.md"
    return ([readme] if readme.is_file() else []) + sorted((root / "docs").glob("*.md"))


def build(build_dir: str | Path = "build", out: str | Path | None = None, root: str | Path | None = None) -> Path:
    """Build the site from the run in ``build_dir`` into ``out`` (default ``build_dir/site``); returns
    the path of its ``index.html``. ``root``: the course folder whose ``labs/`` the site shows.

    Raises:
        CourseError: ``build_dir`` holds no executed lecture (run ``teraflops run`` first), or Sphinx /
            MyST-NB are not installed, or Sphinx reports an error.
    """
    build_dir = Path(build_dir)
    out = Path(out) if out is not None else build_dir / "site"
    root = Path(root) if root is not None else course_root()
    lectures = lectures_in(build_dir)
    if not lectures:
        raise CourseError(f"no executed lectures (NN_name.ipynb) in {build_dir}: run `teraflops run` first")
    try:
        from sphinx.cmd.build import build_main  # lazy: the site's own dependency (pip install -e ".[site]")
    except ImportError:
        raise CourseError('the site needs Sphinx and MyST-NB: pip install -e ".[site]"') from None
    src = out.parent / f".{out.name}-src"
    shutil.rmtree(src, ignore_errors=True)
    for sub in ("lectures", "labs", "extra", "docs"):
        (src / sub).mkdir(parents=True)
    for path in lectures:
        nb = nbformat.read(path, as_version=4)
        static_widgets(nb)
        nbformat.write(nb, src / "lectures" / path.name)
    lab_paths = sorted((root / "labs").glob("*.ipynb"))
    for path in lab_paths:
        shutil.copy(path, src / "labs" / path.name)
    guide = []
    for page in guide_pages(root):  # same relative places as in the clone, so their links resolve
        shutil.copy(page, src / page.relative_to(root))
        guide.append(page.relative_to(root).with_suffix("").as_posix())
    card = build_dir / "report_card.html"
    if card.is_file():
        shutil.copy(card, src / "extra" / card.name)
    (src / "conf.py").write_text(_CONF)
    (src / "index.md").write_text(_index(lectures, [p.stem for p in lab_paths], card.is_file(), guide))
    shutil.rmtree(out, ignore_errors=True)
    code = build_main(["-b", "html", "-q", "-d", str(src / "_doctrees"), str(src), str(out)])
    if code != 0:
        raise CourseError(f"Sphinx could not build the site (exit {code}); its messages are above")
    shutil.rmtree(src, ignore_errors=True)
    return out / "index.html"
