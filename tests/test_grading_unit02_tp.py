"""Unit 2 lab, exercises 5-6 (tensor parallelism): the reference passes, plausible wrong answers fail with their hint."""

import pytest

from teraflops.errors import ExerciseFailed
from teraflops.grading import unit02 as check


def fails(check_fn, answer, *phrases):
    with pytest.raises(ExerciseFailed) as e:
        check_fn(answer)
    msg = str(e.value)
    assert msg.startswith(f"Exercise {check_fn.exercise.number} (") and "\n" not in msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


def tp_bytes(b, s, h, d):
    return 4 * b * s * h * d


@pytest.mark.parametrize("wrong, phrase", [
    (lambda b, s, h, d: 2 * b * s * h * d, "backward all-reduces too"),
    (lambda b, s, h, d: 12 * h * h * d, "not the block's 12h² parameters"),
    (lambda b, s, h, d: 4 * b * s * h, "dtype_bytes"),
    (lambda b, s, h, d: 32 * b * s * h * d, "bytes, not bits"),
    (lambda b, s, h, d: 12 * b * s * h * d, "fused QKV"),
])
def test_tp_bytes_wrong_answers_fail_before_any_launch(wrong, phrase):
    fails(check.tp_bytes_per_layer, wrong, phrase)


@pytest.mark.slow
def test_tp_bytes_reference_passes_against_a_real_run(capsys):
    check.tp_bytes_per_layer(tp_bytes)
    assert "passed" in capsys.readouterr().out
    fails(check.tp_bytes_per_layer, lambda b, s, h, d: tp_bytes(b, s, h, d) * (1 + 1e-3), "expected")


def max_degree(tokens, hidden, layers, bandwidth, budget_s, dtype_bytes=2):
    best = 1
    for n in (2, 4, 8, 16, 32, 64):
        if 4 * layers * 2 * (n - 1) / n * tokens * hidden * dtype_bytes / bandwidth <= budget_s:
            best = n
    return best


@pytest.mark.slow
def test_max_tp_degree_reference_passes_the_formula_and_a_real_4_rank_run(capsys):
    check.max_tp_degree(max_degree)  # the formula's cases, then the bytes a real 4-rank TP run all-reduced
    assert "passed" in capsys.readouterr().out


def test_max_tp_degree_mistakes_are_named_before_any_run():
    def no_ring_factor(t, h, layers, bw, budget, d=2):
        return 64 if 4 * layers * t * h * d / bw <= budget else 1

    def forward_only(t, h, layers, bw, budget, d=2):
        return max_degree(t, h, layers / 2, bw, budget, d)

    fails(check.max_tp_degree, no_ring_factor, "2(n−1)/n of the buffer")
    fails(check.max_tp_degree, forward_only, "backward's 2 all-reduces")
    fails(check.max_tp_degree, lambda *a: 4.0, "int degree")
