"""Timing done right: warm-up, device synchronisation, repeats, median and spread.

We do not write our own timing loop: :func:`benchmark` wraps ``torch.utils.benchmark.Timer``
(https://pytorch.org/docs/stable/benchmark_utils.html), which synchronises CUDA around each
measurement, picks how many calls to put in one measured block so the timer's resolution does
not matter, and reports median and interquartile range. We add an explicit warm-up (first
calls pay for allocation, caching and JIT compilation) and use all of torch's threads (the
Timer defaults to one thread, which would understate a CPU's peak).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.benchmark as torch_benchmark


@dataclass(frozen=True)
class Timing:
    """Result of :func:`benchmark`. Times are seconds per call.

    Attributes:
        median: median over measured blocks (s).
        iqr: interquartile range over measured blocks (s): the spread.
        runs: number of measured blocks.
        calls_per_run: calls averaged inside one block.
    """

    median: float
    iqr: float
    runs: int
    calls_per_run: int

    @property
    def spread(self) -> float:
        """IQR as a fraction of the median (0.05 = ±5 % noise)."""
        return self.iqr / self.median if self.median > 0 else float("nan")

    def __str__(self) -> str:
        return f"{format_seconds(self.median)} ± {format_seconds(self.iqr / 2)} (median ± IQR/2, {self.runs} runs)"


def benchmark(fn: Callable[[], object], *, min_run_time: float = 0.2, warmup: int = 1) -> Timing:
    """Time ``fn()`` (no arguments) with ``torch.utils.benchmark.Timer.blocked_autorange``.

    Args:
        fn: the work to time; GPU work is synchronised by the Timer.
        min_run_time: seconds of measurement after warm-up (more = tighter spread).
        warmup: calls made before measuring.

    Returns:
        :class:`Timing` in seconds per call.
    """
    for _ in range(warmup):
        fn()
    timer = torch_benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(median=float(m.median), iqr=float(m.iqr), runs=len(m.times), calls_per_run=int(m.number_per_run))


def format_seconds(s: float) -> str:
    """``1.2e-05`` → ``"12.0 µs"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"
