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

:func:`attribute` says what kind of straggler slowed a run, against a healthy run of the same job.
A slow-compute straggler works longer before the all-reduce: its *busy* time stands out, and the
statistic above flags it. A slow link (a degraded NIC or cable on one node) leaves every rank's
busy time alone: a ring all-reduce moves at the pace of its slowest link, and every rank sits in
it until the end, so all of them wait longer inside the collective, together. What grows is the
all-reduce's *transfer*, read per step as the smallest wait over ranks (the last rank to arrive
waits for nobody, so its time in the all-reduce is the transfer; see :mod:`teraflops.orchestration.stragglers`).
Which node's link it is, the job cannot say: :mod:`teraflops.orchestration.link_probe` tests the nodes in pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from teraflops.errors import CourseError
from teraflops.tables import table

Z_SCALE = 0.6745  # standard normal 0.75 quantile: MAD / 0.6745 estimates sigma (Iglewicz & Hoaglin 1993)
THRESHOLD = 3.5  # Iglewicz & Hoaglin's recommended cut-off for the modified z-score
REL_FLOOR = 0.05  # MAD is at least this fraction of the median
# attribute(): a run whose median transfer per step is over TRANSFER_RATIO x its healthy run's is
# communication-bound. Measured on the 2-core CPU machine (3 emulated nodes at 50 MB/s, tiny GPT,
# 0.47 MB of gradients, gloo): healthy runs of separate launches 18.8-35 ms per step (ratios up to
# 1.86 between them), node 1's link at 5 MB/s 123-131 ms (3.6-6.8x the healthy run).
TRANSFER_RATIO = 2.5
MIN_RANKS = 3  # a median with a majority of healthy ranks: the fewest ranks the detector can judge


def as_matrix(busy_s, name: str = "busy_s") -> np.ndarray:
    """Per-rank times as float64 ``[steps, ranks]`` (a ``[ranks]`` vector is one step); ValueError with
    a hint unless there are at least 3 ranks of finite times >= 0 s."""
    x = np.asarray(busy_s, dtype=np.float64)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] < MIN_RANKS or x.shape[0] < 1:
        raise ValueError(f"{name} must be [steps, ranks] seconds with at least 3 ranks (a median needs a majority), "
                         f"got shape {tuple(np.shape(busy_s))}. Hint: one column per rank, one row per step.")
    if not np.isfinite(x).all() or (x < 0).any():
        raise ValueError(f"{name} must hold finite times >= 0 s. Hint: pass busy time = step time - wait time.")
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
    x = as_matrix(busy_s)
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


class TimingError(CourseError, ValueError):
    """Per-rank timings that :func:`attribute` cannot use; one line with a hint."""


@dataclass(frozen=True, eq=False)
class Attribution:
    """What :func:`attribute` concluded about a run, against a healthy baseline.

    Attributes:
        verdict: ``"compute"`` (a rank's busy time stands out), ``"communication"`` (the
            all-reduce's transfer grew over :data:`TRANSFER_RATIO`×, and more than any standing-out
            rank's excess busy time), or ``"none"``.
        compute_flagged: ranks the detector flags on busy time (:func:`flag_stragglers`).
        busy_z: float64 ``[ranks]``, their modified z-scores (mean busy time over the steps).
        transfer_ratio: median per-step transfer (s) of the run over the baseline's (dimensionless).
        transfer_s, baseline_transfer_s: those two medians, in seconds.
        reason: one line that says why.
    """

    verdict: str
    compute_flagged: tuple[int, ...]
    busy_z: np.ndarray
    transfer_ratio: float
    transfer_s: float
    baseline_transfer_s: float
    reason: str


def _timings(tl, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(busy, wait)`` ``[steps, ranks]`` seconds of a Timeline-like ``tl``, checked."""
    if not (hasattr(tl, "busy") and hasattr(tl, "wait")):
        raise TimingError(f"{name} must be one setting's Timeline (with .busy and .wait), got {type(tl).__name__}. "
                          "Hint: pass run.sweep[i] or run.kinds[i], not the StragglerRun.")
    busy, wait = as_matrix(tl.busy, f"{name}.busy"), as_matrix(tl.wait, f"{name}.wait")
    if busy.shape != wait.shape:
        raise TimingError(f"{name}.busy and {name}.wait differ in shape: {busy.shape} vs {wait.shape}. "
                          "Hint: both are [steps, ranks] of the same Timeline.")
    return busy, wait


def transfer_s(wait_s) -> np.ndarray:
    """Per step, the all-reduce's transfer (s, float64 ``[steps]``): the smallest wait over ranks.

    ``wait_s`` is ``[steps, ranks]`` seconds inside the collective; the last rank to arrive waits
    for nobody, so its wait is the transfer alone (:func:`teraflops.orchestration.stragglers.baseline_means`).
    """
    return as_matrix(wait_s, "wait_s").min(axis=1)


def attribute(timeline, baseline, threshold: float = THRESHOLD, ratio: float = TRANSFER_RATIO) -> Attribution:
    """Tell a slow-compute straggler from a slow-link one, from per-rank timings.

    Rule: a rank is a compute straggler if :func:`flag_stragglers` flags it on ``timeline.busy``
    (modified z-score of each rank's mean busy time above ``threshold``; Iglewicz & Hoaglin, 1993);
    the link is slow if the median per-step transfer (:func:`transfer_s`) of ``timeline`` is over
    ``ratio`` × that of ``baseline``. With one of the two, that is the verdict; with neither,
    ``"none"``; with both, the one that costs each step more time: the straggler's excess busy time
    (its mean minus the median rank's, which every other rank waits out) against the transfer's
    growth over the baseline's. (On a 2-core machine three ranks share two cores, and a healthy rank
    can stand out by ~30 % of a few-ms busy time while a slow link adds ~100 ms per step.)
    The default, :data:`TRANSFER_RATIO` = 2.5, sits above the spread of healthy runs measured here (up to 1.86× between two launches on a loaded
    2-core machine) and below what a 10×-slower link on one of 3 nodes gives (3.6-6.8×: the
    transfer was 123-131 ms, as a ring all-reduce of 0.47 MB predicts, ``2 (n - 1) / n`` × 0.47 MB
    at 5 MB/s = 126 ms, against a healthy 19-35 ms, of which only 12.6 ms is bandwidth). So it
    catches a link slow enough to make the all-reduce 2.5× slower, not a slightly degraded one. A run with
    both a slow rank and a slow link reads as the costlier of the two: fix that first, then compare again.

    Args:
        timeline: the run to explain, a :class:`teraflops.orchestration.stragglers.Timeline` (or any object with
            ``busy`` and ``wait``, float ``[steps, ranks]`` seconds, at least 3 ranks).
        baseline: the same job with nothing slowed (e.g. the sweep's 0 ms setting on healthy links),
            the same number of ranks.
        threshold: the detector's cut-off. ratio: the transfer growth that counts as communication.

    Raises:
        TimingError: not Timelines, shapes that differ in ranks, fewer than 3 ranks, bad times,
            or a baseline whose transfer is 0.
    """
    busy, wait = _timings(timeline, "timeline")
    _, base_wait = _timings(baseline, "baseline")
    if base_wait.shape[1] != wait.shape[1]:
        raise TimingError(f"timeline has {wait.shape[1]} ranks but baseline has {base_wait.shape[1]}. "
                          "Hint: the baseline is the same job (same ranks) with nothing slowed.")
    t, t0 = float(np.median(transfer_s(wait))), float(np.median(transfer_s(base_wait)))
    if t0 <= 0:
        raise TimingError("baseline's transfer (smallest wait per step) is 0 s, so no ratio can be taken. "
                          "Hint: pass a baseline whose wait holds the time inside the all-reduce.")
    d = detect(busy, threshold=threshold)
    r = t / t0
    means = busy.mean(axis=0)
    excess = float(means[list(d.flagged)].max() - np.median(means)) if d.flagged else 0.0
    growth, named = t - t0, f"rank(s) {', '.join(map(str, d.flagged))}"
    if d.flagged and (r <= ratio or excess >= growth):
        verdict = "compute"
        reason = (f"{named} busy for longer than the others "
                  f"(modified z {max(d.run_z[list(d.flagged)]):.1f} > {threshold:g}, {excess * 1e3:.3g} ms per step "
                  f"over the median rank)")
        if r > ratio:
            reason += f", more than the all-reduce's transfer grew ({growth * 1e3:.3g} ms)"
    elif r > ratio:
        verdict = "communication"
        stood = (f"{named} stand out on busy time by only {excess * 1e3:.3g} ms "
                 "per step" if d.flagged else f"no rank stands out on busy time (max modified z {d.run_z.max():.1f})")
        reason = (f"{stood}, but the all-reduce's transfer grew {r:.1f}x ({t * 1e3:.3g} ms vs "
                  f"{t0 * 1e3:.3g} ms per step)")
    else:
        verdict = "none"
        reason = (f"no rank stands out on busy time (max modified z {d.run_z.max():.1f}) and the transfer is "
                  f"{r:.2f}x the baseline's (<= {ratio:g}x)")
    return Attribution(verdict, d.flagged, d.run_z, r, t, t0, reason)
