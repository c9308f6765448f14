"""``teraflops grade``: the learner's own error, any file name, --unit, --json, --out (JSON, JUnit XML) naming
the learner, progress while a cell runs."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from teraflops.course import cli
from teraflops.errors import CourseError
from teraflops.grading import unit01  # noqa: F401 - registers Lab 1's exercises
from teraflops.grading.core import REGISTRY
from teraflops.grading.grader import cell_error, unit_of

ROOT = Path(__file__).resolve().parents[1]
BROKEN = ("def matmul_intensity(m: int, n: int, k: int, dtype: torch.dtype) -> float:\n"
          "    flops = 2 * m * n * k\n"
          "    return flops / / (m * k + k * n + m * n)")


@pytest.fixture(scope="module")
def my_try(tmp_path_factory):
    """Lab 1 up to Exercise 2's check, saved as my_try.ipynb, with a SyntaxError in Exercise 1."""
    nb = nbformat.read(ROOT / "labs" / "01_model_definition.ipynb", as_version=4)
    cut = next(i for i, c in enumerate(nb.cells) if "check.softmax_intensity(" in c.source) + 1
    nb.cells = nb.cells[:cut]
    exercise = next(i for i, c in enumerate(nb.cells) if c.source.startswith("def matmul_intensity("))
    nb.cells[exercise].source = BROKEN
    path = tmp_path_factory.mktemp("learner") / "my_try.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_grade_shows_the_learners_syntax_error_and_its_line(my_try, capsys):
    assert cli.main(["grade", str(my_try)]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("[1]"))
    assert "SyntaxError: invalid syntax at line 3 of the cell: return flops / / (m * k + k * n + m * n)" in row
    assert "NameError" not in out


@pytest.mark.slow
def test_grade_json_has_the_shape_a_workshop_host_gathers(my_try, tmp_path, capsys):
    out = tmp_path / "learner.json"
    assert cli.main(["grade", str(my_try), "--json", "--out", str(out)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report  # --out writes what --json prints
    assert set(report) == {"notebook", "unit", "learner", "checks", "passed", "total"}
    assert report["notebook"] == "my_try.ipynb" and report["unit"] == 1
    assert report["learner"] == pwd.getpwuid(os.geteuid()).pw_name  # the Unix user the notebook ran as
    assert report["total"] == len(report["checks"]) == sum(ex.unit == 1 for ex in REGISTRY.values()) and report["passed"] == 0
    first = report["checks"][0]
    assert set(first) == {"name", "passed", "message"} and first["passed"] is False
    assert first["name"].startswith("Exercise 1 (") and "SyntaxError" in first["message"]
    assert report["checks"][1]["message"] == "not attempted"


def test_labs_carry_their_unit_whatever_the_file_is_called():
    for lab in sorted((ROOT / "labs").glob("*.ipynb")):
        nb = nbformat.read(lab, as_version=4)
        assert unit_of(Path("my_try.ipynb"), nb) == int(lab.name[:2])


def test_unit_from_override_then_metadata_then_prefix():
    nb = new_notebook(metadata={"teraflops": {"unit": 3}})
    assert unit_of(Path("anything.ipynb"), nb) == 3
    assert unit_of(Path("anything.ipynb"), nb, unit=5) == 5
    assert unit_of(Path("04_mine.ipynb"), new_notebook()) == 4
    with pytest.raises(CourseError, match="--unit N"):
        unit_of(Path("my_try.ipynb"), new_notebook())


def _failed(source, **error):
    cell = new_code_cell(source)
    cell.outputs = [new_output("error", **error)]
    return cell


def test_cell_error_is_one_line_with_the_cells_line():
    syntax = _failed("x = 1\ny = = 2", ename="SyntaxError", evalue="invalid syntax (123.py, line 2)",
                     traceback=["  Cell In[3], line 2\n    y = = 2\n        ^\nSyntaxError: invalid syntax\n"])
    assert cell_error(syntax) == "SyntaxError: invalid syntax at line 2 of the cell: y = = 2"
    indent = _failed("def f():\nreturn 1", ename="IndentationError",
                     evalue="expected an indented block after function definition on line 1 (9.py, line 2)",
                     traceback=["..."])
    assert cell_error(indent).startswith("IndentationError: expected an indented block") and "return 1" in cell_error(indent)
    raised = _failed("def g():\n    return 1/0\ng()", ename="ZeroDivisionError", evalue="division by zero",
                     traceback=["---", "ZeroDivisionError  Traceback", "\x1b[36mCell In[2], line 3\x1b[39m\n",
                                "Cell In[2], line 2, in g()\n", "ZeroDivisionError: division by zero"])
    assert cell_error(raised) == "ZeroDivisionError: division by zero (line 2 of the cell)"
    assert cell_error(new_code_cell("print(1)")) is None


@pytest.mark.slow
def test_a_long_cell_shows_its_elapsed_time_while_it_runs(tmp_path, capsys, monkeypatch):
    """During DeepSpeed's one-off compile a terminal showed nothing for minutes: the bar now ticks."""
    from teraflops.launch import notebook
    from teraflops.launch.notebook import execute_cells, make_client

    monkeypatch.setattr(notebook, "TICK_SECONDS_LOG", 1.0)  # captured stderr is not a terminal

    nb = new_notebook(cells=[new_code_cell("import time\ntime.sleep(3.5)")],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path = tmp_path / "long.ipynb"
    nbformat.write(nb, path)
    assert execute_cells(make_client(nb, path, 60), nb, "long") == []
    err = capsys.readouterr().err
    assert "cell 0: 2 s" in err and "cell 0: 3 s" in err, err


def _report(learner="alice"):
    from teraflops.grading.grade_report import GradeReport, GradeRow

    return GradeReport("my_try.ipynb", (GradeRow("Exercise 1 (a)", "passed"),
                                        GradeRow("Exercise 2 (b)", "failed", "expected shape (4,), got (3,)"),
                                        GradeRow("Exercise 3 (c)", "not attempted")), unit=3, learner=learner)


def test_junit_has_one_testcase_per_exercise_and_the_reason_of_each_failure(tmp_path):
    import xml.etree.ElementTree as ET

    path = _report().write(tmp_path / "alice.xml")
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite.get("name") == "alice/my_try.ipynb"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "2", "0")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props == {"learner": "alice", "unit": "3"}
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["Exercise 1 (a)", "Exercise 2 (b)", "Exercise 3 (c)"]
    assert {c.get("classname") for c in cases} == {"alice.my_try"}
    assert cases[0].find("failure") is None
    assert cases[1].find("failure").attrib == {"message": "expected shape (4,), got (3,)", "type": "ExerciseFailed"}
    assert cases[2].find("failure").attrib == {"message": "not attempted", "type": "NotAttempted"}
    assert [p.name for p in tmp_path.iterdir()] == ["alice.xml"]  # the temporary file is gone


def _fake_grade(calls, report):
    def grade(path, timeout=120, unit=None):
        calls.append(path)
        return report
    return grade


@pytest.mark.parametrize("suffix", [".json", ".xml"])
def test_grade_out_writes_the_report_a_host_gathers(suffix, tmp_path, monkeypatch, capsys):
    from teraflops.grading import grader

    calls = []
    monkeypatch.setattr(grader, "grade", _fake_grade(calls, _report("bob")))
    nb = tmp_path / "my_try.ipynb"
    nb.write_text("{}")
    out = tmp_path / f"bob{suffix}"
    assert cli.main(["grade", str(nb), "--out", str(out)]) == 1  # two exercises not passed
    assert "score: 1/3" in capsys.readouterr().out  # the table still shows
    text = out.read_text()
    if suffix == ".json":
        report = json.loads(text)
        assert report["learner"] == "bob" and report["passed"] == 1 and report["total"] == 3
        assert report["checks"][1] == {"name": "Exercise 2 (b)", "passed": False,
                                       "message": "expected shape (4,), got (3,)"}
    else:
        assert '<testcase classname="bob.my_try" name="Exercise 3 (c)">' in text and 'type="NotAttempted"' in text


@pytest.mark.parametrize("out, wrong", [("grades/alice.json", "no folder"), ("alice.txt", "not '.txt'"),
                                        ("alice", "not 'no suffix'"), ("", "a folder"), ("..", "a folder"),
                                        ("afile/alice.xml", "is a file, not a folder"),
                                        ("locked/alice.xml", "you cannot write in")])
def test_grade_out_that_cannot_be_written_is_refused_before_grading(out, wrong, tmp_path, monkeypatch, capsys):
    from teraflops.grading import grader, grade_report

    calls = []
    monkeypatch.setattr(grader, "grade", _fake_grade(calls, _report()))
    nb = tmp_path / "my_try.ipynb"
    nb.write_text("{}")
    (tmp_path / "afile").write_text("")
    (tmp_path / "locked").mkdir()
    real = os.access  # root may write anywhere: the learner's view of a folder of the host's, for "locked"
    monkeypatch.setattr(grade_report.os, "access", lambda p, mode: real(p, mode) and Path(p).name != "locked")
    assert cli.main(["grade", str(nb), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert calls == [] and len(err) == 1 and err[0].startswith("error: --out ") and wrong in err[0], err
    assert "Hint: " in err[0]


def test_the_learner_is_the_unix_user_not_the_environment(monkeypatch):
    from teraflops.grading.grade_report import current_user

    monkeypatch.setenv("USER", "somebody-else")
    monkeypatch.setenv("LOGNAME", "somebody-else")
    assert current_user() == pwd.getpwuid(os.geteuid()).pw_name
