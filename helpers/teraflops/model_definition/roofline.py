"""The roofline: place each operation by arithmetic intensity against the machine's ceilings.

Arithmetic intensity I = FLOPs / bytes moved to and from memory (FLOP/byte). An operation can
run no faster than ``min(peak FLOP/s, bandwidth × I)`` (Williams, Waterman & Patterson, CACM
52(4), 2009). Left of the ridge point (``peak / bandwidth``) it is **memory-bound**, right of it
**compute-bound**.

Byte counts here are the *minimum* traffic: every input read once and every output written
once (what a perfectly fused kernel with enough on-chip memory would move). FLOP conventions:

* matmul ``(m×k) @ (k×n)``: ``2·m·n·k`` (one multiply and one add per term).
* elementwise add of n elements: ``n`` FLOPs, ``3n`` elements moved (two reads, one write).
* softmax over ``rows × cols``: 5 FLOPs per element (max, subtract, exp, sum, divide); read
  once and write once, ``2·rows·cols`` elements.
* copy: 0 FLOPs, ``2n`` elements (the STREAM "Copy" count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from teraflops import plots
from teraflops.ceilings import Ceilings
from teraflops.tables import table
from teraflops.timing import benchmark

SOFTMAX_FLOPS_PER_ELEMENT = 5


def bytes_per_element(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype`` (fp32: 4, bf16/fp16: 2, int8: 1)."""
    return torch.empty((), dtype=dtype).element_size()


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of ``(m×k) @ (k×n)``: ``2·m·n·k``."""
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, dtype: torch.dtype) -> int:
    """Minimum bytes moved by ``(m×k) @ (k×n)``: read A and B once, write C once."""
    return (m * k + k * n + m * n) * bytes_per_element(dtype)


def matmul_intensity(m: int, n: int, k: int, dtype: torch.dtype) -> float:
    """Arithmetic intensity of a matmul in FLOP/byte (for square n in fp32: n/6)."""
    return matmul_flops(m, n, k) / matmul_bytes(m, n, k, dtype)


def softmax_flops(rows: int, cols: int) -> int:
    """FLOPs of a row softmax: 5 per element (see module docstring)."""
    return SOFTMAX_FLOPS_PER_ELEMENT * rows * cols


def softmax_bytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    """Minimum bytes moved by a row softmax: read the input once, write the output once."""
    return 2 * rows * cols * bytes_per_element(dtype)


def softmax_intensity(rows: int, cols: int, dtype: torch.dtype) -> float:
    """Arithmetic intensity of a row softmax in FLOP/byte (fp32: 5/8)."""
    return softmax_flops(rows, cols) / softmax_bytes(rows, cols, dtype)


NEAR_RIDGE = 1.25  # intensities within this factor of the ridge point read "near the ridge"


@dataclass(frozen=True)
class RooflinePoint:
    """One measured operation. flops in FLOP, nbytes in bytes, seconds per call."""

    name: str
    flops: float
    nbytes: float
    seconds: float

    @property
    def intensity(self) -> float:
        return self.flops / self.nbytes

    @property
    def achieved_flops(self) -> float:
        return self.flops / self.seconds

    @property
    def achieved_bandwidth(self) -> float:
        return self.nbytes / self.seconds

    def bound(self, c: Ceilings) -> str:
        """``"compute"`` if the intensity is at or above the ridge point, else ``"memory"``; ``"near the
        ridge"`` within a factor :data:`NEAR_RIDGE` of it either way, where a probe's error (a busy
        machine moved the ridge by up to ~3× on 2 cores) could flip the verdict."""
        if c.ridge_point / NEAR_RIDGE < self.intensity < c.ridge_point * NEAR_RIDGE:
            return "near the ridge"
        return "compute" if self.intensity >= c.ridge_point else "memory"

    def fraction_of_roof(self, c: Ceilings) -> float:
        """Achieved / attainable performance (the copy: achieved / measured bandwidth)."""
        if self.flops == 0:
            return self.achieved_bandwidth / c.bandwidth
        return self.achieved_flops / c.attainable(self.intensity)


def _measure(name: str, fn: Callable, flops: float, nbytes: float, min_run_time: float) -> RooflinePoint:
    return RooflinePoint(name, flops, nbytes, benchmark(fn, min_run_time=min_run_time).median)


def measure_roofline(matmul_sizes, elementwise_numel: int, dtype: torch.dtype, device: str,
                     min_run_time: float = 0.1, progress: bool = True) -> list[RooflinePoint]:
    """Time square matmuls of each size, plus add, softmax and copy of ``elementwise_numel``.

    Returns one :class:`RooflinePoint` per operation (seconds are medians, see
    :func:`teraflops.timing.benchmark`).
    """
    from tqdm.auto import tqdm

    s = bytes_per_element(dtype)
    jobs = []
    for n in matmul_sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        jobs.append((f"matmul {n}×{n}", (lambda a=a, b=b: a @ b), matmul_flops(n, n, n), matmul_bytes(n, n, n, dtype)))
    x = torch.randn(elementwise_numel, device=device, dtype=dtype)
    y = torch.randn_like(x)
    out = torch.empty_like(x)
    cols = 1024
    rows = elementwise_numel // cols
    x2 = x[: rows * cols].view(rows, cols)
    jobs.append(("add", lambda: torch.add(x, y, out=out), elementwise_numel, 3 * elementwise_numel * s))
    jobs.append((f"softmax {rows}×{cols}", lambda: torch.softmax(x2, dim=-1), softmax_flops(rows, cols), softmax_bytes(rows, cols, dtype)))
    jobs.append(("copy", lambda: out.copy_(x), 0, 2 * elementwise_numel * s))
    return [_measure(n, f, fl, by, min_run_time) for n, f, fl, by in tqdm(jobs, desc="roofline", disable=not progress)]


def _bound_text(bound: str) -> str:
    return bound if bound == "near the ridge" else f"{bound}-bound"


def roofline_table(points: list[RooflinePoint], c: Ceilings) -> str:
    """Operation, intensity, achieved TFLOP/s and GB/s, % of roof, bound."""
    rows = [
        (p.name, p.intensity, p.achieved_flops / 1e12, p.achieved_bandwidth / 1e9,
         f"{100 * p.fraction_of_roof(c):.0f}%", _bound_text(p.bound(c)))
        for p in points
    ]
    return table(rows, ["operation", "FLOP/byte", "TFLOP/s", "GB/s", "of roof", "verdict"])


def plot_roofline(points: list[RooflinePoint], c: Ceilings, ax=None, title: str | None = None):
    """Log-log roofline with the measured ceilings and each point; returns the matplotlib Axes.

    Zero-FLOP operations (copy) cannot sit on a FLOP/s axis: they are drawn at the left edge,
    at their fraction of the bandwidth roof.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.5))
    flop_points = [p for p in points if p.flops > 0]
    lo = min([p.intensity for p in flop_points] + [c.ridge_point]) / 4
    hi = max([p.intensity for p in flop_points] + [c.ridge_point]) * 4
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.loglog(xs, [c.attainable(x) for x in xs], "k-", lw=2, label="measured roof")
    ax.axvline(c.ridge_point, color="grey", ls=":", label=f"ridge point {c.ridge_point:.3g} FLOP/B")
    labels = []
    for p in points:
        x = p.intensity if p.flops > 0 else lo
        y = p.achieved_flops if p.flops > 0 else c.attainable(lo) * p.fraction_of_roof(c)
        color = "tab:red" if p.bound(c) == "compute" and p.flops > 0 else "tab:blue"
        ax.loglog([x], [y], "o", color=color)
        label = p.name if p.flops > 0 else f"{p.name} (0 FLOP, at the left edge)"
        right = x > hi / 8  # near the right edge: label below-left of the point
        labels.append(ax.annotate(label, (x, y), textcoords="offset points", xytext=(-4, -12) if right else (4, 4),
                                  fontsize="small", ha="right" if right else "left"))
    ax.plot([], [], "o", color="tab:red", label="compute-bound")
    ax.plot([], [], "o", color="tab:blue", label="memory-bound")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"Roofline of this machine ({c.device}, {str(c.dtype).replace('torch.', '')})")
    # beside the axes, off the points and their labels, at any figure scale
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, fontsize="small")
    ax.figure.tight_layout()
    plots.place_labels(ax, labels)
    return ax
