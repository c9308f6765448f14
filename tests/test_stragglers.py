"""Unit 3 §1 and §4: straggler injection in synchronous data parallelism, on four gloo ranks with tiny sizes.

The pure functions (idle fraction, prediction, rebalancing, injections, the weighted split) are
tested in-process; one real launch serves the rest. Behaviour is asserted, never speed.
"""

import dataclasses
import math
import shutil

import matplotlib
import numpy as np
import pytest
import torch

from teraflops.orchestration import stragglers as st
from teraflops.sizing import gpt_config, preset
from teraflops.launch.placement import data_parallel_plan
from teraflops.launch.wire import from_json, to_json
from teraflops.workers.common import build_model, make_data
from teraflops.workers.straggler import rank_rows, weighted_loss

STEPS, DELAYS_MS = 4, (0, 50, 150)


def make_timeline(step, wait, injection=st.Injection("constant", 0)):
    step, wait = np.asarray(step, float), np.asarray(wait, float)
    zeros = np.zeros_like(step)
    return st.Timeline("t", injection, zeros, step - wait, zeros, wait, zeros, step, np.ones(step.shape, int),
                       np.zeros(len(step)))


# ---- pure functions ------------------------------------------------------------------------------


def test_idle_fraction_is_total_wait_over_total_step_per_rank():
    step = [[1.0, 2.0], [3.0, 2.0]]
    wait = [[0.5, 0.0], [1.5, 1.0]]
    np.testing.assert_allclose(st.idle_fraction(step, wait), [0.5, 0.25])
    assert st.idle_fraction(np.ones((3, 4)), np.zeros((3, 4))).shape == (4,)


@pytest.mark.parametrize("step, wait, match", [
    (np.ones((2, 3)), np.ones((3, 2)), "same"), (np.ones(3), np.zeros(3), "same"),
    (np.ones((2, 2)), -np.ones((2, 2)), ">= 0"), (np.ones((2, 2)), 2 * np.ones((2, 2)), "at most")])
def test_idle_fraction_rejects_bad_arrays_in_one_line(step, wait, match):
    with pytest.raises(ValueError, match=match) as info:
        st.idle_fraction(step, wait)
    assert "\n" not in str(info.value) and "Hint" in str(info.value)


def test_predicted_idle_is_one_minus_busy_over_stretched_step():
    base = make_timeline(np.full((4, 4), 0.1), np.full((4, 4), 0.02))  # T0 = 100 ms, busy0 = 80 ms
    assert st.predicted_idle(base, 0.0) == pytest.approx(0.2)
    assert st.predicted_idle(base, 0.1) == pytest.approx(1 - 0.08 / 0.2)
    assert st.predicted_idle(base, 0.3) > st.predicted_idle(base, 0.1)
    with pytest.raises(ValueError, match=">= 0"):
        st.predicted_idle(base, -0.01)


def test_prediction_adds_the_transfer_of_the_last_rank_to_its_delay():
    step = np.full((2, 2), 0.1)
    base = make_timeline(step, [[0.03, 0.01], [0.03, 0.01]])  # busy0 = 80 ms, transfer c = 10 ms
    assert st.baseline_means(base) == pytest.approx((0.1, 0.08, 0.01))
    assert st.predicted_step_s(base, 0.0) == pytest.approx(0.1)  # T0: the slowest rank's busy + c
    assert st.predicted_step_s(base, 0.05) == pytest.approx(0.14)
    assert st.predicted_idle(base, 0.05) == pytest.approx(1 - 0.08 / 0.14)


@pytest.mark.parametrize("speeds, batch, expected", [
    ([1, 1, 1, 1], 16, [4, 4, 4, 4]), ([1, 1, 1, 0.5], 16, [5, 5, 4, 2]), ([3, 1], 8, [6, 2]),
    ([1, 1, 1], 4, [2, 1, 1]), ([1000, 1], 3, [2, 1])])
def test_rebalance_is_proportional_with_largest_remainders(speeds, batch, expected):
    sizes = st.rebalance(speeds, batch)
    assert sizes == expected and sum(sizes) == batch and min(sizes) >= 1
    assert all(isinstance(b, int) for b in sizes)


def test_rebalance_sizes_stay_within_one_of_the_quota():
    rng = np.random.default_rng(0)
    for _ in range(50):
        speeds, batch = rng.uniform(0.2, 5, 5), int(rng.integers(5, 200))
        sizes = np.array(st.rebalance(speeds, batch))
        quota = batch * speeds / speeds.sum()
        assert sizes.sum() == batch and (sizes >= 1).all()
        assert (np.abs(sizes - quota) < 1).all() or quota.min() < 1


@pytest.mark.parametrize("speeds, batch", [([1, 0], 4), ([1, -2], 4), ([1, float("nan")], 4), ([], 4),
                                           ([1, 1, 1], 2), ([1, 1], 4.5)])
def test_rebalance_rejects_bad_input(speeds, batch):
    with pytest.raises(ValueError) as info:
        st.rebalance(speeds, batch)
    assert "\n" not in str(info.value)


def test_injection_delays_per_kind():
    world, steps = 4, 12
    assert st.Injection("constant", 50).delays_s(steps, 3, world).tolist() == [0.05] * steps
    assert st.Injection("constant", 50).delays_s(steps, 0, world).tolist() == [0.0] * steps  # not injected
    inter = st.Injection("intermittent", 100, every=4).delays_s(steps, 3, world)
    assert np.flatnonzero(inter).tolist() == [3, 7, 11] and inter.max() == pytest.approx(0.1)
    rnd = st.Injection("random", 100, rank="all", prob=0.5, seed=1)
    per_rank = [rnd.delays_s(200, r, world) for r in range(world)]
    assert all(np.array_equal(d, rnd.delays_s(200, r, world)) for r, d in enumerate(per_rank))  # reproducible
    assert not np.array_equal(per_rank[0], per_rank[1])  # independent per rank
    assert 0.3 < np.mean(per_rank[0] > 0) < 0.7
    assert not st.Injection("compute", factor=2).delays_s(steps, 3, world).any()


def test_injection_ranks_and_errors():
    assert st.Injection("constant", 1).ranks(4) == (3,)
    assert st.Injection("constant", 1, rank=1).ranks(4) == (1,)
    assert st.Injection("random", 1, rank="all").ranks(3) == (0, 1, 2)
    assert st.Injection("random", 1, rank=[0, 2]).ranks(3) == (0, 2)  # a list, as from JSON
    assert st.Injection().ranks(4) == ()
    with pytest.raises(ValueError, match="not a rank"):
        st.Injection("constant", 1, rank=4).ranks(4)
    for bad in (dict(kind="slow"), dict(kind="constant", delay_ms=-1), dict(kind="intermittent", every=0),
                dict(kind="random", prob=1.5), dict(kind="compute", factor=0.5)):
        with pytest.raises(ValueError):
            st.Injection(**bad)


def test_run_rejects_bad_arguments_before_launching():
    with pytest.raises(ValueError, match="experiments"):
        st.run(experiments=("sweep", "nap"))
    with pytest.raises(ValueError, match="delays_ms"):
        st.run(delays_ms=(0, -5))
    with pytest.raises(ValueError, match="delays_ms"):
        st.run(delays_ms=())
    with pytest.raises(ValueError, match="k >= 1"):
        st.run(local_ks=(0,))


def test_any_split_weighted_by_b_over_B_gives_the_global_batch_gradient():
    cfg, world = dataclasses.replace(gpt_config(preset("tiny"), 4, 0.3), vocab=64, d_model=32, seq_len=16), 4
    model = build_model(cfg)
    data = make_data(cfg, 2, world)

    def gradient(sizes):
        model.zero_grad()
        for r in range(world):
            rows = rank_rows(1, r, sizes)
            weighted_loss(model, data[0][rows], data[1][rows], sum(sizes)).backward()  # summed over ranks
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    equal, uneven = gradient([4, 4, 4, 4]), gradient([6, 5, 4, 1])
    torch.testing.assert_close(uneven, equal, rtol=1e-5, atol=1e-7)
    assert rank_rows(1, 0, [6, 5, 4, 1]) == slice(16, 22) and rank_rows(1, 3, [6, 5, 4, 1]) == slice(31, 32)


def test_the_spec_carries_the_preset_sizes_and_survives_json():
    p = preset("tiny")
    spec = st.straggler_spec(data_parallel_plan(p, ranks_cpu=4), steps=3, local_ks=(1, 4))
    assert spec.model == gpt_config(p, p.straggler.micro_batch, p.straggler.lr) and spec.steps == 3
    assert spec.delays_ms == tuple(float(d) for d in p.straggler.delays_ms) and spec.local_ks == (1, 4)
    assert from_json(st.StragglerSpec, to_json(spec)) == spec
    inj = st.Injection("random", 50, rank=(1, 2), seed=3)
    assert from_json(st.Injection, to_json(inj)) == inj


# ---- one real launch -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run():
    """All four experiments in one launch of four gloo ranks (start-up ~10 s, then tiny steps)."""
    p = preset("tiny")
    plan = data_parallel_plan(p, ranks_cpu=p.straggler.ranks_cpu)
    return st.run(plan, delays_ms=DELAYS_MS, steps=STEPS, local_ks=(1, 4), timeout=240)


@pytest.mark.slow
def test_timelines_have_step_by_rank_arrays(tiny_run):
    run = tiny_run
    assert run.world_size == 4 and run.backend == "gloo" and run.params > 0
    assert [t.injection.delay_ms for t in run.sweep] == list(DELAYS_MS)
    assert [t.injection.kind for t in run.kinds] == ["intermittent", "random", "compute"]
    for tl in run.sweep + run.kinds:
        for name in ("start", "compute", "delay", "wait", "update", "step"):
            arr = getattr(tl, name)
            assert arr.shape == (STEPS, 4) and arr.dtype == np.float64 and (arr >= 0).all(), name
        assert tl.batch.shape == (STEPS, 4) and (tl.batch == preset("tiny").straggler.micro_batch).all()
        assert tl.loss.shape == (STEPS,) and np.isfinite(tl.loss).all()
        np.testing.assert_allclose(tl.step, tl.compute + tl.delay + tl.wait + tl.update)
        slowed = tl.injection.delay_ms > 0 or tl.injection.kind == "compute"
        assert (tl.injected_ranks, tl.healthy_ranks) == (([3], [0, 1, 2]) if slowed else ([], [0, 1, 2, 3]))
    first = {float(t.loss[0]) for t in run.sweep + run.kinds}  # same initialisation and data everywhere
    assert max(first) - min(first) < 1e-5


@pytest.mark.slow
def test_only_the_injected_rank_sleeps_and_it_waits_least(tiny_run):
    for tl in tiny_run.sweep[1:]:
        assert (tl.delay[:, 3] >= tl.injection.delay_ms / 1e3).all()  # a sleep lasts at least what was asked
    # Kept on the 150 ms setting only: the injected sleep there is several times the tiny preset's whole step
    # (~20-40 ms at load 5), so only a healthy rank stalled for 150 ms between two clock reads (its "delay")
    # or in every step (its wait) could reverse these; at 50 ms a loaded core could
    big = tiny_run.sweep[-1]
    assert big.injection.delay_ms == 150
    assert (big.delay[:, :3] < 0.15).all()  # no sleep: only the time between two clock reads
    assert big.wait[:, 3].mean() < big.wait[:, :3].mean(0).min()  # last to every all-reduce, it waits least
    inter = tiny_run.kinds[0]  # 200 ms sleeps (at least that long) every 4th step; elsewhere two clock reads
    assert inter.injection.delay_ms == st.KIND_DELAY_MS == 200
    assert np.flatnonzero(inter.delay[:, 3] > 0.15).tolist() == [s for s in range(STEPS) if (s + st.WARMUP) % 4 == 3]


@pytest.mark.slow
def test_healthy_idle_grows_with_the_delay_as_predicted(tiny_run):
    rows = st.sweep_rows(tiny_run)
    # idle grows with the delay; compared only between 0 and 150 ms, for the reason given above (how well
    # the prediction follows the measurement is shown in the table, not asserted: the load moves it)
    assert rows[-1]["healthy_idle"] > rows[0]["healthy_idle"]
    assert rows[-1]["straggler_idle"] < rows[-1]["healthy_idle"]
    assert all(0 <= r[k] < 1 for r in rows for k in ("healthy_idle", "straggler_idle", "predicted_idle")
               if r[k] is not None)
    for row in rows + st.kinds_rows(tiny_run):
        assert row["abs_diff"] == pytest.approx(abs(row["healthy_idle"] - row["predicted_idle"]))
    assert "healthy idle" in st.sweep_table(rows)
    assert f"compute ×{st.FACTOR:g}" in st.kinds_table(st.kinds_rows(tiny_run))


@pytest.mark.slow
def test_rebalancing_keeps_the_update_and_gives_the_slow_rank_less(tiny_run):
    equal, balanced = tiny_run.rebalance
    batch = 4 * preset("tiny").straggler.micro_batch
    assert equal["sizes"] == [batch // 4] * 4 and sum(balanced["sizes"]) == batch
    assert balanced["sizes"] == st.rebalance(balanced["calibration_speeds"], batch)  # timings vary, the rule does not
    assert (balanced["timeline"].batch == balanced["sizes"]).all()
    assert balanced["max_loss_diff"] < 1e-5  # same global batches, same mean gradient
    assert equal["speedup"] == 1 and balanced["speedup"] > 0
    assert "max |Δ loss|" in st.rebalance_table(tiny_run.rebalance)


@pytest.mark.slow
def test_local_sgd_with_k_1_is_synchronous_dp_and_k_4_communicates_less(tiny_run):
    sync, k1, k4 = tiny_run.local_sgd
    assert [r["k"] for r in (sync, k1, k4)] == [0, 1, 4]
    np.testing.assert_allclose(k1["timeline"].loss, sync["timeline"].loss, atol=1e-5)
    assert k1["eval_loss"] == pytest.approx(sync["eval_loss"], abs=1e-5)
    assert k4["bytes_per_step"] == sync["bytes_per_step"] / 4 == tiny_run.params
    assert math.isfinite(k4["eval_loss"]) and k4["eval_loss"] != sync["eval_loss"]
    for row in (sync, k1, k4):  # every rank jittered; the runs end on an average
        assert row["timeline"].injected_ranks == [0, 1, 2, 3] and (len(row["timeline"].step) + st.WARMUP) % 4 == 0


@pytest.mark.slow
def test_plots_return_figures(tiny_run):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for fig in (st.plot_timeline(tiny_run.sweep[-1], steps=3), st.plot_idle_vs_delay(st.sweep_rows(tiny_run)),
                st.plot_rebalance(tiny_run.rebalance)):
        assert isinstance(fig, matplotlib.figure.Figure)
        plt.close(fig)


def test_jitter_cost_matches_a_simulation_and_shrinks_with_k():
    rng = np.random.default_rng(0)
    late = (rng.random((100_000, 4, 4)) < 0.25) * 0.05  # [trials, ranks, steps]
    assert st.jitter_cost_s(0.05, 0.25, 4, 1) == pytest.approx(0.05 * (1 - 0.75 ** 4))
    assert st.jitter_cost_s(0.05, 0.25, 4, 4) == pytest.approx(late.sum(2).max(1).mean() / 4, rel=0.01)
    assert st.jitter_cost_s(0.05, 0.25, 4, 4) < st.jitter_cost_s(0.05, 0.25, 4, 1)  # not timed: a formula on given numbers
    with pytest.raises(ValueError, match="prob"):
        st.jitter_cost_s(0.05, 1.5, 4)


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_with_one_line(monkeypatch):
    from teraflops.launch.launcher import LaunchFailed

    monkeypatch.setenv("TERAFLOPS_FAULT", "kill:rank=1:step=2")
    plan = data_parallel_plan(preset("tiny"), ranks_cpu=4)
    with pytest.raises(LaunchFailed, match="rank 1") as info:
        st.run(plan, delays_ms=(0,), steps=3, experiments="sweep", timeout=60)
    assert "\n" not in str(info.value)
    shutil.rmtree(info.value.logs, ignore_errors=True)


def test_timeline_title_says_the_injection_once():
    """Unit 3's timeline was titled "200 ms: constant 200 ms"."""
    from types import SimpleNamespace

    from teraflops.orchestration.stragglers import timeline_title

    constant = SimpleNamespace(kind="constant", label="constant 200 ms")
    assert timeline_title(SimpleNamespace(name="200 ms", injection=constant)) == "injected: constant 200 ms"
    assert timeline_title(SimpleNamespace(name="rank 3 slow", injection=constant)) == "rank 3 slow: constant 200 ms"
