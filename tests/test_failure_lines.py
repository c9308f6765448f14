"""A lecture that stops shows no result that did not happen, and its failure in one line
(teraflops.launch.notebook.cause_line, teraflops.course.runner: mark_not_run, shorten_failure); run end to end in tests/test_cli.py."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from teraflops.course import runner
from teraflops.launch import notebook
from teraflops.course.runner import CellFailure, NotebookResult

DUMP = (Path(__file__).parent / "data" / "failures" / "inductor_space.txt").read_text()


def test_the_cause_of_a_compiler_dump_is_the_linkers_own_line():
    """torch.compile from a venv in 'sp ace/': recorded, trimmed (tests/data/failures)."""
    line = notebook.cause_line(DUMP)
    assert line == "/usr/bin/ld: cannot find -ltorch: No such file or directory"


def test_a_short_message_is_itself_and_a_tool_summary_is_not_a_cause():
    assert notebook.cause_line("broken on purpose") == "broken on purpose"
    assert notebook.cause_line("") == ""
    dump = "Error building extension 'op'\n[1/2] c++ -c op.cpp\nop.cpp:3:10: fatal error: foo.h: No such file\n" \
           "ninja: build stopped: subcommand failed.\ncollect2: error: ld returned 1 exit status"
    assert notebook.cause_line(dump) == "op.cpp:3:10: fatal error: foo.h: No such file"
    assert notebook.cause_line("first line\nsecond line") == "first line"  # nothing names a cause: the first
    assert len(notebook.cause_line("x" * 500)) == 200


def _notebook():
    nb = new_notebook()
    nb.cells = [new_markdown_cell("# t"), new_code_cell("a = 1"), new_code_cell("1 / 0"),
                new_code_cell("print('later')"), new_markdown_cell("checked:"),
                new_code_cell("# NBVAL_CHECK_OUTPUT\nprint('✓ True')")]
    for i in (3, 5):  # outputs as committed (a checked cell) or left by an earlier run
        nb.cells[i].outputs = [new_output("stream", name="stdout", text="✓ True\n")]
        nb.cells[i].execution_count = i
    return nb


def test_cells_after_the_failure_show_nothing_and_a_checked_one_says_not_run():
    nb = _notebook()
    assert runner.mark_not_run(nb, CellFailure(2, "ZeroDivisionError", "division by zero")) == [5]
    assert nb.cells[3].outputs == [] and nb.cells[3].execution_count is None
    assert nb.cells[5].execution_count is None and "✓" not in str(nb.cells[5].outputs)
    assert nb.cells[5].outputs[0]["text"].startswith("not run: this lecture stopped at cell 2")


def test_a_kernel_that_never_started_leaves_every_cell_not_run():
    nb = _notebook()
    assert runner.mark_not_run(nb, CellFailure(None, "RuntimeError", "no kernel")) == [5]
    assert all(not c.outputs or c.outputs[0]["text"].startswith("not run: this lecture stopped at its kernel's start")
               for c in nb.cells if c.cell_type == "code")


def test_a_dump_in_the_lecture_page_becomes_its_cause_and_the_log():
    nb = _notebook()
    failure = CellFailure(2, "BackendCompilerFailed", notebook.cause_line(DUMP), detail=DUMP)
    nb.cells[2].outputs = [new_output("error", ename=failure.ename, evalue=DUMP, traceback=DUMP.splitlines() * 3)]
    runner.shorten_failure(nb, failure, Path("build/04_compilation.error.txt"))
    out = nb.cells[2].outputs[0]
    assert out["traceback"] == [f"BackendCompilerFailed: {failure.evalue}", "full log: build/04_compilation.error.txt"]
    short = [new_output("error", ename="ValueError", evalue="bad", traceback=["Traceback", "ValueError: bad"])]
    nb.cells[2].outputs = short
    runner.shorten_failure(nb, CellFailure(2, "ValueError", "bad"), None)
    assert nb.cells[2].outputs[0]["traceback"] == ["Traceback", "ValueError: bad"]  # a short one stays as it is


def test_a_failed_unit_is_at_most_two_lines_on_the_summary(tmp_path):
    r = NotebookResult("04_compilation", 12.0, ok=False,
                       error=CellFailure(14, "BackendCompilerFailed", notebook.cause_line(DUMP), detail=DUMP),
                       error_log=tmp_path / "04_compilation.error.txt", not_run_checked=[25, 30])
    lines = r.failure_lines()
    assert len(lines) == 2 and "cannot find -ltorch" in lines[0] and lines[0].startswith("cell 14: ")
    assert lines[1] == f"full log: {tmp_path / '04_compilation.error.txt'}; not run: checked cells 25, 30"
    from teraflops.machine import detect
    summary = runner.format_summary(detect(), [r])
    assert lines[0] in summary and lines[1] in summary and "g++" not in summary
    assert NotebookResult("x", 1.0, ok=True).failure_lines() == []


def test_nbformat_still_reads_a_marked_notebook(tmp_path):
    nb = _notebook()
    runner.mark_not_run(nb, CellFailure(2, "ZeroDivisionError", "division by zero"))
    nbformat.write(nb, tmp_path / "n.ipynb")
    nbformat.validate(nbformat.read(tmp_path / "n.ipynb", as_version=4))
