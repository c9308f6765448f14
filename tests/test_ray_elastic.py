"""Unit 3's Ray Train run (teraflops.orchestration.ray_elastic): what it reads from a run's records, and
why the losses of any group size match the one-process reference. The real run is the lecture's
(tests/test_unit03_run.py); nothing here starts Ray."""

import pytest
import torch

from teraflops.models import GPT, lm_loss
from teraflops.orchestration import ray_elastic as re_
from teraflops.orchestration.ray_elastic import RayDriverResult, RayElasticRun, RaySpec, RayTrainError
from teraflops.sizing import gpt_config, preset

A = ["10.213.0.1", "10.213.0.2", "10.213.0.3"]


def _run(kill=100.0, rejoin=120.0):
    steps = [{"step": s, "loss": 5 - s / 100, "world": 3, "nodes": A, "resumed_from": 0, "time": 90 + s * 0.25}
             for s in range(1, 13)]  # killed after step 12, last checkpoint at 10
    steps += [{"step": s, "loss": 5 - s / 100, "world": 2, "nodes": A[:2], "resumed_from": 10,
               "time": 110 + (s - 11) * 0.25} for s in range(11, 25)]
    steps += [{"step": s, "loss": 5 - s / 100, "world": 3, "nodes": A, "resumed_from": 20,
               "time": 130 + (s - 21) * 0.25} for s in range(21, 31)]
    driver = RayDriverResult(True, None, steps[-1]["loss"], 30, 80.0, 140.0, "node0",
                             [{"time": 80.0, "address": a, "alive": True} for a in A] +
                             [{"time": kill + 3.2, "address": A[2], "alive": False}])
    return RayElasticRun(steps, 2, kill, rejoin, driver, [5 - s / 100 for s in range(1, 31)], 5, {}, 3.0)


def test_the_run_is_read_from_its_records():
    r = _run()
    assert [g["world"] for g in r.groups()] == [3, 2, 3] and r.shrank_and_grew and r.moved()
    assert r.detect_s == pytest.approx(3.2) and r.shrink_s == pytest.approx(10.0) and r.grow_s == pytest.approx(10.0)
    assert r.steps_redone == 2 and r.final_loss_diff == pytest.approx(0.0)
    text = re_.recovery_table(r) + re_.groups_table(r) + re_.comparison_table(r)
    assert "10.213.0.1, 10.213.0.2" in text and "Kubernetes" in text and "SlurmdTimeout" in text


def test_a_group_that_kept_the_dead_node_did_not_move():
    r = _run()
    bad = RayElasticRun([{**s, "nodes": A} for s in r.steps], 2, r.kill_time, r.rejoin_time, r.driver, r.reference,
                        5, {}, 3.0)
    assert not bad.moved()


def test_a_global_batch_that_does_not_split_is_one_line():
    with pytest.raises(RayTrainError, match="divide evenly"):
        RaySpec(model=gpt_config(preset(), 4, 1e-3), steps=4, global_batch=10, checkpoint_every=2, num_workers=3,
                min_workers=2, steps_log="s", result_path="r", storage_path="p")


def test_equal_slices_averaged_give_the_global_batchs_gradient():
    """Why 3, 2 or 1 workers train alike: the mean of per-slice mean-loss gradients is the full batch's."""
    cfg = gpt_config(preset(), 4, 1e-3)
    torch.manual_seed(0)
    model = GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len)
    x = torch.randint(0, cfg.vocab, (12, cfg.seq_len))
    grads = {}
    for world in (1, 2, 3):
        total = None
        for r in range(world):
            model.zero_grad()
            rows = slice(r * 12 // world, (r + 1) * 12 // world)
            lm_loss(model(x[rows]), x[rows]).backward()
            g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            total = g if total is None else total + g
        grads[world] = total / world
    assert torch.allclose(grads[1], grads[2], atol=1e-6) and torch.allclose(grads[1], grads[3], atol=1e-6)


@pytest.mark.parametrize("in_force", ["gpu", "cpu", "tiny"])
def test_the_cpu_workers_are_sized_by_a_cpu_preset(monkeypatch, tmp_path, in_force):
    """Ray Train's workers are CPU workers (one CPU each) whatever the preset in force: on a GPU box the
    GPU preset's GPT would be theirs, ~10⁸ parameters a worker-step on one core."""
    from teraflops.sizing import PRESETS

    monkeypatch.setattr(re_, "preset", lambda: PRESETS[in_force])
    spec = re_.make_spec(tmp_path, steps=4, checkpoint_every=2, step_s=0.1, global_batch=12)
    want = PRESETS["cpu" if in_force == "gpu" else in_force]
    assert spec.model == gpt_config(want, 4, want.dp.lr)
    assert spec.model.d_model <= PRESETS["cpu"].gpt.d_model and spec.model.vocab <= PRESETS["cpu"].gpt.vocab
    assert spec.steps_log == str(tmp_path / "steps.jsonl")


# ---- the recovery decomposed at Ray Train's own records (its worker-group attempts) --------------------------------

def _attempts(kill=100.0, retry=True):
    """Ray Train's attempts around a kill at ``kill``, as the driver records them (Unix s): the 3-worker group
    ended 1.1 s after the kill, a retry at 3 workers waited out a 20 s start timeout, the 2-worker group started,
    and after the rejoin (120 s in _run) a 3-worker group again."""
    out = [{"start": 82.0, "end": kill + 1.1, "status": "ERRORED", "workers": 3, "nodes": A, "detail": "worker died"}]
    t = kill + 1.6
    if retry:
        out.append({"start": t, "end": t + 20.0, "status": "ERRORED", "workers": 3, "nodes": [], "detail": "start timeout"})
        t += 20.4
    out += [{"start": t, "end": 126.0, "status": "FINISHED", "workers": 2, "nodes": A[:2], "detail": ""},
            {"start": 126.5, "end": 140.0, "status": "FINISHED", "workers": 3, "nodes": A, "detail": ""}]
    return out


def _with_attempts(attempts, kill=100.0):
    r = _run(kill=kill)
    steps = [{**s, "time": s["time"] + (15.0 if s["world"] == 2 or s["resumed_from"] == 20 else 0.0)} for s in r.steps]
    driver = RayDriverResult(**{**r.driver.__dict__, "attempts": attempts})
    return RayElasticRun(steps, 2, kill, r.rejoin_time, driver, r.reference, 5, dict(re_.KNOBS), 3.0)


def test_the_recovery_parts_add_up_to_the_kill_to_first_step_time():
    r = _with_attempts(_attempts())
    parts = re_.recovery_parts(r)
    names = [p["part"] for p in parts]
    assert names[0].startswith("kill → controller ends the 3-worker group") and parts[0]["s"] == pytest.approx(1.1)
    retry = [p for p in parts if p["part"].startswith("retry at 3 workers")]
    assert len(retry) == 1 and retry[0]["s"] == pytest.approx(20.0) and "START_TIMEOUT" in retry[0]["knob"]
    between = next(p for p in parts if p["part"].startswith("controller between"))
    assert between["s"] == pytest.approx(0.5 + 0.4)
    before = [p["s"] for p in parts if not p["part"].startswith("work redone")]
    assert sum(before) == pytest.approx(r.shrink_s) and all(s >= 0 for s in before)
    assert parts[-1]["part"].startswith("work redone: 2 steps") and "checkpoint interval" in parts[-1]["knob"]
    assert "= kill → first step of the smaller group" in re_.parts_table(parts)


def test_without_the_retry_there_is_no_retry_part():
    r = _with_attempts(_attempts(retry=False))
    parts = re_.recovery_parts(r)
    assert not any(p["part"].startswith("retry") for p in parts)
    assert sum(p["s"] for p in parts if not p["part"].startswith("work redone")) == pytest.approx(r.shrink_s)


def test_no_attempts_on_record_means_no_decomposition():
    assert re_.recovery_parts(_with_attempts([])) == []


def test_the_timeline_draws_every_worker_and_the_failed_retry():
    import matplotlib

    matplotlib.use("Agg")
    ax = re_.plot_timeline(_with_attempts(_attempts()))
    assert any("never started" in t.get_text() for t in ax.texts) and any("killed" in t.get_text() for t in ax.texts)
    assert len(ax.patches) == 3 + 1 + 2 + 3  # one bar per worker of each attempt, the unstarted retry on one row


def test_a_runs_measured_checkpoint_cost():
    r = _with_attempts(_attempts())
    steps = [{**s, "checkpoint_s": 0.04 if s["step"] % 5 == 1 and s["step"] > 1 else 0.0} for s in r.steps]
    m = re_.measured_cost(RayElasticRun(steps, 2, r.kill_time, r.rejoin_time, r.driver, r.reference, 5, {}, 3.0))
    assert m["last_before_kill"] == 12 and m["resumed_from"] == 10 == m["predicted_resume"]
    assert m["steps_redone"] == 2 and m["checkpoint_s"] == pytest.approx(0.04)
    assert m["checkpoints"] == sum(1 for s in steps if s["checkpoint_s"] > 0)


@pytest.mark.slow
def test_a_real_run_shrinks_regrows_and_leaves_nothing():
    """One real run (3 emulated nodes, node 2 killed and brought back), then the placement groups on the same
    cluster: what the lecture shows, asserted on its records (no timing); nothing of it left afterwards."""
    from teraflops.nodes import cluster
    from teraflops.nodes import ray as ray_nodes
    from teraflops.orchestration import placement_groups

    why = cluster.unavailable() or ray_nodes.unavailable()
    if why:
        pytest.skip(f"Ray on emulated nodes unavailable: {why}")
    with cluster.Cluster(3, ray=re_.CLUSTER) as nodes:
        name = nodes.name
        r = re_.run(cluster=nodes)
        placed = placement_groups.run(nodes)
    assert r.shrank_and_grew and r.moved() and r.steps_redone < r.checkpoint_every
    assert r.final_loss_diff <= re_.LOSS_TOLERANCE and r.detect_s is not None and r.detect_s >= 0
    parts = re_.recovery_parts(r)
    assert parts and sum(p["s"] for p in parts if not p["part"].startswith("work redone")) == pytest.approx(r.shrink_s)
    assert all(p["s"] >= 0 for p in parts) and [a["workers"] for a in r.driver.attempts][0] == 3
    assert placed.packed_waited_then_placed() and placed.spread_placed_at_once() and placed.predictions_match()
    assert not any(ns.startswith(f"teraflops-{name}-") for ns in cluster.namespaces())
    assert not ray_nodes.state_dir(name).exists()


def test_a_recorded_controller_log_reads_the_retry_at_the_old_size():
    """Ray Train's controller log of a real run (tests/data/ray/controller.log: 3 emulated nodes, node 2 killed
    after step 12, load 10-13, start timeout 20 s; DEBUG lines left out): the 3-worker group, a retry at 3 workers
    that waited out the start timeout, then 2 workers on the survivors."""
    from pathlib import Path

    lines = (Path(__file__).parent / "data" / "ray" / "controller.log").read_text().splitlines()
    got = re_.attempts_from_controller_log(lines)
    assert [(a["workers"], a["status"]) for a in got] == [(3, "ERRORED"), (3, "ERRORED"), (2, "RUNNING")]
    first, retry, small = got
    assert sorted(first["nodes"]) == A and retry["nodes"] == [] and sorted(small["nodes"]) == A[:2]
    assert retry["end"] - retry["start"] == pytest.approx(20.0, abs=0.01) and "timed out after 20.0" in retry["detail"]
    assert first["end"] <= retry["start"] <= retry["end"] <= small["start"] and small["end"] is None
    assert re_.attempts_from_controller_log(["not json", '{"asctime": "bad"}']) == []
