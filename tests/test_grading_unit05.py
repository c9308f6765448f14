"""Unit 5's checks: the references pass, plausible wrong answers fail with the hint that names them."""

import math

import numpy as np
import pytest

from teraflops.hardware import alpha_beta, collectives, comm_budget
from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit05 as check
from teraflops.grading.core import REGISTRY
from teraflops.course.labs import PLACEHOLDER_MESSAGE


# --- the solutions as a learner writes them (the solution notebook's) -----------------------------

def busbw(algbw, collective, n):
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    return algbw * factor[collective]


def fit_alpha_beta(sizes, seconds):
    beta, alpha = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), 1)
    return float(alpha), float(beta)


def predict_allreduce(size_bytes, n, bandwidth, alpha):
    return 2 * (n - 1) / n * size_bytes / bandwidth + 2 * (n - 1) * alpha


def accumulation_steps(sync_seconds, micro_batch_seconds, target):
    k = sync_seconds * (1 - target) / (target * micro_batch_seconds)
    return max(1, math.ceil(k))


def _package_fit(sizes, seconds):
    fit = alpha_beta.fit_alpha_beta(sizes, seconds)
    return fit.alpha, fit.beta


def _sweep(alpha=4e-3, bandwidth=0.35e9, seed=11):
    """A stand-in for the lecture's measured all-reduce sweep (rows' sizes and seconds, as lists)."""
    sizes = [2 ** k for k in range(10, 27)]
    rng = np.random.default_rng(seed)
    return sizes, [(alpha + s / bandwidth) * math.exp(0.05 * rng.standard_normal()) for s in sizes]


def test_references_pass(capsys):
    check.busbw(busbw)
    check.fit_alpha_beta(fit_alpha_beta)
    check.predict_allreduce(predict_allreduce)
    check.accumulation_steps(accumulation_steps)
    assert capsys.readouterr().out.count("passed") == 4


def test_the_packages_references_are_the_formulas():
    """The checks grade against the package's functions: these hold them to the formulas, worked by hand
    (nccl-tests doc/PERFORMANCE.md's bus factors; Patarasuk & Yuan 2009's ring time), not to themselves."""
    assert collectives.bus_factor("all_reduce", 4) == pytest.approx(1.5)  # 2(n-1)/n
    assert collectives.bus_factor("all_gather", 4) == pytest.approx(0.75)  # (n-1)/n
    assert collectives.bus_factor("reduce_scatter", 8) == pytest.approx(0.875)
    # 1 GB over 4 ranks at 1 GB/s per direction, 1 ms a step: 2·3/4 · 1 s + 2·3 · 1 ms
    assert alpha_beta.ring_allreduce_seconds(1e9, 4, 1e9, 1e-3) == pytest.approx(1.506)
    # sync 0.3 s, micro-batch 0.1 s, at most 25 % in sync: k = ceil(0.3 · 0.75 / (0.25 · 0.1)) = 9
    assert comm_budget.accumulation_for_fraction(0.3, 0.1, 0.25) == 9
    assert comm_budget.accumulation_for_fraction(0.01, 1.0, 0.5) == 1  # already below: one micro-batch
    fit = alpha_beta.fit_alpha_beta([1e3, 1e6, 1e7], [1e-3 + 1e3 / 1e9, 1e-3 + 1e6 / 1e9, 1e-3 + 1e7 / 1e9])
    assert fit.alpha == pytest.approx(1e-3, rel=1e-6) and fit.bandwidth == pytest.approx(1e9, rel=1e-6)


def test_other_correct_forms_pass(capsys):
    def lstsq(sizes, seconds):
        a = np.stack([np.ones_like(sizes), sizes], axis=1)
        (alpha, beta), *_ = np.linalg.lstsq(a, seconds, rcond=None)
        return alpha, beta  # numpy floats

    def covariance(sizes, seconds):
        s, t = np.asarray(sizes), np.asarray(seconds)
        beta = np.sum((s - s.mean()) * (t - t.mean())) / np.sum((s - s.mean()) ** 2)
        return [t.mean() - beta * s.mean(), beta]  # a list

    def loop(sync, micro, target):
        k = 1
        while sync / (k * micro + sync) > target:
            k += 1
        return np.int64(k)  # a NumPy integer

    for fit in (lstsq, covariance):
        check.fit_alpha_beta(fit, *_sweep())
    check.accumulation_steps(loop)
    check.busbw(lambda a, c, n: a * (n - 1) / n * (2 if c == "all_reduce" else 1))
    assert capsys.readouterr().out.count("passed") == 4


def test_placeholder_is_not_attempted():
    def todo(*args):
        raise NotImplementedError(PLACEHOLDER_MESSAGE)

    for fn in (check.busbw, check.fit_alpha_beta, check.predict_allreduce, check.accumulation_steps):
        with pytest.raises(NotAttempted, match="not attempted"):
            fn(todo)


def test_unit5_is_registered_for_grading():
    mine = sorted((ex.number, ex.name) for ex in REGISTRY.values() if ex.unit == 5)
    assert mine == [(1, "busbw"), (2, "fit_alpha_beta"), (3, "predict_allreduce"), (4, "accumulation_steps"),
                    (5, "ring_all_reduce")]


def test_learner_exception_is_one_line():
    with pytest.raises(ExerciseFailed, match="your code raised KeyError: 'all_gather'$"):
        check.busbw(lambda a, c, n: a * {"all_reduce": 2 * (n - 1) / n}[c])


# --- exercise 1 -------------------------------------------------------------------------------

def _factors(ar, other):
    return lambda a, c, n: a * (ar(n) if c == "all_reduce" else other(n))


@pytest.mark.parametrize("wrong, hint", [
    (_factors(lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1) / n), "half an all-reduce's data"),
    (_factors(lambda n: (n - 1) / n, lambda n: (n - 1) / n), "twice theirs"),
    (_factors(lambda n: (n - 1) / n, lambda n: 2 * (n - 1) / n), "wrong way round"),
    (lambda a, c, n: a / collectives.bus_factor(c, n), "do not divide"),
    (_factors(lambda n: 2, lambda n: 1), "depends on the rank count"),
    (_factors(lambda n: 2 * n / (n - 1), lambda n: n / (n - 1)), "not n/\\(n-1\\)"),
    (lambda a, c, n: busbw(a, c, n) / 1e9, "not GB/s"),
    (lambda a, c, n: busbw(a, c, n) / 2**30, "not GiB/s"),
    (lambda a, c, n: a, "busbw = algbw × factor\\(n\\)"),
    (lambda a, c, n: busbw(a, c, n) * 1.01, "fit none of the usual mistakes"),
])
def test_busbw_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.busbw(wrong)


def test_busbw_names_the_case():
    with pytest.raises(ExerciseFailed, match="^Exercise 1 \\(bus bandwidth from algorithm bandwidth\\): for "
                                             "algbw=3.8e\\+08 bytes/s \\(0.38 GB/s\\), collective='all_gather', n=2"):
        check.busbw(_factors(lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1) / n))


@pytest.mark.parametrize("wrong, message", [
    (lambda a, c, n: None, "should return a number \\(bytes/s\\), got NoneType"),
    (lambda a, c, n: "4e9", "should return a number \\(bytes/s\\), got str"),
    (lambda a, c, n: True, "got bool"),
    (lambda a, c, n: float("nan"), "got nan, expected a finite number"),
    (lambda a, c, n: a * (n - 1) / (n - 2) if n > 2 else math.inf, "got inf, expected a finite number"),
])
def test_busbw_garbage(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as e:
        check.busbw(wrong)
    assert "\n" not in str(e.value)


# --- exercise 2 -------------------------------------------------------------------------------

def _ols(s, t):
    beta, alpha = np.polyfit(s, t, 1)
    return alpha, beta


def _through_origin(s, t):
    return 0.0, float(np.sum(s * t) / np.sum(s * s))


def _log_log(s, t):
    k, c = np.polyfit(np.log(s), np.log(t), 1)
    return math.exp(c), k


def _log10_raw(s, t):
    k, c = np.polyfit(np.log10(s), np.log10(t), 1)
    return c, k


def _largest_two(s, t):
    beta = (t[-1] - t[-2]) / (s[-1] - s[-2])
    return t[-1] - beta * s[-1], beta


def _endpoints(s, t):
    beta = (t[-1] - t[0]) / (s[-1] - s[0])
    return t[0] - beta * s[0], beta


def _min_time(s, t):
    return float(t.min()), _ols(s, t)[1]


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, t: (_ols(s, t)[0], 1 / _ols(s, t)[1]), "not the bandwidth B in bytes/s"),
    (lambda s, t: _ols(s, t)[::-1], "in that order"),
    (lambda s, t: np.polyfit(s, t, 1), "np.polyfit\\(sizes, seconds, 1\\) gives \\[beta, alpha\\]"),
    (_log_log, "log-log"),
    (_log10_raw, "log-log"),
    (_through_origin, "does not pass through the origin"),
    (lambda s, t: (0.0, float(np.mean(t / s))), "does not pass through the origin"),
    (_largest_two, "goes through two of the points"),
    (_endpoints, "goes through two of the points"),
    (_min_time, "not the smallest measured time"),
    (lambda s, t: (float(t.min()), _endpoints(s, t)[1]), "not the smallest measured time"),
    (lambda s, t: (_ols(s, t)[0] * 1.01, _ols(s, t)[1]), "by least squares over every point"),
])
def test_fit_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.fit_alpha_beta(wrong)


def test_fit_mistakes_named_on_the_measured_sweep_too():
    with pytest.raises(ExerciseFailed, match="goes through two of the points"):
        check.fit_alpha_beta(lambda s, t: _largest_two(s, t), *_sweep())


def test_fit_two_points_pass_exact_data_but_fail_noisy():
    with pytest.raises(ExerciseFailed, match="^Exercise 2 \\(fit alpha and beta\\): on the same times with 3% noise"):
        check.fit_alpha_beta(_largest_two)


def test_fit_synthetic_cases_include_one_negative_free_alpha():
    # the first two keep α > 0 (the clamp does not decide them); the last is the case where it does
    assert [check._ols(s, t)[0] > 0 for _, s, t in check._synthetic_cases()] == [True, True, False]


def test_fit_wrong_only_on_the_measured_sweep():
    sizes, seconds = _sweep()

    def cheat(s, t):  # right on the synthetic data, through the origin on the measured sweep
        return _through_origin(s, t) if t[0] == seconds[0] else _ols(s, t)

    with pytest.raises(ExerciseFailed, match="on your measured sweep \\(17 sizes\\)"):
        check.fit_alpha_beta(cheat, sizes, seconds)


def test_fit_accepts_either_answer_when_the_free_alpha_is_negative(capsys):
    sizes = [2.0 ** k for k in range(10, 20)]
    seconds = [s / 1e8 * (1.3 if s > 2**18 else 1.0) for s in sizes]  # steeper at the top: free α < 0
    assert check._ols(np.array(sizes), np.array(seconds))[0] < 0
    check.fit_alpha_beta(fit_alpha_beta, sizes, seconds)  # np.polyfit: α < 0
    check.fit_alpha_beta(_package_fit, sizes, seconds)  # the package: α clamped to 0, B refitted
    assert capsys.readouterr().out.count("passed") == 2


def test_fit_measured_sweep_that_cannot_be_fitted_is_left_out(capsys):
    sizes = [1024, 2048, 4096]
    check.fit_alpha_beta(fit_alpha_beta, sizes, [3e-3, 2e-3, 1e-3])  # all latency: the synthetic cases decide
    check.fit_alpha_beta(fit_alpha_beta, sizes, [1e-3, 9e-3, 2e-3])  # R² far below 0.9: too noisy to judge by
    assert capsys.readouterr().out.count("passed") == 2


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, t: (max(np.polyfit(s, t, 1)[1], 0.0), np.polyfit(s, t, 1)[0]), "refit the line through the origin"),
    (lambda s, t: (np.polyfit(s, t, 1)[1] * 1e6, np.polyfit(s, t, 1)[0] * 1e9), "convert neither to µs, ms or ns"),
    (lambda s, t: (np.polyfit(s, t, 1)[1] * 1e3, np.polyfit(s, t, 1)[0]), "convert neither to µs, ms or ns"),
])
def test_fit_clamp_and_unit_mistakes_are_named(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.fit_alpha_beta(wrong)


def test_fit_may_keep_a_negative_free_alpha_or_refit_through_the_origin():
    def refit(s, t):
        beta, alpha = np.polyfit(s, t, 1)
        return (0.0, float(np.sum(s * t) / np.sum(s * s))) if alpha < 0 else (float(alpha), float(beta))

    check.fit_alpha_beta(refit)
    check.fit_alpha_beta(fit_alpha_beta)


def test_pass_both_sizes_and_seconds():
    sizes = [1024, 2048, 4096]
    with pytest.raises(ExerciseFailed, match="pass both sizes and seconds"):
        check.fit_alpha_beta(fit_alpha_beta, sizes)


@pytest.mark.parametrize("wrong, message", [
    (lambda s, t: None, "should return a tuple \\(alpha, beta\\) of numbers, got NoneType"),
    (lambda s, t: 5e-3, "got float"),
    (lambda s, t: alpha_beta.fit_alpha_beta(s, t), "got AlphaBeta"),
    (lambda s, t: (5e-3, 2.5e-9, 0.99), "two numbers \\(alpha, beta\\), got 3"),
    (lambda s, t: (5e-3,), "got 1"),
    (lambda s, t: ("5e-3", 2.5e-9), "alpha should return a number"),
    (lambda s, t: (float("nan"), 2.5e-9), "alpha = nan"),
    (lambda s, t: (5e-3, math.inf), "beta = inf"),
])
def test_fit_garbage(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as e:
        check.fit_alpha_beta(wrong)
    assert "\n" not in str(e.value)


# --- exercise 3 -------------------------------------------------------------------------------

def _ring(s, n, b):
    return 2 * (n - 1) / n * s / b


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, n, b, a: s / b + a, "one message of S bytes"),
    (lambda s, n, b, a: s / b + 2 * (n - 1) * a, "carries 2\\(n-1\\)/n·S bytes, not S"),
    (lambda s, n, b, a: (n - 1) / n * s / b + (n - 1) * a, "that is a reduce-scatter"),
    (lambda s, n, b, a: (n - 1) / n * s / b + 2 * (n - 1) * a, "an all-reduce is both"),
    (lambda s, n, b, a: 2 * (n - 1) * s / b + 2 * (n - 1) * a, "a chunk of S/n bytes, not S"),
    (lambda s, n, b, a: _ring(s, n, b) + a, "not α once"),
    (lambda s, n, b, a: _ring(s, n, b) + (n - 1) * a, "not n-1"),
    (lambda s, n, b, a: _ring(s * 8, n, b) + 2 * (n - 1) * a, "no factor of 8"),
    (lambda s, n, b, a: _ring(s, n, b * 8) + 2 * (n - 1) * a, "no factor of 8"),
    (lambda s, n, b, a: _ring(s / 2**30, n, b / 1e9) + 2 * (n - 1) * a, "off by 7%"),
    (lambda s, n, b, a: _ring(s / 1e9, n, b / 2**30) + 2 * (n - 1) * a, "off by 7%"),
    (lambda s, n, b, a: 2 * (n - 1) / n * s / (b * 1e9) + 2 * (n - 1) * a, "do not multiply it by 1e9"),
    (lambda s, n, b, a: 1e3 * predict_allreduce(s, n, b, a), "not milliseconds"),
    (lambda s, n, b, a: 1e6 * predict_allreduce(s, n, b, a), "not microseconds"),
    (lambda s, n, b, a: s / b + 2 * n * a, "fit none of the usual mistakes"),
])
def test_predict_allreduce_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.predict_allreduce(wrong)


def test_predict_allreduce_names_the_link():
    with pytest.raises(ExerciseFailed, match="n=8, bandwidth=4.5e\\+11 bytes/s \\(NVLink 4 \\(H100 SXM\\)\\)"):
        check.predict_allreduce(lambda s, n, b, a: s / b + a)


@pytest.mark.parametrize("wrong, message", [
    (lambda s, n, b, a: None, "should return a number \\(seconds\\), got NoneType"),
    (lambda s, n, b, a: [predict_allreduce(s, n, b, a)], "got list"),
    (lambda s, n, b, a: float("nan"), "got nan, expected a finite number \\(seconds\\)"),
])
def test_predict_allreduce_garbage(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as e:
        check.predict_allreduce(wrong)
    assert "\n" not in str(e.value)


# --- exercise 4 -------------------------------------------------------------------------------

def _k(s, m, t):
    return s * (1 - t) / (t * m)


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, m, t: 0 if s / (m + s) <= t else math.ceil(_k(s, m, t)), "when one already meets the target, return 1"),
    (lambda s, m, t: math.floor(_k(s, m, t)), "round k = .* up"),
    (lambda s, m, t: max(1, math.floor(_k(s, m, t))), "round k = .* up"),
    (lambda s, m, t: max(1, round(_k(s, m, t))), "round k = .* up"),
    (lambda s, m, t: math.floor(_k(s, m, t)) + 1, "a k that meets it exactly is enough"),
    (lambda s, m, t: max(1, math.ceil(s / (t * m))), "not sync / \\(k·micro\\)"),
    (lambda s, m, t: max(1, math.ceil(_k(s, m, t))) + 1, "the smallest k with"),
])
def test_accumulation_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.accumulation_steps(wrong)


def test_accumulation_message_shows_the_share():
    with pytest.raises(ExerciseFailed, match="with a 350 ms sync, 120 ms micro-batches and target 0.1 you returned "
                                             "k = 26 \\(at k = 26 the sync takes 10.1% of the step\\), expected 27"):
        check.accumulation_steps(lambda s, m, t: max(1, math.floor(_k(s, m, t))))


@pytest.mark.parametrize("wrong, message", [
    (lambda s, m, t: float(max(1, math.ceil(_k(s, m, t)))), "should return an int .*got float 18.0.*np.ceil"),
    (lambda s, m, t: np.ceil(_k(s, m, t)), "got float64"),
    (lambda s, m, t: None, "got NoneType None"),
    (lambda s, m, t: True, "got bool True"),
    (lambda s, m, t: float("nan"), "got float nan"),
])
def test_accumulation_garbage(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as e:
        check.accumulation_steps(wrong)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spelling", ["allreduce", "all-reduce"])
@pytest.mark.parametrize("otherwise", ["raise", "half"])
def test_busbw_names_a_collective_spelt_otherwise(spelling, otherwise):
    """A branch on "allreduce" was answered with a hint about the bus factor."""
    def mine(algbw, collective, n):
        if collective == spelling:
            return algbw * 2 * (n - 1) / n
        if collective in ("all_gather", "reduce_scatter") or otherwise == "half":
            return algbw * (n - 1) / n
        raise ValueError(f"unknown collective {collective!r}")

    with pytest.raises(ExerciseFailed, match=f"busbw\\(algbw, '{spelling}', n\\) gets the factor of 'all_reduce'.*"
                                             "the collective is called 'all_reduce'"):
        check.busbw(mine)


def test_busbw_formula_only_on_a_repeated_failure():
    wrong = lambda a, c, n: busbw(a, c, n) * 1.01  # noqa: E731
    with pytest.raises(ExerciseFailed) as first:
        check.busbw(wrong)
    assert "2(n-1)/n" not in str(first.value) and "if it fails again" in str(first.value)
    with pytest.raises(ExerciseFailed, match="defines busbw = algbw × 2\\(n-1\\)/n"):
        check.busbw(wrong)


def test_fit_polyfit_only_on_a_repeated_failure():
    wrong = lambda s, t: (_ols(s, t)[0] * 1.01, _ols(s, t)[1])  # noqa: E731
    with pytest.raises(ExerciseFailed) as first:
        check.fit_alpha_beta(wrong)
    assert "polyfit" not in str(first.value)
    with pytest.raises(ExerciseFailed, match="np.polyfit"):
        check.fit_alpha_beta(wrong)
