"""The ``teraflops`` command: doctor, run (on a throw-away course), report, and its errors."""

from __future__ import annotations

import contextlib
import io
import json
import os

import nbformat
import pytest

from teraflops import headlines
from teraflops.course import cli
from teraflops.errors import CourseError
from teraflops.course.runner import format_summary, format_value, run_units


def _write_notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {path.stem}")]
    nb.cells += [nbformat.v4.new_code_cell(src) for src in sources]
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def tiny_course(tmp_path_factory):
    """A course root with one good notebook (records a headline) and one that raises."""
    root = tmp_path_factory.mktemp("course")
    (root / "notebooks").mkdir()
    _write_notebook(
        root / "notebooks" / "01_tiny.ipynb",
        'import teraflops.headlines\nteraflops.headlines.record("answer", 42, "x", "The answer")\n'
        'print("recorded")',
    )
    _write_notebook(
        root / "notebooks" / "02_broken.ipynb",
        'print("before")',
        'raise ZeroDivisionError("broken on purpose")',
        'print("never runs")',
        "# NBVAL_CHECK_OUTPUT\nprint(chr(10003), True)",  # its committed ✓ must not survive the failure above
    )
    broken = nbformat.read(root / "notebooks" / "02_broken.ipynb", as_version=4)
    broken.cells[4].outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ True\n")]
    broken.cells[4].execution_count = 7
    nbformat.write(broken, root / "notebooks" / "02_broken.ipynb")
    checked = nbformat.v4.new_notebook()  # a checked cell whose run differs from the committed output
    checked.cells = [nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint('matched 4 of 6')")]
    checked.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="matched 6 of 6\n")]
    nbformat.write(checked, root / "notebooks" / "03_checked.ipynb")
    return root


@pytest.fixture(scope="module")
def cli_run(tiny_course, tmp_path_factory):
    """``teraflops run --out OUT`` from inside the course root (found via the current directory)."""
    out = tmp_path_factory.mktemp("build")
    stdout = io.StringIO()  # capsys is function-scoped; this fixture runs once for the module
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.chdir(tiny_course)
        mp.delenv(headlines.ENV_VAR, raising=False)
        code = cli.main(["run", "--out", str(out), "--timeout", "120"])
    return code, stdout.getvalue(), out


@pytest.mark.slow
def test_doctor_mentions_torch_and_triton_mode(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out
    assert "mode: interpreter" in out or "mode: compiled" in out
    assert "Skipped on this machine" in out
    assert "Size preset" in out and ("(chosen for this machine" in out or "(TERAFLOPS_PRESET=" in out)


@pytest.mark.slow
def test_run_writes_outputs_and_reports_failures(cli_run):
    code, out, build = cli_run
    assert code == 1  # one notebook failed

    for name in ("01_tiny", "02_broken"):
        assert (build / f"{name}.ipynb").is_file()
        assert (build / f"{name}.html").is_file()

    tiny = nbformat.read(build / "01_tiny.ipynb", as_version=4)
    assert "recorded" in tiny.cells[1].outputs[0]["text"]
    assert "The answer" in out and "42 x" in out
    broken = nbformat.read(build / "02_broken.ipynb", as_version=4)
    assert broken.cells[1].outputs[0]["text"].strip() == "before"
    assert broken.cells[2].outputs[0]["ename"] == "ZeroDivisionError"
    assert not broken.cells[3].get("outputs")  # stopped at the failing cell
    assert broken.cells[4].execution_count is None and "✓" not in str(broken.cells[4].outputs)
    assert broken.cells[4].outputs[0]["text"].startswith("not run: this lecture stopped at cell 2")
    assert "✓" not in (build / "02_broken.html").read_text()
    assert (build / "02_broken.error.txt").is_file() and "broken on purpose" in (build / "02_broken.error.txt").read_text()

    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("0")}
    assert rows["01_tiny"].split()[1] == "ok"  # its unit's stories cannot tell (nothing recorded): still ok
    assert "can't tell (measurement missing: compute_bound_ops (its cell did not run, or skipped here)): " in out
    assert rows["02_broken"].split()[1] == "FAILED"
    assert "cell 2: ZeroDivisionError: broken on purpose" in rows["02_broken"]
    failed_at = out.splitlines().index(rows["02_broken"])
    assert "not run: checked cell 4" in out.splitlines()[failed_at + 1]  # the failure in two lines
    assert str(build.resolve()) in out
    card = (build / "report_card.html").read_text()  # the run ends with the report card
    assert f"report card: {build / 'report_card.html'}" in out
    assert "01_tiny" in card and "The answer" in card and "42 x" in card and "failed: cell 2" in card
    assert "not run: checked cell 4" in card and "✓" not in card


@pytest.mark.slow
def test_run_warns_about_a_checked_cell_that_differs(cli_run):
    """Triage matched 4 of 6, its checked cell showed it, and `teraflops run` said ok."""
    _, out, build = cli_run
    row = next(line for line in out.splitlines() if line.startswith("03_checked"))
    assert row.split()[1] == "WARNING", out
    assert "WARNING: unit 3 (03_checked) cell 0: checked output differs from the committed one" in row
    assert "matched 4 of 6" in row and "matched 6 of 6" in row
    assert "1/3 notebooks ok (1 ran with a checked output that differs" in out
    assert "WARNING: unit 3 (03_checked) cell 0" in (build / "report_card.html").read_text()


def test_summary_names_the_unit_and_cell_of_a_differing_checked_output():
    from teraflops.course.runner import NotebookResult
    from teraflops.machine import Machine

    r = NotebookResult("06_triage", 61.0, True, mismatches=["cell 23: expected 'a', got 'b'"])
    assert r.status == "WARNING"
    text = format_summary(Machine("cpu", cpu_cores=2), [r, NotebookResult("01_x", 1.0, True)])
    assert "06_triage  WARNING" in text and "01_x       ok" in text
    assert "WARNING: unit 6 (06_triage) cell 23: checked output differs from the committed one (expected 'a', got 'b')" in text
    assert "1/2 notebooks ok (1 ran with a checked output that differs" in text


@pytest.mark.slow
def test_run_units_results_and_env_restored(tiny_course, tmp_path, monkeypatch):
    monkeypatch.setenv(headlines.ENV_VAR, "keep-me")
    results = run_units([1], out_dir=tmp_path, html=False, timeout_per_cell=120, root=tiny_course)
    assert os.environ[headlines.ENV_VAR] == "keep-me"  # restored after the kernel started
    [r] = results
    assert r.ok and r.error is None and r.name == "01_tiny"
    assert r.headline == {"answer": {"value": 42.0, "unit": "x", "label": "The answer"}}
    assert not (tmp_path / "01_tiny.html").exists()


def test_record_without_env_var_is_a_noop(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(headlines.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    headlines.record("k", 1.0, "s")
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr() == ("", "")


def test_record_updates_entries(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    monkeypatch.setenv(headlines.ENV_VAR, str(path))
    headlines.record("a", 1, "s")
    headlines.record("b", 2.5, label="B")
    headlines.record("a", 3, "ms")
    assert headlines.read(path) == {
        "a": {"value": 3.0, "unit": "ms", "label": "a"},
        "b": {"value": 2.5, "unit": "", "label": "B"},
    }
    assert list(json.loads(path.read_text())) == ["a", "b"]
    assert headlines.read(tmp_path / "missing.json") == {}


def test_unknown_unit_is_a_one_line_error(tiny_course, monkeypatch, capsys):
    monkeypatch.chdir(tiny_course)
    assert cli.main(["run", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: no notebook for unit 07")
    assert "available units: 01, 02" in err
    with pytest.raises(CourseError):
        run_units([7], root=tiny_course)


def test_format_value_three_significant_digits():
    assert [format_value(v) for v in (42, 0.012345, 1234.5, 3.14159e9, 0)] == [
        "42", "0.0123", "1230", "3.14e+09", "0"
    ]


def test_format_summary_without_results():
    from teraflops import detect

    text = format_summary(detect(), [])
    assert text.splitlines()[0].startswith("machine: ")


@pytest.mark.slow
def test_python_dash_m_teraflops():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "teraflops", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "doctor" in p.stdout


def test_checked_output_mismatches_compares_check_cells_as_nbval(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    from teraflops.errors import CourseError
    from teraflops.course.runner import checked_output_mismatches

    def nb(check_text, other_text, path):
        cells = [new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(ok)"), new_code_cell("print(time)")]
        cells[0].outputs = [new_output("stream", name="stdout", text=t) for t in check_text]
        cells[1].outputs = [new_output("stream", name="stdout", text=other_text)]
        nbformat.write(new_notebook(cells=cells), path)
        return path

    committed = nb(["ok: True\n"], "", tmp_path / "kept.ipynb")
    assert checked_output_mismatches(nb(["ok: ", "True\n"], "1.3 s\n", tmp_path / "a.ipynb"), committed) == []
    (line,) = checked_output_mismatches(nb(["ok: False\n"], "1.3 s\n", tmp_path / "b.ipynb"), committed)
    assert line.startswith("cell 0:") and "False" in line
    other = tmp_path / "c.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("print(1)")]), other)
    with pytest.raises(CourseError, match="same cells"):
        checked_output_mismatches(other, committed)


def test_run_measures_the_ceilings_once_for_every_notebook(cli_run):
    """The run's one probe is in machine.json (for the card) and in ceilings.json (for the kernels)."""
    _, _, out = cli_run
    machine = json.loads((out / "machine.json").read_text())
    assert machine["ceilings"] == json.loads((out / "ceilings.json").read_text())
    assert machine["ceilings"]["peak_flops"] > 0 and "busy_warning" in machine
    assert "measured once at the start of this run" in (out / "report_card.html").read_text()
