"""Unit 2's ZeRO runs: the comms-log accounting, real DeepSpeed runs, and a rank killed mid-run."""

import shutil

import psutil
import pytest

from teraflops import caches
from teraflops.launch import launcher, ops
from teraflops.parallelization import model_states, zero
from teraflops.launch.launcher import LaunchFailed
from teraflops.launch.ops import shm_buffers
from teraflops.launch.ports import port_in_use
from teraflops.sizing import PRESETS
from teraflops.launch.placement import data_parallel_plan


def log(entries):
    return {op: {size: [n, [1.0] * n, [1.0] * n, [1.0] * n] for size, n in sizes.items()} for op, sizes in entries.items()}


def test_comm_bytes_per_step_counts_the_paper_way():
    # all-reduce of S counts 2S; an all-gather logs the shard, so N shards; reduce-scatter logs its input
    assert zero.comm_bytes_per_step(log({"all_reduce": {100: 3}}), 2, 3) == 200
    assert zero.comm_bytes_per_step(log({"all_gather_into_tensor": {50: 2}}), 4, 2) == 200
    assert zero.comm_bytes_per_step(log({"reduce_scatter_tensor": {100: 1}, "reduce": {10: 2}, "broadcast": {8: 1}}), 2, 1) == 128
    with pytest.raises(ValueError, match="all_to_all"):
        zero.comm_bytes_per_step(log({"all_to_all": {1: 1}}), 2, 1)
    with pytest.raises(ValueError, match="steps"):
        zero.comm_bytes_per_step({}, 2, 0)


def recorded_runs(psi=1000, world=2, bucket=100):
    """Four stages as DeepSpeed's fp32 runs hold them on 2 ranks, counted by hand from the paper and the
    worker's sampling: gradients Ψ/Nd after backward from stage 1, at the peak Ψ (stage 1) or a
    partition plus a bucket (stage 2); the fp32 master partition Ψ/Nd inside the optimizer from stage 1."""
    shard = psi // world
    held = {0: (psi, psi, 2 * psi), 1: (psi, shard, 2 * shard + shard), 2: (psi, shard, 3 * shard),
            3: (shard, shard, 3 * shard)}
    peak = {0: psi, 1: psi, 2: shard + bucket, 3: shard}
    return [zero.StageRun(stage=s, psi=psi, world_size=world, backend="gloo",
                          held=[dict(zip(zero.CATEGORIES, held[s]))] * world, comms=[{}] * world, logged_steps=1,
                          losses=[[1.0]] * world, step_s=[[0.1]] * world, grads_peak=[peak[s]] * world,
                          master_elements=[shard if s else 0] * world) for s in range(4)]


def test_held_table_parts_stages_1_and_2_at_the_peak_and_shows_the_master_copy():
    import re

    rows = {}
    for line in zero.held_table(recorded_runs()).splitlines()[2:]:
        stage, state, *cols = re.split(r"\s{2,}", line.strip())
        rows[stage[0], state.strip()] = cols[:3]  # measured, calculator, ratio
    # stage 1 still holds all Ψ gradients at the peak (the paper's count), stage 2 its partition + a bucket
    assert rows["1", "grads at peak"] == ["1,000", "1,000", "1"] and rows["2", "grads at peak"][0] == "600"
    assert rows["1", "grads"][0] == rows["2", "grads"][0] == "500"  # after backward they read the same
    assert rows["0", "of which fp32 master"] == ["0", "0", "—"]  # torch's AdamW alone keeps none
    assert rows["1", "of which fp32 master"] == ["500", "500", "1"]  # Ψ/Nd, inside the optimizer's 1,500


def test_stacked_bars_are_each_stages_peak_with_the_master_copy_hatched():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = recorded_runs()
    fig, ax = plt.subplots()
    heights = zero.stack_states(ax, runs, [0] * 4)
    assert heights == pytest.approx([r.peak_bytes(0) / 1e6 for r in runs])
    assert [round(h * 1e6) for h in heights] == [4 * 4000, 4 * 3500, 4 * 3100, 4 * 2500]  # params + peak grads + optimizer
    labels = [c.get_label() for c in ax.containers]
    assert labels[-1] == "optimizer: fp32 master copy (DeepSpeed)" and ax.containers[-1][0].get_height() == 0
    assert ax.containers[-1][1].get_height() * 1e6 == pytest.approx(4 * 500) and ax.containers[-1][1].get_hatch() == "//"
    plt.close(fig)


@pytest.fixture(scope="module")
def runs_and_leftovers(zero_tiny_runs):
    """The four stages' runs and the DeepSpeed shared-memory files they left in /dev/shm (conftest)."""
    return zero_tiny_runs


@pytest.fixture(scope="module")
def runs(runs_and_leftovers):
    return runs_and_leftovers[0]


@pytest.mark.slow
def test_zero_runs_leave_no_shared_memory_files(runs_and_leftovers):
    # DeepSpeed's CPU comm op never unlinks its ~67 MB per rank; left behind, they filled RAM run by run
    assert not runs_and_leftovers[1]


@pytest.mark.slow
def test_zero_peak_model_states_fall_stage_by_stage(runs):
    """Stages 1 and 2 read the same after backward; at the backward pass's peak stage 1 still
    holds every gradient, stage 2 its partition and a bucket, so per rank 2 < 1 < 0, and 3 <= 2. (At the
    demo's CPU sizes, Ψ = 437,760, stage 3 is below stage 2 too: ``teraflops demo zero``; at tiny's Ψ =
    118,528 with 100,000-element buckets, stage 3's gathered gradients can equal stage 2's bucket.)"""
    assert [r.stage for r in runs] == [0, 1, 2, 3]
    for rank in range(runs[0].world_size):
        peaks = [r.peak_bytes(rank) for r in runs]
        assert peaks[0] > peaks[1] > peaks[2] >= peaks[3], (rank, peaks)
        assert runs[1].grads_peak[rank] == runs[1].psi  # all Ψ gradients live before stage 1 reduces them


@pytest.mark.slow
def test_zero_runs_hold_what_the_calculator_says(runs):
    for run in runs:
        calc = run.calculator()
        for state in zero.CATEGORIES:
            want = getattr(calc, f"{state}_elements")
            if (run.stage, state) == (1, "grads"):  # DeepSpeed's stage 1 keeps only its gradient partition
                want /= run.world_size
            for held in run.held:
                assert held[state] == pytest.approx(want, rel=0.01), (run.stage, state)


@pytest.mark.slow
def test_zero_losses_agree_and_communication_follows_the_paper(runs):
    assert zero.max_loss_difference(runs) < 1e-4
    for run in runs:
        ratio = run.comm_bytes / model_states.comm_volume(run.psi, run.stage, 4)
        assert 0.9 <= ratio <= 1.1 if run.stage < 3 else 1.0 <= ratio <= 1.25, (run.stage, ratio)
    assert runs[3].comm_bytes > 1.4 * runs[2].comm_bytes  # stage 3 pays ~1.5x
    assert "reduce_scatter_tensor" in runs[3].comms[0] and "all_reduce" in runs[0].comms[0]


@pytest.mark.slow
def test_a_rank_killed_mid_run_fails_cleanly_and_the_next_run_starts():
    plan = data_parallel_plan(PRESETS["tiny"])
    with pytest.raises(LaunchFailed) as info:
        zero.run_zero(stages=(2,), plan=plan, steps=3, env={"TERAFLOPS_FAULT": "kill:rank=1:step=1"})
    message = str(info.value)
    assert "timed out after 600 s" not in message  # the death was seen, not waited out (the launch's own timeout)
    assert "\n" not in message and "rank 1" in message
    assert not psutil.Process().children(recursive=True)
    assert not port_in_use(info.value.port)
    assert not shm_buffers(info.value.port)
    shutil.rmtree(info.value.logs)  # kept for the learner on a failure; the test has read what it needs
    lock = caches.extensions_dir() / ops.SHM_OP / "lock"
    assert not lock.exists()
    lock.touch()  # as a rank killed inside torch's JIT loader leaves it: the next run must not wait on it forever
    (again,) = zero.run_zero(stages=(0,), plan=plan, steps=2)
    assert again.held[0]["params"] == again.psi
