"""A lecture's time budget on the CPU machine, as the unit-run tests hold it.

The budgets are those of the issues ("Unit 3 within 4 minutes on the CPU machine"), met by a lecture run
alone (``teraflops run``, or ``pytest tests/test_unitNN_run.py``). CI runs the suite on two pytest-xdist
workers on the same 2 cores (README's test command), so a lecture shares the machine with the other
worker's tests: there the bound is twice the budget, which still catches a lecture that hangs or doubles.
"""

import os


def share() -> int:
    """How many pytest workers share this machine now (1 without xdist)."""
    return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))


def assert_within(result, budget_s: float, unit: int) -> None:
    """Fail when ``result`` (a :class:`teraflops.course.runner.NotebookResult`) took longer than
    ``budget_s`` seconds, twice that when other pytest workers run beside it (:func:`share`)."""
    bound = budget_s * min(share(), 2)
    beside = "" if bound == budget_s else f" ({bound:.0f} s allowed beside {share() - 1} other pytest worker(s))"
    assert result.seconds < bound, f"Unit {unit} took {result.seconds:.0f} s on CPU; the budget is {budget_s:.0f} s{beside}"
