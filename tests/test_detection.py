"""The straggler detector: median/MAD flags a slow rank that mean/std would miss, and stays quiet on jitter."""

from types import SimpleNamespace

import numpy as np
import pytest

from teraflops.orchestration.detection import (detect, detection_rows, detection_table, false_alarm_rate,
    flag_stragglers, modified_z)


def jittered(steps=20, ranks=4, base=0.04, jitter=0.002, seed=0):
    return base + np.random.default_rng(seed).uniform(0, jitter, size=(steps, ranks))


def test_one_slow_rank_is_flagged_where_a_mean_std_z_score_cannot_reach_the_threshold():
    busy = jittered()
    busy[:, 3] += 0.05
    assert flag_stragglers(busy) == [3]
    means = busy.mean(axis=0)
    assert ((means - means.mean()) / means.std()).max() < 3.5  # (n-1)/sqrt(n) = 1.5 for n = 4


def test_jitter_alone_is_not_flagged_thanks_to_the_mad_floor():
    busy = jittered(jitter=0.004)
    assert flag_stragglers(busy) == []
    assert modified_z([1.0, 1.0, 1.0, 1.0]).tolist() == [0, 0, 0, 0]


def test_intermittent_straggler_is_caught_by_windows_and_false_alarms_are_counted():
    busy = jittered(steps=24)
    busy[::4, 2] += 0.1  # every 4th step
    d = detect(busy, window=5)
    assert d.flagged == (2,) and d.fraction[2] == 1.0 and d.run_z[2] > 3.5
    assert false_alarm_rate(d, injected=(2,)) == 0.0
    quiet = detect(jittered(steps=24, seed=1))
    assert quiet.flagged == () and false_alarm_rate(quiet) == 0.0


def test_rows_and_table_report_caught_and_false_alarms():
    busy = jittered()
    busy[:, 1] += 0.03
    rows = detection_rows([SimpleNamespace(name="delay 30 ms", busy=busy, injected_ranks=(1,)),
                           SimpleNamespace(name="none", busy=jittered(seed=2), injected_ranks=())])
    assert rows[0]["caught"] and rows[0]["exact"] and rows[1]["flagged"] == () and rows[1]["false_alarm_rate"] == 0
    assert "slowed rank" in detection_table(rows)


@pytest.mark.parametrize("bad", [np.ones((5, 2)), -np.ones((5, 4)), np.full((5, 4), np.nan)])
def test_bad_input_is_one_line(bad):
    with pytest.raises(ValueError) as e:
        flag_stragglers(bad)
    assert "\n" not in str(e.value)
