"""The course site: the lectures as this test run executed them (tests/test_unitNN_run.py,
through the ``lecture_runs`` fixture: nothing is executed again), the labs and the report card, built
offline and read in Chromium: every page loads without a console error and requests nothing outside
the site, every lecture page shows its figures, and widgets show their final state, never tqdm's
first frame. The root conftest runs this file last; it builds from whichever lectures ran before it
(Unit 0, executed here, when none did: the file run alone)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from teraflops.course import site

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
FIRST_FRAME = re.compile(r"\b0/\d+ \[00:00<\?|\?(step|it|cell)/s\]")  # tqdm before its first update


def _tqdm_notebook(with_state: bool = True) -> nbformat.NotebookNode:
    """A cell whose output is a finished tqdm bar: the view's text is the first frame, the state the last."""
    view = {"model_id": "box", "version_major": 2, "version_minor": 0}
    out = new_output("display_data", data={"text/plain": "steps:   0%|          | 0/5 [00:00<?, ?it/s]",
                                           site.WIDGET_VIEW: view})
    nb = new_notebook(cells=[new_code_cell("for _ in tqdm(range(5), desc='steps'): ...", outputs=[out])])
    models = {
        "box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_d", "IPY_MODEL_p", "IPY_MODEL_n"]}},
        "d": {"model_name": "HTMLModel", "state": {"value": "steps: 100%"}},
        "p": {"model_name": "FloatProgressModel", "state": {"value": 5, "min": 0, "max": 5}},
        "n": {"model_name": "HTMLModel", "state": {"value": " 5/5 [00:00&lt;00:00, 49.6it/s]"}},
    }
    if with_state:
        nb.metadata["widgets"] = {site.WIDGET_STATE: {"state": models, "version_major": 2, "version_minor": 0}}
    return nb


def test_a_progress_bar_shows_its_final_state_not_its_first_frame():
    nb = _tqdm_notebook()
    assert site.static_widgets(nb) == 1
    (out,) = nb.cells[0].outputs
    assert site.WIDGET_VIEW not in out.data and "widgets" not in nb.metadata
    assert out.data["text/plain"] == "steps: 100%|██████████| 5/5 [00:00<00:00, 49.6it/s]"  # as tqdm ends in a terminal
    assert "<progress value='5' max='5'>" in out.data["text/html"]
    assert not FIRST_FRAME.search(out.data["text/plain"])


def test_a_widget_without_state_is_a_note_not_a_frozen_frame():
    nb = _tqdm_notebook(with_state=False)
    site.static_widgets(nb)
    text = nb.cells[0].outputs[0].data["text/plain"]
    assert "run the notebook" in text and not FIRST_FRAME.search(text)


def test_a_slider_shows_its_value():
    out = new_output("execute_result", data={"text/plain": "IntSlider(value=3)", site.WIDGET_VIEW: {"model_id": "s"}},
                     execution_count=1)
    nb = new_notebook(cells=[new_code_cell("w", outputs=[out])])
    nb.metadata["widgets"] = {site.WIDGET_STATE: {"state": {"s": {"model_name": "IntSliderModel",
                                                                  "state": {"value": 8, "description": "ranks"}}}}}
    site.static_widgets(nb)
    assert nb.cells[0].outputs[0].data["text/plain"] == "ranks: 8"
    nb.cells[0].outputs[0].data[site.WIDGET_VIEW] = {"model_id": "d"}
    nb.metadata["widgets"] = {site.WIDGET_STATE: {"state": {"d": {"model_name": "DropdownModel", "state": {
        "index": 1, "_options_labels": ["fp32", "bf16"], "description": "dtype"}}}}}
    site.static_widgets(nb)
    assert nb.cells[0].outputs[0].data["text/plain"] == "dtype: bf16"  # a dropdown keeps its choice as an index


def test_no_executed_lecture_is_one_line(tmp_path):
    from teraflops.errors import CourseError

    with pytest.raises(CourseError, match="run `teraflops run` first"):
        site.build(tmp_path)


def _results(folder: Path):
    """What ``teraflops run`` returned for the executed lectures in ``folder``, read back from its files."""
    from teraflops import headlines
    from teraflops.course.runner import NotebookResult

    return [NotebookResult(p.stem, 0.0, True, headline=headlines.read(p.with_suffix(".report.json")),
                           takeaway=headlines.read_takeaway(p.with_suffix(".report.json")), executed=p)
            for p in site.lectures_in(folder)]


@pytest.fixture(scope="module")
def built(lecture_runs, tmp_path_factory, request):
    """(index.html, the executed lectures): this run's executed lectures in one folder,
    their report card, and the site built from them."""
    from teraflops import detect
    from teraflops.course import report_card, runner

    _wait_for_lecture_tests(lecture_runs, request.session.items)
    executed = sorted(lecture_runs.glob("*/[0-9][0-9]_*.ipynb"))
    if not executed:  # this file alone: one lecture, the shortest
        runner.run_units([0], out_dir=lecture_runs / "site", html=False)
        executed = sorted(lecture_runs.glob("*/[0-9][0-9]_*.ipynb"))
    build = tmp_path_factory.mktemp("build")
    for path in executed:
        for f in path.parent.glob(f"{path.stem}*"):
            shutil.copy(f, build / f.name)
    shutil.copy(executed[0].parent / runner.MACHINE_FILE, build / runner.MACHINE_FILE)
    report_card.write(detect(), _results(build), build)
    return site.build(build, root=ROOT), site.lectures_in(build)  # its time: scripts/benchmark.py --site


def _wait_for_lecture_tests(lecture_runs: Path, items, timeout: float = 1800) -> None:
    """Under pytest-xdist the other worker may still be running lecture tests when this file (the last)
    starts: wait until every tests/test_unitNN_run.py test of this session has ended (its ``lecture_out``
    folder marked done, also after a failure), at most ``timeout`` s."""
    stems = {item.path.stem for item in items if re.fullmatch(r"test_unit\d\d_run", item.path.stem)}
    deadline = time.monotonic() + timeout
    done = "done"  # what tests/conftest.py's lecture_out leaves when its test ends
    while (waiting := sorted(s for s in stems if not (lecture_runs / s / done).exists())) and \
            time.monotonic() < deadline:
        time.sleep(2)
    assert not waiting, f"the lecture tests {waiting} did not end within {timeout:.0f} s"


def _figures(executed: Path) -> int:
    nb = nbformat.read(executed, as_version=4)
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


@pytest.mark.slow
@pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="no Chromium at /usr/bin/chromium (apt-get install chromium)")
def test_the_site_reads_offline_in_the_browser(built):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    index, lectures = built
    home = index.parent
    pages = [index, home / "report_card.html", *sorted((home / "lectures").glob("*.html")),
             *sorted((home / "labs").glob("*.html")), home / "README.html", *sorted((home / "docs").glob("*.html"))]
    assert len(list((home / "lectures").glob("*.html"))) == len(lectures)
    # the guide: README and every docs/ page, README's links to them turned into the site's own pages
    assert {p.stem for p in (home / "docs").glob("*.html")} == {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert 'href="docs/install.html' in (home / "README.html").read_text()
    assert len(list((home / "labs").glob("*.html"))) == len(list((ROOT / "labs").glob("*.ipynb")))
    inside = home.resolve().as_uri()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        errors, outside = [], []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith((inside, "data:")) else outside.append(r.url))
        page.on("requestfailed", lambda r: errors.append(f"failed: {r.url}"))
        for path in pages:
            page.goto(path.resolve().as_uri(), wait_until="load")
            assert page.title(), f"{path.name} has no title"
            text = page.inner_text("body")
            assert not FIRST_FRAME.search(text), f"{path.name} shows a progress bar's first frame"
            if path.parent.name == "lectures":
                shown = page.evaluate("[...document.images].filter(i => i.complete && i.naturalWidth > 0).length")
                want = _figures(next(p for p in lectures if p.stem == path.stem))
                assert shown >= want, f"{path.name} shows {shown} of its {want} figures"
            if path.parent.name == "labs":
                assert "Exercise 1" in text and "NotImplementedError" in text
        browser.close()
    assert not errors, errors
    assert not outside, f"requests outside the site: {outside[:5]}"
    assert any(_figures(p) for p in lectures) or [p.stem for p in lectures] == ["00_the_map"]
