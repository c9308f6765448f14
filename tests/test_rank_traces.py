"""teraflops.triage.rank_traces: real multi-rank traces, and the verdicts of the recorded ones.

One launch (4 gloo ranks on the CPU machine) runs the three workloads; the tests of it assert what
does not depend on the load while it ran: every rank wrote its trace and waits, no process or shared
memory is left, and rank 0's trace triages to shares that sum to 1. The verdict each workload is built
for is asserted on its recorded trace (tests/data/triage, with its waits and the ceilings and launch
floor of the recording: see tests/data/triage/README.md): measured beside other work, the ZeRO-3 step
read "overhead" 0.455 over "communication" 0.429 once. Argument errors are checked without launching.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

from teraflops.ceilings import Ceilings
from teraflops.launch import leftovers
from teraflops.orchestration.detection import THRESHOLD
from teraflops.triage import rank_traces, verdict
from teraflops.triage.rank_traces import RankTraceError, profile_ranks

DATA = Path(__file__).parent / "data" / "triage"
RECORDED = json.loads((DATA / "recorded.json").read_text())
AT_RECORDING = Ceilings(RECORDED["ceilings"]["peak_flops"], RECORDED["ceilings"]["bandwidth"], torch.float32, "cpu",
                        0, 0, source="recorded")


def recorded(name: str, waits="recorded") -> verdict.Triage:
    """Rank 0's recorded trace of workload ``name``, triaged with ``waits`` (default its recorded ones)."""
    w = RECORDED["workloads"][name]
    return verdict.triage(DATA / w["trace"], waits=w["waits"] if waits == "recorded" else waits,
                          ceilings=AT_RECORDING, launch_floor=RECORDED["launch_floor"])


# ---- the recorded traces: the verdicts ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["zero3", "allreduce"])
def test_zero3_and_tiny_all_reduces_are_communication_bound_with_even_waits(name):
    r = recorded(name)
    assert r.verdict == "communication-bound" == rank_traces.EXPECTED[name], r.shares
    assert r.stragglers == () and r.shares["waiting"] == 0 and r.note.startswith("No rank stands out")


def test_zero3_s_hooks_waiting_on_their_all_gathers_count_as_communication():
    """The rule that decides ZeRO-3: DeepSpeed's autograd nodes and module hooks (no work of their own)
    wait for the parameter all-gathers; their time during a collective in flight is communication.
    Without any collective in the trace, the same time is overhead."""
    r = recorded("zero3", waits=None)
    events = [e for e in verdict.load_trace(DATA / RECORDED["workloads"]["zero3"]["trace"])[0]
              if not verdict.is_collective(e["name"], e.get("cat", ""))]
    blind = verdict.triage(events, ceilings=AT_RECORDING, launch_floor=RECORDED["launch_floor"])
    assert r.shares["communication"] > r.shares["overhead"] and blind.shares["communication"] == 0
    assert blind.shares["overhead"] > r.shares["overhead"] + 0.5 * r.shares["communication"]


def test_a_late_rank_makes_rank_0_wait():
    r = recorded("straggler")
    late = len(RECORDED["workloads"]["straggler"]["waits"][0]) - 1
    assert r.verdict == "waiting (straggler)" == rank_traces.EXPECTED["straggler"], r.shares
    assert r.stragglers == (late,)


def test_the_straggler_flag_on_each_side_of_the_threshold():
    """Rank 0's recorded straggler step with waits made up around the detector's threshold (modified
    z of the ranks' mean waits, :data:`teraflops.orchestration.detection.THRESHOLD`): even waits flag
    no one (communication-bound); one rank waiting far less is the straggler (waiting); one waiting a
    little less (z under the threshold) is not."""
    even = [[0.20, 0.21, 0.20, 0.21]] * 3
    assert recorded("straggler", even).stragglers == ()
    assert recorded("straggler", even).verdict != "waiting (straggler)"
    late = [[0.20, 0.21, 0.20, 0.01]] * 3
    assert recorded("straggler", late).stragglers == (3,)
    assert recorded("straggler", late).verdict == "waiting (straggler)"
    near = [[0.20, 0.22, 0.21, 0.19]] * 3  # rank 3 waits least, but within the others' spread
    r = recorded("straggler", near)
    assert r.stragglers == () and f"<= {THRESHOLD:g}" in r.note


# ---- the launch: what does not depend on the load -----------------------------------------------------


def deepspeed_shm_files():
    """DeepSpeed's buffers that no live process maps (another launch on this machine maps its own)."""
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) - {Path(m) for m in leftovers.mapped()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``(traces by workload, DeepSpeed /dev/shm files the launch left, processes it left)``."""
    before = deepspeed_shm_files()
    found = profile_ranks(out_dir=tmp_path_factory.mktemp("rank_traces"))
    return found, deepspeed_shm_files() - before, psutil.Process().children(recursive=True)


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
        assert rt.expected == rank_traces.EXPECTED[name]
    assert found["straggler"].straggler == found["straggler"].ranks - 1 and found["straggler"].delay_s > 0
    assert found["zero3"].straggler is None and found["allreduce"].delay_s == 0


@pytest.mark.slow
def test_every_rank_0_trace_triages_to_whole_shares(launched):
    """Each live rank-0 trace with its waits, at fixed ceilings: shares non-negative summing to 1, time
    in collectives found (communication or waiting), the collectives among the evidence; which share
    wins is the recorded traces' test above."""
    for name, rt in launched[0].items():
        r = verdict.triage(rt.trace, waits=rt.waits, ceilings=AT_RECORDING, launch_floor=RECORDED["launch_floor"],
                           top=50)
        assert abs(sum(r.shares.values()) - 1) < 1e-9 and min(r.shares.values()) >= 0, (name, r.shares)
        assert r.shares["communication"] + r.shares["waiting"] > 0 and r.step_s > 0, (name, r.shares)
        assert any(verdict.is_collective(e.name) for e in r.evidence), name
        assert r.verdict in verdict.VERDICTS.values()


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
