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
    """Issue 18: a detector centred on the mean with a 1 % MAD floor passed every case before."""
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


def test_checkpoint_interval_passes_youngs_optimum(capsys):
    check.checkpoint_interval(_interval)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (lambda t, c, m, r: round(math.sqrt(c * m) / t), "factor 2 is missing"),
    (lambda t, c, m, r: round(math.sqrt(2 * c * m)), "interval in seconds"),
    (lambda t, c, m, r: round(math.sqrt(2 * (c + r) * m) / t), "restart time is paid once per failure"),
    (lambda t, c, m, r: round(math.sqrt(2 * m / c) / t), "wrong way round"),
    (lambda t, c, m, r: math.sqrt(2 * c * m) / t, "whole number of steps"),
    (lambda t, c, m, r: 10, "minimise C/(k·T)"),
])
def test_checkpoint_interval_mistakes_are_named(wrong, hint):
    with pytest.raises(ExerciseFailed, match=re.escape(hint)):
        check.checkpoint_interval(wrong)
