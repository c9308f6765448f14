"""teraflops.triage.rank_traces: real multi-rank traces get the triage verdict their workload is built for.

One launch (4 gloo ranks on the CPU machine) runs the three workloads; rank 0's trace of each, with
the waits of all ranks, goes through :func:`teraflops.triage.verdict.triage` at this machine's measured
ceilings and launch floor (its defaults). Argument errors are checked without launching.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from teraflops.launch import leftovers
from teraflops.triage import rank_traces, verdict
from teraflops.triage.rank_traces import RankTraceError, profile_ranks


def deepspeed_shm_files():
    """DeepSpeed's buffers that no live process maps (another launch on this machine maps its own)."""
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) - {Path(m) for m in leftovers.mapped()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``(traces by workload, DeepSpeed /dev/shm files the launch left, processes it left)``."""
    before = deepspeed_shm_files()
    found = profile_ranks(out_dir=tmp_path_factory.mktemp("rank_traces"))
    return found, deepspeed_shm_files() - before, psutil.Process().children(recursive=True)


@pytest.fixture(scope="module")
def verdicts(launched):
    """The triage of each workload's rank-0 trace with its waits, at this machine's ceilings."""
    found = {name: verdict.triage(rt.trace, waits=rt.waits) for name, rt in launched[0].items()}
    for name, r in found.items():  # shown with -s: what each verdict rests on
        print(f"\n{name}: {r.summary()}\n{r.table()}")
    return found


@pytest.mark.slow
def test_the_launch_leaves_no_process_or_shared_memory(launched):
    assert not launched[1] and not launched[2]


@pytest.mark.slow
def test_every_rank_wrote_its_trace_and_waits(launched):
    found = launched[0]
    assert tuple(found) == rank_traces.WORKLOADS
    for name, rt in found.items():
        assert rt.workload == name and rt.ranks >= 3 and len(rt.traces) == rt.ranks and rt.trace == rt.traces[0]
        for r, path in enumerate(rt.traces):
            assert path.name == f"{name}.rank{r}.json"
            assert json.loads(path.read_text())["distributedInfo"]["rank"] == r
        assert len(rt.waits) == rank_traces.STEPS and all(len(row) == rt.ranks for row in rt.waits)
        assert all(w > 0 for row in rt.waits for w in row)  # every step of every workload communicates
    assert found["straggler"].straggler == found["straggler"].ranks - 1 and found["straggler"].delay_s > 0
    assert found["zero3"].straggler is None and found["allreduce"].delay_s == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3", "allreduce"])
def test_zero3_and_tiny_all_reduces_are_communication_bound_with_even_waits(verdicts, name):
    r = verdicts[name]
    assert r.verdict == "communication-bound" == rank_traces.EXPECTED[name], r.shares
    assert r.stragglers == () and r.shares["waiting"] == 0


@pytest.mark.slow
def test_a_late_rank_makes_rank_0_wait(launched, verdicts):
    rt, r = launched[0]["straggler"], verdicts["straggler"]
    assert r.verdict == "waiting (straggler)" == rt.expected, r.shares
    assert r.stragglers == (rt.ranks - 1,) == (rt.straggler,)


# ---- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    ({"workloads": ("zero3", "ddp")}, "unknown workload(s) ['ddp']"),
    ({"workloads": ()}, "no workload given"),
    ({"workloads": "straggler", "ranks": 2}, "ranks must be an int >= 3"),
    ({"workloads": ("allreduce",), "ranks": 1}, "ranks must be an int >= 2"),
    ({"ranks": 4.0}, "ranks must be an int"),
    ({"steps": 0}, "steps must be an int >= 1"),
])
def test_bad_arguments_are_one_line_errors_before_any_launch(monkeypatch, kwargs, words):
    import teraflops.launch.launcher as distributed

    monkeypatch.setattr(distributed, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(RankTraceError) as e:
        profile_ranks(**kwargs)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and "Hint:" in msg


def test_collective_seconds_counts_overlapping_ranges_once():
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 50},
          {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1, "ts": 100, "dur": 10},
          {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2, "ts": 105, "dur": 95},
          {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 300}]
    assert rank_traces.collective_seconds({"traceEvents": ev}) == pytest.approx(100e-6)
