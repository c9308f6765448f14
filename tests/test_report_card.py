"""The report card that ends `teraflops run`: machine, each notebook's headline numbers and figure."""

import base64
import json

import nbformat

from teraflops.course import report_card
from teraflops.machine import detect
from teraflops.course.runner import CellFailure, NotebookResult

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()


def executed(tmp_path, name, tagged_second=False):
    nb = nbformat.v4.new_notebook()
    first = nbformat.v4.new_code_cell("plot()")
    first.outputs = [nbformat.v4.new_output("display_data", data={"image/png": "FIRST"})]
    second = nbformat.v4.new_code_cell("plot2()")
    second.outputs = [nbformat.v4.new_output("display_data", data={"image/png": PNG})]
    if tagged_second:
        second.metadata["tags"] = ["headline"]
    nb.cells = [first, second]
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_card_shows_the_machine_headlines_and_the_tagged_figure(tmp_path):
    ok = NotebookResult("01_model_definition", 95.0, True, headline={
        "matmul_tflops": {"value": 0.0612, "unit": "TFLOP/s", "label": "peak matmul"}},
        executed=executed(tmp_path, "01_model_definition", tagged_second=True))
    bad = NotebookResult("02_parallelization", 12.0, False, error=CellFailure(7, "LaunchFailed", "rank 1 <died>"))
    page = report_card.render(detect(), [ok, bad], references=[])
    assert detect().summary() in page and "1/2 ran without error" in page
    assert "peak matmul" in page and "0.0612 TFLOP/s" in page
    assert f"base64,{PNG}" in page and "FIRST" not in page  # the tagged figure, not the first
    assert "failed: cell 7: LaunchFailed: rank 1 &lt;died&gt;" in page  # escaped
    assert "No reference results" in page


def test_without_a_tag_the_first_figure_and_references_sit_beside(tmp_path):
    refdir = tmp_path / "reference"
    refdir.mkdir()
    (refdir / "h100.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "teraflops": "0.1.0", "notebooks": {
        "01_model_definition": {"matmul_tflops": {"value": 612.0, "unit": "TFLOP/s", "label": "peak matmul"}}}}))
    (refdir / "broken.json").write_text("{not json")
    refs = report_card.load_references(refdir)
    assert [r["gpu"] for r in refs] == ["NVIDIA H100 80GB HBM3"]
    ok = NotebookResult("01_model_definition", 95.0, True, headline={
        "matmul_tflops": {"value": 0.0612, "unit": "TFLOP/s", "label": "peak matmul"}},
        executed=executed(tmp_path, "01_model_definition"))
    page = report_card.render(detect(), [ok], references=refs)
    assert "reference: NVIDIA H100 80GB HBM3" in page and "612 TFLOP/s" in page
    assert "base64,FIRST" in page and "No reference results" not in page
    path = report_card.write(detect(), [ok], tmp_path / "build", references=refs)
    assert path.name == "report_card.html" and path.read_text().startswith("<!doctype html>")
    # this run's numbers in the reference format: what a maintainer ships from a GPU run, never a CPU's
    written = json.loads((tmp_path / "build" / "results.json").read_text())
    assert written["notebooks"] == {"01_model_definition": ok.headline} and written["gpu"] == detect().gpu_name
    assert report_card.load_references(tmp_path / "build") == ([] if detect().gpu_name is None else [written])


def test_sections_are_titled_by_question_with_takeaway_at_most_five_numbers_and_caption(tmp_path):
    """Sections were titled by file name, with no takeaway and up to 11 numbers."""
    path = executed(tmp_path, "01_model_definition", tagged_second=True)
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].metadata["caption"] = "This machine's roofline <measured>"
    nbformat.write(nb, path)
    headline = {f"k{i}": {"value": i, "unit": "x", "label": f"number {i}"} for i in range(7)}
    headline["k1"]["card"] = False
    ok = NotebookResult("01_model_definition", 95.0, True, headline=headline, executed=path,
                        takeaway="memory-bound: naive attention held 63× the memory of flash at N = 1024")
    page = report_card.render(detect(), [ok], references=[])
    assert f"Unit 1: {report_card.QUESTIONS[1]}" in page
    assert "<p class='takeaway'>memory-bound: naive attention held 63× the memory of flash at N = 1024</p>" in page
    shown = [f"number {i}" for i in range(7) if f"<td>number {i}</td>" in page]
    assert shown == ["number 0", "number 2", "number 3", "number 4", "number 5"]
    assert "<figcaption>This machine&#x27;s roofline &lt;measured&gt;</figcaption>" in page


def test_the_card_carries_the_runs_ceilings_and_busy_warning(tmp_path):
    (tmp_path / "machine.json").write_text(json.dumps({
        "ceilings": {"peak_flops": 2e11, "bandwidth": 1e10, "dtype": "float32", "device": "cpu",
                     "matmul_n": 512, "copy_bytes": 2**26},
        "busy_warning": "other processes are using 93% of the CPU right now: timings will be noisy"}))
    page = report_card.render(detect(), [], references=[], context=report_card.read_machine(tmp_path))
    assert "measured once at the start of this run" in page and "ridge point 20 FLOP/byte" in page
    assert "Busy machine:" in page and "93% of the CPU" in page


def test_questions_are_the_readmes():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = re.findall(r"^\| (\d) \| [^|]+ \| ([^|]+) \|", readme, re.M)
    assert {int(u): q.strip() for u, q in rows} == report_card.QUESTIONS
