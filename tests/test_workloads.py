"""teraflops.triage.workloads: the in-process unit workloads run and triage to whole shares on this machine;
on their recorded traces (tests/data/triage) each gets its unit's verdict and a fix moves it; the
mysteries' key is seeded (the multi-rank workloads: tests/test_rank_traces.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from teraflops.ceilings import Ceilings
from teraflops.errors import CourseError
from teraflops.triage import verdict, workloads

DATA = Path(__file__).parent / "data" / "triage"
RECORDED = json.loads((DATA / "recorded.json").read_text())
AT_RECORDING = Ceilings(RECORDED["ceilings"]["peak_flops"], RECORDED["ceilings"]["bandwidth"], torch.float32, "cpu",
                        0, 0, source="recorded")


@pytest.fixture(scope="module")
def recorded_rows():
    """:func:`workloads.verdict_rows` of the recorded in-process traces, at the recording's ceilings."""
    runs = []
    for name in workloads.LOCAL:
        unit, expected, what = (workloads.UNIT_WORKLOADS[name] if name in workloads.UNIT_WORKLOADS
                                else (workloads.MIXED_WORKLOADS[name][0], None, workloads.MIXED_WORKLOADS[name][1]))
        runs.append(workloads.Profiled(name, unit, DATA / RECORDED["workloads"][name]["trace"], None, expected, what))
    rows = workloads.verdict_rows(runs, ceilings=AT_RECORDING, launch_floor=RECORDED["launch_floor"])
    return {r["name"]: r for r in rows}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """The in-process workloads profiled here, now, triaged at the recording's ceilings (given as numbers)."""
    out = tmp_path_factory.mktemp("workloads")
    runs = [workloads.profile(n, out) for n in workloads.LOCAL]
    return {r["name"]: r for r in workloads.verdict_rows(runs, ceilings=AT_RECORDING,
                                                         launch_floor=RECORDED["launch_floor"])}


@pytest.mark.parametrize("name", ["matmul", "naive_attention", "decode"])
def test_recorded_unit_workloads_get_their_units_verdict(recorded_rows, name):
    r = recorded_rows[name]
    assert r["expected"] == workloads.UNIT_WORKLOADS[name][1]
    assert r["matches"] is True and r["result"].verdict == verdict.VERDICTS[r["expected"]], r["result"].summary()


def test_the_fixes_move_the_bottleneck_in_the_recordings(recorded_rows):
    rows = recorded_rows
    assert rows["sdpa_attention"]["matches"] is None and rows["batched_decode"]["matches"] is None
    assert rows["sdpa_attention"]["result"].verdict != "memory-bound"  # fused: the scores are never written
    assert rows["batched_decode"]["result"].shares["overhead"] < rows["decode"]["result"].shares["overhead"] / 2


def test_live_workloads_write_traces_that_triage_to_whole_shares(rows):
    """Each workload profiled here: its trace written under its name, shares non-negative summing to 1,
    and ``matches`` saying whether the verdict is the unit's (which verdict won is the recordings' test)."""
    assert list(rows) == list(workloads.LOCAL)
    for name, r in rows.items():
        t = r["result"]
        assert abs(sum(t.shares.values()) - 1) < 1e-9 and min(t.shares.values()) >= 0 and t.step_s > 0, name
        assert t.evidence and t.verdict in verdict.VERDICTS.values()
        assert r["matches"] == (None if r["expected"] is None else t.verdict == verdict.VERDICTS[r["expected"]])
    # counted, not timed: the same FLOPs as the recording at the same preset
    rec = {e.name: e.flops for e in verdict.triage(DATA / RECORDED["workloads"]["matmul"]["trace"], ceilings=AT_RECORDING,
                                                    launch_floor=RECORDED["launch_floor"]).evidence}
    assert {e.name: e.flops for e in rows["matmul"]["result"].evidence}["aten::mm"] == rec["aten::mm"]


def test_table_and_plot_show_every_workload(recorded_rows):
    rs = list(recorded_rows.values())
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
