"""Unit 5 §1: the bandwidth of collectives, measured as nccl-tests measures it, modelled, and compared.

**Definitions** (NVIDIA nccl-tests, ``doc/PERFORMANCE.md``,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), so that a learner who later
runs ``all_reduce_perf`` reads the same columns:

* ``S`` is the size in bytes of the *whole* buffer: for all-reduce the buffer every rank reduces;
  for all-gather and reduce-scatter the full gathered (or scattered) buffer, ``n`` × the per-rank
  chunk (NCCL's ``sendcount`` / ``recvcount`` are per rank).
* **algbw** = ``S / t``: divide a size by it to get a time.
* **busbw** = ``algbw × factor``, the factor (:data:`BUS_FACTOR`) chosen so that busbw can be compared
  with the bandwidth of one rank's link whatever the number of ranks ``n``: all-reduce
  ``2(n−1)/n`` (each element needs ``n − 1`` additions and ``n`` assignments, ``2(n−1)`` transfers
  spread over ``n`` links); reduce-scatter and all-gather ``(n−1)/n`` (one half of that);
  broadcast and reduce ``1`` (all data passes the root's link); all-to-all ``(n−1)/n``.

**Timing** (nccl-tests ``src/common.cu``, ``BenchTime``): warm-up calls, a barrier, ``iters`` calls
back to back timed as one span, the span / ``iters`` averaged over ranks; then one call on known data
whose wrong elements are counted (``#wrong``). Two deviations, both for a 2-core CPU machine: the
number of timed calls falls with the size (``volume / size``, within [min, max] iterations; nccl-tests
uses a fixed ``-n 20``), and one form per collective is timed (all-reduce in place, torch's only form;
all-gather and reduce-scatter out of place), where nccl-tests times both.

**Model**: the alpha-beta (Hockney) model of a message, ``T(S) = α + S / B``: a fixed latency
``α`` (s) plus the size over a bandwidth ``B`` (bytes/s; ``β = 1/B`` s per byte) (R. Hockney,
"The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3),
1994; nccl-tests' doc models a collective's time the same way, a fixed overhead plus size over
bandwidth). :func:`fit_alpha_beta` fits it to
measured times; the achieved bandwidth ``S / T(S) = B · S / (S + αB)`` reaches a fraction ``f`` of
``B`` at ``S = f / (1 − f) · α · B`` (:func:`saturation_size`). A ring all-reduce of ``S`` bytes on
``n`` ranks takes ``2(n−1)`` steps, each sending ``S/n`` bytes over every link:
``T = 2(n−1)·α + 2(n−1)/n · S/B`` (P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", J. Parallel Distrib. Comput. 69(2), 2009), the time
whose ``B`` is what busbw measures (:func:`ring_allreduce_seconds`).

Units: sizes in bytes, times in seconds (µs in tables), bandwidths in bytes/s (GB/s in tables,
GB = 1e9 bytes; Gb/s = 1e9 bits/s); message sizes in prose and on plots are binary, KiB = 1024 B and
MiB = 2**20 B, as nccl-tests' ``-b 1K -e 64M`` counts them.

What to expect on the 2-core CPU machine with 4 gloo ranks (they share the cores and talk over
loopback TCP): the sweep of three collectives over 1 KiB – 64 MiB takes ~35 s, the launch included;
a message of up to ~1 MiB costs the same 5–8 ms (on 2 ranks ~2 ms: roughly 1 ms per ring step, and a
ring all-reduce takes 2(n−1) steps); the all-reduce fit gives α ≈ 5–6 ms, algbw B ≈ 0.35–0.45 GB/s
(busbw 0.55–0.65 GB/s), R² ≈ 0.99, 80% of B from ~8 MiB; peak busbw ~0.6–0.7 GB/s (all-reduce),
~0.4–0.6 (all-gather), ~0.2 (reduce-scatter): some 700× below NVLink 4's 450 GB/s per direction.
"""

from __future__ import annotations

import math
import numbers
import time
import warnings
from dataclasses import dataclass

import numpy as np

from .errors import CourseError
from .tables import GB, fmt, fmt_bytes, fmt_seconds, table

WORKER = "teraflops.workers.collective_sweep"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what sweep() measures


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


def _check_collective(collective: str) -> None:
    if collective not in BUS_FACTOR:
        raise CollectiveInputError(f"unknown collective {collective!r}. Hint: choose one of {', '.join(BUS_FACTOR)} "
                                   "(snake_case, as torch.distributed names them)")


def _check_ranks(n) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise CollectiveInputError(f"n must be an integer number of ranks >= 2, got {n!r}. "
                                   "Hint: with one rank there is nothing to communicate")


def _check_positive(name: str, values) -> np.ndarray:
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
    _check_collective(collective)
    _check_ranks(n)
    return BUS_FACTOR[collective](int(n))


def algbw(size_bytes, seconds):
    """Algorithm bandwidth ``S / t`` in bytes/s (``S``: bytes of the whole buffer, see the module doc).

    Works on scalars and arrays. Raises:
        CollectiveInputError: a size or time that is not > 0.
    """
    s, t = _check_positive("size_bytes", size_bytes), _check_positive("seconds", seconds)
    out = s / t
    return float(out) if out.ndim == 0 else out


def busbw(size_bytes, seconds, collective: str, n: int):
    """Bus bandwidth ``algbw × bus_factor(collective, n)`` in bytes/s (nccl-tests doc/PERFORMANCE.md).

    Raises:
        CollectiveInputError: unknown collective, ``n < 2``, a size or time not > 0.
    """
    return algbw(size_bytes, seconds) * bus_factor(collective, n)


# ---- published link ceilings -----------------------------------------------------------------------


@dataclass(frozen=True)
class PublishedLink:
    """A link's datasheet bandwidth. ``bandwidth``: bytes/s **per direction** (what busbw is compared
    with: a ring sends and receives at once); ``note``: how the number follows from the source."""

    name: str
    bandwidth: float
    quoted: str  # the figure as the source prints it
    note: str
    source: str


PUBLISHED_LINKS: tuple[PublishedLink, ...] = (
    PublishedLink("NVLink 4 (H100 SXM)", 450e9, "900 GB/s",
                  "900 GB/s total per GPU = 18 links × 50 GB/s, counting both directions: 450 GB/s per direction "
                  "(data rate; NVSwitch connects all 8 GPUs of an HGX H100 at this rate)",
                  "NVIDIA H100 Tensor Core GPU datasheet (2023), https://resources.nvidia.com/en-us-tensor-core/"
                  "nvidia-tensor-core-gpu-datasheet; NVLink page, https://www.nvidia.com/en-us/data-center/nvlink/"),
    PublishedLink("PCIe Gen4 x16", 16 * 16e9 * 128 / 130 / 8, "16 GT/s per lane",
                  "16 lanes × 16 GT/s with 128b/130b encoding = 31.5 GB/s per direction (datasheets print "
                  "64 GB/s: both directions, before encoding); transaction-layer packet headers take a further share",
                  "PCI-SIG, PCI Express Base Specification Revision 4.0 (2017), https://pcisig.com/specifications"),
    PublishedLink("PCIe Gen5 x16", 16 * 32e9 * 128 / 130 / 8, "32 GT/s per lane",
                  "16 lanes × 32 GT/s with 128b/130b encoding = 63.0 GB/s per direction (the H100 datasheet's "
                  "128 GB/s: both directions, before encoding)",
                  "PCI-SIG, PCI Express Base Specification Revision 5.0 (2019), https://pcisig.com/specifications"),
    PublishedLink("InfiniBand NDR (400 Gb/s)", 400e9 / 8, "400 Gb/s",
                  "one 4x NDR port: 400 Gb/s of data per direction (4 lanes × 100 Gb/s; the line rate with FEC "
                  "is higher) = 50 GB/s; a DGX H100 has one such port per GPU",
                  "NVIDIA DGX SuperPOD data-center design guide (cabling), \"NDR Overview\", https://docs.nvidia.com/"
                  "dgx-superpod/design-guide-cabling-data-centers/latest/ndr-overview.html; InfiniBand Trade "
                  "Association roadmap, https://www.infinibandta.org/infiniband-roadmap/"),
)


def cross_node_link(nics_per_node: int = 8, nic: PublishedLink = PUBLISHED_LINKS[3],
                    intra: PublishedLink = PUBLISHED_LINKS[0]) -> PublishedLink:
    """The per-rank bandwidth of a ring all-reduce that crosses nodes with ``nics_per_node`` network
    ports per node: ``min(nics_per_node × nic, intra)``, as a :class:`PublishedLink` for
    :func:`gradient_sync_rows`.

    NCCL builds one ring (channel) per port; each ring carries its share of the buffer and enters and
    leaves every node once, through its own port, while the hops inside a node use NVLink. So a node's
    ports add up, until the intra-node links become the limit (NVIDIA/nccl issue #412, the maintainer's
    answer: more NICs next to the GPUs give more inter-node bandwidth, "up to" the NVLink intra-node
    bandwidth; issue #569 measures it on DGX-2 nodes). ``nics_per_node = 1`` is a node whose GPUs share
    one port, the bare ``nic`` row of :data:`PUBLISHED_LINKS`; a DGX H100 has 8 NDR ports, one per GPU.

    Raises:
        CollectiveInputError: ``nics_per_node`` not an integer >= 1.
    """
    if isinstance(nics_per_node, bool) or not isinstance(nics_per_node, (int, np.integer)) or nics_per_node < 1:
        raise CollectiveInputError(f"nics_per_node must be an integer >= 1, got {nics_per_node!r}. "
                                   "Hint: a DGX H100 has 8 InfiniBand NDR ports, one per GPU")
    bandwidth = min(int(nics_per_node) * nic.bandwidth, intra.bandwidth)
    return PublishedLink(f"{nics_per_node} × {nic.name.split(' (')[0]} per node", bandwidth,
                         f"{nics_per_node} × {nic.quoted}",
                         f"a ring across nodes: one NCCL ring per port, {nics_per_node} × {nic.bandwidth / GB:g} GB/s "
                         f"= {nics_per_node * nic.bandwidth / GB:g} GB/s per direction, at most {intra.name}'s "
                         f"{intra.bandwidth / GB:g} GB/s",
                         f"{nic.source}; NVIDIA/nccl issue #412, https://github.com/NVIDIA/nccl/issues/412")


def links_table(links=PUBLISHED_LINKS) -> str:
    """The published links: GB/s per direction, the figure as printed and its source; then, numbered,
    how the one follows from the other."""
    body = table([(f"[{i}] {l.name}", l.bandwidth / GB, l.quoted, l.source.split(", http")[0])
                  for i, l in enumerate(links, 1)], ["link", "GB/s per direction", "as published", "source"])
    return body + "\n" + "\n".join(f"[{i}] {l.note}" for i, l in enumerate(links, 1))


# ---- the alpha-beta model ------------------------------------------------------------------------


@dataclass(frozen=True)
class AlphaBeta:
    """A fit of ``T(S) = alpha + S / bandwidth`` to measured times.

    Attributes:
        alpha: latency (s). bandwidth: the asymptotic bandwidth ``B = 1/β`` (bytes/s); fitted to the
            times of a collective with ``S`` as nccl-tests counts it, it is the **algbw** asymptote.
        r2: coefficient of determination of the predicted times (seconds, unweighted): ``1 − Σ(T −
            T̂)² / Σ(T − mean T)²`` over the fitted points. max_rel_error: the largest ``|T̂ − T| / T``.
        collective, ranks: what was measured, when known (``busbw`` and ``gradient_sync_table`` use them).
        sizes: the fitted sizes (bytes).
    """

    alpha: float
    bandwidth: float
    r2: float
    max_rel_error: float
    collective: str | None = None
    ranks: int | None = None
    sizes: tuple = ()

    @property
    def beta(self) -> float:
        """Seconds per byte, ``1 / bandwidth``."""
        return 1.0 / self.bandwidth

    @property
    def bus_bandwidth(self) -> float | None:
        """The busbw asymptote, ``bandwidth × bus_factor`` (bytes/s), when collective and ranks are known."""
        return None if self.collective is None or self.ranks is None else \
            self.bandwidth * bus_factor(self.collective, self.ranks)

    def predict(self, size_bytes):
        """Predicted time (s) of a ``size_bytes`` message: ``alpha + size / bandwidth``."""
        s = _check_positive("size_bytes", size_bytes)
        out = self.alpha + s / self.bandwidth
        return float(out) if out.ndim == 0 else out

    def __str__(self) -> str:
        what = f"{self.collective}, {self.ranks} ranks: " if self.collective else ""
        bus = f" (busbw {self.bus_bandwidth / GB:.3g} GB/s)" if self.bus_bandwidth else ""
        return (f"{what}T = α + S/B with α = {fmt_seconds(self.alpha)}, B = {self.bandwidth / GB:.3g} GB/s{bus}; "
                f"R² = {self.r2:.4f}, worst relative error {self.max_rel_error:.0%}; "
                f"80% of B from {saturation_text(self)}")


def fit_alpha_beta(sizes, seconds, *, weighting: str = "ordinary", collective: str | None = None,
                   ranks: int | None = None) -> AlphaBeta:
    """Fit ``T = α + S/B`` to measured ``(size, time)`` points by (weighted) least squares.

    ``weighting="ordinary"`` (default) minimises the squared errors in seconds, ``Σ (α + βS − T)²``:
    it is the fit with the highest R² of the times (least squares maximises R² for a model linear in
    its parameters), and it fits the large messages, where the bandwidth is decided, best.
    ``weighting="relative"`` minimises ``Σ ((α + βS − T) / T)²``, so every size counts alike and α is
    set by the small messages, but a real link's bandwidth is not one number (on the CPU machine
    gloo's all-reduce busbw falls from 0.68 GB/s at 16 MiB to 0.60 GB/s at 64 MiB as the buffers
    outgrow the caches), and a B that suits the middle sizes mispredicts the largest ones: on the
    measured all-reduce sweep it gave R² = 0.944 where the ordinary fit gave 0.992. Ordinary it is;
    the relative fit is there to compare α. ``r2`` is in both cases the plain R² of the times. α is
    kept >= 0 (if the free fit makes it negative, α = 0 and B alone is fitted). Times that are all
    equal (R² undefined) or fall with size (``β <= 0``) raise rather than give an absurd fit.

    Args:
        sizes: message sizes (bytes, > 0), at least 2 distinct. seconds: their times (s, > 0).
        collective, ranks: recorded in the result (for busbw and predictions), not used in the fit.

    Raises:
        CollectiveInputError: mismatched lengths, fewer than 2 distinct sizes, values not > 0, an
            unknown weighting, or times that do not grow with size (fitted ``β = 1/B <= 0``).
    """
    s, t = _check_positive("sizes", sizes), _check_positive("seconds", seconds)
    if s.shape != t.shape or s.ndim != 1 or len(np.unique(s)) < 2:
        raise CollectiveInputError(f"need sizes and seconds of the same length with >= 2 distinct sizes, got "
                                   f"{s.shape} and {t.shape}. Hint: pass one time per size, e.g. from a sweep's rows")
    if weighting not in ("ordinary", "relative"):
        raise CollectiveInputError(f"weighting must be 'ordinary' or 'relative', got {weighting!r}. "
                                   "Hint: 'ordinary' fits the large messages best, 'relative' every size alike")
    if np.ptp(t) == 0:
        raise CollectiveInputError(f"all {t.size} times are equal ({t[0]:.3g} s): times do not grow with size and R² "
                                   "is undefined. Hint: sweep larger sizes")
    w = 1.0 / t if weighting == "relative" else np.ones_like(t)  # row weights: residual × w
    a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if beta <= 0:
        raise CollectiveInputError(f"times do not grow with size (fitted 1/B = {float(beta):.3g} s/byte <= 0). "
                                   "Hint: sweep larger sizes, where the bandwidth term outweighs the latency")
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(w * w * s * t) / np.sum(w * w * s * s))
    pred = alpha + beta * s
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((t - pred) ** 2)) / ss_tot if ss_tot > 0 else math.nan  # equal times: R² undefined
    return AlphaBeta(float(alpha), 1.0 / float(beta), r2, float(np.max(np.abs(pred - t) / t)), collective,
                     ranks, tuple(float(x) for x in s))


def fit_rows(rows: list[dict], collective: str = "all_reduce", **kwargs) -> AlphaBeta:
    """:func:`fit_alpha_beta` on the sweep rows of one collective (sizes in bytes, times in s).

    Raises:
        CollectiveInputError: no rows of that collective (or fewer than 2 sizes).
    """
    _check_collective(collective)
    mine = [r for r in rows if r["collective"] == collective]
    if len(mine) < 2:
        raise CollectiveInputError(f"the rows hold {len(mine)} sizes of {collective!r}. "
                                   f"Hint: sweep it over at least two sizes (collectives=({collective!r},))")
    return fit_alpha_beta([r["size"] for r in mine], [r["seconds"] for r in mine], collective=collective,
                          ranks=mine[0].get("ranks"), **kwargs)


def saturation_size(fit: AlphaBeta, fraction: float = 0.8) -> float | None:
    """The size (bytes) at which the fitted achieved bandwidth ``S / T(S)`` reaches ``fraction`` of B:
    ``S = fraction / (1 − fraction) · α · B`` (from ``S / (α + S/B) = fraction · B``).

    ``None`` when the fit has ``α = 0`` (:func:`fit_alpha_beta` clamps a negative α to 0): the
    latency is too small for the sizes measured to resolve, so the fraction is reached somewhere
    below the smallest size measured, not at 0 bytes (:func:`saturation_text` says so in words).

    Raises:
        CollectiveInputError: ``fraction`` not strictly between 0 and 1.
    """
    if not 0 < fraction < 1:
        raise CollectiveInputError(f"fraction must be between 0 and 1 (exclusive), got {fraction!r}. "
                                   "Hint: 0.8 asks where 80% of the bandwidth is reached; B itself is never reached")
    if fit.alpha <= 0:
        return None
    return fraction / (1 - fraction) * fit.alpha * fit.bandwidth


def saturation_text(fit: AlphaBeta, fraction: float = 0.8) -> str:
    """:func:`saturation_size` in words: ``"4 MiB"``, or, when α = 0, ``"below 1 KiB, the smallest
    size measured (α fitted as 0)"``."""
    size = saturation_size(fit, fraction)
    if size is not None:
        return fmt_bytes(size)
    smallest = f"below {fmt_bytes(min(fit.sizes))}, the smallest size measured" if fit.sizes else \
        "below the smallest size measured"
    return f"{smallest} (α fitted as 0)"


# ---- predictions ----------------------------------------------------------------------------------


def ring_allreduce_seconds(size_bytes, n: int, bandwidth: float, alpha: float = 0.0):
    """Time (s) of a ring all-reduce: ``2(n−1)/n · S/B + 2(n−1)·α`` (Patarasuk & Yuan 2009; NCCL's busbw
    of all-reduce, nccl-tests doc/PERFORMANCE.md, is the ``B`` of this formula).

    Args:
        size_bytes: bytes all-reduced on every rank (> 0). n: ranks (>= 2). bandwidth: bytes/s per
            direction of each rank's link (> 0). alpha: latency of one of the ``2(n−1)`` steps (s, >= 0).

    Raises:
        CollectiveInputError: a value out of range.
    """
    _check_ranks(n)
    s = _check_positive("size_bytes", size_bytes)
    _check_positive("bandwidth", bandwidth)
    if isinstance(alpha, (bool, np.bool_)) or not (isinstance(alpha, numbers.Real) and 0 <= alpha < math.inf):
        raise CollectiveInputError(f"alpha must be a latency >= 0 in seconds, got {alpha!r}. "
                                   "Hint: alpha=0 gives the bandwidth-only ceiling")
    out = 2 * (n - 1) / n * s / bandwidth + 2 * (n - 1) * alpha
    return float(out) if out.ndim == 0 else out


def _h100_peak() -> float:
    """Dense bf16 FLOP/s of an H100 SXM (989.5 TFLOP/s, :func:`teraflops.ceilings.published_peak`)."""
    from .ceilings import published_peak

    return published_peak()[0]


def _check_fraction(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating)) or not 0 < x <= 1:
        raise CollectiveInputError(f"{name} must be a fraction in (0, 1], got {x!r}. "
                                   "Hint: MFU 0.4 means 40% of the peak FLOP/s goes into the model's math")
    return float(x)


def gradient_sync_rows(params=(1e9, 7e9, 13e9, 70e9), n: int = 8, bytes_per_grad: float = 2,
                       links=PUBLISHED_LINKS, fit: AlphaBeta | None = None, *, tokens_per_gpu: float | None = None,
                       peak_flops: float | None = None, mfu: float = 0.4) -> list[dict]:
    """Predicted ring all-reduce time (s) of one step's gradients, per model size and link, and the
    share of the step it takes.

    Each row: ``params``, ``bytes`` (``params × bytes_per_grad``: 2 for bf16 gradients) and, per link,
    :func:`ring_allreduce_seconds` at the link's per-direction bandwidth with α = 0 (a ceiling: the
    best any implementation can do). The link is the ring's slowest hop for every rank: NVLink 4 only
    while all ``n`` GPUs share one NVLink domain (8 in an HGX H100); the bare InfiniBand row is a ring
    whose nodes each have one port; for nodes with several ports use :func:`cross_node_link`. With ``fit`` (an all-reduce fit from :func:`fit_rows`, measured
    on ``fit.ranks`` ranks) a ``"measured"`` column: the ring formula with ``B`` = the fit's busbw
    asymptote and ``α`` = fitted latency / ``2(fit.ranks − 1)`` per step, scaled to ``n`` ranks.

    With ``tokens_per_gpu`` (tokens each GPU processes per optimizer step: micro-batch × sequence
    length × accumulation steps) also ``compute``, the step's math time ``6 · params · tokens_per_gpu /
    (peak_flops · mfu)`` (:func:`train_flops`; ``peak_flops`` default the H100 SXM's dense bf16
    989.5 TFLOP/s, the datasheet in :data:`teraflops.ceilings.PUBLISHED`), and per column
    ``"<name> fraction"``: :func:`comm_fraction` with no overlap.

    Raises:
        CollectiveInputError: ``n < 2``, parameters, bytes, tokens or peak not > 0, ``mfu`` not in
            (0, 1], a fit of another collective or without its rank count.
    """
    _check_ranks(n)
    counts = np.atleast_1d(_check_positive("params", params))
    if np.ndim(bytes_per_grad) != 0:
        raise CollectiveInputError(f"bytes_per_grad must be one number, got {bytes_per_grad!r}. "
                                   "Hint: 2 for bf16 gradients, 4 for fp32")
    _check_positive("bytes_per_grad", bytes_per_grad)
    if fit is not None and (fit.collective != "all_reduce" or fit.ranks is None):
        raise CollectiveInputError("fit must be an all-reduce fit that knows its rank count. "
                                   "Hint: fit_rows(rows, 'all_reduce') on a sweep's rows")
    peak = _h100_peak() if peak_flops is None else float(_check_positive("peak_flops", peak_flops))
    _check_fraction("mfu", mfu)
    if tokens_per_gpu is not None:
        _check_positive("tokens_per_gpu", tokens_per_gpu)
    names = [link.name for link in links] + (["measured"] if fit is not None else [])
    rows = []
    for p in counts:
        size = float(p) * bytes_per_grad
        row = {"params": float(p), "bytes": size}
        for link in links:
            row[link.name] = ring_allreduce_seconds(size, n, link.bandwidth)
        if fit is not None:
            row["measured"] = ring_allreduce_seconds(size, n, fit.bus_bandwidth, fit.alpha / (2 * (fit.ranks - 1)))
        if tokens_per_gpu is not None:
            row["compute"] = train_flops(float(p), tokens_per_gpu) / (peak * mfu)
            for k in names:
                row[f"{k} fraction"] = comm_fraction(row[k], row["compute"])
        rows.append(row)
    return rows


def gradient_sync_table(params=(1e9, 7e9, 13e9, 70e9), n: int = 8, bytes_per_grad: float = 2,
                        links=PUBLISHED_LINKS, fit: AlphaBeta | None = None, **compute) -> str:
    """:func:`gradient_sync_rows` as a table: one row per model, seconds per link; with
    ``tokens_per_gpu`` (and ``peak_flops``, ``mfu``) the compute time and each link's share of the step."""
    rows = gradient_sync_rows(params, n, bytes_per_grad, links, fit, **compute)
    names = [l.name for l in links] + (["measured"] if fit is not None else [])
    head = (f"# ring all-reduce of the gradients ({bytes_per_grad:g} bytes each) on n = {n} ranks: seconds per step "
            f"(links: α = 0, per-direction datasheet bandwidth"
            + (f"; measured: this machine's fit, busbw {fit.bus_bandwidth / GB:.3g} GB/s)" if fit else ")"))
    if "compute" in rows[0]:
        head += (f"\n# compute: 6·params·{compute['tokens_per_gpu']:g} tokens per GPU at MFU {compute.get('mfu', 0.4):g}"
                 " of the peak; (x%) = communication's share of the step with no overlap")
        cells = [[f"{r['params'] / 1e9:g}B", r["bytes"] / GB, r["compute"]]
                 + [f"{fmt(r[k])} ({r[k + ' fraction']:.0%})" for k in names] for r in rows]
        return head + "\n" + table(cells, ["model", "gradients (GB)", "compute (s)"] + [f"{k} (s)" for k in names])
    body = table([[f"{r['params'] / 1e9:g}B", r["bytes"] / GB] + [r[k] for k in names] for r in rows],
                 ["model", "gradients (GB)"] + [f"{k} (s)" for k in names])
    return head + "\n" + body


def comm_bound_tokens(n: int, bandwidth: float, bytes_per_grad: float = 2, peak_flops: float | None = None,
                      mfu: float = 0.4) -> float:
    """Tokens per GPU per step below which the gradient all-reduce takes longer than the math: the
    step is communication-bound. Setting the ring's ``2(n−1)/n · Ψ·b / B`` equal to ``6·Ψ·T /
    (peak · mfu)`` gives ``T* = 2(n−1)/n · b · peak · mfu / (6 · B)``: the model size ``Ψ`` cancels
    (both grow with it), so whether a job is communication-bound is decided by the tokens each GPU
    processes between syncs and the link, not by the model (α = 0; with latency small messages do
    worse). Sources as :func:`ring_allreduce_seconds` and :func:`train_flops`.

    Args:
        n: ranks (>= 2). bandwidth: bytes/s per direction of each rank's link. bytes_per_grad: 2 for
            bf16. peak_flops: FLOP/s (default H100 SXM dense bf16). mfu: achieved fraction of the peak.

    Raises:
        CollectiveInputError: a value out of range.
    """
    _check_ranks(n)
    b = float(_check_positive("bandwidth", bandwidth))
    per = float(_check_positive("bytes_per_grad", bytes_per_grad))
    peak = _h100_peak() if peak_flops is None else float(_check_positive("peak_flops", peak_flops))
    return 2 * (n - 1) / n * per * peak * _check_fraction("mfu", mfu) / (6 * b)


def plot_comm_fraction(n: int = 8, links=PUBLISHED_LINKS, fit: AlphaBeta | None = None, params: float = 7e9,
                       peak_flops: float | None = None, mfu: float = 0.4, ax=None):
    """Communication's share of a step (no overlap) against tokens per GPU per step, one line per
    link (and the measured fit, scaled to ``n`` ranks, if given) for a ``params`` model on ``n``
    ranks, with the communication-bound half drawn: where each line crosses 50% is
    :func:`comm_bound_tokens`. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    tokens = np.logspace(4, 22, 73, base=2)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4))
    for i, t in enumerate(tokens):
        rows = gradient_sync_rows((params,), n, 2, links, fit, tokens_per_gpu=float(t), peak_flops=peak_flops, mfu=mfu)
        if i == 0:
            names = [k for k in rows[0] if k.endswith(" fraction")]
            series = {k: [] for k in names}
        for k in names:
            series[k].append(rows[0][k])
    for k, ys in series.items():
        ax.plot(tokens, ys, label=k.removesuffix(" fraction"), lw=2.5 if k.startswith("measured") else 1.5)
    ax.axhspan(0.5, 1.0, color="0.92", zorder=0)
    ax.text(tokens[-1], 0.97, "communication-bound", ha="right", va="top", fontsize=8, color="0.35")
    ax.set(xscale="log", xlabel="tokens per GPU per optimizer step (micro-batch × sequence × accumulation)",
           ylabel="share of the step in all-reduce", ylim=(0, 1),
           title=f"gradient all-reduce vs math: {params / 1e9:g}B parameters, n = {n}, MFU {mfu:g} (no overlap)")
    ax.legend(fontsize=8)
    return ax


# ---- communication against compute -----------------------------------------------------------------


def train_flops(params, tokens):
    """FLOPs of one training step: ``6 · params · tokens`` (2 for the forward multiply-adds, 4 for the
    backward; Kaplan et al., "Scaling Laws for Neural Language Models", arXiv:2001.08361, §2.1, which
    leaves out the attention term, small while the context is short against 12 · d_model).

    Raises:
        CollectiveInputError: a count not > 0.
    """
    p, t = _check_positive("params", params), _check_positive("tokens", tokens)
    out = 6.0 * p * t
    return float(out) if out.ndim == 0 else out


def comm_fraction(sync_seconds, compute_seconds):
    """The share of a step spent in communication when none of it overlaps compute:
    ``sync / (compute + sync)`` (dimensionless, 0–1). Overlap (DDP's buckets) can only lower it.

    Raises:
        CollectiveInputError: a sync time < 0 or a compute time not > 0.
    """
    k = _check_positive("compute_seconds", compute_seconds)
    c = np.asarray(sync_seconds, dtype=np.float64) if not isinstance(sync_seconds, (bool, str)) else None
    if c is None or c.size == 0 or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise CollectiveInputError(f"sync_seconds must be finite times >= 0, got {sync_seconds!r}. "
                                   "Hint: seconds of one all-reduce of the gradients")
    out = 1.0 / (1.0 + k / c) if np.all(c > 0) else np.where(c > 0, c / (k + np.where(c > 0, c, 1.0)), 0.0)
    return float(out) if out.ndim == 0 else out


def accumulation_for_fraction(sync_seconds: float, micro_batch_seconds: float, target: float) -> int:
    """The fewest micro-batches ``k >= 1`` per all-reduce (gradient accumulation) for which the
    gradient sync takes at most ``target`` of the step: ``sync / (k · micro + sync) <= target``, i.e.
    ``k = max(1, ceil(sync · (1 − target) / (target · micro)))``. No overlap is assumed, so this is
    the safe side. Lab 5, exercise 4, writes it.

    Args:
        sync_seconds: one all-reduce of the gradients (s, > 0). micro_batch_seconds: forward + backward
            of one micro-batch (s, > 0). target: the largest acceptable communication fraction (0–1).

    Raises:
        CollectiveInputError: a time not > 0 or ``target`` not strictly between 0 and 1.
    """
    sync = float(_check_positive("sync_seconds", sync_seconds))
    micro = float(_check_positive("micro_batch_seconds", micro_batch_seconds))
    if isinstance(target, bool) or not isinstance(target, (int, float, np.floating)) or not 0 < target < 1:
        raise CollectiveInputError(f"target must be a fraction strictly between 0 and 1, got {target!r}. "
                                   "Hint: 0.1 asks that communication take at most 10% of the step")
    x = sync * (1 - target) / (target * micro)
    if not math.isfinite(x):
        raise CollectiveInputError(f"sync {sync!r} s over micro-batch {micro!r} s is out of range. "
                                   "Hint: both in seconds, of the same order of magnitude as a real step")
    k = max(1, math.ceil(x))
    while k > 1 and sync / ((k - 1) * micro + sync) <= target:  # x rounded up past an exact integer
        k -= 1
    while sync / (k * micro + sync) > target:  # x rounded down below the true k
        k += 1
    return k


# ---- the measurement -------------------------------------------------------------------------------


def default_sizes(p=None, ranks: int | None = None) -> list[int]:
    """Powers of two from the preset's ``collective_min_bytes`` to ``collective_max_bytes`` (bytes); on
    a CPU, capped so that every rank's buffers (~3× the size) fit in a quarter of the available memory."""
    from .sizing import preset

    p = p or preset()
    top = p.collective_max_bytes
    if p.device == "cpu":
        import psutil

        top = min(top, psutil.virtual_memory().available // (4 * 3 * (p.collective_ranks_cpu if ranks is None else ranks)))
    sizes, s = [], p.collective_min_bytes
    while s <= top:
        sizes.append(s)
        s *= 2
    return sizes


def sweep(collectives=COLLECTIVES, sizes=None, ranks: int | None = None, iters: int | None = None, *,
          warmup: int | None = None, min_iters: int | None = None, volume_bytes: int | None = None,
          timeout: float = 300, verbose: bool = False, cluster=None) -> list[dict]:
    """Measure ``collectives`` over message ``sizes`` on real ranks, in one launch; rows for :func:`bandwidth_table`.

    With ``cluster`` (an emulated :class:`~teraflops.cluster.Cluster` that is up) the ranks are gloo
    CPU ranks spread evenly over its nodes (default one per node), so the collective crosses the
    shaped links.

    Ranks: one per GPU with NCCL when there are at least 2 GPUs (``ranks``, if given, at most that
    many: asking for more raises), else ``ranks`` (default the preset's ``collective_ranks_cpu``) CPU ranks with gloo and one
    torch thread each, the GPU (if one) hidden. Each rank runs ``workers/collective_sweep.py``.

    Args:
        collectives: some of :data:`COLLECTIVES`. sizes: bytes of the whole buffer (nccl-tests'
            ``S``; default :func:`default_sizes`). iters: the most timed calls per size (default the
            preset's ``collective_iters``); ``min_iters``, ``volume_bytes`` (timed calls per size =
            volume / size, clamped), ``warmup``: the preset's ``collective_*`` by default.
        timeout: seconds for the whole launch.

    Returns:
        One dict per collective and size: ``collective``, ``size`` (bytes moved, after rounding each
        rank's chunk to 8 elements), ``count`` (float32 elements), ``type``, ``seconds`` (mean over
        iterations, averaged over ranks), ``seconds_max`` (the slowest rank's), ``algbw`` and
        ``busbw`` (bytes/s), ``wrong`` (elements, summed over ranks), ``iters``, ``warmup``,
        ``ranks``, ``backend``; and ``wall_s`` (the whole launch) in every row.

    Raises:
        CollectiveInputError: an unknown collective, a size that is not an integer >= 32·ranks bytes,
            ranks < 2 (or more ranks than GPUs on a machine with 2 or more), iteration counts < 1.

    Warns (``UserWarning``) naming the sizes the ranks skipped because they did not fit in GPU memory.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    from .distributed import launch
    from .machine import detect
    from .placement import place
    from .sizing import PRESETS, preset

    collectives = (collectives,) if isinstance(collectives, str) else tuple(collectives)
    for c in collectives or ("",):
        if c not in COLLECTIVES:
            raise CollectiveInputError(f"sweep measures some of {COLLECTIVES}, got {c!r}. "
                                       "Hint: pass a tuple such as ('all_reduce',)")
    if ranks is not None:
        _check_ranks(ranks)
    p, gpus = preset(), detect().gpu_count
    if cluster is not None and ranks is None:
        ranks = cluster.nodes
    if cluster is None and gpus >= 2 and ranks is not None and ranks > gpus:
        raise CollectiveInputError(f"ranks={ranks} but this machine has {gpus} GPUs (one NCCL rank per GPU). "
                                   f"Hint: ranks <= {gpus}, or ranks=None for one rank per GPU")
    cpu = p if p.device == "cpu" else PRESETS["cpu"]
    # emulated nodes shape TCP traffic: gloo CPU ranks there, so that the collective crosses the links
    where = place(None if ranks is None else int(ranks), cpu_ranks=cpu.collective_ranks_cpu, min_ranks=2, cluster=cluster,
                  gpus=cluster is None and p.device == "cuda")
    if not where.on_gpus:
        where = where.with_env(OMP_NUM_THREADS=1)  # one torch thread per gloo rank
    n = where.world_size
    _check_ranks(n)
    q = p if where.on_gpus else cpu
    sizes = default_sizes(q, n) if sizes is None else list(sizes)
    if not sizes or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 32 * n
                            for s in sizes):
        raise CollectiveInputError(f"sizes must be integers of at least 32·ranks = {32 * n} bytes, got {sizes!r}. "
                                   "Hint: each rank's chunk holds a multiple of 8 float32 elements")
    knobs = {"iters": q.collective_iters if iters is None else iters,
             "min_iters": q.collective_min_iters if min_iters is None else min_iters,
             "warmup": q.collective_warmup if warmup is None else warmup,
             "volume_bytes": q.collective_volume_bytes if volume_bytes is None else volume_bytes}
    for name, v in knobs.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise CollectiveInputError(f"{name} must be an integer >= 1, got {v!r}. "
                                       f"Hint: leave it None for the preset's {getattr(q, 'collective_' + name)}")
    knobs = {k: int(v) for k, v in knobs.items()}
    args = ["--collectives", ",".join(collectives), "--sizes", ",".join(str(int(s)) for s in sizes),
            "--iters", knobs["iters"], "--min-iters", min(knobs["min_iters"], knobs["iters"]),
            "--warmup", knobs["warmup"], "--volume-bytes", knobs["volume_bytes"]]
    start = time.perf_counter()
    results = launch(WORKER, where, args, timeout=timeout, verbose=verbose, cluster=cluster, desc=f"{', '.join(collectives)} on {n} ranks")
    wall = time.perf_counter() - start
    r0 = results[0]
    if r0.get("skipped"):
        warnings.warn(f"sweep skipped {len(r0['skipped'])} point(s) that did not fit in device memory: "
                      + ", ".join(f"{c} {fmt_bytes(size)}" for c, size in r0["skipped"]), stacklevel=2)
    rows = []
    for row in r0["rows"]:
        row = {**row, "ranks": r0["world_size"], "backend": r0["backend"], "wall_s": wall}
        row["algbw"] = algbw(row["size"], row["seconds"])
        row["busbw"] = busbw(row["size"], row["seconds"], row["collective"], row["ranks"])
        rows.append(row)
    return rows


# ---- showing it --------------------------------------------------------------------------------------


def bandwidth_table(rows: list[dict]) -> str:
    """nccl-tests' table, one block per collective: size (B), count (elements), type, time (µs),
    algbw and busbw (GB/s, GB = 1e9 bytes), #wrong; a footer with the average busbw over the sizes."""
    blocks = []
    for c in dict.fromkeys(r["collective"] for r in rows):
        mine = [r for r in rows if r["collective"] == c]
        head = (f"# {c}: {mine[0].get('ranks', '?')} ranks, {mine[0].get('backend', '?')}; time = mean of back-to-back "
                "calls, averaged over ranks (nccl-tests); size = the whole buffer")
        body = table([(r["size"], r["count"], r["type"], r["seconds"] * 1e6, r["algbw"] / GB, r["busbw"] / GB,
                       r["wrong"]) for r in mine],
                     ["size (B)", "count (elements)", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"])
        wrong = sum(r["wrong"] for r in mine)
        foot = (f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'WRONG'}\n"
                f"# Avg bus bandwidth    : {fmt(float(np.mean([r['busbw'] for r in mine])) / GB)} GB/s")
        blocks.append("\n".join([head, body, foot]))
    return "\n\n".join(blocks)


def plot_sweep(rows: list[dict], fit: AlphaBeta | None = None, links=PUBLISHED_LINKS, ax=None):
    """busbw (GB/s) against message size (bytes), both axes logarithmic: the measured points per
    collective; with ``fit``, its busbw curve ``factor · S / (α + S/B)`` and the 80% saturation size;
    the published link ceilings (per direction) as horizontal lines, labelled. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(8, 4.5))
    for c in dict.fromkeys(r["collective"] for r in rows):
        mine = [r for r in rows if r["collective"] == c]
        ax.plot([r["size"] for r in mine], [r["busbw"] / GB for r in mine], "o-", ms=4,
                label=f"{c} ({mine[0]['ranks']} ranks, {mine[0]['backend']})")
    if fit is not None and fit.bus_bandwidth:
        s = np.logspace(np.log10(min(fit.sizes)), np.log10(max(fit.sizes)), 200)
        factor = fit.bus_bandwidth / fit.bandwidth
        ax.plot(s, factor * s / fit.predict(s) / GB, "k--", lw=1,
                label=f"fit: α = {fmt_seconds(fit.alpha)}, busbw → {fit.bus_bandwidth / GB:.3g} GB/s")
        sat = saturation_size(fit)
        top = max(r["busbw"] for r in rows) / GB
        low = min((link.bandwidth / GB for link in links if link.bandwidth / GB > top), default=top * 10)
        if sat is not None:
            ax.axvline(sat, color="gray", ls=":", lw=1)
        # beside the dotted line (α = 0: at the smallest size, reached below it), in the empty band between
        # the highest measured point and the lowest published link (geometric middle on the log axis):
        # off the data, the links and the legend
        ax.annotate(f"80% of B at {saturation_text(fit)} " if sat is not None else f" 80% of B {saturation_text(fit)}",
                    (sat if sat is not None else min(fit.sizes), (top * low) ** 0.5),
                    ha="right" if sat is not None else "left", va="center", fontsize=8, color="gray")
    ordered = sorted(links, key=lambda link: link.bandwidth)  # PCIe Gen5 and NDR are 63 and 50 GB/s
    for i, link in enumerate(ordered):  # two right-aligned columns: neighbours in bandwidth never share one
        ax.axhline(link.bandwidth / GB, color="tab:red", lw=0.8, alpha=0.6)
        ax.annotate(f"{link.name}: {link.bandwidth / GB:.3g} GB/s", (0.99 if i % 2 == 0 else 0.6, link.bandwidth / GB),
                    xycoords=("axes fraction", "data"), fontsize=8, color="tab:red", ha="right", va="bottom")
    ax.set(xscale="log", yscale="log", xlabel="message size S (bytes)", ylabel="busbw (GB/s, per direction)",
           title="Collective bandwidth on this machine against published links")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
