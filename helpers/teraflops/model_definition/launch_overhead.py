"""Launch overhead: the fixed cost every operator pays before it touches a byte.

Each eager PyTorch operator goes through Python, the dispatcher, and (on a GPU) a kernel launch:
a few microseconds during which no useful work happens. For small tensors that fixed cost is the
whole time, so the time of an op is flat in its size (the *floor*) until the data is big enough
for bandwidth to matter. A chain of N small ops pays the floor N times; one fused op pays it once.

The fused/unfused pair used here is the tanh approximation of GELU (Hendrycks & Gimpel 2016,
arXiv:1606.08415): written out in eager PyTorch it is a chain of elementwise operators;
``torch.nn.functional.gelu(x, approximate="tanh")`` computes the same function in one kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from teraflops.model_definition.profiling import count_ops
from teraflops.tables import table
from teraflops.timing import Timing, benchmark, format_seconds


def op_time_vs_size(sizes, device: str, dtype: torch.dtype = torch.float32,
                    min_run_time: float = 0.1) -> list[tuple[int, Timing]]:
    """Time ``torch.add(x, y, out=z)`` for each element count in ``sizes`` (no allocation in the loop)."""
    out = []
    for n in sizes:
        x = torch.randn(n, device=device, dtype=dtype)
        y = torch.randn_like(x)
        z = torch.empty_like(x)
        out.append((n, benchmark(lambda: torch.add(x, y, out=z), min_run_time=min_run_time)))
    return out


def launch_floor(sweep: list[tuple[int, Timing]]) -> float:
    """The floor: the smallest median time in a :func:`op_time_vs_size` sweep (seconds)."""
    return min(t.median for _, t in sweep)


def gelu_chain(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU written as separate eager ops: ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``."""
    inner = x + 0.044715 * torch.pow(x, 3)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * inner))


def gelu_fused(x: torch.Tensor) -> torch.Tensor:
    """The same function as one kernel: ``F.gelu(x, approximate="tanh")``."""
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class ChainVsFused:
    numel: int
    chain_ops: int
    fused_ops: int
    chain: Timing
    fused: Timing

    @property
    def speedup(self) -> float:
        return self.chain.median / self.fused.median


def chain_vs_fused(numel: int, device: str, dtype: torch.dtype = torch.float32,
                   min_run_time: float = 0.1) -> ChainVsFused:
    """Time :func:`gelu_chain` against :func:`gelu_fused` on ``numel`` elements; count their operators."""
    x = torch.randn(numel, device=device, dtype=dtype)
    # Same function? Checked in fp32: in bf16 the chain rounds after each of its eight ops.
    torch.testing.assert_close(gelu_chain(x.float()), gelu_fused(x.float()), rtol=1e-4, atol=1e-4)
    return ChainVsFused(
        numel,
        sum(count_ops(lambda: gelu_chain(x)).values()),
        sum(count_ops(lambda: gelu_fused(x)).values()),
        benchmark(lambda: gelu_chain(x), min_run_time=min_run_time),
        benchmark(lambda: gelu_fused(x), min_run_time=min_run_time),
    )


def sweep_table(sweep: list[tuple[int, Timing]], dtype: torch.dtype = torch.float32) -> str:
    """Elements, time, and effective bandwidth (3 tensors moved) of an add sweep."""
    size = torch.empty((), dtype=dtype).element_size()
    rows = [(n, format_seconds(t.median), 3 * n * size / t.median / 1e9) for n, t in sweep]
    return table(rows, ["elements", "time per add", "GB/s"])


def chain_table(results: list[ChainVsFused]) -> str:
    rows = [(r.numel, r.chain_ops, format_seconds(r.chain.median), r.fused_ops,
             format_seconds(r.fused.median), r.speedup) for r in results]
    return table(rows, ["elements", "chain ops", "chain time", "fused ops", "fused time", "speedup ×"])


def plot_launch(sweep: list[tuple[int, Timing]], ax=None):
    """Time per op against element count, log-log, with the floor marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    ns = [n for n, _ in sweep]
    ts = [t.median for _, t in sweep]
    ax.loglog(ns, ts, "o-", label="torch.add")
    ax.axhline(launch_floor(sweep), color="grey", ls=":", label=f"floor {format_seconds(launch_floor(sweep))}")
    ax.set_xlabel("elements")
    ax.set_ylabel("seconds per op")
    ax.set_title("Launch overhead: time is flat until bytes matter")
    ax.legend()
    return ax
