"""A launch, prepared: the first step of :func:`teraflops.launch.launcher.launch`.

:func:`prepare` checks what ``launch`` was asked (the launcher, the cluster, Slurm, the fault to
inject), places the ranks (:func:`teraflops.launch.placement.place`), builds DeepSpeed's CPU op where
the ranks need it, sweeps what launches of dead notebooks left (:func:`teraflops.launch.leftovers.sweep`),
makes the launch folder with its owner record and the Spec (``spec.json``, :mod:`teraflops.launch.wire`),
and composes the ranks' environment. Its :class:`LaunchPlan` is frozen: every later step (a
:class:`Starter`, the wait, the diagnosis, the teardown) reads it and changes nothing in it.

A :class:`Starter` is one way of starting the ranks of a plan: :class:`teraflops.launch.agents.TorchrunAgents`
(one launcher per node, started by this process) or :class:`teraflops.launch.slurm_job.SlurmBatchJob`
(one Slurm batch job whose ``srun`` starts them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from teraflops.caches import extensions_dir, with_ninja
from teraflops.errors import CourseError
from teraflops.launch import leftovers, wire
from teraflops.launch.faults import FAULT_ENV, parse_fault
from teraflops.launch.ops import prepare_deepspeed_ops
from teraflops.launch.placement import VISIBLE_ENV, Placement, PlacementError, across, place
from teraflops.launch.ports import free_port
from teraflops.launch.wire import RESULTS_ENV

LAUNCHERS = ("torchrun", "deepspeed")


@dataclass(frozen=True)
class LaunchPlan:
    """One launch, checked and placed, with its folder made (:func:`prepare`).

    Attributes:
        module: what each rank runs, ``python -m MODULE``.
        spec_path: the Spec's file in the launch folder (``spec.json``), or None for a launch without one.
        where: the placement (world size, nodes, backend, each rank's device and environment).
        launcher: ``"torchrun"`` or ``"deepspeed"`` (DeepSpeed's launcher, one node).
        deepspeed: the ranks initialise DeepSpeed (its launcher, or ``deepspeed=True`` under torchrun).
        launcher_args: more options for the launcher.
        timeout: seconds the whole launch may take.
        label: the progress bar's description.
        title: what a failure's line starts with (``desc``, else the module).
        verbose: echo the ranks' output as it comes.
        port: the rendezvous (master) port.
        results: the launch folder (``$TERAFLOPS_RESULTS_DIR``): spec, results, logs, ``owner.json``.
        cluster: the :class:`teraflops.nodes.cluster.Cluster` it runs on, or None (this machine).
        slurm: the cluster's :class:`teraflops.nodes.slurm.Slurm` when the run is a batch job, else None.
        course_env: what the course sets for every rank (extensions folder, launch folder, unbuffered
            output, ``PATH`` with the environment's ninja first).
        user_env: ``env=``, as strings.
        env: every launcher's environment: ``os.environ``, ``course_env``, the placement's, the owner's
            (:func:`teraflops.launch.leftovers.owner_env`), then ``user_env``.
        started: when it was prepared (Unix seconds).
    """

    module: str
    spec_path: Path | None
    where: Placement
    launcher: str
    deepspeed: bool
    launcher_args: tuple[str, ...]
    timeout: float
    label: str
    title: str
    verbose: bool
    port: int
    results: Path
    cluster: object | None
    slurm: object | None
    course_env: dict
    user_env: dict
    env: dict
    started: float

    @property
    def world(self) -> int:
        return self.where.world_size

    @property
    def fault(self) -> str | None:
        """The fault injected into the ranks (``$TERAFLOPS_FAULT``), if any."""
        return self.env.get(FAULT_ENV)


class Starter(Protocol):
    """One way of starting the ranks of a :class:`LaunchPlan`, and of stopping them for good.

    Attributes:
        refused: why the ranks could not be started at all (one line, e.g. sbatch's refusal), else None.
        hosts: each node's host name, for the line naming a failed rank's node, or None.
        watchdog: the launch's watchdog (:func:`teraflops.launch.leftovers.start_watchdog`) once started.
    """

    refused: str | None
    hosts: list[str] | None
    watchdog: subprocess.Popen | None

    def start(self) -> None:
        """Start the ranks and the watchdog (which stops them if this process dies)."""

    def poll(self) -> int | None:
        """None while the ranks run; then their exit code (the first failure's, 0 when all are done)."""

    def stop(self) -> None:
        """Stop everything it started, through more Ctrl-Cs; safe to call when nothing runs."""

    def explain(self, code: int | None, rank: int | None, why: str) -> tuple[int | None, str]:
        """The failure ``(rank, why)`` of :func:`teraflops.launch.diagnosis.diagnose`, or what replaces it
        where this way of starting knows better (a batch job that never started)."""

    def outcome(self) -> str:
        """What the failure line ends with once :meth:`stop` is done (`` Slurm job 7 FAILED ..., nothing
        left allocated.``), or ``""``."""


def prepare(module: str, ranks, *, launcher: str = "torchrun", timeout: float = 120,
            env: dict | None = None, launcher_args: Sequence[str] = (), desc: str | None = None,
            verbose: bool = False, port: int | None = None, cluster=None, deepspeed: bool = False, spec=None,
            submit: bool | None = None) -> LaunchPlan:
    """The :class:`LaunchPlan` of :func:`teraflops.launch.launcher.launch`'s arguments (the same, see
    there): checked, placed, DeepSpeed's op built, its folder made with the Spec in it.

    Raises:
        ValueError: an unknown launcher, or a fault for a rank the launch does not have.
        CourseError: a multi-node launch without torchrun or a cluster that is up; ``submit=True``
            without Slurm; a placement over nodes without a cluster; more GPU ranks per node than the
            Slurm nodes declare.
        PlacementError: ``ranks`` cannot be placed; ``env`` sets ``CUDA_VISIBLE_DEVICES`` (the rank wrapper
            would put the placement's GPUs back over it, silently).
        teraflops.launch.wire.SpecError: ``spec`` cannot be written (the folder is removed again).
    """
    slurm = _batch_system(launcher, cluster, submit)
    where = _placement(ranks, cluster, slurm)
    user = {k: str(v) for k, v in (env or {}).items()}
    if {"CUDA_VISIBLE_DEVICES", VISIBLE_ENV} & set(user):
        raise PlacementError("launch(env={'CUDA_VISIBLE_DEVICES': ...}) would be undone: the placement gives each rank "
                             "its GPUs. Hint: set os.environ['CUDA_VISIBLE_DEVICES'] before launching; the placement "
                             "keeps the GPUs it lists")
    fault = parse_fault({**os.environ, **user}.get(FAULT_ENV))  # a malformed spec fails here, not in a rank
    uses_deepspeed = launcher == "deepspeed" or deepspeed
    if uses_deepspeed:  # before anything that needs cleaning up
        prepare_deepspeed_ops(cpu=not where.on_gpus)
    if fault is not None and fault.rank >= where.world_size:
        raise ValueError(f"{FAULT_ENV} names rank {fault.rank}, but the launch has ranks 0-{where.world_size - 1}")
    port, results = _launch_folder(port)
    try:
        spec_path = None if spec is None else wire.write(spec, results / "spec.json")
    except BaseException:
        shutil.rmtree(results, ignore_errors=True)
        raise
    course = {"TORCH_EXTENSIONS_DIR": str(extensions_dir()), RESULTS_ENV: str(results), "PYTHONUNBUFFERED": "1",
              "PYTHONFAULTHANDLER": "1", **{k: v for k, v in with_ninja(os.environ).items() if k == "PATH"}}
    return LaunchPlan(module=module, spec_path=spec_path, where=where, launcher=launcher, deepspeed=uses_deepspeed,
                      launcher_args=tuple(map(str, launcher_args)), timeout=timeout,
                      label=desc or module.rsplit(".", 1)[-1], title=desc or module, verbose=verbose, port=port,
                      results=results, cluster=cluster, slurm=slurm, course_env=course, user_env=user,
                      env={**os.environ, **course, **where.env, **leftovers.owner_env(), **user}, started=time.time())


def _batch_system(launcher: str, cluster, submit: bool | None):
    """The cluster's Slurm when the run is to be a batch job, else None; checks launcher and cluster."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be 'torchrun' or 'deepspeed', got {launcher!r}")
    if cluster is not None and (launcher != "torchrun" or not getattr(cluster, "up_", False)):
        raise CourseError("a multi-node launch needs launcher='torchrun' and a cluster that is up. "
                          "Hint: with Cluster(2) as cl: launch(..., cluster=cl); DeepSpeed initialises inside torchrun ranks.")
    slurm = getattr(cluster, "slurm_", None) if cluster is not None and submit is not False else None
    if submit and slurm is None:
        raise CourseError("submit=True needs a cluster that runs Slurm. Hint: Cluster(2, slurm=True); on a cluster "
                          "without Slurm leave submit out and launch starts one torchrun agent per node itself.")
    return slurm


def _placement(ranks, cluster, slurm) -> Placement:
    """``ranks`` as a :class:`Placement` over ``cluster``'s nodes (or this machine), checked against them."""
    if not isinstance(ranks, Placement):
        per_node = isinstance(ranks, int) and not isinstance(ranks, bool)
        where = place(ranks * (1 if cluster is None else cluster.nodes) if per_node else ranks, cluster=cluster)
    elif cluster is not None and ranks.nodes != cluster.nodes:
        where = across(ranks, cluster)
    else:
        where = ranks
    if cluster is None and where.nodes != 1:
        raise CourseError(f"the placement spreads {where.world_size} ranks over {where.nodes} nodes but no cluster "
                          "was given. Hint: launch(..., cluster=cl) with the cluster it was placed on")
    if slurm is not None and where.on_gpus and where.ranks_per_node > slurm.config.gpus_per_node:
        raise CourseError(f"the run puts {where.ranks_per_node} GPU ranks on each node but the Slurm nodes declare "
                          f"{slurm.config.gpus_per_node} GPUs each. Hint: Cluster(..., slurm=SlurmConfig("
                          f"gpus_per_node={where.ranks_per_node})), or fewer ranks.")
    return where


def _launch_folder(port: int | None) -> tuple[int, Path]:
    """Sweep dead launches' leftovers, then a port and a fresh launch folder with this process's owner record."""
    leftovers.sweep()  # what launches of dead notebooks left: folders, /dev/shm buffers, torchelastic_* folders
    port, results = port or free_port(), Path(tempfile.mkdtemp(prefix="teraflops-launch-"))
    leftovers.record(results, port)
    return port, results
