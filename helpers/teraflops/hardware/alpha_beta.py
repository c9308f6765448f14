"""Unit 5 §1: the alpha-beta model of a message, fitted to a collective's measured times.

The alpha-beta (Hockney) model of a message, ``T(S) = α + S / B``: a fixed latency ``α`` (s) plus
the size over a bandwidth ``B`` (bytes/s; ``β = 1/B`` s per byte) (R. Hockney, "The communication
challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3), 1994; nccl-tests' doc
models a collective's time the same way, a fixed overhead plus size over bandwidth).
:func:`fit_alpha_beta` fits it to the times :func:`teraflops.hardware.collectives.sweep` measures; the
achieved bandwidth ``S / T(S) = B · S / (S + αB)`` reaches a fraction ``f`` of ``B`` at
``S = f / (1 − f) · α · B`` (:func:`saturation_size`). A ring all-reduce of ``S`` bytes on ``n`` ranks takes ``2(n−1)`` steps, each sending ``S/n`` bytes over every link:
``T = 2(n−1)·α + 2(n−1)/n · S/B`` (P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", J. Parallel Distrib. Comput. 69(2), 2009), the time
whose ``B`` is what busbw measures (:func:`ring_allreduce_seconds`).

Sizes, times and bandwidths as in :mod:`teraflops.hardware.collectives` (nccl-tests' ``S``, bytes; seconds;
bytes/s, GB = 1e9 bytes). :func:`plot_sweep` draws a sweep's busbw, the fit's curve and the
published links (:mod:`teraflops.datasheets`) on one figure.

What to expect on the 2-core CPU machine with 4 gloo ranks: the all-reduce fit gives α ≈ 5–6 ms,
algbw B ≈ 0.35–0.45 GB/s (busbw 0.55–0.65 GB/s), R² ≈ 0.99, 80% of B from ~8 MiB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The ring's time lives in the shared base (Unit 2 prices tensor parallelism with it); Unit 5 teaches it here.
from teraflops.comm_cost import ring_allreduce_seconds as ring_allreduce_seconds
from teraflops.hardware.collectives import CollectiveInputError, bus_factor, check_collective, check_positive
from teraflops.datasheets import PUBLISHED_LINKS
from teraflops.tables import GB, fmt_bytes, fmt_seconds


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
        s = check_positive("size_bytes", size_bytes)
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
    s, t = check_positive("sizes", sizes), check_positive("seconds", seconds)
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
    check_collective(collective)
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


# ---- showing it --------------------------------------------------------------------------------------


def plot_sweep(rows: list[dict], fit: AlphaBeta | None = None, links=PUBLISHED_LINKS, ax=None):
    """busbw (GB/s) against message size (bytes), both axes logarithmic: the measured points per
    collective; with ``fit``, its busbw curve ``factor · S / (α + S/B)`` and the 80% saturation size;
    the published link ceilings (per direction) as horizontal lines, labelled. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(8, 6))  # tall: link labels 2x apart
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
                    ha="right" if sat is not None else "left", va="center", fontsize="small", color="gray")
    ax.set(xscale="log", yscale="log", xlabel="message size S (bytes)", ylabel="busbw (GB/s, per direction)",
           title="Collective bandwidth on this machine against published links")
    ax.legend(fontsize="small", loc="lower right")
    _label_links(ax, links)
    return fig


def _label_links(ax, links) -> None:
    """A red line per link, labelled at the first spot (right edge, left edge, middle; above its line, then
    below) where its label overlaps no label placed before it: links close in bandwidth (PCIe Gen5 63, NDR
    50, Gen4 31.5 GB/s) get different spots at any figure scale. The top link's label sits below its line."""
    ordered = sorted(links, key=lambda link: link.bandwidth)
    for link in ordered:
        ax.axhline(link.bandwidth / GB, color="tab:red", lw=0.8, alpha=0.6)
    ax.set_ylim(ax.get_ylim())  # fixed now: a later autoscale would move the labels placed below
    ax.figure.tight_layout()
    renderer = ax.figure.canvas.get_renderer()
    placed = [t.get_window_extent(renderer) for t in ax.texts]
    for i, link in enumerate(ordered):
        above = "top" if i == len(ordered) - 1 else "bottom"  # above, the top link's label would leave the frame
        spots = [(x, ha, va) for va in (above, "top") for x, ha in ((0.99, "right"), (0.01, "left"), (0.5, "center"))]
        for x, ha, va in spots:
            t = ax.annotate(f"{link.name}: {link.bandwidth / GB:.3g} GB/s", (x, link.bandwidth / GB),
                            xycoords=("axes fraction", "data"), fontsize="small", color="tab:red", ha=ha, va=va)
            box = t.get_window_extent(renderer)
            if not any(box.overlaps(b) for b in placed):
                break
            if (x, ha, va) != spots[-1]:
                t.remove()
        placed.append(box)
