"""teraflops.triage.workloads: the in-process unit workloads get their unit's verdict on this machine, a
fix moves it, and the mysteries' key is seeded (the multi-rank workloads: tests/test_rank_traces.py)."""

from __future__ import annotations

import pytest

from teraflops.triage import verdict, workloads
from teraflops.errors import CourseError


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("workloads")
    runs = [workloads.profile(n, out) for n in workloads.LOCAL]
    return {r["name"]: r for r in workloads.verdict_rows(runs)}


@pytest.mark.parametrize("name", ["matmul", "naive_attention", "decode"])
def test_unit_workloads_get_their_units_verdict(rows, name):
    r = rows[name]
    assert r["expected"] == workloads.UNIT_WORKLOADS[name][1]
    # On a busy machine with no quiet ceilings to fall back on, triage says it cannot tell (issue 29).
    assert r["matches"] or "inconclusive: machine busy" in r["result"].note, f"{name}: {r['result'].summary()}"


def test_the_fixes_move_the_bottleneck(rows):
    assert rows["sdpa_attention"]["matches"] is None and rows["batched_decode"]["matches"] is None
    assert rows["sdpa_attention"]["result"].verdict != "memory-bound"  # fused: the scores are never written
    assert rows["batched_decode"]["result"].shares["overhead"] < rows["decode"]["result"].shares["overhead"] / 2


def test_table_and_plot_show_every_workload(rows):
    rs = list(rows.values())
    text = workloads.verdict_table(rs)
    assert all(r["name"] in text and r["result"].verdict in text for r in rs)
    ax = workloads.plot_shares(rs)
    assert len(ax.patches) == len(rs) * len(verdict.CATEGORIES)
    import matplotlib.pyplot as plt

    plt.close("all")


def test_mystery_key_is_seeded_and_holds_one_of_each_kind():
    for seed in range(20):
        key = workloads.mystery_key(seed)
        assert list(key) == list(workloads.MYSTERY_LABELS) and sorted(key.values()) == sorted(workloads.MYSTERY_KINDS)
        assert key == workloads.mystery_key(seed)
    assert len({tuple(workloads.mystery_key(s).values()) for s in range(20)}) > 5


def test_unknown_workloads_are_one_line_errors(tmp_path):
    with pytest.raises(CourseError, match="unknown in-process workload 'zero3'.*profile_ranks"):
        workloads.profile("zero3", tmp_path)
    with pytest.raises(CourseError, match="unknown workload.*'mamtul'"):
        workloads.profile_units(tmp_path, names=("mamtul",))
