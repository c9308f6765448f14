"""Unit 3 §4b: a rank killed mid-training, torchrun's elastic agent restarting the job from the last
checkpoint, on two gloo ranks with the tiny preset's sizes (each launch ~10-20 s of start-up)."""

import shutil
import tempfile
from types import SimpleNamespace

import matplotlib
import psutil
import pytest

import teraflops.launch.plan as launch_plan  # prepare() picks the launch port
from teraflops.orchestration import elastic
from teraflops.launch.launcher import LaunchFailed
from teraflops.launch.ports import port_in_use
from teraflops.sizing import preset
from teraflops.launch.placement import data_parallel_plan

TINY = preset("tiny")  # elastic: steps=8, checkpoint_every=3, kill_step=5


def tiny_plan():
    return data_parallel_plan(TINY, ranks_cpu=2)


@pytest.fixture
def private_tmp(monkeypatch, tmp_path):
    """Temporary directories (the launches' and the checkpoints') go here, so leftovers can be counted
    without seeing other tests' runs; the ports launches pick are recorded."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ports = []

    def recording_free_port(free_port=launch_plan.free_port):
        ports.append(free_port())
        return ports[-1]

    monkeypatch.setattr(launch_plan, "free_port", recording_free_port)
    return tmp_path, ports


def assert_clean(tmp, ports):
    assert psutil.Process().children(recursive=True) == []
    assert ports and not any(port_in_use(p) for p in ports)
    assert list(tmp.iterdir()) == []


def test_launcher_args_and_arguments_checked_before_any_launch():
    args = elastic.elastic_launcher_args(1)
    assert args[:4] == ["--max-restarts", "1", "--rdzv-backend", "c10d"] and args[4] == "--rdzv-id"
    assert args[5] != elastic.elastic_launcher_args(1)[5]  # a fresh rendezvous id each time
    with pytest.raises(ValueError, match="kill_step=8 must be a step of the run"):
        elastic.run(tiny_plan(), kill_step=8)
    with pytest.raises(ValueError, match="kill_rank=2 is not a rank"):
        elastic.run(tiny_plan(), kill_rank=2)


@pytest.mark.slow
def test_killed_rank_restarts_from_the_last_checkpoint_to_the_reference_loss(private_tmp):
    matplotlib.use("Agg")
    tmp, ports = private_tmp
    run = elastic.run(tiny_plan(), kill_rank=1, timeout=180)
    assert (run.steps, run.checkpoint_every, run.kill_step, run.ranks, run.backend) == (8, 3, 5, 2, "gloo")
    assert run.restarts == 1 and run.last_checkpoint_step == 3 and run.steps_recomputed == 2
    assert run.final_loss_diff <= 1e-4 and run.max_loss_diff <= 1e-4 and len(run.losses) == 8
    assert [(r["step"], r["attempt"]) for r in run.records] == \
        [(s, 0) for s in range(5)] + [(s, 1) for s in range(3, 8)]
    assert [r["step"] for r in run.reference_records] == list(range(8))
    assert {r["attempt"] for r in run.reference_records} == {0}
    for r in run.records:  # a recomputed step sees the same batch and parameters, so the same loss
        assert abs(r["loss"] - run.reference_losses[r["step"]]) <= 1e-4
    # the restart's cost from the recorded step times (its size is this machine's, not asserted; the
    # derivation is tested on injected times below): a restart starts processes, a step does not
    assert run.step_s > 0 and run.restart_s > 0 and run.interrupted_wall_s > run.restart_s  # not timed: the interrupted run's wall time contains its restart
    spans = [rs[-1]["time"] - rs[0]["time"] for rs in (run.reference_records, run.records)]
    assert run.training_lost_s == pytest.approx(spans[1] - spans[0])
    table = elastic.recovery_table(run)
    assert "rank 1 killed at step 5" in table and len(table.splitlines()) == 4
    assert len(elastic.plot_recovery(run).axes) == 2
    assert_clean(tmp, ports)


@pytest.mark.slow
def test_without_restarts_a_kill_fails_the_launch_naming_the_rank(private_tmp):
    tmp, ports = private_tmp
    checkpoints = tmp / "checkpoints"
    checkpoints.mkdir()
    with pytest.raises(LaunchFailed) as info:
        elastic.launch_training(checkpoints, tiny_plan(), 8, 3, fault="kill:rank=1:step=4", max_restarts=0, timeout=600)
    msg = str(info.value)
    # the death was seen (rank and signal named), not waited out: the launch's timeout says "timed out after"
    assert "timed out after 600 s" not in msg
    assert "\n" not in msg and "rank 1 of 2 was killed by SIGKILL" in msg and info.value.rank == 1, msg
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["step-000003.pt", "steps.jsonl"]  # kept for a rerun
    shutil.rmtree(info.value.logs)  # kept for the learner on a failure
    shutil.rmtree(checkpoints)
    assert_clean(tmp, ports)


@pytest.mark.slow
def test_a_launch_keeps_one_checkpoint_on_disk(private_tmp):
    # 8 steps checkpointed every 3: steps 3 and 6 are saved, only step 6 stays (a GPU-preset checkpoint is ~1.6 GB).
    tmp, ports = private_tmp
    checkpoints = tmp / "checkpoints"
    checkpoints.mkdir()
    elastic.launch_training(checkpoints, tiny_plan(), timeout=180)
    assert sorted(p.name for p in checkpoints.glob("step-*.pt")) == ["step-000006.pt"]
    shutil.rmtree(checkpoints)
    assert_clean(tmp, ports)


def test_run_removes_its_checkpoint_folders_when_a_launch_fails(private_tmp, monkeypatch):
    tmp, _ = private_tmp

    def failing(checkpoint_dir, *args, **kwargs):
        (checkpoint_dir / "step-000003.pt").write_bytes(b"x" * 1024)
        raise LaunchFailed("rank 1 exited with code -9")

    monkeypatch.setattr(elastic, "launch_training", failing)
    with pytest.raises(LaunchFailed):
        elastic.run(tiny_plan())
    assert list(tmp.iterdir()) == []


def test_restart_cost_is_derived_from_the_recorded_step_times(monkeypatch):
    """Injected step times (1 s per step; rank 1 killed at step 5, the job back from step 3's checkpoint
    at t = 25 s): the restart is 25 - 14 - one step = 10 s, and the training lost between first and last
    step is the restart plus the two recomputed steps."""
    ref = [{"step": s, "attempt": 0, "time": 10.0 + s, "loss": 4.0 - s / 10} for s in range(8)]
    got = [dict(r) for r in ref[:5]] + [{"step": s, "attempt": 1, "time": 25.0 + s - 3, "loss": 4.0 - s / 10}
                                        for s in range(3, 8)]
    losses = [r["loss"] for r in ref]

    def launch(checkpoint_dir, plan, steps, every, timeout=None, fault=None, desc=""):
        if fault is None:
            return [SimpleNamespace(losses=losses, attempt=0, resumed_from=None, backend="gloo")], ref, 20.0
        assert fault == "kill:rank=1:step=5"
        return [SimpleNamespace(losses=losses, attempt=1, resumed_from=3, backend="gloo")], got, 33.0

    monkeypatch.setattr(elastic, "launch_training", launch)
    run = elastic.run(tiny_plan())
    assert (run.kill_step, run.kill_rank, run.restarts, run.last_checkpoint_step, run.steps_recomputed) == (5, 1, 1, 3, 2)
    assert run.step_s == 1.0 and run.restart_s == 10.0 and run.time_lost_s == 13.0
    assert run.training_lost_s == run.restart_s + run.steps_recomputed * run.step_s == 12.0
    assert run.final_loss_diff == 0 and run.max_loss_diff == 0
