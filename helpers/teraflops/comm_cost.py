"""What a collective costs on a link: the model Units 2 and 5 both stand on.

Unit 5 measures collectives and fits this model (:mod:`teraflops.hardware.collectives`,
:mod:`teraflops.hardware.alpha_beta`); Unit 2 prices tensor parallelism with it before Unit 5 has
been taught (:mod:`teraflops.parallelization.tensor_parallel`). It lives in the shared base so that a
lecture imports only the base and earlier lectures:

* nccl-tests' bus factors (:data:`BUS_FACTOR`, :func:`bus_factor`; ``doc/PERFORMANCE.md``,
  https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md) and the input checks every
  collective formula shares (one-line :class:`CollectiveInputError`);
* the ring all-reduce time ``2(n−1)/n · S/B + 2(n−1)·α`` (:func:`ring_allreduce_seconds`;
  P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
  J. Parallel Distrib. Comput. 69(2), 2009);
* the fabrics the emulated nodes reproduce, scaled to what one machine carries (:data:`FABRICS`,
  :data:`SCALE`, :func:`scaled_rate`; the published rates are :mod:`teraflops.datasheets`').

Units: sizes in bytes, times in seconds, bandwidths in bytes/s per direction.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from teraflops.datasheets import ETHERNET_25G, PUBLISHED_LINKS, PublishedLink
from teraflops.errors import CourseError


class CollectiveInputError(CourseError, ValueError):
    """A bad argument to this module: an unknown collective, a size or rank count out of range."""


# nccl-tests doc/PERFORMANCE.md, "Summary": busbw = algbw × factor(n)
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}


def check_collective(collective: str) -> None:
    """Raise :class:`CollectiveInputError` (one line) unless ``collective`` is one of :data:`BUS_FACTOR`'s."""
    if collective not in BUS_FACTOR:
        raise CollectiveInputError(f"unknown collective {collective!r}. Hint: choose one of {', '.join(BUS_FACTOR)} "
                                   "(snake_case, as torch.distributed names them)")


def check_ranks(n) -> None:
    """Raise :class:`CollectiveInputError` (one line) unless ``n`` is an integer number of ranks >= 2."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise CollectiveInputError(f"n must be an integer number of ranks >= 2, got {n!r}. "
                                   "Hint: with one rank there is nothing to communicate")


def check_positive(name: str, values) -> np.ndarray:
    """``values`` (a number or a sequence) as a float64 array, every element finite and > 0; else
    :class:`CollectiveInputError` naming ``name`` (bytes, seconds and bytes/s are the units)."""
    flat = values if isinstance(values, (list, tuple, np.ndarray)) else [values]
    if any(isinstance(v, (bool, np.bool_, str, bytes)) for v in np.asarray(flat, dtype=object).reshape(-1)):
        raise CollectiveInputError(f"{name} must be numbers, got {values!r}. "
                                   "Hint: sizes are in bytes, times in seconds, bandwidths in bytes/s")
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise CollectiveInputError(f"{name} must be numbers, got {values!r}. "
                                   "Hint: sizes are in bytes, times in seconds, bandwidths in bytes/s") from None
    if arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise CollectiveInputError(f"{name} must be finite numbers > 0, got {values!r}. "
                                   "Hint: sizes are in bytes, times in seconds, bandwidths in bytes/s")
    return arr


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw for ``collective`` on ``n`` ranks (nccl-tests doc/PERFORMANCE.md, "Summary").

    Raises:
        CollectiveInputError: unknown collective, or ``n`` not an integer >= 2.
    """
    check_collective(collective)
    check_ranks(n)
    return BUS_FACTOR[collective](int(n))



def ring_allreduce_seconds(size_bytes, n: int, bandwidth: float, alpha: float = 0.0):
    """Time (s) of a ring all-reduce: ``2(n−1)/n · S/B + 2(n−1)·α`` (Patarasuk & Yuan 2009; NCCL's busbw
    of all-reduce, nccl-tests doc/PERFORMANCE.md, is the ``B`` of this formula).

    Args:
        size_bytes: bytes all-reduced on every rank (> 0). n: ranks (>= 2). bandwidth: bytes/s per
            direction of each rank's link (> 0). alpha: latency of one of the ``2(n−1)`` steps (s, >= 0).

    Raises:
        CollectiveInputError: a value out of range.
    """
    check_ranks(n)
    s = check_positive("size_bytes", size_bytes)
    check_positive("bandwidth", bandwidth)
    if isinstance(alpha, (bool, np.bool_)) or not (isinstance(alpha, numbers.Real) and 0 <= alpha < math.inf):
        raise CollectiveInputError(f"alpha must be a latency >= 0 in seconds, got {alpha!r}. "
                                   "Hint: alpha=0 gives the bandwidth-only ceiling")
    out = 2 * (n - 1) / n * s / bandwidth + 2 * (n - 1) * alpha
    return float(out) if out.ndim == 0 else out


SCALE = 1e-3  # an emulated link runs at the published rate × SCALE: GB/s become MB/s
FABRICS: tuple[PublishedLink, ...] = (PUBLISHED_LINKS[3], PUBLISHED_LINKS[1], ETHERNET_25G)  # IB NDR, PCIe Gen4, 25GbE


def scaled_rate(link: PublishedLink, scale: float = SCALE) -> float:
    """The emulated link's rate for a published one, bytes/s (per direction)."""
    return link.bandwidth * scale
