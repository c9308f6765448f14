"""``teraflops preflight``'s checks as GPU tests: ``pytest -m gpu`` collects every check the preflight
registry holds (:data:`teraflops.course.preflight.CHECKS`, filled by ``@preflight.register``) and runs
the very function ``teraflops preflight`` runs, on its GPU path: one source for both, no check body here.

A check needs at least one GPU here (on a CPU machine ``teraflops preflight`` runs the CPU equivalents,
and tests/test_preflight.py runs the cheap ones that way), some need two; where this machine has fewer,
the test is skipped with the check's own reason, the line preflight prints for a skip.
"""

from __future__ import annotations

import pytest

from teraflops.course import preflight
from teraflops.machine import detect


def _collected(check: preflight.Check):
    why = check.unmet(detect().gpu_count, gpu_path=True)
    return pytest.param(check, id=check.name, marks=[
        pytest.mark.gpu, pytest.mark.slow,  # slow: several launch ranks or compile
        pytest.mark.skipif(why is not None, reason=f"preflight {check.name}: {why}")])


@pytest.mark.parametrize("check", [_collected(c) for c in preflight.CHECKS])
def test_preflight_check_on_this_gpu(check: preflight.Check):
    """The check's function as ``teraflops preflight`` calls it: its :class:`~teraflops.course.preflight.CheckFailed`
    (an AssertionError) names the number that failed; it returns ``(value, unit, detail)``. A check whose
    outcome is a verdict on timings taken now (:data:`~teraflops.course.preflight.TIMED_VERDICTS`) must
    reach a judgment: passed, or one line naming the verdicts it got (inconclusive or failed); which one
    is not this machine's test (the judgment on given verdicts is tests/test_busy_verdicts.py's)."""
    if check.name in preflight.TIMED_VERDICTS:
        try:
            value, unit, detail = check.fn()
        except preflight.CheckFailed as e:
            assert "verdicts" in str(e) and "\n" not in str(e), str(e)
            print(f"{check.name}: {type(e).__name__}: {e}")
            return
    else:
        try:
            value, unit, detail = check.fn()
        except preflight.CheckSkipped as e:  # a reason only running the check finds (a container's EPERM)
            pytest.skip(f"preflight {check.name}: {e}")
    assert isinstance(unit, str) and isinstance(detail, str) and detail, (value, unit, detail)
    assert value is None or isinstance(value, (int, float, str)), value
    print(f"{check.name}: {value} {unit}  {detail}")
