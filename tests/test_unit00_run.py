"""`teraflops run 0`: the course map runs headless and reports this machine's ceilings."""

import pytest
import torch
from torch.utils import benchmark

from teraflops import ceilings
from teraflops.course import runner
from teraflops.sizing import preset


def _best_rate(stmt: str, work: float, **globals_) -> float:
    """``work`` (FLOPs or bytes) per second of ``stmt``'s fastest of 5 blocks (torch.utils.benchmark)."""
    times = benchmark.Timer(stmt, globals=globals_).blocked_autorange(min_run_time=0.5).raw_times
    return work / min(times)


@pytest.mark.slow
def test_run_unit_0_reports_the_machine_and_its_ceilings(lecture_out):
    [result] = runner.run_units([0], out_dir=lecture_out, html=False)
    assert result.ok, result.error
    assert set(result.headline) == {"peak_tflops", "bandwidth", "ridge_point"}
    assert not result.mismatches, result.mismatches  # compared by the run itself (runner.run_notebook)
    h = {k: v["value"] for k, v in result.headline.items()}
    # Units: a slip between FLOP/s and TFLOP/s or B/s and GB/s (1e3-1e12) lands outside these ranges,
    # which hold from a 2-core laptop to a B200.
    assert 1e-3 < h["peak_tflops"] < 1e4 and 0.5 < h["bandwidth"] < 2e4, h
    # The ceilings are ceilings: a matmul and a copy of other sizes, timed here by torch.utils.benchmark
    # instead of the course's probe, do not beat them by more than timing noise. The roof is the larger
    # of the notebook's and the same probe rerun now, beside the re-measure, so that a probe which
    # landed on a busy moment of a shared machine is not mistaken for a wrong one.
    if torch.cuda.is_available():
        pytest.skip("the independent re-measure below runs on the CPU path only")
    p = preset()
    n = 3 * p.probe.matmul_n // 4
    a, b = torch.randn(n, n, dtype=p.dtype), torch.randn(n, n, dtype=p.dtype)
    x = torch.ones(2 * p.probe.copy_bytes // 4, dtype=torch.float32)  # twice the probe's: no cache holds it
    y = torch.empty_like(x)
    matmul = _best_rate("a @ b", 2 * n**3, a=a, b=b) / 1e12
    copy = _best_rate("y.copy_(x)", 2 * x.numel() * 4, x=x, y=y) / 1e9  # read + write
    peak = max(h["peak_tflops"], ceilings.measure_peak_flops(p.probe.matmul_n, p.dtype, "cpu") / 1e12)
    bandwidth = max(h["bandwidth"], ceilings.measure_copy_bandwidth(p.probe.copy_bytes, "cpu") / 1e9)
    assert matmul < 1.5 * peak, f"a {n}² matmul ran at {matmul:.3g} TFLOP/s, over the peak {peak:.3g}"
    assert copy < 1.5 * bandwidth, f"a copy moved {copy:.3g} GB/s, over the measured bandwidth {bandwidth:.3g}"
