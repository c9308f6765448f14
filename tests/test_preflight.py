"""``teraflops preflight``: checks run or skip with a reason, a failure is one line naming the check,
and results.json is in the report card's reference format."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from teraflops.course import preflight, report_card
from teraflops.machine import GPU, Machine

CHEAP = ["device", "triton-flash", "ceilings", "profiler-verdicts", "ladder-contention", "triage"]


def test_checks_needing_gpus_are_skipped_with_the_reason(monkeypatch):
    ran = []
    checks = (preflight.Check("a", "runs everywhere", lambda: ran.append("a") or (1.0, "x", "fine")),
              preflight.Check("b", "needs two GPUs", lambda: ran.append("b") or (2.0, "y", "fine"), gpus=2),
              preflight.Check("c", "fails", lambda: preflight._need(False, "measured 3, expected 4")))
    monkeypatch.setattr("teraflops.machine.detect", lambda: Machine("cpu", cpu_cores=2))
    results = preflight.run(checks, progress=False)
    assert ran == ["a"] and [r.status for r in results] == ["passed", "skipped", "failed"]
    assert "needs 2 GPUs, this machine has 0" in results[1].detail and results[2].detail == "measured 3, expected 4"
    monkeypatch.setattr("teraflops.machine.detect", lambda: Machine("cuda", (GPU(0, "g", 1, (8, 0)),) * 2))
    assert [r.status for r in preflight.run(checks[:2], progress=False)] == ["passed", "passed"]
    with pytest.raises(preflight.CourseError, match="no preflight check named nope"):
        preflight.run(checks, only=["nope"])


def test_an_unexpected_exception_is_one_line_with_its_place():
    def broken():
        raise KeyError("max_error")

    r, = preflight.run((preflight.Check("k", "broken", broken),), progress=False)
    assert r.status == "failed" and r.detail.startswith("KeyError: 'max_error' (test_preflight.py:") and "\n" not in r.detail


def test_results_json_is_a_reference_the_report_card_reads(tmp_path):
    results = [preflight.CheckResult("ceilings", "peak", "passed", "ok", 1.0, 12.5, "FLOP/byte"),
               preflight.CheckResult("zero", "zero", "failed", "boom", 2.0)]
    machine = Machine("cuda", (GPU(0, "NVIDIA H200", 141 << 30, (9, 0)),))
    (tmp_path / "h200.json").write_text(json.dumps(preflight.results_json(machine, results)))
    ref, = report_card.load_references(tmp_path)
    assert ref["gpu"] == "NVIDIA H200" and ref["notebooks"]["preflight"] == {
        "ceilings": {"value": 12.5, "unit": "FLOP/byte", "label": "peak"}}
    assert [c["status"] for c in ref["checks"]] == ["passed", "failed"]


def _preflight(tmp_path, *args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "teraflops.course.cli", "preflight", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_cheap_checks_pass_on_this_machine_and_write_results(tmp_path):
    """The cheap checks run for real. Those that measure mechanisms (positive ceilings, a verdict per
    operator, rungs measured) pass; the triage check's verdicts come from timings taken now, so it may end
    passed, inconclusive or failed (its judgment on given verdicts is tests/test_busy_verdicts.py's): it must
    end in one of them, on one line, and the exit code must follow a failure."""
    out = _preflight(tmp_path, "--only", *CHEAP)
    lines = out.stdout.splitlines()
    for name in CHEAP:
        mine = [line for line in lines if line.split()[1:2] == [name] and line.split()[0] in ("ok", "??", "FAIL", "skip")]
        ends = ("ok", "??", "FAIL") if name in preflight.TIMED_VERDICTS else ("ok",)
        assert mine and mine[0].split()[0] in ends, out.stdout[-3000:] + out.stderr[-2000:]
    triage_failed = any(line.startswith("FAIL") and " triage " in line for line in lines)
    assert out.returncode == (1 if triage_failed else 0), out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert {c["name"] for c in data["checks"]} == set(CHEAP)
    assert all(c["status"] in ("passed", "inconclusive", "failed") for c in data["checks"])


@pytest.mark.slow
def test_a_check_made_to_fail_exits_non_zero_with_one_line_naming_it(tmp_path):
    # a stand-in fault: the GPU preset forced on a machine without a GPU
    out = _preflight(tmp_path, "--only", "ceilings", env={"TERAFLOPS_PRESET": "gpu"})
    assert out.returncode == 1
    failed = [line for line in out.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith("FAILED ceilings: ValueError") and "needs a CUDA GPU" in failed[0]


def test_the_registry_holds_every_check_once_in_the_tables_order():
    """``@preflight.register`` is the one place a check is declared: ``teraflops preflight`` and
    ``pytest -m gpu`` (tests/test_preflight_gpu.py) both read :data:`preflight.CHECKS`."""
    assert [(c.name, c.gpus) for c in preflight.CHECKS] == [
        ("device", 0), ("triton-flash", 0), ("fused-rmsnorm", 0), ("ceilings", 0), ("attention-sweep", 0),
        ("profiler-verdicts", 0), ("decode", 0), ("ladder-contention", 0), ("triage", 0), ("zero", 0),
        ("collectives", 0), ("remedies", 2), ("stragglers", 2), ("elastic", 2),
        ("tensor-parallel", 0), ("pipeline", 0), ("recompute", 0), ("serving", 0), ("ray-sizing", 0),
        ("full-memory", 0), ("full-stragglers", 3), ("full-zero", 2), ("full-remedies", 2), ("full-rank-traces", 3)]
    assert [c.name for c in preflight.CHECKS if c.full] == [c.name for c in preflight.CHECKS[19:]]  # --full only
    assert preflight.CHECKS[0].fn is preflight.check_device_facts
    with pytest.raises(ValueError, match="named 'zero' is registered already"):
        preflight.register("zero", "again")(lambda: (0, "", ""))
    assert len(preflight.CHECKS) == 24


def test_a_checks_gpu_path_is_skipped_with_the_reason_preflight_gives():
    zero, = (c for c in preflight.CHECKS if c.name == "zero")
    elastic, = (c for c in preflight.CHECKS if c.name == "elastic")
    assert zero.unmet(0) is None  # preflight runs its CPU equivalent
    assert zero.unmet(0, gpu_path=True) == "needs 1 GPU, this machine has 0 (`teraflops preflight` runs its CPU equivalent here)"
    assert zero.unmet(1, gpu_path=True) is None
    assert elastic.unmet(0) == elastic.unmet(0, gpu_path=True) == (
        "needs 2 GPUs, this machine has 0 (the CPU test suite runs its gloo version)")
    assert elastic.unmet(1) == "needs 2 GPUs, this machine has 1" and elastic.unmet(2) is None


def test_full_adds_the_gpu_preset_checks_and_a_cpu_machine_skips_the_gpu_ones_with_reasons(monkeypatch):
    """`teraflops preflight --full` runs every CPU-reachable part and lists each GPU-only one as
    skipped with its reason; without --full none of them runs. The memory check is replaced by a stand-in
    here (its real run, minutes on 2 cores, is tests/test_gpu_memory.py's)."""
    from teraflops.course import preflight
    from teraflops.machine import Machine

    monkeypatch.setattr(preflight.machine, "detect", lambda: Machine("cpu", cpu_cores=2))
    full = [c for c in preflight.CHECKS if c.full]
    assert {c.name for c in full} >= {"full-memory", "full-stragglers", "full-zero", "full-remedies", "full-rank-traces"}
    ran = []
    stand_ins = [preflight.Check(c.name, c.label, (lambda n=c.name: ran.append(n) or (1.0, "GB", "stand-in")),
                                 c.gpus, c.full) for c in preflight.CHECKS if c.full]
    assert all(r.name not in {c.name for c in full} for r in preflight.run(stand_ins, progress=False))  # not without --full
    results = {r.name: r for r in preflight.run(stand_ins, progress=False, full=True)}
    assert ran == ["full-memory"] and results["full-memory"].status == "passed"
    for name in ("full-stragglers", "full-zero", "full-remedies", "full-rank-traces"):
        assert results[name].status == "skipped" and "GPU" in results[name].detail, results[name]
    assert "min" in preflight.FULL_NOTE  # it states its time


def test_the_straggler_check_does_not_flag_a_healthy_ranks_blip_at_ms_scale():
    """8 GPU ranks busy ~2 ms a step; one healthy rank's 0.6 ms blips, one rank 200 ms late.
    With a MAD floor of 5 % of the median alone (0.1 ms) the healthy rank is flagged too."""
    import numpy as np

    from teraflops.course import preflight
    from teraflops.orchestration.detection import flag_stragglers

    rng = np.random.default_rng(0)
    busy = 2e-3 + rng.normal(0, 2e-5, (4, 8))
    busy[:, 3] += 6e-4  # a healthy rank's blips
    busy[:, 7] += 0.2  # the injected straggler
    assert 3 in flag_stragglers(busy)  # the finding
    assert preflight.flag_late_ranks(busy) == [7]


def test_list_prints_every_check_with_its_gpus_and_full_and_runs_none(monkeypatch, capsys):
    """`teraflops preflight --list`: the table of checks (TP, pipeline, recompute, serving and Ray among
    them), the GPUs each needs, whether only --full runs it and what it does on this machine; nothing runs."""
    from teraflops.course import cli

    def ran(*a, **k):
        raise AssertionError("--list ran a check")

    monkeypatch.setattr(preflight, "run", ran)
    monkeypatch.setattr(preflight, "main", ran)
    monkeypatch.setattr(preflight.machine, "detect", lambda: Machine("cpu", cpu_cores=2))
    assert cli.main(["preflight", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["check", "GPUs", "--full", "here", "covers"]
    rows = {line.split()[0]: line.split()[1:4] for line in lines[1:len(preflight.CHECKS) + 1]}
    assert list(rows) == [c.name for c in preflight.CHECKS]
    for name in ("tensor-parallel", "pipeline", "recompute", "serving", "ray-sizing"):
        assert rows[name] == ["0", "no", "CPU"], name  # their CPU part runs here
    assert rows["elastic"] == ["2", "no", "skipped"] and rows["full-memory"] == ["0", "yes", "CPU"]
    assert rows["full-rank-traces"] == ["3", "yes", "skipped"]
    assert lines[-1].startswith("here: this machine has 0 GPUs")
    two = preflight.listing(gpus=2).splitlines()
    assert "runs" in two[1].split() and "skipped" in next(x for x in two if x.startswith("full-rank-traces"))
    assert preflight.listing().splitlines()[0].split() == ["check", "GPUs", "--full", "covers"]


def test_the_rank_traces_check_covers_zero3_on_nccl_ranks_and_names_an_overhead_reading(monkeypatch):
    """Whether ZeRO-3's trace on 3+ NCCL ranks reads communication-bound or overhead only a GPU shows
    (the ratio of NCCL transfer time to DeepSpeed's host-side hooks); on the CPU: the check that shows
    it needs 3 GPUs and --full, profiles zero3, and fails on an overhead reading naming the workload."""
    from types import SimpleNamespace

    from teraflops.orchestration.detection import MIN_RANKS
    from teraflops.triage import rank_traces

    check, = (c for c in preflight.CHECKS if c.name == "full-rank-traces")
    assert check.gpus == MIN_RANKS >= 3 and check.full and "zero3" in rank_traces.WORKLOADS
    assert "Only a GPU can show it" in check.fn.__doc__ and "overhead" in check.fn.__doc__
    asked = []

    def profile_ranks(workloads=rank_traces.WORKLOADS, **kw):
        asked.append(tuple(workloads))
        return {w: SimpleNamespace(trace=w, waits=None) for w in workloads}

    verdicts = dict(rank_traces.EXPECTED)
    monkeypatch.setattr(rank_traces, "profile_ranks", profile_ranks)
    monkeypatch.setattr(preflight, "triage", lambda trace, waits=None: SimpleNamespace(verdict=verdicts[trace]))
    value, unit, detail = check.fn()
    assert asked == [rank_traces.WORKLOADS] and value == len(rank_traces.WORKLOADS)
    assert "zero3: communication-bound" in detail
    verdicts["zero3"] = "overhead"
    with pytest.raises(preflight.CheckFailed) as info:
        check.fn()
    assert "'zero3': 'overhead'" in str(info.value) and "'zero3': 'communication-bound'" in str(info.value)
    assert "straggler" not in str(info.value) and "size its GPT for the GPU" in str(info.value)
