"""Unit 2 §3-4: stale updates and DDP overlap, run for real on two gloo ranks with tiny sizes."""

import dataclasses
import math

import matplotlib
import pytest
import torch

from teraflops.parallelization import ddp_sync as dp
from teraflops.sizing import dp_config, preset
from teraflops.launch.placement import data_parallel_plan
from teraflops.launch.wire import SpecError, from_json, to_json
from teraflops.workers.common import held_out, make_data, rank_batch
from teraflops.workers.ddp_sync import DelayedGradients, train_reference

STALENESS_KEYS = {"tau", "step_ms", "samples_per_s", "tokens_per_s", "speedup", "final_loss", "loss_delta",
                  "eval_loss", "eval_delta", "updates", "losses"}
OVERLAP_KEYS = {"mode", "key", "step_ms", "forward_ms", "backward_ms", "comm_ms", "exposed_ms", "buckets",
                "max_loss_diff", "losses"}
STEPS, OVERLAP_STEPS = 6, 5


class FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(self.name)


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_delayed_gradients_release_each_buffer_tau_pushes_late(tau):
    q, waited, released = DelayedGradients(tau), [], []
    for step in range(6):
        released.append(q.push(FakeWork(waited, step), f"g{step}"))
    assert released == [[]] * tau + [[f"g{s}"] for s in range(6 - tau)]
    assert waited == list(range(6 - tau)) and len(q) == tau
    q.wait_all()
    assert waited == list(range(6)) and len(q) == tau
    assert q.drain() == [f"g{s}" for s in range(6 - tau, 6)] and waited == list(range(6)) and len(q) == 0


def test_delayed_gradients_refuse_negative_tau():
    with pytest.raises(ValueError, match="tau must be >= 0"):
        DelayedGradients(-1)
    with pytest.raises(ValueError, match="taus must be >= 0"):
        dp.run(taus=(0, -2))


def test_ranks_split_each_global_batch_and_the_held_out_rows_are_unseen():
    cfg, world, steps = dataclasses.replace(dp_config(preset("tiny")), micro_batch=3, eval_batches=5), 2, 4
    inputs, targets = make_data(cfg, steps, world)
    assert inputs.shape == ((steps + 5) * world * 3, cfg.seq_len)
    assert (targets[:, :-1] == inputs[:, 1:]).all()
    seen = [rank_batch((inputs, targets), s, r, world, 3)[0] for s in range(steps) for r in range(world)]
    assert (torch.cat(seen) == inputs[:steps * world * 3]).all()
    assert (held_out((inputs, targets), cfg, steps, world)[0] == inputs[steps * world * 3:]).all()
    assert len(held_out((inputs, targets), cfg, steps - 1, world)[0]) == 5 * world * 3  # eval_batches batches


def test_slowest_median_ms_takes_the_slowest_ranks_median_of_its_timed_steps():
    per_rank = [[None, 0.010, 0.012, 0.011], [None, 0.020, 0.030, 0.025]]
    assert dp.slowest_median_ms(per_rank) == pytest.approx(25.0)
    assert math.isnan(dp.slowest_median_ms([[None, 0.01], [None]]))  # a rank with no timed step


def test_mean_over_ranks_is_the_per_step_mean():
    assert dp.mean_over_ranks([[4.0, 3.0], [2.0, 1.0]]) == [3.0, 2.0]


def test_launch_timed_passes_the_plan_and_returns_the_launch_fields(monkeypatch):
    seen = {}
    cfg = dp_config(preset("tiny"))

    def fake_launch(module, where, **kwargs):
        seen.update(module=module, where=where, **kwargs)
        n = where.world_size
        return [dp.DataParallelResult(rank=r, world_size=n, backend="gloo", device="cpu", params=10, config=cfg,
                                      staleness=(), overlap=()) for r in range(n)]

    monkeypatch.setattr(dp, "launch", fake_launch)
    plan = data_parallel_plan(preset("tiny"))
    spec = dp.dp_spec(plan)
    results, launched = dp.launch_timed("some.worker", plan, spec, dp.DataParallelResult, timeout=5, desc="d")
    assert len(results) == plan.ranks and seen["where"] == plan.placement and seen["timeout"] == 5
    assert seen["module"] == "some.worker" and seen["spec"] == spec and seen["desc"] == "d"
    assert seen["result"] is dp.DataParallelResult and launched["config"] == cfg
    assert {f.name for f in dataclasses.fields(dp.RankLaunch)} == set(launched)
    assert launched["ranks"] == plan.ranks and launched["params"] == 10 and launched["wall_s"] >= 0
    assert len(launched["load_avg"]) == 2


def test_the_spec_carries_the_sizes_of_the_preset_and_survives_json():
    p = preset("tiny")
    spec = dp.dp_spec(data_parallel_plan(p), steps=3)
    assert spec.steps == 3 and spec.overlap_steps == p.dp.overlap_steps and spec.bucket_mb == p.dp.bucket_mb
    assert spec.model == dp_config(p) and spec.model.d_model == p.comm_gpt.d_model and spec.model.heads == p.comm_gpt.heads
    assert from_json(dp.DataParallelSpec, to_json(spec)) == spec
    with pytest.raises(SpecError, match=r"^DataParallelSpec: unknown experiment or mode \['fast'\]"):
        from_json(dp.DataParallelSpec, {**to_json(spec), "modes": ["fast"]})


@pytest.fixture(scope="module")
def tiny_run():
    """Both experiments in one launch of two gloo ranks (a few seconds of start-up, then tiny steps)."""
    plan = data_parallel_plan(preset("tiny"))
    return plan, dp.run(steps=STEPS, overlap_steps=OVERLAP_STEPS, plan=plan, timeout=240)


@pytest.mark.slow
def test_staleness_rows_and_tau_0_is_plain_synchronous_training(tiny_run):
    plan, result = tiny_run
    rows = result.staleness
    assert [r["tau"] for r in rows] == list(dp.TAUS) and result.ranks == 2 and result.backend == "gloo"
    for r in rows:
        assert set(r) == STALENESS_KEYS and len(r["losses"]) == STEPS
        assert r["updates"] == max(0, STEPS - r["tau"])
        assert r["step_ms"] > 0 and math.isfinite(r["eval_loss"]) and r["speedup"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * plan.preset.comm_gpt.seq_len)
    for r in rows:  # every τ reproduces one process applying each global-batch gradient τ steps late
        reference = train_reference(result.config, STEPS, result.ranks, tau=r["tau"])
        assert max(abs(a - b) for a, b in zip(r["losses"], reference)) < 1e-5, r["tau"]
    first = {r["losses"][0] for r in rows}  # same initialisation and data for every τ
    assert max(first) - min(first) < 1e-6
    assert abs(rows[1]["losses"][1] - rows[0]["losses"][1]) > 1e-4  # τ = 1 has made no update yet


@pytest.mark.slow
def test_overlap_rows_agree_with_each_other_and_with_tau_0(tiny_run):
    _, result = tiny_run
    rows = {r["key"]: r for r in result.overlap}
    assert list(rows) == ["bucketed", "after", "local"]
    assert [r["mode"] for r in result.overlap] == [dp.MODE_LABELS[k] for k in rows]
    for r in rows.values():
        assert set(r) == OVERLAP_KEYS and len(r["losses"]) == OVERLAP_STEPS and r["step_ms"] > 0
    assert rows["bucketed"]["buckets"] > 1 and rows["after"]["buckets"] == 1 and rows["local"]["buckets"] == 0
    assert rows["bucketed"]["max_loss_diff"] < 1e-5
    assert rows["local"]["max_loss_diff"] is None and rows["local"]["exposed_ms"] is None
    # timings are figures, not verdicts: which mode's wait was longer depends on the machine's load
    assert all(r["comm_ms"] >= 0 and r["forward_ms"] >= 0 and r["backward_ms"] >= 0 for r in rows.values())
    tau0 = result.staleness[0]["losses"]
    assert max(abs(a - b) for a, b in zip(rows["after"]["losses"], tau0)) < 1e-5


@pytest.mark.slow
def test_tables_and_plots(tiny_run):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, result = tiny_run
    text = dp.staleness_table(result.staleness)
    assert "speedup" in text and len(text.splitlines()) == 2 + len(dp.TAUS)
    assert "bucketed (overlap)" in dp.overlap_table(result.overlap)
    for fig in (dp.plot_staleness(result.staleness), dp.plot_overlap(result.overlap)):
        assert fig.axes
        plt.close(fig)
