"""Checks for Unit 5 (Hardware). Each takes the learner's function and nothing else (exercise 2 also
takes the notebook's own measured sweep).

Every check compares the learner's answer with the package's reference (:mod:`teraflops.hardware.collectives`)
on cases built here and, on a wrong answer, tries the plausible wrong versions: a mistake is named
only when it reproduces every answer the learner gave. Units as in :mod:`teraflops.hardware.collectives`:
bytes, seconds, bytes/s.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import numpy as np

from teraflops.hardware.alpha_beta import fit_alpha_beta as reference_fit, ring_allreduce_seconds
from teraflops.hardware.collectives import bus_factor
from teraflops.hardware.comm_budget import accumulation_for_fraction
from teraflops.datasheets import PUBLISHED_LINKS
from teraflops.errors import PLACEHOLDER_MESSAGE, CourseError
from teraflops.hardware import ring
from teraflops.launch.launcher import LaunchFailed
from teraflops.grading.core import check_cases, close, exercise, expect_number, fail, finite_answer, holds, reveal


# --- exercise 1: bus bandwidth from algorithm bandwidth --------------------------------------------

_BUS_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
_ALGBWS = (0.38e9, 180e9, 21.5e9, 45e9)  # bytes/s: gloo on the CPU machine, NVLink, PCIe, InfiniBand
# (algbw bytes/s, collective, n): every collective on 2, 3, 4 and 8 ranks
_BUS_CASES = [(_ALGBWS[i % len(_ALGBWS)], c, n)
              for i, (c, n) in enumerate((c, n) for c in _BUS_COLLECTIVES for n in (2, 3, 4, 8))]


def _factor_ar(n):  # all-reduce
    return 2 * (n - 1) / n


def _factor_half(n):  # all-gather, reduce-scatter
    return (n - 1) / n


def _pick(ar, other):
    """A factor rule: ``ar(n)`` for all-reduce, ``other(n)`` for all-gather and reduce-scatter."""
    return lambda a, c, n: a * (ar(n) if c == "all_reduce" else other(n))


_BUS_MISTAKES = [
    (_pick(_factor_ar, _factor_ar),
     "all-gather and reduce-scatter move half an all-reduce's data: nccl-tests' factor for them is (n-1)/n, "
     "2(n-1)/n only for all-reduce"),
    (_pick(_factor_half, _factor_half),
     "an all-reduce is a reduce-scatter then an all-gather: nccl-tests' factor for it is 2(n-1)/n, twice theirs"),
    (_pick(_factor_half, _factor_ar),
     "the factors are the wrong way round: nccl-tests uses 2(n-1)/n for all_reduce, (n-1)/n for all_gather and "
     "reduce_scatter"),
    (lambda a, c, n: a / bus_factor(c, n),
     "nccl-tests defines busbw = algbw × factor: multiply by the factor, do not divide"),
    (_pick(lambda n: 2.0, lambda n: 1.0),
     "the factor depends on the rank count: nccl-tests uses 2(n-1)/n for all_reduce, (n-1)/n for the others"),
    (_pick(lambda n: 2 * n / (n - 1), lambda n: n / (n - 1)),
     "nccl-tests' factor is (n-1)/n (times 2 for all_reduce), not n/(n-1): each link carries n-1 of every n chunks"),
    (lambda a, c, n: a * bus_factor(c, n) / 1e9,
     "bytes/s in, bytes/s out: return busbw in algbw's unit, not GB/s (nccl-tests converts only to print)"),
    (lambda a, c, n: a * bus_factor(c, n) / 2**30,
     "bytes/s in, bytes/s out: return busbw in algbw's unit, not GiB/s"),
    (lambda a, c, n: a, "nccl-tests defines busbw = algbw × factor(n): 2(n-1)/n for all_reduce, (n-1)/n for "
                        "all_gather and reduce_scatter"),
]


_OTHER_SPELLINGS = {"all_reduce": ("allreduce", "all-reduce", "AllReduce", "all_reduce_perf"),
                    "all_gather": ("allgather", "all-gather", "AllGather", "all_gather_perf"),
                    "reduce_scatter": ("reducescatter", "reduce-scatter", "ReduceScatter", "reduce_scatter_perf")}


def _names_spelt_otherwise(fn) -> None:
    """Fail, naming the collective's name, when ``fn`` gives another spelling of it (``"allreduce"``) the
    factor the exercise's name (``"all_reduce"``) should get but not the name itself: the learner's
    factors are right, their branch never matches."""
    a, n = _ALGBWS[0], 4

    def answer(name):
        try:
            return float(fn(a, name, n))
        except Exception:  # noqa: BLE001 - the usual checks report what the learner's code raised
            return None

    unknown = answer("no_such_collective")  # what a name no branch matches gets: a value, or an error
    for name, others in _OTHER_SPELLINGS.items():
        want = a * bus_factor(name, n)
        mine = answer(name)
        if mine is not None and close(mine, want):
            continue
        if not (mine is None and unknown is None or mine is not None and unknown is not None and close(mine, unknown)):
            continue  # the name reaches a branch of its own: a wrong factor, which the usual checks name
        for other in others:
            got = answer(other)
            if got is not None and close(got, want):
                fail(f"busbw(algbw, {other!r}, n) gets the factor of {name!r}, but busbw(algbw, {name!r}, n) does not: "
                     f"the collective is called {name!r}. Hint: compare with the names "
                     f"{', '.join(map(repr, _BUS_COLLECTIVES))}, exactly as spelt")


def _describe_bus(case) -> str:
    a, c, n = case
    return f"algbw={a:g} bytes/s ({a / 1e9:g} GB/s), collective={c!r}, n={n}"


@exercise(1, "bus bandwidth from algorithm bandwidth")
def busbw(fn) -> None:
    """``fn(algbw, collective, n) -> busbw`` in bytes/s for ``"all_reduce"``, ``"all_gather"`` and
    ``"reduce_scatter"`` on ``n`` = 2, 3, 4 and 8 ranks (nccl-tests doc/PERFORMANCE.md)."""
    _names_spelt_otherwise(fn)
    check_cases(finite_answer(fn, "busbw", "bytes/s", _describe_bus), "busbw", "bytes/s", _BUS_CASES,
                lambda a, c, n: a * bus_factor(c, n),
                [(holds(f), h) for f, h in _BUS_MISTAKES],
                "nccl-tests (doc/PERFORMANCE.md) defines busbw = algbw × 2(n-1)/n for all_reduce and algbw × (n-1)/n "
                "for all_gather and reduce_scatter",
                _describe_bus, lambda g, w: f"got {g:.6g} bytes/s, expected {w:.6g}")


# --- exercise 2: fit alpha and beta -----------------------------------------------------------------

_ALPHA, _BANDWIDTH = 5e-3, 0.4e9  # s, bytes/s: about what gloo's all-reduce gives on the CPU machine
_SIZES = 2.0 ** np.arange(10, 27)  # 1 KiB … 64 MiB, as the lecture's sweep
_NOISE = 0.03  # relative: a typical spread of repeated measurements


def _synthetic_cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    exact = _ALPHA + _SIZES / _BANDWIDTH
    noisy = exact * np.exp(_NOISE * np.random.default_rng(5).standard_normal(_SIZES.size))
    # NVLink-like: µs latency, so noise can push the free intercept below 0 (the reference then keeps α = 0)
    fast = (1e-6 + _SIZES / 100e9) * np.exp(0.05 * np.random.default_rng(6).standard_normal(_SIZES.size))
    return [("exact times T = 5 ms + S / (0.4 GB/s) over 1 KiB–64 MiB", _SIZES, exact),
            (f"the same times with {_NOISE:.0%} noise", _SIZES, noisy),
            ("noisy times T = 1 µs + S / (100 GB/s), whose free fit has α < 0", _SIZES, fast)]


def _ols(s, t) -> tuple[float, float]:
    """The free least-squares line, α unclamped."""
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(s), s], axis=1), t, rcond=None)
    return float(a), float(b)


def _same_fit(got, want, t) -> bool:
    """β within 1e-6 relative; α within 1e-6 of the largest time (α may be 0)."""
    return abs(got[0] - want[0]) <= 1e-6 * float(np.max(t)) and close(got[1], want[1])


def _two_points(s, t, i, j, anchor):
    b = (t[j] - t[i]) / (s[j] - s[i])
    return t[anchor] - b * s[anchor], b


def _endpoints(s, t, anchor_first=True):
    o = np.argsort(s)
    return _two_points(s, t, o[0], o[-1], o[0] if anchor_first else o[-1])


def _largest_two(s, t):
    o = np.argsort(s)
    return _two_points(s, t, o[-2], o[-1], o[-1])


def _min_time(slope):
    def fit(s, t):
        return float(np.min(t)), slope(s, t)
    return fit


def _log_fit(log, exp):
    def fit(s, t):
        slope, intercept = np.polyfit(log(s), log(t), 1)
        return (exp(intercept) if exp else intercept), slope
    return fit


_TWO_POINTS = ("your line goes through two of the points: one noisy point then decides B; use every point in a "
               "least-squares fit")
_MIN_TIME = ("α is the fitted line's intercept, not the smallest measured time (which also holds S·β and noise): "
             "fit α and β together by least squares")
_LOG_LOG = ("fit T = α + β·S to the times themselves: a straight line on log-log axes is a power law T = c·S^k, "
            "not the alpha-beta model")
_ORIGIN = "the line does not pass through the origin: fit the intercept α too (a column of ones next to the sizes)"

def _clamped_no_refit(s, t):
    a, b = _ols(s, t)
    return max(a, 0.0), b


_UNITS_FIT = ("return alpha in seconds and beta in seconds per byte: convert neither to µs, ms or ns "
              "(the notebook converts only to print)")

_FIT_MISTAKES = [
    (_clamped_no_refit, "when the free fit's α is negative, α = 0 changes the best β: refit the line through the "
                        "origin, β = Σ S·T / Σ S² (or keep the free α < 0: both pass)"),
    (lambda s, t: (_ols(s, t)[0] * 1e6, _ols(s, t)[1] * 1e9), _UNITS_FIT),
    (lambda s, t: (_ols(s, t)[0] * 1e3, _ols(s, t)[1] * 1e9), _UNITS_FIT),
    (lambda s, t: (_ols(s, t)[0] * 1e6, _ols(s, t)[1]), _UNITS_FIT),
    (lambda s, t: (_ols(s, t)[0] * 1e3, _ols(s, t)[1]), _UNITS_FIT),
    (lambda s, t: (_ols(s, t)[1], _ols(s, t)[0]),
     "return (alpha, beta) in that order (np.polyfit(sizes, seconds, 1) gives [beta, alpha], the highest power first)"),
    (lambda s, t: (_ols(s, t)[0], 1 / _ols(s, t)[1]),
     "return β in seconds per byte, 1 / B, not the bandwidth B in bytes/s"),
    (lambda s, t: (1 / _ols(s, t)[1], _ols(s, t)[0]),
     "return (alpha, beta): alpha in seconds first, then β = 1/B in seconds per byte, not the bandwidth"),
    (lambda s, t: (0.0, float(np.sum(s * t) / np.sum(s * s))), _ORIGIN),
    (lambda s, t: (0.0, float(np.mean(t / s))), _ORIGIN),
    (lambda s, t: (0.0, _ols(s, t)[1]), _ORIGIN),
    (_log_fit(np.log, np.exp), _LOG_LOG),
    (_log_fit(np.log, None), _LOG_LOG),
    (_log_fit(np.log10, lambda x: 10 ** x), _LOG_LOG),
    (_log_fit(np.log10, None), _LOG_LOG),
    (_endpoints, _TWO_POINTS),
    (lambda s, t: _endpoints(s, t, anchor_first=False), _TWO_POINTS),
    (_largest_two, _TWO_POINTS),
    (_min_time(lambda s, t: _ols(s, t)[1]), _MIN_TIME),
    (_min_time(lambda s, t: _endpoints(s, t)[1]), _MIN_TIME),
    (_min_time(lambda s, t: float(np.sum(s * (t - np.min(t))) / np.sum(s * s))), _MIN_TIME),
]


def _pair(got) -> tuple[float, float]:
    """The learner's ``(alpha, beta)`` as floats, or a one-line failure."""
    if not isinstance(got, (tuple, list, np.ndarray)):
        fail(f"fit_alpha_beta should return a tuple (alpha, beta) of numbers, got {type(got).__name__}. "
             "Hint: return alpha, beta")
    if len(got) != 2:
        fail(f"fit_alpha_beta should return two numbers (alpha, beta), got {len(got)}. Hint: return alpha, beta")
    a = expect_number("fit_alpha_beta's alpha", got[0], "seconds")
    b = expect_number("fit_alpha_beta's beta", got[1], "seconds per byte")
    if not (math.isfinite(a) and math.isfinite(b)):
        fail(f"fit_alpha_beta returned alpha = {a}, beta = {b}: expected finite numbers (s, s/byte). "
             "Hint: look for a division by zero, e.g. a variance of equal sizes")
    return a, b


def _words(fit) -> str:
    return f"alpha = {fit[0]:.6g} s, beta = {fit[1]:.6g} s/byte"


@exercise(2, "fit alpha and beta")
def fit_alpha_beta(fn, sizes=None, seconds=None) -> None:
    """``fn(sizes, seconds) -> (alpha, beta)``: the ordinary least-squares line ``T = α + β·S`` through
    measured times (``sizes`` in bytes and ``seconds``, NumPy arrays; ``alpha`` in s, ``beta = 1/B`` in
    s/byte). Checked on exact and noisy synthetic times and, when the notebook passes them, on its own
    measured sweep (``sizes``, ``seconds``: one all-reduce time per size)."""
    cases = _synthetic_cases()
    if (sizes is None) != (seconds is None):
        fail("pass both sizes and seconds of your sweep, or neither. Hint: check.fit_alpha_beta(fit_alpha_beta, "
             "sizes, seconds)")
    if sizes is not None:
        s, t = np.array(sizes, dtype=np.float64).reshape(-1), np.array(seconds, dtype=np.float64).reshape(-1)
        try:  # a sweep the reference cannot fit well (too few sizes, times that do not grow: all latency, or
            # too noisy) says nothing about the learner's fit: the synthetic cases then decide alone
            usable = s.size == t.size and reference_fit(s, t).r2 >= 0.9
        except CourseError:
            usable = False
        if usable:
            cases.append((f"your measured sweep ({s.size} sizes)", s, t))
    answers = []
    for what, s, t in cases:
        got = _pair(fn(s.copy(), t.copy()))
        ref = reference_fit(s, t)
        want = (ref.alpha, ref.beta)
        free = _ols(s, t)  # where the reference kept α >= 0 by refitting, the free fit is right too
        answers.append((got, want, (s, t), what, _same_fit(got, want, t) or (free[0] < 0 and _same_fit(got, free, t))))
    wrong = [a for a in answers if not a[4]]
    if not wrong:
        return
    hint = reveal("fit the line T = α + β·S by least squares over every point",
                  "beta, alpha = np.polyfit(sizes, seconds, 1)")
    for model, h in _FIT_MISTAKES:
        try:
            if all(_same_fit(got, model(*case), case[1]) for got, _, case, _, _ in answers):
                hint = h
                break
        except (ArithmeticError, ValueError, np.linalg.LinAlgError):  # cannot answer a case: not the mistake
            continue
    got, want, _, what, _ = wrong[0]
    fail(f"on {what}: got {_words(got)}, expected {_words(want)}. Hint: {hint}")


# --- exercise 3: predict an all-reduce on a fabric ------------------------------------------------

_LINKS = {link.name: link.bandwidth for link in PUBLISHED_LINKS}
_NVLINK, _PCIE4, _PCIE5, _NDR = (next(n for n in _LINKS if n.startswith(p))
                                 for p in ("NVLink", "PCIe Gen4", "PCIe Gen5", "InfiniBand"))
# (size bytes, n, bandwidth bytes/s, alpha s): 1 MB – 10 GB, 2 – 64 ranks, the published links
_RING_CASES = [(1e6, 2, _LINKS[_NVLINK], 0.0), (1e6, 8, _LINKS[_NVLINK], 5e-6), (1e10, 8, _LINKS[_NDR], 0.0),
               (2e9, 64, _LINKS[_NDR], 5e-6), (2.6e8, 4, _LINKS[_PCIE4], 5e-6), (1e8, 4, _LINKS[_PCIE5], 0.0),
               (1e7, 64, _LINKS[_NVLINK], 5e-6), (1e9, 2, _LINKS[_PCIE5], 5e-6)]


def _ring_bw(s, n, b):
    return 2 * (n - 1) / n * s / b


def _ring_lat(n, a):
    return 2 * (n - 1) * a


_UNITS = "size_bytes and bandwidth are both in bytes (bytes/s): convert neither"

_RING_MISTAKES = [
    (lambda s, n, b, a: s / b + a,
     "that is one message of S bytes, α + S/B; a ring all-reduce is 2(n-1) steps of S/n bytes each: "
     "T = 2(n-1)/n·S/B + 2(n-1)·α"),
    (lambda s, n, b, a: s / b + _ring_lat(n, a),
     "in a ring all-reduce each rank's link carries 2(n-1)/n·S bytes, not S: T = 2(n-1)/n·S/B + 2(n-1)·α"),
    (lambda s, n, b, a: (n - 1) / n * s / b + (n - 1) * a,
     "that is a reduce-scatter (n-1 steps); an all-reduce is a reduce-scatter then an all-gather: "
     "2(n-1) steps, T = 2(n-1)/n·S/B + 2(n-1)·α"),
    (lambda s, n, b, a: (n - 1) / n * s / b + _ring_lat(n, a),
     "(n-1)/n is a reduce-scatter's (or an all-gather's) share; an all-reduce is both: 2(n-1)/n·S/B"),
    (lambda s, n, b, a: 2 * (n - 1) * s / b + _ring_lat(n, a),
     "each of the 2(n-1) steps sends a chunk of S/n bytes, not S: 2(n-1)/n·S/B"),
    (lambda s, n, b, a: _ring_bw(s, n, b) + a,
     "every one of the ring's 2(n-1) steps pays the latency: 2(n-1)·α, not α once"),
    (lambda s, n, b, a: _ring_bw(s, n, b) + (n - 1) * a,
     "the latency is paid 2(n-1) times (n-1 steps of reduce-scatter, n-1 of all-gather), not n-1"),
    (lambda s, n, b, a: 8 * _ring_bw(s, n, b) + _ring_lat(n, a), f"{_UNITS}: no factor of 8 for bits"),
    (lambda s, n, b, a: _ring_bw(s, n, b) / 8 + _ring_lat(n, a), f"{_UNITS}: no factor of 8 for bits"),
    (lambda s, n, b, a: _ring_bw(s, n, b) * 2**30 / 1e9 + _ring_lat(n, a),
     f"{_UNITS}; mixing GB (1e9 bytes) and GiB (2**30 bytes) is off by 7%"),
    (lambda s, n, b, a: _ring_bw(s, n, b) * 1e9 / 2**30 + _ring_lat(n, a),
     f"{_UNITS}; mixing GB (1e9 bytes) and GiB (2**30 bytes) is off by 7%"),
    (lambda s, n, b, a: _ring_bw(s, n, b) / 1e9 + _ring_lat(n, a),
     f"{_UNITS}: bandwidth is already in bytes/s (450e9 for 450 GB/s), do not multiply it by 1e9"),
    (lambda s, n, b, a: _ring_bw(s, n, b) * 1e9 + _ring_lat(n, a),
     f"{_UNITS}: bandwidth is in bytes/s, not GB/s, and size_bytes in bytes: do not divide either by 1e9"),
    (lambda s, n, b, a: 1e3 * ring_allreduce_seconds(s, n, b, a), "return seconds, not milliseconds"),
    (lambda s, n, b, a: 1e6 * ring_allreduce_seconds(s, n, b, a), "return seconds, not microseconds"),
]


def _describe_ring(case) -> str:
    s, n, b, a = case
    link = next((name for name, bw in _LINKS.items() if bw == b), "")
    return f"size_bytes={s:g}, n={n}, bandwidth={b:.4g} bytes/s ({link}), alpha={a:g} s"


@exercise(3, "predict an all-reduce on a fabric")
def predict_allreduce(fn) -> None:
    """``fn(size_bytes, n, bandwidth, alpha) -> seconds`` of a ring all-reduce (see
    :func:`teraflops.hardware.alpha_beta.ring_allreduce_seconds`), on 2 – 64 ranks and the published links."""
    check_cases(finite_answer(fn, "predict_allreduce", "seconds", _describe_ring), "predict_allreduce", "seconds",
                _RING_CASES, ring_allreduce_seconds, [(holds(f), h) for f, h in _RING_MISTAKES],
                "a ring all-reduce takes T = 2(n-1)/n · size_bytes / bandwidth + 2(n-1) · alpha "
                "(Patarasuk & Yuan 2009)",
                _describe_ring, lambda g, w: f"got {g:.6g} s, expected {w:.6g} s")


# --- exercise 4: accumulation steps for a communication budget -------------------------------------

# (sync s, micro-batch s, target): exact boundaries (dyadic, so float arithmetic is exact), the target
# met by one micro-batch, ordinary and large ratios (kept well away from whole numbers)
_ACCUM_CASES = [(3.0, 0.5, 0.25), (1.0, 0.25, 0.5), (0.001, 1.0, 0.1), (0.05, 0.2, 0.3), (0.35, 0.12, 0.1),
                (0.9, 0.22, 0.5), (1.7, 0.013, 0.05)]


def _exact_k(sync, micro, target) -> Fraction:
    """sync·(1 − target) / (target·micro), exactly (the k at which the fraction equals target)."""
    s, m, t = Fraction(sync), Fraction(micro), Fraction(target)
    return s * (1 - t) / (t * m)


def _ceil(x: Fraction) -> int:
    return -((-x.numerator) // x.denominator)


def _share(sync, micro, k) -> float:
    return sync / (k * micro + sync)


_ROUND_UP = ("the fewest micro-batches that meet the target: round k = sync·(1 - target) / (target·micro) up "
             "(math.ceil); rounding down or to nearest leaves the sync above the target")

_ACCUM_MISTAKES = [
    (lambda s, m, t: 0 if _share(s, m, 1) <= t else _ceil(_exact_k(s, m, t)),
     "k counts micro-batches per all-reduce, at least 1: when one already meets the target, return 1"),
    (lambda s, m, t: max(1, math.floor(_exact_k(s, m, t))), _ROUND_UP),
    (lambda s, m, t: math.floor(_exact_k(s, m, t)), _ROUND_UP),
    (lambda s, m, t: max(1, round(_exact_k(s, m, t))), _ROUND_UP),
    (lambda s, m, t: round(_exact_k(s, m, t)), _ROUND_UP),
    (lambda s, m, t: math.floor(_exact_k(s, m, t)) + 1,
     "the target is 'at most': sync / (k·micro + sync) <= target, so a k that meets it exactly is enough"),
    (lambda s, m, t: max(1, _ceil(Fraction(s) / (Fraction(t) * Fraction(m)))),
     "the fraction is of the whole step, compute and sync: sync / (k·micro + sync) <= target, "
     "not sync / (k·micro)"),
]


@exercise(4, "accumulation steps for a communication budget")
def accumulation_steps(fn) -> None:
    """``fn(sync_seconds, micro_batch_seconds, target) -> int``: the fewest micro-batches ``k >= 1`` per
    all-reduce with ``sync / (k·micro + sync) <= target`` (see
    :func:`teraflops.hardware.comm_budget.accumulation_for_fraction`)."""
    answers = []
    for case in _ACCUM_CASES:
        got = fn(*case)
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            fail(f"accumulation_steps should return an int (micro-batches per all-reduce), got "
                 f"{type(got).__name__} {got!r}. Hint: math.ceil returns an int; np.ceil returns a float, "
                 "so wrap it in int(...)")
        answers.append((int(got), accumulation_for_fraction(*case), case))
    wrong = [a for a in answers if a[0] != a[1]]
    if not wrong:
        return
    got, want, (sync, micro, target) = wrong[0]
    hint = next((h for m, h in _ACCUM_MISTAKES if all(m(*c) == g for g, _, c in answers)),
                "k = max(1, ceil(sync·(1 - target) / (target·micro))): the smallest k with "
                "sync / (k·micro + sync) <= target")
    share = f" (at k = {got} the sync takes {_share(sync, micro, got):.1%} of the step)" if got >= 1 else ""
    fail(f"with a {1e3 * sync:g} ms sync, {1e3 * micro:g} ms micro-batches and target {target:g} you returned "
         f"k = {got}{share}, expected {want}. Hint: {hint}")


# --- exercise 5: a ring all-reduce by hand -------------------------------------------------------

LAUNCH_TIMEOUT = 120  # seconds for one world size's launch, start-up included
_RING_STEPS = ("in reduce-scatter step s = 0 … n−2, rank r sends chunk (r − s) mod n to rank r + 1 and adds what "
               "it receives from rank r − 1 into chunk (r − s − 1) mod n; the all-gather then starts from chunk "
               "(r + 1) mod n, the one rank r finished")
_RING_HINTS = {  # {substring of "Type: message": hint}
    "imed out": "every send needs the matching receive on the neighbour: post both at once (dist.isend and "
                "dist.irecv, or dist.batch_isend_irecv) and wait after, so no rank blocks in send",
    "Connection closed by peer": "every rank must make the same steps, each a send to rank + 1 and a receive from "
                                 "rank − 1",
    "NameError": "only the function's own code goes to the ranks, with torch, dist, math, nn and F defined",
    "size": "chunks differ in size when n does not divide the tensor: torch.tensor_split(t, n) gives views whose "
            "sizes differ by at most one; receive into a buffer shaped like the chunk you will add it to",
}


def _ring_error(results) -> str | None:
    errors = [(r.error, r.rank) for r in results if r.error]
    if not errors:
        return None
    first, rank = min(errors, key=lambda er: (er[0].secondary, er[0].time))
    text = f"{first.type}: {first.message}"
    hint = next((h for needle, h in _RING_HINTS.items() if needle in text), "")
    message = f": {first.message.rstrip('.')}" if first.message else " (with no message)"
    return f"your {first.where} raised {first.type} on rank {rank}{message}" + (f". Hint: {hint}" if hint else "")


def _judge_ring(results) -> None:
    """Fail with the first problem the ranks' reports of one world size show (see
    :mod:`teraflops.workers.ring_check`): an error, a collective called, wrong elements, too much sent."""
    error = _ring_error(results)
    n = results[0].world_size
    if error:
        fail(f"on {n} ranks, {error}")
    _ring_no_collective(results, n)
    _ring_sums_right(results, n)
    _ring_sends_2n_minus_2_chunks(results, n)


def _ring_no_collective(results, n: int) -> None:
    calls = max(c.collectives for r in results for c in r.cases)
    if calls:
        fail(f"on {n} ranks your function called a collective ({calls} call(s) a run): the exercise builds the "
             "all-reduce from messages. Hint: use only dist.send/dist.recv or dist.isend/dist.irecv")


def _ring_sums_right(results, n: int) -> None:
    """Every size summed exactly; else the largest wrong size is judged: its chunks all hold elements,
    so the pattern shows."""
    wrong = [i for i, case in enumerate(results[0].cases) if any(r.cases[i].wrong for r in results)]
    if wrong:
        i = max(wrong, key=lambda j: results[0].cases[j].elements)
        bad = [r.cases[i] for r in results if r.cases[i].wrong]  # not empty: some rank got size i wrong
        _ring_wrong_pattern(results, n, results[0].cases[i], bad)


def _ring_wrong_pattern(results, n: int, case, bad: list) -> None:
    """Name what the wrong elements of ``case`` (``bad``: the cases of the ranks that got some wrong) point to."""
    even = [c.elements for c in results[0].cases if c.elements % n == 0 and c.elements >= n]
    uneven_only = all(not r.cases[j].wrong for r in results for j, c in enumerate(results[0].cases)
                      if c.elements in even)
    lead = (f"on {n} ranks, a tensor of {case.elements} elements came back with {bad[0].wrong} wrong "
            f"element(s) on {len(bad)} rank(s), in chunk(s) {bad[0].chunks} of {n}")
    if uneven_only and case.elements % n:
        fail(f"{lead}; sizes that {n} divides come back right. Hint: {_RING_HINTS['size']}")
    if all(len(c.chunks) == min(n, case.elements) - 1 and c.partial for c in bad) and len(bad) == n:
        fail(f"{lead}: each rank holds the full sum of one chunk only. Hint: after the reduce-scatter, run "
             f"the all-gather's n − 1 steps, passing the finished chunks round the ring")
    if all(c.partial for c in bad):
        fail(f"{lead}, holding sums of some ranks' contributions, not all: the chunks the ring passes on "
             f"are off. Hint: {_RING_STEPS}")
    fail(f"{lead}. Hint: {_RING_STEPS}; copy (not add) in the all-gather")


def _ring_sends_2n_minus_2_chunks(results, n: int) -> None:
    for i, case in enumerate(results[0].cases):
        bound = 2 * (n - 1) * -(-case.elements // n)  # 2(n−1) chunks of at most ⌈S/n⌉ elements
        sent = max(r.cases[i].sent for r in results)
        if sent > bound:
            fail(f"on {n} ranks, for {case.elements} elements a rank sent {sent:,} elements; a ring sends 2(n−1) "
                 f"chunks of S/n, at most {bound:,}. Hint: send one chunk per step, not the whole tensor")


@exercise(5, "a ring all-reduce by hand")
def ring_all_reduce(fn) -> None:
    """``fn(tensor) -> None``: sums ``tensor`` over the default group's ranks in place, with point-to-point
    messages only (a reduce-scatter then an all-gather round a ring; :mod:`teraflops.hardware.ring`).

    Its source runs on 2, 3 and 4 CPU ranks in turn (:mod:`teraflops.workers.ring_check`, one launch
    each, ~10-20 s), on fp32 tensors of :data:`~teraflops.hardware.ring.CHECK_ELEMENTS` elements
    (fewer than the ranks, sizes no rank count divides, a prime) holding integers, so its result must
    equal ``dist.all_reduce``'s exactly. Named mistakes: an exception or a deadlock (blocking sends),
    a collective used, uneven chunks mishandled, no all-gather, ring step indices off (partial sums),
    more than 2(n−1) chunks sent.
    """
    if not callable(fn) or isinstance(fn, type):
        fail(f"pass your function itself, check.ring_all_reduce(ring_all_reduce), not a {type(fn).__name__}")
    try:
        source = ring.function_source(fn)
    except (OSError, TypeError):
        fail("cannot find the source code of your function, and the check runs it in other processes. "
             "Hint: define it in a notebook cell of its own and run that cell")
    if PLACEHOLDER_MESSAGE in source:
        raise NotImplementedError(PLACEHOLDER_MESSAGE)  # the decorator reports "not attempted"
    for n in ring.CHECK_WORLDS:
        try:
            results = ring.run(source, fn.__name__, n, timeout=LAUNCH_TIMEOUT)
        except LaunchFailed as e:
            if "timed out after" not in str(e):
                raise
            fail(f"on {n} ranks the ranks did not finish within {LAUNCH_TIMEOUT} s. Hint: {_RING_HINTS['imed out']}")
        _judge_ring(results)
