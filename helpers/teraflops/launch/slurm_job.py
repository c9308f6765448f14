"""Starting a launch's ranks as one Slurm batch job on an emulated cluster that runs Slurm.

:class:`SlurmBatchJob` is the :class:`teraflops.launch.plan.Starter` of a launch on ``Cluster(...,
slurm=True)``: it writes the plan's :class:`teraflops.launch.sbatch.BatchJob` script into the launch
folder (``job.sbatch``), starts the watchdog, submits it (``sbatch``; a refusal is the launch's
failure, in sbatch's own words), follows it with ``scontrol`` (:class:`teraflops.launch.sbatch.Follower`),
and on the way out cancels it (``scancel``, waiting until it has left its nodes), keeps the script
in the cluster's ``jobs/`` folder (:func:`teraflops.launch.sbatch.archive`) and stops what Slurm's
process tracking lost. A failure line then says how Slurm ended the job, and a job that never
started says why in Slurm's terms (its pending reason, https://slurm.schedmd.com/job_reason_codes.html).
"""

from __future__ import annotations

import os
import subprocess

from teraflops.launch import leftovers, sbatch
from teraflops.launch.agents import WRAPPER, spec_args, torchrun_command
from teraflops.launch.processes import stop
from teraflops.nodes.slurm import host as slurm_host
from teraflops.teardown import uninterruptible


class SlurmBatchJob:
    """The ranks of ``plan`` (a :class:`teraflops.launch.plan.LaunchPlan` whose ``slurm`` is set) as one
    batch job: an allocation of the plan's nodes, ``srun`` starting one torchrun agent per node.
    A :class:`teraflops.launch.plan.Starter`; ``job_id`` is Slurm's id once submitted."""

    def __init__(self, plan):
        self.plan, self.slurm = plan, plan.slurm
        self.job_id: int | None = None
        self.refused: str | None = None
        self.follower: sbatch.Follower | None = None
        self.final: sbatch.JobState | None = None  # the job's state once cancelled
        self.watchdog: subprocess.Popen | None = None
        self.hosts = [slurm_host(i) for i in range(plan.where.nodes)]

    def job(self) -> sbatch.BatchJob:
        """The plan's batch job: every node's ranks with the course's and the caller's environment."""
        p = self.plan
        return sbatch.BatchJob.of(p.where, [str(WRAPPER), p.module, *spec_args(p.spec_path)], torchrun=torchrun_command(),
                                  port=p.port, time_s=p.timeout, output=str(p.results / sbatch.OUTPUT),
                                  name=p.module.rsplit(".", 1)[-1], env={**p.course_env, **p.user_env},
                                  cpus_per_node=self.slurm.config.cpus, torchrun_args=p.launcher_args,
                                  log_dir=str(p.results / "torchelastic"))

    def start(self) -> None:
        p = self.plan
        script = p.results / sbatch.SCRIPT
        script.write_text(self.job().script())
        self.watchdog = leftovers.start_watchdog(p.results, p.port, [])  # stops the job's processes if we die
        try:  # sbatch hands its environment (the owner's record for the ranks' wrappers) on to the job
            # and TERAFLOPS_EMULATED_NODES=1: the script's emulation block applies here, not on a real cluster
            self.job_id = sbatch.submit(self.slurm, script,
                                        env={**os.environ, **leftovers.owner_env(), sbatch.EMULATED_ENV: "1"})
        except sbatch.BatchJobError as e:
            self.refused = str(e)
            return
        self.follower = sbatch.Follower(self.slurm, self.job_id)

    def poll(self) -> int | None:
        return 1 if self.follower is None else self.follower.poll()

    def stop(self) -> None:
        if self.job_id is None:
            return
        self.final = uninterruptible(sbatch.cancel, self.slurm, self.job_id)  # scancel; wait until it left its nodes
        sbatch.archive(self.slurm, self.job_id, self.plan.results)  # the script outlives the launch folder
        uninterruptible(stop, None, self.plan.results)  # what proctrack/linuxproc lost track of

    def explain(self, code: int | None, rank: int | None, why: str) -> tuple[int | None, str]:
        """A job that never started: PENDING for a reason waiting cannot cure (:data:`teraflops.launch.sbatch.UNSTARTABLE`),
        or still PENDING at the timeout; else the diagnosis as it is."""
        last = self.follower.last if self.follower is not None else None
        if last is None or last.state != "PENDING":
            return rank, why
        if last.reason in sbatch.UNSTARTABLE:
            return None, (f"Slurm job {self.job_id} cannot start: it is PENDING ({last.reason}), asking for more "
                          f"than the nodes or the partition have. Hint: compare the #SBATCH lines of "
                          f"{sbatch.SCRIPT} with `sinfo -N -l` (https://slurm.schedmd.com/job_reason_codes.html).")
        if code is None:
            return None, (f"Slurm job {self.job_id} was still PENDING ({last.reason}) after {self.plan.timeout:g} s: "
                          f"its {self.plan.where.nodes} nodes never came free. Hint: `squeue` shows the jobs holding "
                          "them; scancel those or raise timeout=.")
        return rank, why

    def outcome(self) -> str:
        """How Slurm ended the job, and whether it still holds it (after :meth:`stop`)."""
        if self.job_id is None:
            return ""
        held = self.job_id in sbatch.queued(self.slurm)
        return f" {(self.final.describe() if self.final else f'Slurm job {self.job_id}')}" + (
            f", still in squeue (scancel {self.job_id})." if held else ", nothing left allocated.")
