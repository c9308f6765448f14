"""Launch multi-process work from a notebook: :func:`launch`, the course's one way to start ranks.

:func:`launch` starts ``python -m MODULE`` on N local ranks (127.0.0.1) through ``torchrun``
(https://pytorch.org/docs/stable/elastic/run.html) or DeepSpeed's launcher, each rank inside
``launch/scripts/rank_wrapper.py``, which records how it ended. The rendezvous listens on loopback only (on each
node's own address for a multi-node run; :mod:`teraflops.launch.loopback`). A host module sends its rank
program a Spec (``launch(..., spec=)``, a frozen dataclass written to ``spec.json``, read with
:func:`teraflops.launch.rank.read_spec`) and ranks hand back a Result (a dataclass) with
:func:`teraflops.launch.rank.write_result`, read back as ``result=`` (:mod:`teraflops.launch.wire`
checks every field). Their output goes to files in ``$TERAFLOPS_RESULTS_DIR`` (a fresh temporary
directory per launch, kept when it fails): ``spec.json``, ``rank{r}.json``, ``rank{r}.out``/``.err``,
``rank{r}.exit``, ``progress.json`` (rank 0's :func:`~teraflops.launch.rank.report_progress`) and
``launcher.log``. A crash, a killed or hung rank or a timeout raises :class:`LaunchFailed` (one line,
:mod:`teraflops.launch.diagnosis`) once every process of the launch is gone and its port is free
(and, for DeepSpeed on CPU, its shared-memory files are removed), also when the cell is interrupted.
Faults can be injected on purpose (:mod:`teraflops.launch.faults`).

:func:`launch` is a pipeline of named steps: :func:`teraflops.launch.plan.prepare` (check, place, the
launch folder, the Spec, the environment: a frozen :class:`~teraflops.launch.plan.LaunchPlan`), a
:class:`~teraflops.launch.plan.Starter` (:func:`starter_for`: torchrun agents,
:mod:`teraflops.launch.agents`, or a Slurm batch job, :mod:`teraflops.launch.slurm_job`) started,
:func:`wait`, :func:`read_results`, :func:`explain` (the one-line diagnosis) and :func:`teardown`.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import fields
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from teraflops.errors import CourseError
from teraflops.launch import wire
from teraflops.launch.agents import TorchrunAgents
from teraflops.launch.diagnosis import diagnose
from teraflops.launch.loopback import check_torch
from teraflops.launch.ops import clear_stale_build_lock, remove_shm_buffers
from teraflops.launch.plan import LaunchPlan, Starter, prepare
from teraflops.launch.ports import port_in_use
from teraflops.launch.slurm_job import SlurmBatchJob
from teraflops.launch.wire import read_json


class LaunchFailed(CourseError, RuntimeError):
    """A launch failed: the rank, its exit status or timeout, its last error line, a hint, the logs.

    Attributes ``rank`` (None when no rank is to blame), ``logs`` (the results directory), ``port``.
    """


def launch(module: str, ranks, *, launcher: str = "torchrun",
           timeout: float = 120, env: dict | None = None, launcher_args: Sequence[str] = (),
           desc: str | None = None, verbose: bool = False, port: int | None = None,
           cluster=None, deepspeed: bool = False, spec=None, result=None, submit: bool | None = None) -> list:
    """Run ``python -m module --spec PATH`` on the ranks of a run; return their results, by rank.

    ``spec`` (a frozen dataclass, :mod:`teraflops.launch.wire`) is written to ``spec.json`` in the launch
    folder and the ranks get ``--spec PATH``, their only argument (:func:`read_spec` reads it). ``result``
    (a dataclass) is what each rank's :func:`write_result` is read back as, every field checked;
    without it the results are the ranks' dicts.

    ``ranks`` is a :class:`~teraflops.launch.placement.Placement` (world size, backend, each rank's device
    and environment; :func:`teraflops.launch.placement.place` decides it) or an int, the ranks per node,
    placed with :func:`~teraflops.launch.placement.place` (NCCL on a GPU each where there are 2 or more GPUs
    for them, else gloo CPU ranks with the GPUs hidden). A one-node placement given with
    ``cluster`` is re-placed over its nodes (:func:`~teraflops.launch.placement.across`).

    ``launcher`` is ``"torchrun"`` or ``"deepspeed"``; ``launcher_args`` go to it (torchrun ``--rdzv-*``
    options get ``--rdzv-endpoint 127.0.0.1:port`` unless they name one, and ``--local-addr 127.0.0.1``).
    Every rendezvous store of a one-node run listens on 127.0.0.1 only, those of a multi-node run on
    their node's address (:mod:`teraflops.launch.loopback`). ``timeout`` (s) covers the
    whole launch. Ranks get the placement's environment, ``TORCH_EXTENSIONS_DIR`` under
    :func:`cache_dir` unless set, ``PATH`` with the Python environment's ninja first
    (:func:`teraflops.caches.with_ninja`: loading an op runs ninja), then ``env``. ``verbose``
    prints their output as it comes.

    ``cluster`` (a :class:`teraflops.nodes.cluster.Cluster` that is up) runs it multi-node, as on a real
    cluster: one torchrun agent per emulated node (``--nnodes K --nproc-per-node``, c10d
    rendezvous on node 0's address), talking over the nodes' shaped links. Each result then carries
    ``"node"``, the node its rank ran on. Torchrun only.

    ``submit``: on a cluster that runs Slurm (``Cluster(..., slurm=True)``) the run is submitted as a
    batch job (the default, or ``True``; :mod:`teraflops.launch.sbatch`): an sbatch script for an allocation
    of K nodes, ``srun`` starting one torchrun agent per node with c10d rendezvous on the first node
    of the allocation, written to ``job.sbatch`` in the launch folder and kept in the cluster's
    ``jobs/`` folder as ``<job id>.sbatch`` (:func:`teraflops.launch.sbatch.archived`: the script to take to
    a real cluster), submitted, followed until it ends (``scontrol show job``; ``scancel`` at
    ``timeout``), the ranks' results read back as above. A failed rank's line then names its node
    (``node1``) and Slurm's end of the job, and the job has left its nodes when :class:`LaunchFailed`
    is raised. ``submit=False`` starts the agents itself, as on a cluster without Slurm.

    ``deepspeed=True`` says torchrun's ranks call ``deepspeed.init_distributed`` (the DeepSpeed
    launcher implies it): its CPU op is built first (:func:`prepare_deepspeed_ops`).

    Raises:
        LaunchFailed: a rank failed or wrote no result, or ``timeout`` passed.
        PlacementError: ``ranks`` cannot be placed (see :func:`~teraflops.launch.placement.place`).
    """
    check_torch()  # one line here, not a hang at the ranks' rendezvous
    plan = prepare(module, ranks, launcher=launcher, timeout=timeout, env=env, launcher_args=launcher_args,
                   desc=desc, verbose=verbose, port=port, cluster=cluster, deepspeed=deepspeed, spec=spec,
                   submit=submit)
    starter = starter_for(plan)
    failed, rank, why = False, None, ""
    try:
        starter.start()
        code = wait(plan, starter)
        out = read_results(plan, code)
        if out is not None:
            return out if result is None else typed_results(out, result)
        failed = True  # the launch folder is kept: the error names it
        rank, why = explain(plan, starter, code)
    finally:  # also on KeyboardInterrupt: nothing of this launch may outlive the call
        teardown(plan, starter, keep=failed)
    raise failure(plan, rank, why + starter.outcome())


def starter_for(plan: LaunchPlan) -> Starter:
    """How ``plan``'s ranks start: one Slurm batch job on a cluster that runs Slurm (unless ``submit=False``),
    else one launcher per node started here."""
    return SlurmBatchJob(plan) if plan.slurm is not None else TorchrunAgents(plan)


def wait(plan: LaunchPlan, starter: Starter) -> int | None:
    """Wait behind a progress bar (rank 0's :func:`~teraflops.launch.rank.report_progress`) until the ranks
    are done: their exit code (:meth:`Starter.poll`), None after ``plan.timeout`` s; 1 at once for a
    starter that was refused."""
    if starter.refused is not None:
        return 1
    start, offsets, shown = time.monotonic(), {}, None
    with tqdm(desc=plan.label, unit="step", dynamic_ncols=True) as bar:  # the row's full width in JupyterLab
        widgets = getattr(getattr(bar, "container", None), "children", ())
        if len(widgets) == 3:  # tqdm's notebook bar: [description, bar, counts]; a long description squeezed
            widgets[1].layout.min_width = "12em"  # the bar to 30 px, so it wraps below it instead
        while True:
            code, progress = starter.poll(), read_json(plan.results / "progress.json")
            if progress:
                if bar.total != progress["total"]:  # tqdm's notebook bar only takes its width in reset(total=)
                    bar.reset(total=progress["total"])
                bar.n = progress["done"]
            if shown != (bar.n, int(time.monotonic() - start)):  # redraw on progress and every second
                shown = (bar.n, int(time.monotonic() - start))
                bar.refresh()
            if plan.verbose:
                _echo(plan.results, offsets)
            if code is not None or time.monotonic() - start > plan.timeout:
                return code
            time.sleep(0.2)


def _echo(results: Path, offsets: dict) -> None:
    """Print the whole lines the launch's logs gained since the last call (``offsets``: bytes read per file)."""
    for f in sorted(p for p in results.iterdir() if p.suffix in (".log", ".out", ".err")):
        with open(f, "rb") as fh:
            fh.seek(offsets.get(f, 0))
            data = fh.read()
        data = data[: data.rfind(b"\n") + 1]  # whole lines only
        offsets[f] = offsets.get(f, 0) + len(data)
        for line in data.decode(errors="replace").splitlines():
            tqdm.write(f"[{f.name}] {line}")


def read_results(plan: LaunchPlan, code: int | None) -> list[dict] | None:
    """Every rank's result dict (with ``"node"`` on a cluster) when the ranks ended with ``code`` 0 and each
    wrote one; else None (the launch failed)."""
    out = [read_json(plan.results / f"rank{r}.json") for r in range(plan.world)]
    if code != 0 or None in out:
        return None
    if plan.cluster is not None:
        for r, got in enumerate(out):
            got["node"] = (read_json(plan.results / f"rank{r}.exit") or {}).get("node")
    return out


def explain(plan: LaunchPlan, starter: Starter, code: int | None) -> tuple[int | None, str]:
    """``(rank or None, one line)`` of a failed launch: the starter's refusal, else
    :func:`~teraflops.launch.diagnosis.diagnose` (as the starter amends it), after who took the cluster
    down if someone did."""
    if starter.refused is not None:
        rank, why = None, starter.refused
    else:
        rank, why = diagnose(plan.results, plan.world, code, plan.timeout, plan.launcher, plan.fault,
                             hosts=starter.hosts)
    rank, why = starter.explain(code, rank, why)
    gone = plan.cluster.taken_down(since=plan.started) if plan.cluster is not None else None
    return rank, (f"{gone} {why}" if gone else why)


def teardown(plan: LaunchPlan, starter: Starter, keep: bool) -> None:
    """Stop every process of the launch, wait until its port is free (one node), remove DeepSpeed's
    shared-memory buffers and a stale build lock, stop the watchdog and remove the launch folder
    unless ``keep`` (a failure's logs)."""
    try:
        starter.stop()
        deadline = time.monotonic() + 10
        while plan.cluster is None and port_in_use(plan.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        if plan.launcher == "deepspeed":
            remove_shm_buffers(plan.port)
        if plan.deepspeed:
            clear_stale_build_lock()
    finally:  # a second Ctrl-C cuts the wait for the port short, not the clean-up of the folder
        if starter.watchdog is not None:
            starter.watchdog.kill()
            starter.watchdog.wait()
        if not keep:
            shutil.rmtree(plan.results, ignore_errors=True)


def failure(plan: LaunchPlan, rank: int | None, why: str) -> LaunchFailed:
    """The :class:`LaunchFailed` of ``plan``: its title, ``why``, the logs' folder."""
    err = LaunchFailed(f"{plan.title}: {why} Logs: {plan.results}")
    err.rank, err.logs, err.port = rank, plan.results, plan.port
    return err


def typed_results(out: list[dict], cls) -> list:
    """Each rank's result dict as a ``cls`` (:func:`teraflops.launch.wire.from_json`); ``node`` (multi-node
    launches) only where ``cls`` has such a field."""
    names = {f.name for f in fields(cls)}
    return [wire.from_json(cls, {k: v for k, v in got.items() if k != "node" or k in names}, f"{cls.__name__} of rank {r}")
            for r, got in enumerate(out)]
