"""In a live notebook a cell that fails to compile defines nothing, so the check is handed the lab's
stub again: the check names the learner's syntax error and its line, not "not attempted"."""

import pytest

from teraflops.course.labs import PLACEHOLDER
from teraflops.grading import history

STUB = f"def matmul_intensity(m, n, k, dtype):\n    {PLACEHOLDER}"
BROKEN = "def matmul_intensity(m, n, k, dtype):\n    flops = 2 * m * n * k\n    return flops / / (m * k)"


def test_the_latest_definition_decides():
    assert history.failed_definition("matmul_intensity", [STUB, BROKEN]) == (
        "SyntaxError: invalid syntax at line 3 of the cell: return flops / / (m * k)")
    assert history.failed_definition("matmul_intensity", [BROKEN, STUB]) is None  # the stub ran again: unattempted
    assert history.failed_definition("matmul_intensity", [STUB]) is None
    assert history.failed_definition("other", [BROKEN]) is None
    indented = history.failed_definition("f", ["def f():\nreturn 1"])
    assert indented.startswith("IndentationError: ") and "at line 2 of the cell: return 1" in indented


def test_names_of_what_a_check_is_handed():
    assert history.function_name(history.syntax_line) == "syntax_line"
    assert history.function_name(3.0) is None and history.function_name(lambda: 0) is None

    class Kernel:  # what triton.jit returns: the original function as .fn
        fn = staticmethod(history.syntax_line)
    assert history.function_name(Kernel()) == "syntax_line"


def test_outside_a_kernel_the_stub_is_not_attempted():
    from teraflops.errors import PLACEHOLDER_MESSAGE, NotAttempted
    from teraflops.grading import unit01 as check

    def matmul_intensity(m, n, k, dtype):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)
    with pytest.raises(NotAttempted):
        check.matmul_intensity(matmul_intensity)


@pytest.mark.slow
def test_a_live_kernel_names_the_syntax_error_of_the_latest_version():
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    check = "check.matmul_intensity(matmul_intensity)"
    nb = new_notebook(cells=[new_code_cell(f"from teraflops.grading import unit01 as check\n{STUB}"),
                             new_code_cell(check), new_code_cell(BROKEN), new_code_cell(check),
                             new_code_cell(STUB), new_code_cell(check)])
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    NotebookClient(nb, allow_errors=True, kernel_name="python3", timeout=120).execute()
    first, broken, stale, again = (next(o for o in nb.cells[i].outputs if o.output_type == "error") for i in (1, 2, 3, 5))
    assert first.ename == "NotAttempted" and broken.ename == "SyntaxError"
    assert stale.ename == "ExerciseFailed", stale
    assert stale.evalue.startswith("Exercise 1 (") and "not attempted" not in stale.evalue
    assert "SyntaxError: invalid syntax at line 3 of the cell: return flops / / (m * k)" in stale.evalue
    assert again.ename == "NotAttempted"  # the stub itself, run again, is unattempted once more
