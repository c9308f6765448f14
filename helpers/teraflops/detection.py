"""Find the straggler from per-rank timings, with a statistic one slow rank cannot hide from.

In synchronous data parallelism every rank's *step* time is the same: all of them leave the
all-reduce together, so the step time says that something is slow, not who. What differs is the
time each rank works before it arrives at the collective (its *busy* time: compute, plus whatever
delayed it), which is what production systems time per rank (MegaScale, Jiang et al., NSDI 2024,
records the timing of each rank's critical code segments with CUDA events to find stragglers). The straggler is the rank
whose busy time stands out from the others'.

"Stands out" needs a statistic that the outlier does not distort. Mean and standard deviation fail:
with n ranks, one outlier's z-score is at most (n - 1)/sqrt(n) with the sample standard deviation
(1.5 for n = 4; sqrt(n - 1) with the population one), however slow it is, because it inflates the standard deviation it is measured against. The median and the median
absolute deviation (MAD) ignore one outlier in n >= 3. This module uses the *modified z-score* of
Iglewicz and Hoaglin ("How to Detect and Handle Outliers", ASQC 1993, ch. 3):

    M_i = 0.6745 (x_i - median(x)) / MAD,   MAD = median(|x_i - median(x)|),

flagging M_i > 3.5 (one-sided: only slow ranks matter here). 0.6745 is the 0.75 quantile of the
standard normal, so M is on the scale of a z-score for normal data. With a handful of ranks
whose times nearly agree, MAD can be ~0 and any jitter would look infinite; the MAD is therefore
floored at ``rel_floor`` × median (default 5 %): a rank must be at least
3.5 / 0.6745 × 5 % ≈ 26 % slower than the median rank to be flagged.

:func:`detect` gives the verdict for a run: the statistic on each rank's mean busy time over all
its steps (:func:`flag_stragglers`), which also catches a rank that is late only every few steps
as long as its average lateness clears the MAD floor (about 26 % of the median busy time).
It also applies the statistic to each sliding window of ``window`` steps, as a live monitor would,
to show *when* a rank stood out; its false-alarm rate (:func:`false_alarm_rate`) is the fraction
of (window, rank) pairs flagged among ranks nobody slowed, measured on an uninjected run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tables import table

Z_SCALE = 0.6745  # standard normal 0.75 quantile: MAD / 0.6745 estimates sigma (Iglewicz & Hoaglin 1993)
THRESHOLD = 3.5  # Iglewicz & Hoaglin's recommended cut-off for the modified z-score
REL_FLOOR = 0.05  # MAD is at least this fraction of the median


def _as_matrix(busy_s, name: str = "busy_s") -> np.ndarray:
    x = np.asarray(busy_s, dtype=np.float64)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] < 3 or x.shape[0] < 1:
        raise ValueError(f"{name} must be [steps, ranks] seconds with at least 3 ranks (a median needs a majority), "
                         f"got shape {tuple(np.shape(busy_s))}")
    if not np.isfinite(x).all() or (x < 0).any():
        raise ValueError(f"{name} must hold finite times >= 0 s; hint: pass busy time = step time - wait time")
    return x


def modified_z(values, rel_floor: float = REL_FLOOR) -> np.ndarray:
    """Modified z-score of each entry of ``values`` (shape ``[ranks]``, any unit) against the others.

    ``0.6745 (x - median) / max(MAD, rel_floor × median)``; positive means slower than the median.
    Source: Iglewicz & Hoaglin (1993); the floor is the course's choice (module docstring).
    """
    x = np.asarray(values, dtype=np.float64)
    med = np.median(x)
    mad = max(np.median(np.abs(x - med)), rel_floor * abs(med), 1e-12)
    return Z_SCALE * (x - med) / mad


def flag_stragglers(busy_s, threshold: float = THRESHOLD, rel_floor: float = REL_FLOOR) -> list[int]:
    """Ranks whose mean busy time over the steps of ``busy_s`` is an outlier on the slow side.

    Args:
        busy_s: ``[steps, ranks]`` (or ``[ranks]``) seconds each rank worked before the collective.
        threshold: modified z-score above which a rank is flagged.
        rel_floor: the MAD floor as a fraction of the median.

    Returns:
        Sorted rank indices (empty when nobody stands out).

    Raises:
        ValueError: fewer than 3 ranks, or negative / non-finite times.
    """
    return list(detect(busy_s, threshold=threshold, rel_floor=rel_floor).flagged)


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found in one run.

    ``flagged``: the run's stragglers (:func:`flag_stragglers` over all steps); ``run_z``:
    ``[ranks]`` their modified z-scores; ``z``: ``[windows, ranks]`` per sliding window,
    ``window_flags``: ``z > threshold``; ``fraction``: ``[ranks]`` share of windows flagged.
    """

    flagged: tuple[int, ...]
    run_z: np.ndarray
    fraction: np.ndarray
    z: np.ndarray
    window_flags: np.ndarray
    window: int
    threshold: float


def detect(busy_s, window: int = 5, threshold: float = THRESHOLD, rel_floor: float = REL_FLOOR) -> Detection:
    """Flag the stragglers of a run and show when they stood out.

    Args:
        busy_s: ``[steps, ranks]`` seconds each rank worked before the collective (>= 3 ranks).
        window: steps per sliding window (clipped to the number of steps).
        threshold, rel_floor: as in :func:`flag_stragglers`.

    Raises:
        ValueError: bad shapes or times (see :func:`flag_stragglers`), ``window < 1``.
    """
    x = _as_matrix(busy_s)
    if not (isinstance(window, (int, np.integer)) and window >= 1):
        raise ValueError(f"window must be a whole number of steps >= 1, got {window!r}")
    w = min(window, x.shape[0])
    run_z = modified_z(x.mean(axis=0), rel_floor)
    z = np.stack([modified_z(x[i:i + w].mean(axis=0), rel_floor) for i in range(x.shape[0] - w + 1)])
    flags = z > threshold
    flagged = tuple(int(r) for r in np.flatnonzero(run_z > threshold))
    return Detection(flagged, run_z, flags.mean(axis=0), z, flags, w, threshold)


def false_alarm_rate(detection: Detection, injected=()) -> float:
    """Fraction of (window, rank) pairs flagged among the ranks not in ``injected``."""
    healthy = [r for r in range(detection.window_flags.shape[1]) if r not in set(injected)]
    return float(detection.window_flags[:, healthy].mean()) if healthy else 0.0


def detection_rows(timelines, **kwargs) -> list[dict]:
    """One row per run: the ranks slowed, the ranks flagged, the slowed ranks' share of flagged
    windows, the false-alarm rate. ``timelines`` have ``name``, ``busy`` ``[steps, ranks]`` (s) and
    ``injected_ranks``; ``kwargs`` go to :func:`detect`."""
    rows = []
    for t in timelines:
        d, inj = detect(t.busy, **kwargs), tuple(t.injected_ranks)
        rows.append({"run": t.name, "injected": inj, "flagged": d.flagged,
                     "caught": set(inj) <= set(d.flagged), "injected_windows": float(d.fraction[list(inj)].min())
                     if inj else None, "false_alarm_rate": false_alarm_rate(d, inj), "exact": set(inj) == set(d.flagged)})
    return rows


def detection_table(rows: list[dict]) -> str:
    """:func:`detection_rows` as text."""
    def ranks(rs):
        return ", ".join(map(str, rs)) or "none"

    return table([(r["run"], ranks(r["injected"]), ranks(r["flagged"]),
                   "-" if r["injected_windows"] is None else f"{r['injected_windows']:.0%}",
                   f"{r['false_alarm_rate']:.1%}") for r in rows],
                 ["run", "slowed rank", "flagged", "windows flagged (slowed)", "false alarms"])
