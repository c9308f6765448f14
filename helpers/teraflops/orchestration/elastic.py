"""Unit 3 §4b: a rank is killed mid-training, torchrun's elastic agent restarts the job, and training
resumes from its last atomic checkpoint to the same final loss.

:func:`run` trains the small GPT data-parallel twice (``workers/elastic_train.py``), both times
under torchrun's elastic agent (https://pytorch.org/docs/stable/elastic/run.html): once
uninterrupted, as the reference, and once with ``TERAFLOPS_FAULT=kill:rank=R:step=K``, which
SIGKILLs rank R before step K in the first attempt. What the agent does, as documented there:

* ``--max-restarts N``: "For a training job with n workers, if k<=n workers fail all workers are
  stopped and restarted up to max_restarts". The agent polls its workers every ``--monitor-interval``
  (0.1 s by default); when one has exited with an error it stops the others (SIGTERM, then SIGKILL)
  and starts the whole group again, with ``TORCHELASTIC_RESTART_COUNT`` one higher. With
  ``--max-restarts 0`` (torchrun's default) the first failure ends the job.
* ``--rdzv-backend c10d``: the ranks are assigned through a rendezvous held in a TCPStore that the
  agent hosts on ``--rdzv-endpoint`` (no etcd or other server to run); every restart is a new
  rendezvous round of the same ``--rdzv-id``.
* Since torch 2.5 the workers' process group shares that store by default, and keys written in
  one attempt are still there in the next: a restarted gloo rank can read a peer's address from
  the failed attempt and fail with "connectFullMesh failed ... Connection refused" (NCCL: a stale
  unique id), https://github.com/pytorch/pytorch/issues/135712. torch 2.13 still did that here.
  :data:`ELASTIC_ENV` turns the sharing off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): each round
  then hands the workers a fresh ``MASTER_PORT``, where rank 0 hosts a new store.

The agent brings processes back, not state: a restarted rank starts ``main()`` from the top, so
the worker loads the newest checkpoint (:mod:`teraflops.orchestration.checkpoint`; model, optimizer, step, loss
history) and redoes the steps after it. Because batches are indexed by the global step and all
arithmetic is deterministic on a fixed number of ranks, the resumed run reproduces the reference's
losses; what the failure costs is time: the steps computed since the checkpoint, redone
(``steps_recomputed``), and the restart itself (``restart_s``: detection, stopping the group, the
rendezvous, starting Python and torch, joining the process group, loading the checkpoint). With 4
gloo ranks on 2 shared cores the agent's log showed detection and stopping in 0.2 s and the new
rendezvous in 0.3 s; the other ~14 s were the ranks starting again, as long as the job's first
start: a restart costs about one job start-up.
Checkpointing more often recomputes less but writes more; Young ("A first order approximation to
the optimum checkpoint interval", CACM 1974) puts the best interval at about sqrt(2 × checkpoint
cost × mean time between failures).

Units: seconds (wall, ``time.perf_counter`` around each launch; step times from the Unix times
rank 0 logs as each step finishes), losses in nats (the global batch's mean next-token
cross-entropy). The reference runs first, under the same launcher options, so ``time_lost_s``
compares like with like; on a shared machine both walls carry a few seconds of noise.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from teraflops.launch.faults import FAULT_ENV
from teraflops.launch.launcher import launch
from teraflops.launch.rank import RankIdentity
from teraflops.sizing import TrainConfig, gpt_config, preset
from teraflops.launch.placement import DataParallelPlan, data_parallel_plan
from teraflops.tables import table

WORKER = "teraflops.workers.elastic_train"
STEPS_LOG = "steps.jsonl"  # rank 0's per-step log in the checkpoint folder (outlives an attempt)
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh store per attempt (module docstring)


@dataclass(frozen=True)
class ElasticSpec:
    """What :mod:`teraflops.workers.elastic_train` runs: ``model`` (Adam at ``model.lr``) trained
    ``steps`` steps, checkpointing into ``checkpoint_dir`` every ``checkpoint_every`` completed
    steps (and resuming from the newest checkpoint there); ``timeout_s``: seconds a collective waits."""

    model: TrainConfig
    checkpoint_dir: str
    steps: int
    checkpoint_every: int
    timeout_s: float = 30

    def __post_init__(self):
        if min(self.steps, self.checkpoint_every) < 1:
            raise ValueError(f"steps={self.steps} and checkpoint_every={self.checkpoint_every} must be >= 1")


@dataclass(frozen=True)
class ElasticResult(RankIdentity):
    """One rank's attempt that finished: ``attempt`` (torchrun's restart count), ``resumed_from``
    (the checkpoint's step, 0 if none), ``losses`` (global loss per step, all steps, nats),
    ``final_loss``, ``params``, ``train_s`` (this attempt's training seconds)."""

    attempt: int
    resumed_from: int
    steps: int
    losses: list[float]
    final_loss: float
    params: int
    train_s: float


@dataclass(frozen=True)
class ElasticRun:
    """What :func:`run` measured (steps count from 0; checkpoint ``S`` holds the state after ``S`` steps).

    Attributes:
        reference_losses: global loss per step of the uninterrupted run, ``[steps]`` (nats).
        reference_records, records: rank 0's per-step log of the uninterrupted and the interrupted
            run, ``{"step", "loss", "attempt", "time"}`` (attempt: torchrun's restart count; time:
            seconds since the launch began); the interrupted run lists its recomputed steps twice.
        losses: global loss per step of the interrupted run as it ended (resumed history), ``[steps]``.
        steps, checkpoint_every, kill_step, kill_rank, ranks, backend: the setting.
        restarts: restarts the agent made (1 when the kill was recovered).
        last_checkpoint_step: the checkpoint the restarted ranks loaded (0: none, from scratch).
        steps_recomputed: ``kill_step - last_checkpoint_step``, steps done twice.
        step_s: typical step time, the median interval between steps of the reference (s).
        restart_s: from the last step finished before the kill to the first finished after the
            restart, less one ``step_s`` (s); NaN if the kill came before any step finished.
        time_lost_s: interrupted launch wall minus reference launch wall (s). Start-up (~10-20 s of
            importing torch in every rank) varies by seconds on a shared machine, and so does this.
        training_lost_s: the same difference counted from each run's first finished step to its
            last, which leaves the start-up out: ``restart_s + steps_recomputed × step_s``, give or take
            noise in the steps (s); NaN like ``restart_s``.
        final_loss_diff, max_loss_diff: ``|interrupted - reference|`` loss at the last step, and the
            largest over all steps (nats).
        reference_wall_s, interrupted_wall_s: wall time of each launch, process start-up included (s).
    """

    reference_losses: list
    reference_records: list
    records: list
    losses: list
    steps: int
    checkpoint_every: int
    kill_step: int
    kill_rank: int
    ranks: int
    backend: str
    restarts: int
    last_checkpoint_step: int
    steps_recomputed: int
    step_s: float
    restart_s: float
    time_lost_s: float
    training_lost_s: float
    final_loss_diff: float
    max_loss_diff: float
    reference_wall_s: float
    interrupted_wall_s: float


def elastic_launcher_args(max_restarts: int = 1) -> list[str]:
    """torchrun options for an elastic job on this node: ``--max-restarts`` and a c10d rendezvous
    with a fresh id (:func:`~teraflops.launch.launcher.launch` adds ``--rdzv-endpoint``)."""
    return ["--max-restarts", str(int(max_restarts)), "--rdzv-backend", "c10d",
            "--rdzv-id", f"teraflops-elastic-{uuid.uuid4().hex[:8]}"]


def elastic_spec(plan: DataParallelPlan, checkpoint_dir, steps: int, checkpoint_every: int,
                 collective_timeout: float = 30) -> ElasticSpec:
    """The worker's :class:`ElasticSpec`: ``plan.preset``'s ``gpt``, ``straggler.micro_batch``
    sequences per rank, ``dp.lr``."""
    p = plan.preset
    return ElasticSpec(model=gpt_config(p, p.straggler.micro_batch, p.dp.lr), checkpoint_dir=str(checkpoint_dir),
                       steps=steps, checkpoint_every=checkpoint_every, timeout_s=collective_timeout)


def launch_training(checkpoint_dir, plan: DataParallelPlan | None = None, steps: int | None = None,
                    checkpoint_every: int | None = None, *, fault: str | None = None, max_restarts: int = 1,
                    timeout: float = 120, port: int | None = None, desc: str = "elastic training"):
    """One launch of the worker under the elastic agent, checkpointing into ``checkpoint_dir``
    (which must exist; a checkpoint already in it is resumed from).

    ``fault``: a ``TERAFLOPS_FAULT`` spec, e.g. ``"kill:rank=1:step=17"``. Returns ``(results by
    rank (:class:`ElasticResult`), rank 0's step records with ``time`` in seconds since the launch began, wall seconds)``.

    Raises:
        LaunchFailed: a rank failed more often than ``max_restarts`` allows, or ``timeout`` s passed.
    """
    plan = plan or data_parallel_plan(preset(), ranks_cpu=preset().straggler.ranks_cpu)
    p = plan.preset
    env = {**ELASTIC_ENV, **({FAULT_ENV: fault} if fault else {})}
    start, wall = time.time(), time.perf_counter()
    spec = elastic_spec(plan, checkpoint_dir, steps or p.elastic.steps, checkpoint_every or p.elastic.checkpoint_every)
    results = launch(WORKER, plan.placement, spec=spec, result=ElasticResult, timeout=timeout, env=env, launcher_args=elastic_launcher_args(max_restarts), desc=desc, port=port)
    wall = time.perf_counter() - wall
    lines = (Path(checkpoint_dir) / STEPS_LOG).read_text().splitlines()
    records = [{**r, "time": r["time"] - start} for r in map(json.loads, lines)]
    return results, records, wall


def run(plan: DataParallelPlan | None = None, steps: int | None = None, checkpoint_every: int | None = None,
        kill_step: int | None = None, kill_rank: int | None = None, timeout: float = 120) -> ElasticRun:
    """Train uninterrupted, then again with rank ``kill_rank`` SIGKILLed before step ``kill_step`` and
    one elastic restart; compare (see :class:`ElasticRun`). Two launches; with 4 gloo ranks on 2
    cores shared with other work (load 2-6) each start-up took 17-29 s, the restart 17-26 s, the
    whole call 80-98 s.

    Args:
        plan: ranks and sizes (default: ``data_parallel_plan(preset(), ranks_cpu=preset().straggler.ranks_cpu)``,
            4 gloo ranks on a CPU machine, one rank per GPU with two or more).
        steps, checkpoint_every, kill_step: default the preset's ``elastic.steps``,
            ``elastic.checkpoint_every``, ``elastic.kill_step``.
        kill_rank: default the last rank.
        timeout: seconds for each launch.

    Raises:
        ValueError: ``kill_step`` not in ``[0, steps)``, or ``kill_rank`` not a rank.
        LaunchFailed: a launch failed (e.g. the restarted job failed again) or timed out.
    """
    plan = plan or data_parallel_plan(preset(), ranks_cpu=preset().straggler.ranks_cpu)
    p = plan.preset
    steps = p.elastic.steps if steps is None else steps
    every = p.elastic.checkpoint_every if checkpoint_every is None else checkpoint_every
    if steps < 1 or every < 1:
        raise ValueError(f"steps={steps} and checkpoint_every={every} must be >= 1 (training steps)")
    kill_step = p.elastic.kill_step if kill_step is None else kill_step
    kill_rank = plan.ranks - 1 if kill_rank is None else kill_rank
    if not 0 <= kill_step < steps:
        raise ValueError(f"kill_step={kill_step} must be a step of the run, 0 to {steps - 1}: a later one never comes")
    if not 0 <= kill_rank < plan.ranks:
        raise ValueError(f"kill_rank={kill_rank} is not a rank; the launch has ranks 0-{plan.ranks - 1}")
    dirs = [Path(tempfile.mkdtemp(prefix="teraflops-elastic-")) for _ in range(2)]
    try:
        ref, ref_records, ref_wall = launch_training(dirs[0], plan, steps, every, timeout=timeout,
                                                     desc="elastic: reference")
        out, records, wall = launch_training(dirs[1], plan, steps, every, timeout=timeout,
                                             fault=f"kill:rank={kill_rank}:step={kill_step}",
                                             desc=f"elastic: rank {kill_rank} killed at step {kill_step}")
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    times = [r["time"] for r in ref_records]
    step_s = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0
    before = [r["time"] for r in records if r["attempt"] == 0]
    after = [r["time"] for r in records if r["attempt"] > 0]
    restart_s = after[0] - before[-1] - step_s if before and after else math.nan
    span = [rs[-1]["time"] - rs[0]["time"] for rs in (ref_records, records)]
    training_lost_s = span[1] - span[0] if before else math.nan
    ref_losses, losses, r0 = ref[0].losses, out[0].losses, out[0]
    return ElasticRun(reference_losses=ref_losses, reference_records=ref_records, records=records, losses=losses,
                      steps=steps, checkpoint_every=every, kill_step=kill_step, kill_rank=kill_rank, ranks=plan.ranks,
                      backend=r0.backend, restarts=r0.attempt, last_checkpoint_step=r0.resumed_from,
                      steps_recomputed=kill_step - r0.resumed_from, step_s=step_s, restart_s=restart_s,
                      time_lost_s=wall - ref_wall, training_lost_s=training_lost_s,
                      final_loss_diff=abs(losses[-1] - ref_losses[-1]),
                      max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)), reference_wall_s=ref_wall,
                      interrupted_wall_s=wall)


def recovery_table(run: ElasticRun) -> str:
    """The two runs side by side: wall time, restarts, the checkpoint resumed from, steps recomputed,
    restart and time lost (s; in wall time, and from first to last step), final loss and its
    difference from the reference."""
    return table([("uninterrupted", run.reference_wall_s, 0, "-", 0, "-", "-", "-", run.reference_losses[-1], "-"),
                  (f"rank {run.kill_rank} killed at step {run.kill_step}", run.interrupted_wall_s, run.restarts,
                   run.last_checkpoint_step, run.steps_recomputed, run.restart_s, run.time_lost_s,
                   run.training_lost_s, run.losses[-1], f"{run.final_loss_diff:.1e}")],
                 ["run", "wall s", "restarts", "resumed from step", "steps recomputed", "restart s", "lost s (wall)",
                  "lost s (steps)", "final loss", "|Δ final loss|"])


def plot_recovery(run: ElasticRun):
    """Loss against step (left: both runs, the kill, the checkpoint resumed from, the recomputed steps
    shaded) and the step finished against seconds since each launch began (right: start-up, the
    restart gap, the fall back to the checkpoint); returns the Figure."""
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(12, 4.2))
    first = [r for r in run.records if r["attempt"] == 0]
    again = [r for r in run.records if r["attempt"] > 0]
    ax_step.plot(range(run.steps), run.reference_losses, color="grey", lw=3, alpha=0.5, label="uninterrupted")
    ax_step.plot([r["step"] for r in first], [r["loss"] for r in first], "o", ms=4, label="first attempt")
    ax_step.plot([r["step"] for r in again], [r["loss"] for r in again], "x", ms=5, label="after the restart")
    ax_step.axvspan(run.last_checkpoint_step - 0.5, run.kill_step - 0.5, color="orange", alpha=0.2,
                    label=f"recomputed ({run.steps_recomputed} steps)")
    ax_step.axvline(run.last_checkpoint_step - 0.5, color="green", ls="--",
                    label=f"checkpoint resumed from (step {run.last_checkpoint_step})")
    ax_step.axvline(run.kill_step - 0.5, color="red", label=f"rank {run.kill_rank} killed (step {run.kill_step})")
    ax_step.set(xlabel="step", ylabel="training loss (nats, global batch)", title="Same losses, some steps twice")
    ax_step.legend(fontsize="small", loc="upper right")
    ax_time.plot([r["time"] for r in run.reference_records], [r["step"] for r in run.reference_records], ".-",
                 color="grey", label=f"uninterrupted ({run.reference_wall_s:.1f} s launch)")
    for records, label in ((first, "first attempt"), (again, "after the restart")):
        ax_time.plot([r["time"] for r in records], [r["step"] for r in records], ".-", label=label)
    if first and again:
        ax_time.axvspan(first[-1]["time"], again[0]["time"], color="red", alpha=0.15,
                        label=f"restart: {run.restart_s:.1f} s + one step")
    ax_time.set(xlabel="seconds since the launch began (process start-up included)", ylabel="step finished",
                title=f"{run.training_lost_s:.1f} s lost between first and last step "
                      f"({run.time_lost_s:+.1f} s in launch wall time)")
    ax_time.set_xlim(left=0)
    ax_time.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    return fig
