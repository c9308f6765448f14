"""Tail at scale: expected maximum of N draws, and the hiccup model."""

import numpy as np
import pytest

from teraflops.orchestration.tail import expected_max, hiccup_step, hours_between_interruptions, tail_rows, tail_table


def test_expected_max_matches_closed_forms_and_a_simulation():
    x = np.arange(1, 7)  # a fair die
    assert expected_max(x, 1) == pytest.approx(3.5)
    assert expected_max(x, 2) == pytest.approx(161 / 36)  # E[max of two dice]
    rng = np.random.default_rng(0)
    sim = rng.choice(x, size=(200_000, 8)).max(axis=1).mean()
    assert expected_max(x, 8) == pytest.approx(sim, rel=0.01)
    assert expected_max(x, 4096) == pytest.approx(6, rel=1e-6)  # capped at the largest sample


def test_hiccup_model_reproduces_dean_and_barroso():
    assert hiccup_step(0.0, 1.0, 0.01, 100) == pytest.approx(0.634, abs=1e-3)
    with pytest.raises(ValueError):
        hiccup_step(0, 1, 1.5, 8)


def test_rows_grow_with_ranks_and_mark_lower_bounds():
    samples = np.random.default_rng(1).lognormal(np.log(0.04), 0.2, size=80)
    rows = tail_rows(samples, base_s=0.04, delay_s=0.1, p=1e-3)
    emp = [r["empirical_ms"] for r in rows]
    assert emp == sorted(emp) and rows[0]["lower_bound"] is False and rows[-1]["lower_bound"] is True
    assert rows[-1]["p_any_hiccup"] > 0.98 and ">=" in tail_table(rows)
    assert hours_between_interruptions() == pytest.approx(54 * 24 / 419)
