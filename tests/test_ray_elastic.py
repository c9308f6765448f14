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


def test_youngs_interval_is_the_overheads_minimum():
    k = re_.best_interval(0.25, 0.5, 600.0, 45.0)
    assert k == 98 and all(re_.overhead(k, 0.25, 0.5, 600.0, 45.0) <= re_.overhead(n, 0.25, 0.5, 600.0, 45.0)
                           for n in range(1, 400))
