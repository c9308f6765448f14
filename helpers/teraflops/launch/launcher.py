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
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from teraflops.caches import extensions_dir, with_ninja
from teraflops.errors import CourseError
from teraflops.launch import leftovers, loopback, sbatch, wire
from teraflops.launch.diagnosis import diagnose
from teraflops.launch.faults import FAULT_ENV, parse_fault
from teraflops.launch.ops import clear_stale_build_lock, prepare_deepspeed_ops, remove_shm_buffers
from teraflops.launch.placement import Placement, across, place
from teraflops.launch.ports import free_port, port_in_use
from teraflops.launch.processes import stop, stop_all
from teraflops.launch.wire import RESULTS_ENV, read_json
from teraflops.nodes.slurm import host as slurm_host
from teraflops.teardown import uninterruptible

_WRAPPER = Path(__file__).resolve().parent / "scripts" / "rank_wrapper.py"


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
    if launcher not in ("torchrun", "deepspeed"):
        raise ValueError(f"launcher must be 'torchrun' or 'deepspeed', got {launcher!r}")
    if cluster is not None and (launcher != "torchrun" or not getattr(cluster, "up_", False)):
        raise CourseError("a multi-node launch needs launcher='torchrun' and a cluster that is up. "
                          "Hint: with Cluster(2) as cl: launch(..., cluster=cl); DeepSpeed initialises inside torchrun ranks.")
    slurm = getattr(cluster, "slurm_", None) if cluster is not None and submit is not False else None
    if submit and slurm is None:
        raise CourseError("submit=True needs a cluster that runs Slurm. Hint: Cluster(2, slurm=True); on a cluster "
                          "without Slurm leave submit out and launch starts one torchrun agent per node itself.")
    if not isinstance(ranks, Placement):
        ranks = place(ranks * (1 if cluster is None else cluster.nodes) if isinstance(ranks, int) and not
                      isinstance(ranks, bool) else ranks, cluster=cluster)
    elif cluster is not None and ranks.nodes != cluster.nodes:
        ranks = across(ranks, cluster)
    where = ranks
    if cluster is None and where.nodes != 1:
        raise CourseError(f"the placement spreads {where.world_size} ranks over {where.nodes} nodes but no cluster "
                          "was given. Hint: launch(..., cluster=cl) with the cluster it was placed on")
    if slurm is not None and where.on_gpus and where.ranks_per_node > slurm.config.gpus_per_node:
        raise CourseError(f"the run puts {where.ranks_per_node} GPU ranks on each node but the Slurm nodes declare "
                          f"{slurm.config.gpus_per_node} GPUs each. Hint: Cluster(..., slurm=SlurmConfig("
                          f"gpus_per_node={where.ranks_per_node})), or fewer ranks.")
    fault = parse_fault({**os.environ, **(env or {})}.get(FAULT_ENV))  # a malformed spec fails here, not in a rank
    if launcher == "deepspeed" or deepspeed:  # before anything that needs cleaning up
        prepare_deepspeed_ops(cpu=not where.on_gpus)
    world = where.world_size
    if fault is not None and fault.rank >= world:
        raise ValueError(f"{FAULT_ENV} names rank {fault.rank}, but the launch has ranks 0-{world - 1}")
    leftovers.sweep()  # what launches of dead notebooks left: folders, /dev/shm buffers, torchelastic_* folders
    port, results = port or free_port(), Path(tempfile.mkdtemp(prefix="teraflops-launch-"))
    leftovers.record(results, port)
    spec_path = None if spec is None else wire.write(spec, results / "spec.json")
    course = {"TORCH_EXTENSIONS_DIR": str(extensions_dir()), RESULTS_ENV: str(results), "PYTHONUNBUFFERED": "1",
              "PYTHONFAULTHANDLER": "1", **{k: v for k, v in with_ninja(os.environ).items() if k == "PATH"}}
    user = {k: str(v) for k, v in (env or {}).items()}
    child_env = {**os.environ, **course, **where.env, **leftovers.owner_env(), **user}
    procs, keep, watchdog = [], False, None  # the results directory is kept for a LaunchFailed, which names it
    job_id, follower, refused, final = None, None, None, None
    try:
        if slurm is not None:  # one batch job; Slurm's srun starts the agents
            job = sbatch.BatchJob.of(where, [str(_WRAPPER), module, *_spec_args(spec_path)], torchrun=torchrun_command(), port=port,
                                     time_s=timeout, output=str(results / sbatch.OUTPUT),
                                     name=module.rsplit(".", 1)[-1], env={**course, **user},
                                     cpus_per_node=slurm.config.cpus, torchrun_args=launcher_args,
                                     log_dir=str(results / "torchelastic"))
            script = results / sbatch.SCRIPT
            script.write_text(job.script())
            watchdog = leftovers.start_watchdog(results, port, [])  # stops the job's processes if we die
            try:  # sbatch hands its environment (the owner's record for the ranks' wrappers) on to the job
                job_id = sbatch.submit(slurm, script, env={**os.environ, **leftovers.owner_env()})
            except sbatch.BatchJobError as e:
                refused = str(e)
            follower = sbatch.Follower(slurm, job_id) if job_id is not None else None
            poll = follower.poll if follower is not None else None
        else:
            cmds = launch_commands(where, module, spec_path, launcher=launcher, port=port, rdzv_id=results.name,
                                   launcher_args=launcher_args, cluster=cluster, log_dir=results / "torchelastic")
            for node, node_cmd in enumerate(cmds):
                node_env = {**child_env, **where.node_env[node], **user}
                if cluster is not None:  # the node's own address: its stores listen there, nowhere else
                    node_env[loopback.LISTEN_ENV] = cluster.address(node)
                with open(results / ("launcher.log" if node == 0 else f"launcher{node}.log"), "wb") as log:
                    procs.append(subprocess.Popen(node_cmd, env=node_env, stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            watchdog = leftovers.start_watchdog(results, port, [p.pid for p in procs])  # stops it all if we die
            poll = lambda: _launchers_code(procs)  # noqa: E731
        code = 1 if refused else _wait(poll, results, timeout, desc or module.rsplit(".", 1)[-1], verbose)
        out = [read_json(results / f"rank{r}.json") for r in range(world)]
        if refused is None and code == 0 and None not in out:
            if cluster is not None:
                for r, got in enumerate(out):
                    got["node"] = (read_json(results / f"rank{r}.exit") or {}).get("node")
            return out if result is None else typed_results(out, result)
        keep = True
        hosts = None if slurm is None else [slurm_host(i) for i in range(where.nodes)]
        rank, why = (None, refused) if refused else diagnose(results, world, code, timeout, launcher,
                                                              child_env.get(FAULT_ENV), hosts=hosts)
        last = follower.last if follower is not None else None
        if last is not None and last.state == "PENDING" and last.reason in sbatch.UNSTARTABLE:
            rank, why = None, (f"Slurm job {job_id} cannot start: it is PENDING ({last.reason}), asking for more "
                               f"than the nodes or the partition have. Hint: compare the #SBATCH lines of "
                               f"{sbatch.SCRIPT} with `sinfo -N -l` (https://slurm.schedmd.com/job_reason_codes.html).")
        elif code is None and last is not None and last.state == "PENDING":
            rank, why = None, (f"Slurm job {job_id} was still PENDING ({last.reason}) after {timeout:g} s: its "
                               f"{where.nodes} nodes never came free. Hint: `squeue` shows the jobs holding them; "
                               "scancel those or raise timeout=.")
        gone = cluster.taken_down() if cluster is not None else None
        why = f"{gone} {why}" if gone else why
    finally:  # also on KeyboardInterrupt: nothing of this launch may outlive the call
        try:
            if job_id is not None:  # scancel (if it still runs) and wait until it has left its nodes
                final = uninterruptible(sbatch.cancel, slurm, job_id)
                sbatch.archive(slurm, job_id, results)  # the script outlives the launch folder
                uninterruptible(stop, None, results)  # what proctrack/linuxproc lost track of
            stop_all(procs, results)
            deadline = time.monotonic() + 10
            while cluster is None and port_in_use(port) and time.monotonic() < deadline:
                time.sleep(0.1)
            if launcher == "deepspeed":
                remove_shm_buffers(port)
            if launcher == "deepspeed" or deepspeed:
                clear_stale_build_lock()
        finally:  # a second Ctrl-C cuts the wait for the port short, not the clean-up of the folder
            if watchdog is not None:
                watchdog.kill()
                watchdog.wait()
            if not keep:
                shutil.rmtree(results, ignore_errors=True)
    if job_id is not None:
        held = job_id in sbatch.queued(slurm)
        why += f" {(final.describe() if final else f'Slurm job {job_id}')}" + (
            f", still in squeue (scancel {job_id})." if held else ", nothing left allocated.")
    err = LaunchFailed(f"{desc or module}: {why} Logs: {results}")
    err.rank, err.logs, err.port = rank, results, port
    raise err


def torchrun_command() -> list[str]:
    """This environment's torchrun, its stores listening on one address: ``python -m
    teraflops.launch.loopback torch.distributed.run`` (the program of the ``torchrun`` script;
    :mod:`teraflops.launch.loopback`)."""
    return [sys.executable, "-m", "teraflops.launch.loopback", "torch.distributed.run"]


def typed_results(out: list[dict], cls) -> list:
    """Each rank's result dict as a ``cls`` (:func:`teraflops.launch.wire.from_json`); ``node`` (multi-node
    launches) only where ``cls`` has such a field."""
    names = {f.name for f in fields(cls)}
    return [wire.from_json(cls, {k: v for k, v in got.items() if k != "node" or k in names}, f"{cls.__name__} of rank {r}")
            for r, got in enumerate(out)]


def _spec_args(spec_path: Path | None) -> list[str]:
    """A rank's command-line arguments: ``--spec PATH``, or none for a launch without a Spec."""
    return [] if spec_path is None else ["--spec", str(spec_path)]


def launch_commands(where, module: str, spec_path: Path | None = None, *, launcher: str = "torchrun",
                    port: int = 29500, rdzv_id: str = "teraflops", launcher_args: Sequence[str] = (),
                    cluster=None, log_dir: Path | None = None) -> list[list[str]]:
    """The command line of each node's launcher for placement ``where`` (one per node; what
    :func:`launch` starts): torchrun (``torch.distributed.run``) with ``--nproc-per-node``, or
    DeepSpeed's launcher with ``--num_gpus``; on emulated nodes, inside the node's namespace with
    c10d rendezvous on node 0 (``is_host`` and ``--local-addr`` said, as torch finds both by hostname,
    which a namespace shares with the machine). torchrun runs as :func:`torchrun_command` (its stores
    listen on one address), and one-node c10d gets ``--local-addr 127.0.0.1``: rank 0's agent hosts
    the store it shares with the ranks on its local address, by default its host name
    (``dynamic_rendezvous.py``, ``_create_tcp_store_server``). Each rank runs ``launch/scripts/rank_wrapper.py
    MODULE --spec SPEC_PATH`` (nothing after MODULE without ``spec_path``). ``log_dir``: torchrun's
    ``--log-dir`` (inside the launch folder: no ``/tmp/torchelastic_*`` per launch)."""
    nproc = str(where.ranks_per_node)
    tail = [*launcher_args, str(_WRAPPER), module, *_spec_args(spec_path)]
    if launcher == "deepspeed":
        return [[sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", nproc, "--master_addr",
                 "127.0.0.1", "--master_port", str(port), "--no_local_rank", *tail]]
    cmd = [*torchrun_command(), "--nproc-per-node", nproc, *(["--log-dir", str(log_dir)] if log_dir is not None else [])]
    if cluster is not None:
        cmd += ["--nnodes", str(where.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{cluster.address(0)}:{port}", "--rdzv-id", rdzv_id]
        return [[*cluster.prefix(node), *cmd, "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr",
                 cluster.address(node), *tail] for node in range(where.nodes)]
    if any(a.startswith("--rdzv") for a in launcher_args):
        cmd += [] if any("endpoint" in a for a in launcher_args) else ["--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd += [] if any(a.startswith(("--local-addr", "--local_addr")) for a in launcher_args) else \
            ["--local-addr", "127.0.0.1"]
    else:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [cmd + tail]


def _launchers_code(procs) -> int | None:
    """The launchers' exit code: the first non-zero one as soon as any fails, 0 when all are done."""
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    return failed[0] if failed else (0 if None not in codes else None)


def _wait(poll, results: Path, timeout: float, desc: str, verbose: bool) -> int | None:
    """Wait behind a progress bar until ``poll()`` (the launchers' or the batch job's exit code, None
    while they run) says they are done: that code, or None after ``timeout`` s."""
    start, offsets, shown = time.monotonic(), {}, None
    with tqdm(desc=desc, unit="step", dynamic_ncols=True) as bar:  # the row's full width in JupyterLab
        widgets = getattr(getattr(bar, "container", None), "children", ())
        if len(widgets) == 3:  # tqdm's notebook bar: [description, bar, counts]; a long description squeezed
            widgets[1].layout.min_width = "12em"  # the bar to 30 px, so it wraps below it instead
        while True:
            code, progress = poll(), read_json(results / "progress.json")
            if progress:
                if bar.total != progress["total"]:  # tqdm's notebook bar only takes its width in reset(total=)
                    bar.reset(total=progress["total"])
                bar.n = progress["done"]
            if shown != (bar.n, int(time.monotonic() - start)):  # redraw on progress and every second
                shown = (bar.n, int(time.monotonic() - start))
                bar.refresh()
            for f in sorted(p for p in results.iterdir() if p.suffix in (".log", ".out", ".err")) if verbose else ():
                with open(f, "rb") as fh:
                    fh.seek(offsets.get(f, 0))
                    data = fh.read()
                data = data[: data.rfind(b"\n") + 1]  # whole lines only
                offsets[f] = offsets.get(f, 0) + len(data)
                for line in data.decode(errors="replace").splitlines():
                    tqdm.write(f"[{f.name}] {line}")
            if code is not None or time.monotonic() - start > timeout:
                return code
            time.sleep(0.2)




