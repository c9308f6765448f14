"""Unit 3's checks: answers written here from the exercises' definitions pass, plausible wrong answers fail
with the hint that names them."""

import math
import re
import statistics

import numpy as np
import pytest

from teraflops.orchestration import detection, queue_sim, stragglers
from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit03 as check


# --- the exercises as a learner writes them, from their definitions (not the package's references) -------

def idle_fraction(step_s, wait_s):
    """Per rank: total seconds waiting over total seconds of its steps."""
    steps, ranks = len(step_s), len(step_s[0])
    return [sum(wait_s[t][r] for t in range(steps)) / sum(step_s[t][r] for t in range(steps)) for r in range(ranks)]


def flag_stragglers(busy_s):
    """Iglewicz & Hoaglin's modified z-score 0.6745 (x - median) / MAD of each rank's mean busy time, the
    MAD floored at 5 % of the median; ranks above 3.5."""
    means = [statistics.fmean(column) for column in zip(*np.asarray(busy_s).tolist())]
    median = statistics.median(means)
    mad = max(statistics.median(abs(x - median) for x in means), 0.05 * median)
    return [r for r, x in enumerate(means) if 0.6745 * (x - median) / mad > 3.5]


def rebalance(speeds, global_batch):
    """Shares proportional to speed, floored (at least 1); the samples left go to the largest remainders,
    and samples the raised ranks took come back from the largest micro-batch."""
    share = [global_batch * s / sum(speeds) for s in speeds]
    sizes = [max(1, math.floor(x)) for x in share]
    by_remainder = sorted(range(len(share)), key=lambda r: share[r] - math.floor(share[r]), reverse=True)
    for r in by_remainder[:max(0, global_batch - sum(sizes))]:
        sizes[r] += 1
    while sum(sizes) > global_batch:
        sizes[sizes.index(max(sizes))] -= 1
    return sizes


def backfill_policy(queue, cluster, now):
    """EASY backfill: jobs in order while they fit; behind the first that does not (the head), a job that
    fits now and leaves the head's earliest start where it was."""
    chosen = []
    for i, job in enumerate(queue):
        if not cluster.fits(job, assuming=chosen):
            break
        chosen.append(job)
    else:
        return chosen
    head = queue[i]
    reservation = cluster.earliest_start(head, assuming=chosen)
    for job in queue[i + 1:]:
        if cluster.fits(job, assuming=chosen) and cluster.earliest_start(head, assuming=[*chosen, job]) <= reservation:
            chosen.append(job)
    return chosen


def test_answers_written_from_the_definitions_pass(capsys):
    """Each check compares with the package's reference: these answers, written here, pass only where the
    reference agrees with the exercise's definition (passing the reference itself would hold by construction)."""
    check.idle_fraction(idle_fraction)
    check.straggler_detector(flag_stragglers)
    check.rebalance(rebalance)
    check.backfill_policy(backfill_policy)
    assert capsys.readouterr().out.count("passed") == 4


def test_the_references_the_checks_use_give_the_hand_computed_values():
    """What the checks compare with, on cases worked out by hand."""
    step = np.array([[1.0, 1.0], [3.0, 3.0]])
    wait = np.array([[0.5, 0.0], [0.5, 1.5]])
    assert stragglers.idle_fraction(step, wait).tolist() == [0.25, 0.375]  # (0.5 + 0.5) / 4, (0 + 1.5) / 4
    # [1, 1, 1, 1.3]: median 1, MAD 0 floored at 0.05, z of the last 0.6745 * 0.3 / 0.05 = 4.05 > 3.5
    assert list(detection.flag_stragglers(np.tile([1.0, 1.0, 1.0, 1.3], (3, 1)))) == [3]
    assert list(detection.flag_stragglers(np.tile([1.0, 1.0, 1.0, 1.25], (3, 1)))) == []  # z = 3.37


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, w: (w / s).mean(axis=0), "not the average of per-step ratios"),
    (lambda s, w: (w / s).mean(axis=1), "reduce over the steps"),
    (lambda s, w: 100 * w.sum(0) / s.sum(0), "not a percentage"),
    (lambda s, w: 1 - w.sum(0) / s.sum(0), "busy fraction"),
])
def test_idle_fraction_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.idle_fraction(wrong)


@pytest.mark.parametrize("wrong, hint", [
    (check._mean_std, "median and the MAD"),
    (check._mean_centred, "centre on the median, not the mean"),
    (lambda busy: check._mean_centred(busy, 0.05), "centre on the median, not the mean"),
    (check._no_floor, "floor the MAD"),
    (check._two_sided, "only slow ranks"),
    (lambda busy: [], "flagged \\[\\], expected \\[3\\]"),
    (check._no_scale, "multiply by 0.6745"),
    (check._inverse_scale, "multiply by 0.6745"),
    (check._any_step, "one slow step is not a straggler"),
    (lambda busy: (busy.mean(0) > 1.3 * np.median(busy.mean(0))).tolist(), "a mask"),
])
def test_detector_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.straggler_detector(wrong)


@pytest.mark.parametrize("wrong, hint", [
    (lambda s, g: [round(g * x / sum(s)) for x in s], "must not change"),
    (lambda s, g: [g * x / sum(s) for x in s], "whole number"),
    (lambda s, g: stragglers.rebalance([1 / x for x in s], g), "proportional to speed, not to time"),
    (lambda s, g: [g // len(s)] * (len(s) - 1) + [g - g // len(s) * (len(s) - 1)], "within one"),
    (lambda s, g: _largest_remainder_without_minimum(s, g), "at least one sample"),
])
def test_rebalance_mistakes(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        check.rebalance(wrong)


def _largest_remainder_without_minimum(speeds, batch):
    share = np.asarray(speeds) / sum(speeds) * batch
    sizes = np.floor(share).astype(int)
    sizes[np.argsort(-(share - sizes), kind="stable")[: batch - sizes.sum()]] += 1
    return sizes.tolist()


def _candidates_tested_alone(queue, cluster, now):
    started = []
    for i, job in enumerate(queue):
        if not cluster.fits(job, assuming=started):
            break
        started.append(job)
    else:
        return started
    reservation = cluster.earliest_start(queue[i], assuming=started)
    return started + [j for j in queue[i + 1:] if cluster.fits(j, assuming=started)
                      and cluster.earliest_start(queue[i], assuming=[j]) <= reservation]


def test_policy_mistakes():
    with pytest.raises(ExerciseFailed, match="together with the jobs you already chose"):
        check.backfill_policy(_candidates_tested_alone)
    with pytest.raises(ExerciseFailed, match="not above FIFO"):
        check.backfill_policy(queue_sim.fifo)
    with pytest.raises(ExerciseFailed, match="pushed the head job"):
        check.backfill_policy(queue_sim.greedy)


def test_placeholder_is_not_attempted():
    def placeholder(*args):
        raise NotImplementedError

    for name in ("idle_fraction", "straggler_detector", "rebalance", "backfill_policy"):
        with pytest.raises(NotAttempted):
            getattr(check, name)(placeholder)


def test_a_mean_centred_detector_fails_on_its_telling_case():
    """A detector centred on the mean with a 1 % MAD floor passed every case before."""
    with pytest.raises(ExerciseFailed, match=r"three equal ranks, one 30 % slower': flagged \[\], expected \[3\]"):
        check.straggler_detector(check._mean_centred)


def test_an_unrecognised_detector_gets_the_formula_only_when_it_fails_again():
    never = lambda busy: [0]  # noqa: E731 - none of the modelled mistakes
    with pytest.raises(ExerciseFailed) as first:
        check.straggler_detector(never)
    assert "0.6745" not in str(first.value) and "if it fails again" in str(first.value)
    with pytest.raises(ExerciseFailed, match="0.6745"):
        check.straggler_detector(never)


# --- exercise 5: a two-node batch script ---------------------------------------------------------

def _script(command, nodes="--nodes=2", gres="--gres=gpu:1", time="--time=1", srun="srun "):
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in (nodes, "--ntasks-per-node=1", gres, time) if o)]
    return "\n".join(lines + [f"{srun}{command}", ""])


STATIC_MISTAKES = [
    (lambda c: _script(c)[12:], "shebang"),
    (lambda c: _script(c, nodes="--nodes=1"), r"--nodes.*#SBATCH --nodes=2"),
    (lambda c: _script(c, gres=""), r"no GPUs per node.*--gres=gpu:1"),
    (lambda c: _script(c, gres="--gres=gpu:2"), r"gpu:2 per node, not one"),
    (lambda c: _script(c, time="--time=60"), r"time limit is 60, not 1 minute"),
    (lambda c: _script(c, srun=""), r"not started with srun.*first node"),
    (lambda c: _script(c).replace("#SBATCH --time=1\n", "") + "#SBATCH --time=1\n", "stops reading #SBATCH lines"),
    (lambda c: 42, "return the script as a str"),
]


@pytest.mark.parametrize("wrong, hint", STATIC_MISTAKES)
def test_batch_script_mistakes_read_from_the_text(wrong, hint, monkeypatch):
    import teraflops.nodes.cluster

    monkeypatch.setattr(teraflops.nodes.cluster, "unavailable", lambda: "no Slurm in this test")
    with pytest.raises(ExerciseFailed, match=hint):
        check.batch_script(wrong)


def test_batch_script_read_only_where_slurm_cannot_run(monkeypatch, capsys):
    import teraflops.nodes.cluster

    monkeypatch.setattr(teraflops.nodes.cluster, "unavailable", lambda: "no Slurm in this test")
    check.batch_script(_script)
    check.batch_script(lambda c: f"#!/bin/sh\n#SBATCH -N 2 -t 0:01:00\n#SBATCH --gpus-per-node=1\nsrun {c}\n")
    out = capsys.readouterr().out
    assert out.count("(read, not submitted: no Slurm in this test)") == 2 and out.count("passed") == 2
    with pytest.raises(NotAttempted):
        check.batch_script(lambda c: (_ for _ in ()).throw(NotImplementedError()))


@pytest.mark.slow
def test_batch_script_is_submitted_to_a_real_cluster(capsys):
    from teraflops.nodes import cluster, slurm

    why = cluster.unavailable() or slurm.unavailable()
    if why:
        pytest.skip(why)
    check.batch_script(_script)
    assert "passed" in capsys.readouterr().out
    # wrong where the job shows it: the cluster's own answer names the mistake, not the text
    with pytest.raises(ExerciseFailed, match=r"ran once, on node0 only.*srun"):
        check.batch_script(lambda c: _script(c, srun=""))
    with pytest.raises(ExerciseFailed, match=r"GPUs per node: .*none.*--gres=gpu:1"):
        check.batch_script(lambda c: _script(c, gres=""))
    assert not [n for n in cluster.namespaces() if "lab3" in n]


# ---- exercise 6: checkpoint interval ------------------------------------------------------------


def _interval(t, c, m, r):
    k = max(1.0, math.sqrt(2 * c * m) / t)
    return min((max(1, math.floor(k)), math.ceil(k)), key=lambda n: c / (n * t) + (r + n * t / 2) / m)


@pytest.fixture
def formula_only(monkeypatch):
    """No emulated nodes: the check judges the formula alone (the real run is the slow test's)."""
    import teraflops.nodes.cluster

    monkeypatch.setattr(teraflops.nodes.cluster, "unavailable", lambda: "no Ray in this test")


def _fake_ray_run(calls, checkpoint_s=0.03, resume_off=0):
    """A stand-in for ray_elastic.run: the records a run with ``checkpoint_every`` would leave (kill after
    step 17 of 30, 0.25 s steps, each checkpoint logged with the next step), no process started."""
    from teraflops.orchestration.ray_elastic import RayDriverResult, RayElasticRun

    def run(steps, checkpoint_every, kill_step, rejoin_after, step_s, **_):
        calls.append(checkpoint_every)
        k, a = checkpoint_every, ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
        ckpt = lambda n: checkpoint_s if n > 1 and (n - 1) % k == 0 else 0.0  # noqa: E731
        rows = [{"step": n, "loss": 5.0, "world": 3, "nodes": a, "resumed_from": 0, "time": 100 + n * step_s,
                 "checkpoint_s": ckpt(n)} for n in range(1, kill_step + 1)]
        resumed = kill_step // k * k + resume_off
        rows += [{"step": n, "loss": 5.0, "world": 2, "nodes": a[:2], "resumed_from": resumed,
                  "time": 140 + n * step_s, "checkpoint_s": ckpt(n) if n > resumed + 1 else 0.0}
                 for n in range(resumed + 1, steps + 1)]
        driver = RayDriverResult(True, None, 5.0, steps, 90.0, 160.0, "node0", [], [])
        return RayElasticRun(rows, 2, 100 + kill_step * step_s + 0.1, None, driver, [5.0] * steps, k, {}, 3.0)
    return run


@pytest.fixture
def fake_ray(monkeypatch):
    """Emulated nodes and Ray 'available', ray_elastic.run replaced by :func:`_fake_ray_run`: the intervals it was
    asked for."""
    import teraflops.nodes.cluster
    import teraflops.nodes.ray
    import teraflops.orchestration.ray_elastic

    calls = []
    monkeypatch.setattr(teraflops.nodes.cluster, "unavailable", lambda: None)
    monkeypatch.setattr(teraflops.nodes.ray, "unavailable", lambda: None)
    monkeypatch.setattr(teraflops.orchestration.ray_elastic, "run", _fake_ray_run(calls))
    return calls


def test_checkpoint_interval_passes_youngs_optimum(capsys, formula_only):
    check.checkpoint_interval(_interval)
    assert "passed" in capsys.readouterr().out and "no Ray" in check.last_run["skipped"]


def test_the_learners_interval_runs_on_ray_and_resumes_where_it_says(capsys, fake_ray):
    check.checkpoint_interval(_interval)
    assert capsys.readouterr().out.strip().endswith("passed")  # the measurements are the lab's next cell's
    k = _interval(*check.LIVE_CASE)
    assert fake_ray == [k] and k == 5  # the live case's best interval sits inside the 30-step run
    m = check.last_run
    assert m["k"] == 5 and m["resumed_from"] == 15 == m["predicted_resume"] and m["steps_redone"] == 2
    assert m["checkpoints"] >= 1 and m["checkpoint_s"] == pytest.approx(0.03)


@pytest.mark.parametrize("wrong, hint, measured", [
    (lambda t, c, m, r: 1, "a checkpoint every step", r"measured on Ray: \d+ checkpoints cost [\d.]+ s \(30 ms each\); "
     r"the kill after step 17 redid 0 steps"),
    (lambda t, c, m, r: 10**9, "never checkpointing", r"the kill after step 17 redid 17 steps \(4\.2 s\)"),
])
def test_every_step_and_never_fail_with_their_measured_cost(wrong, hint, measured, fake_ray):
    with pytest.raises(ExerciseFailed, match=re.escape(hint)) as e:
        check.checkpoint_interval(wrong)
    assert re.search(measured, str(e.value)), str(e.value)


def test_a_run_that_resumed_elsewhere_fails(monkeypatch, fake_ray):
    import teraflops.orchestration.ray_elastic

    monkeypatch.setattr(teraflops.orchestration.ray_elastic, "run", _fake_ray_run([], resume_off=-3))
    with pytest.raises(ExerciseFailed, match="resumed from step 12, not a checkpoint of your interval at or before 15"):
        check.checkpoint_interval(_interval)


def test_a_checkpoint_ray_had_not_registered_yet_is_not_the_learners_fault(monkeypatch, fake_ray):
    """Ray resumes from the last checkpoint it registered: with one every step that can trail the last written."""
    import teraflops.orchestration.ray_elastic

    monkeypatch.setattr(teraflops.orchestration.ray_elastic, "run", _fake_ray_run([], resume_off=-5))
    check.checkpoint_interval(_interval)
    assert check.last_run["resumed_from"] == 10 and check.last_run["steps_redone"] == 7


@pytest.mark.slow
def test_the_solution_runs_on_a_real_ray_cluster(capsys):
    """One real run (a 3-node Ray cluster, a node killed): the solution's interval resumes where it says."""
    from teraflops.nodes import cluster
    from teraflops.nodes import ray as ray_nodes

    why = cluster.unavailable() or ray_nodes.unavailable()
    if why:
        pytest.skip(f"Ray on emulated nodes unavailable: {why}")
    check.checkpoint_interval(_interval)
    m = check.last_run
    assert m["resumed_from"] == m["predicted_resume"] and m["k"] == 5 and m["steps_redone"] >= 0
    assert math.isfinite(m["checkpoint_s"]) and m["checkpoint_s"] > 0


@pytest.mark.parametrize("wrong, hint", [
    (lambda t, c, m, r: round(math.sqrt(c * m) / t), "factor 2 is missing"),
    (lambda t, c, m, r: round(math.sqrt(2 * c * m)), "interval in seconds"),
    (lambda t, c, m, r: round(math.sqrt(2 * (c + r) * m) / t), "restart time is paid once per failure"),
    (lambda t, c, m, r: round(math.sqrt(2 * m / c) / t), "wrong way round"),
    (lambda t, c, m, r: math.sqrt(2 * c * m) / t, "whole number of steps"),
    (lambda t, c, m, r: 10, "minimise C/(k·T)"),
])
def test_checkpoint_interval_mistakes_are_named(wrong, hint, formula_only):
    with pytest.raises(ExerciseFailed, match=re.escape(hint)):
        check.checkpoint_interval(wrong)
