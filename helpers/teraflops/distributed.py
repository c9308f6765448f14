"""Launch multi-process work from a notebook, and the helpers each rank calls.

:func:`launch` starts ``python -m MODULE`` on N local ranks (127.0.0.1) through ``torchrun``
(https://pytorch.org/docs/stable/elastic/run.html) or DeepSpeed's launcher, each rank inside
``workers/_rank.py``, which records how it ended. The rendezvous listens on loopback only (on each
node's own address for a multi-node run; :mod:`teraflops.loopback`). A host module sends its rank
program a Spec (``launch(..., spec=)``, a frozen dataclass written to ``spec.json``, read with :func:`read_spec`)
and ranks hand back a Result (a dataclass, or a JSON dict) with :func:`write_result`, read back as
``result=`` (:mod:`teraflops.spec` checks every field). Their output goes to files in
``$TERAFLOPS_RESULTS_DIR`` (a fresh temporary directory per launch, kept when it fails):
``spec.json``, ``rank{r}.json``, ``rank{r}.out``/``.err``, ``rank{r}.exit``,
``progress.json`` (rank 0's :func:`report_progress`) and ``launcher.log``. A crash, a killed or hung
rank or a timeout raises :class:`LaunchFailed` (one line) once every process of the launch is gone
and its port is free (and, for DeepSpeed on CPU, its shared-memory files are removed), also when
the cell is interrupted.

Fault injection: ``TERAFLOPS_FAULT=KIND:rank=R:step=S`` makes rank R, at ``fault_point(S)``,
SIGKILL itself (``kill``), sleep forever (``hang``) or raise RuntimeError (``raise``), in the first
attempt only, so that an elastic restart (torchrun ``--max-restarts``) recovers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple, Sequence

from . import loopback, sbatch, stale
from .errors import CourseError
from .slurm import host as slurm_host
from .teardown import uninterruptible
from .warmup import cache_dir, env_key, with_ninja  # cache_dir's home is warmup; notebooks name it here

RESULTS_ENV, FAULT_ENV, FAULT_KINDS = "TERAFLOPS_RESULTS_DIR", "TERAFLOPS_FAULT", ("kill", "hang", "raise")
_WRAPPER = Path(__file__).with_name("workers") / "_rank.py"
_SHM_OP = "deepspeed_shm_comm"  # the C++ op DeepSpeed's CPU accelerator JIT-builds in init_distributed
_SHM_PREFIX = "deepspeed_allreduce_buffer"  # its shared-memory files, in /dev/shm
_NOISE = re.compile(r"warn|^\s|^\[?[WI]\d{4}|\[(INFO|WARNING)\]|^[*=-]+$", re.IGNORECASE)
_VICTIMS = (-signal.SIGTERM, -signal.SIGINT)  # how launchers stop the other ranks after a failure


class LaunchFailed(CourseError, RuntimeError):
    """A launch failed: the rank, its exit status or timeout, its last error line, a hint, the logs.

    Attributes ``rank`` (None when no rank is to blame), ``logs`` (the results directory), ``port``.
    """


class OpBuildFailed(CourseError, RuntimeError):
    """A DeepSpeed op did not compile; the message has the compiler's last line and the log's path."""


def _extensions_dir() -> Path:
    """``$TORCH_EXTENSIONS_DIR``, else one folder per Python environment under :func:`cache_dir`.

    torch's JIT build is keyed by its compile command, which names the environment's paths: two
    virtual environments sharing a folder would rebuild the op in turn, inside a launch's ranks.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return cache_dir() / "torch_extensions" / env_key()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses now (the OS picks one for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """True if a server could not listen on ``port`` now (binds all addresses with ``SO_REUSEADDR``,
    as torch's TCPStore does, so a finished run's connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
        return False


def launch(module: str, ranks, args: Sequence[str] = (), *, launcher: str = "torchrun",
           timeout: float = 120, env: dict | None = None, launcher_args: Sequence[str] = (),
           desc: str | None = None, verbose: bool = False, port: int | None = None,
           cluster=None, deepspeed: bool = False, spec=None, result=None, submit: bool | None = None) -> list:
    """Run ``python -m module *args`` on the ranks of a run; return their results, by rank.

    ``spec`` (a frozen dataclass, :mod:`teraflops.spec`) is written to ``spec.json`` in the launch
    folder and the ranks get ``--spec PATH`` after ``args`` (:func:`read_spec` reads it). ``result``
    (a dataclass) is what each rank's :func:`write_result` is read back as, every field checked;
    without it the results are the ranks' dicts.

    ``ranks`` is a :class:`~teraflops.placement.Placement` (world size, backend, each rank's device
    and environment; :func:`teraflops.placement.place` decides it) or an int, the ranks per node,
    placed with :func:`~teraflops.placement.place` (NCCL on a GPU each where there are 2 or more GPUs
    for them, else gloo CPU ranks with the GPUs hidden). A one-node placement given with
    ``cluster`` is re-placed over its nodes (:func:`~teraflops.placement.across`).

    ``launcher`` is ``"torchrun"`` or ``"deepspeed"``; ``launcher_args`` go to it (torchrun ``--rdzv-*``
    options get ``--rdzv-endpoint 127.0.0.1:port`` unless they name one, and ``--local-addr 127.0.0.1``).
    Every rendezvous store of a one-node run listens on 127.0.0.1 only, those of a multi-node run on
    their node's address (:mod:`teraflops.loopback`). ``timeout`` (s) covers the
    whole launch. Ranks get the placement's environment, ``TORCH_EXTENSIONS_DIR`` under
    :func:`cache_dir` unless set, ``PATH`` with the Python environment's ninja first
    (:func:`teraflops.warmup.with_ninja`: loading an op runs ninja), then ``env``. ``verbose``
    prints their output as it comes.

    ``cluster`` (a :class:`teraflops.cluster.Cluster` that is up) runs it multi-node, as on a real
    cluster: one torchrun agent per emulated node (``--nnodes K --nproc-per-node``, c10d
    rendezvous on node 0's address), talking over the nodes' shaped links. Each result then carries
    ``"node"``, the node its rank ran on. Torchrun only.

    ``submit``: on a cluster that runs Slurm (``Cluster(..., slurm=True)``) the run is submitted as a
    batch job (the default, or ``True``; :mod:`teraflops.sbatch`): an sbatch script for an allocation
    of K nodes, ``srun`` starting one torchrun agent per node with c10d rendezvous on the first node
    of the allocation, written to ``job.sbatch`` in the launch folder and kept in the cluster's
    ``jobs/`` folder as ``<job id>.sbatch`` (:func:`teraflops.sbatch.archived`: the script to take to
    a real cluster), submitted, followed until it ends (``scontrol show job``; ``scancel`` at
    ``timeout``), the ranks' results read back as above. A failed rank's line then names its node
    (``node1``) and Slurm's end of the job, and the job has left its nodes when :class:`LaunchFailed`
    is raised. ``submit=False`` starts the agents itself, as on a cluster without Slurm.

    ``deepspeed=True`` says torchrun's ranks call ``deepspeed.init_distributed`` (the DeepSpeed
    launcher implies it): its CPU op is built first (:func:`prepare_deepspeed_ops`).

    Raises:
        LaunchFailed: a rank failed or wrote no result, or ``timeout`` passed.
        PlacementError: ``ranks`` cannot be placed (see :func:`~teraflops.placement.place`).
    """
    from .placement import Placement, across, place

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
    world, nproc = where.world_size, where.ranks_per_node
    if fault is not None and fault.rank >= world:
        raise ValueError(f"{FAULT_ENV} names rank {fault.rank}, but the launch has ranks 0-{world - 1}")
    stale.sweep()  # what launches of dead notebooks left: folders, /dev/shm buffers, torchelastic_* folders
    port, results = port or free_port(), Path(tempfile.mkdtemp(prefix="teraflops-launch-"))
    stale.record(results, port)
    if spec is not None:
        from . import spec as wire

        args = [*args, "--spec", str(wire.write(spec, results / "spec.json"))]
    course = {"TORCH_EXTENSIONS_DIR": str(_extensions_dir()), RESULTS_ENV: str(results), "PYTHONUNBUFFERED": "1",
              "PYTHONFAULTHANDLER": "1", **{k: v for k, v in with_ninja(os.environ).items() if k == "PATH"}}
    user = {k: str(v) for k, v in (env or {}).items()}
    child_env = {**os.environ, **course, **where.env, **stale.owner_env(), **user}
    procs, keep, watchdog = [], False, None  # the results directory is kept for a LaunchFailed, which names it
    job_id, follower, refused, final = None, None, None, None
    try:
        if slurm is not None:  # one batch job; Slurm's srun starts the agents
            job = sbatch.BatchJob.of(where, [str(_WRAPPER), module, *map(str, args)], torchrun=_torchrun(), port=port,
                                     time_s=timeout, output=str(results / sbatch.OUTPUT),
                                     name=module.rsplit(".", 1)[-1], env={**course, **user},
                                     cpus_per_node=slurm.config.cpus, torchrun_args=launcher_args,
                                     log_dir=str(results / "torchelastic"))
            script = results / sbatch.SCRIPT
            script.write_text(job.script())
            watchdog = stale.start_watchdog(results, port, [])  # stops the job's processes if we die
            try:  # sbatch hands its environment (the owner's record for the ranks' wrappers) on to the job
                job_id = sbatch.submit(slurm, script, env={**os.environ, **stale.owner_env()})
            except sbatch.BatchJobError as e:
                refused = str(e)
            follower = sbatch.Follower(slurm, job_id) if job_id is not None else None
            poll = follower.poll if follower is not None else None
        else:
            cmds = launch_commands(where, module, args, launcher=launcher, port=port, rdzv_id=results.name,
                                   launcher_args=launcher_args, cluster=cluster, log_dir=results / "torchelastic")
            for node, node_cmd in enumerate(cmds):
                node_env = {**child_env, **where.node_env[node], **user}
                if cluster is not None:  # the node's own address: its stores listen there, nowhere else
                    node_env[loopback.LISTEN_ENV] = cluster.address(node)
                with open(results / ("launcher.log" if node == 0 else f"launcher{node}.log"), "wb") as log:
                    procs.append(subprocess.Popen(node_cmd, env=node_env, stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            watchdog = stale.start_watchdog(results, port, [p.pid for p in procs])  # stops it all if we die
            poll = lambda: _launchers_code(procs)  # noqa: E731
        code = 1 if refused else _wait(poll, results, timeout, desc or module.rsplit(".", 1)[-1], verbose)
        out = [_read_json(results / f"rank{r}.json") for r in range(world)]
        if refused is None and code == 0 and None not in out:
            if cluster is not None:
                for r, got in enumerate(out):
                    got["node"] = (_read_json(results / f"rank{r}.exit") or {}).get("node")
            return out if result is None else _typed(out, result)
        keep = True
        hosts = None if slurm is None else [slurm_host(i) for i in range(where.nodes)]
        rank, why = (None, refused) if refused else _diagnose(results, world, code, timeout, launcher,
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
                uninterruptible(_stop, None, results)  # what proctrack/linuxproc lost track of
            _stop_uninterrupted(procs, results)
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


def _torchrun() -> list[str]:
    """This environment's torchrun, its stores listening on one address: ``python -m
    teraflops.loopback torch.distributed.run`` (the program of the ``torchrun`` script;
    :mod:`teraflops.loopback`)."""
    return [sys.executable, "-m", "teraflops.loopback", "torch.distributed.run"]


def _typed(out: list[dict], cls) -> list:
    """Each rank's result dict as a ``cls`` (:func:`teraflops.spec.from_json`); ``node`` (multi-node
    launches) only where ``cls`` has such a field."""
    from dataclasses import fields

    from .spec import from_json

    names = {f.name for f in fields(cls)}
    return [from_json(cls, {k: v for k, v in got.items() if k != "node" or k in names}, f"{cls.__name__} of rank {r}")
            for r, got in enumerate(out)]


def launch_commands(where, module: str, args: Sequence[str] = (), *, launcher: str = "torchrun",
                    port: int = 29500, rdzv_id: str = "teraflops", launcher_args: Sequence[str] = (),
                    cluster=None, log_dir: Path | None = None) -> list[list[str]]:
    """The command line of each node's launcher for placement ``where`` (one per node; what
    :func:`launch` starts): torchrun (``torch.distributed.run``) with ``--nproc-per-node``, or
    DeepSpeed's launcher with ``--num_gpus``; on emulated nodes, inside the node's namespace with
    c10d rendezvous on node 0 (``is_host`` and ``--local-addr`` said, as torch finds both by hostname,
    which a namespace shares with the machine). torchrun runs as :func:`_torchrun` (its stores
    listen on one address), and one-node c10d gets ``--local-addr 127.0.0.1``: rank 0's agent hosts
    the store it shares with the ranks on its local address, by default its host name
    (``dynamic_rendezvous.py``, ``_create_tcp_store_server``). Each rank runs ``workers/_rank.py
    MODULE ARGS``. ``log_dir``: torchrun's ``--log-dir`` (inside the launch folder: no
    ``/tmp/torchelastic_*`` per launch)."""
    nproc = str(where.ranks_per_node)
    tail = [*launcher_args, str(_WRAPPER), module, *map(str, args)]
    if launcher == "deepspeed":
        return [[sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", nproc, "--master_addr",
                 "127.0.0.1", "--master_port", str(port), "--no_local_rank", *tail]]
    cmd = [*_torchrun(), "--nproc-per-node", nproc, *(["--log-dir", str(log_dir)] if log_dir is not None else [])]
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


def shm_buffers(port: int, addr: str = "127.0.0.1") -> list[Path]:
    """The shared-memory files DeepSpeed's CPU comm op made for the launch on ``addr:port``.

    On CPU, with every rank on one host, ``deepspeed.init_distributed`` has each rank create
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (~67 MB, its all-reduce
    workspace; ``csrc/cpu/comm/shm.cpp``) and never unlinks it: they hold RAM until removed.
    """
    shm = Path("/dev/shm")
    return sorted(shm.glob(f"{_SHM_PREFIX}_{os.getuid()}_{addr}_{port}_*")) if shm.is_dir() else []


def remove_shm_buffers(port: int, addr: str = "127.0.0.1") -> None:
    """Unlink :func:`shm_buffers` of a finished launch (its ranks must be gone)."""
    for path in shm_buffers(port, addr):
        path.unlink(missing_ok=True)


def _launchers_code(procs) -> int | None:
    """The launchers' exit code: the first non-zero one as soon as any fails, 0 when all are done."""
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    return failed[0] if failed else (0 if None not in codes else None)


def _wait(poll, results: Path, timeout: float, desc: str, verbose: bool) -> int | None:
    """Wait behind a progress bar until ``poll()`` (the launchers' or the batch job's exit code, None
    while they run) says they are done: that code, or None after ``timeout`` s."""
    from tqdm.auto import tqdm

    start, offsets, shown = time.monotonic(), {}, None
    with tqdm(desc=desc, unit="step", dynamic_ncols=True) as bar:  # the row's full width in JupyterLab
        widgets = getattr(getattr(bar, "container", None), "children", ())
        if len(widgets) == 3:  # tqdm's notebook bar: [description, bar, counts]; a long description squeezed
            widgets[1].layout.min_width = "12em"  # the bar to 30 px, so it wraps below it instead
        while True:
            code, progress = poll(), _read_json(results / "progress.json")
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


def _diagnose(results: Path, nproc: int, code: int | None, timeout: float, launcher: str, fault: str | None,
              hosts: Sequence[str] | None = None):
    """(rank or None, one line: what happened, the rank's last error line, a hint). ``hosts``: each
    node's host name (by the ``node`` of the ranks' exit records), named for the failed rank."""
    exits = [_read_json(results / f"rank{r}.exit") for r in range(nproc)]
    failed = sorted((e["time"], e["rank"], e["returncode"]) for e in exits if e and e["returncode"])
    failed = [f for f in failed if f[2] not in _VICTIMS] or failed  # the first real failure
    missing = [r for r in range(nproc) if not (results / f"rank{r}.json").exists()]
    rc = failed[0][2] if failed else 0
    if failed:
        rank = failed[0][1]
        node = next((e.get("node") for e in exits if e and e["rank"] == rank), None)
        on = f"on {hosts[node]} " if hosts and isinstance(node, int) and 0 <= node < len(hosts) else ""
        what = f"rank {rank} of {nproc} {on}" + (f"was killed by {signal.Signals(-rc).name}" if rc < 0
                                              else f"exited with code {rc}")
    elif code is None:
        running = [r for r in range(nproc) if exits[r] is None]  # suspect first one that said something
        rank = next((r for r in running if _last_line(results / f"rank{r}.err")), (running or [None])[0])
        what = f"timed out after {timeout:g} s with rank(s) {running} still running"
    elif missing and (code == 0 or all(exits)):
        rank, what = missing[0], f"rank {missing[0]} exited without a result (did it call write_result?)"
    else:
        rank, what = None, f"the {launcher} launcher exited with code {code}"
    logs = [f"rank{rank}.err"] if rank is not None else sorted(  # the agents' logs, or the batch job's output
        p.name for p in [*results.glob("launcher*.log"), *results.glob("slurm-*.out")])
    line = next((found for found in map(_last_line, (results / name for name in logs)) if found), "")
    others = [r for r, e in enumerate(exits) if r != rank and (e is None or e["returncode"] in _VICTIMS)]
    timeouts = {r: t for r in range(nproc) if (t := nccl_timeout(results / f"rank{r}.err"))}
    if timeouts:  # NCCL's watchdog aborts the process: faulthandler's last line says only "Aborted"
        first = min(timeouts)
        late = [r for r in range(nproc) if r not in timeouts]
        why = (f"rank(s) {late} never reached it (hung, crashed or much slower)" if late else
               "every rank waited: the collectives did not match (different order or sizes) or the network is stuck")
        return first, (f"rank {first} of {nproc}: {timeouts[first]}. Hint: {why}; raise the timeout only if the run "
                       "is just slow.")
    if rc == -signal.SIGKILL:
        hint = "SIGKILL usually comes from the out-of-memory killer (see `dmesg`)"
        hint += f", or from {FAULT_ENV}={fault}" if fault else ""
    elif re.search(r"timed? ?out", line, re.IGNORECASE) and others:
        hint = f"a collective timed out: rank(s) {others} never reached it (hung, crashed or much slower)"
    elif code is None:
        hint = "a rank stuck in a collective waits for one that never comes; if the run is just slow, raise timeout="
    else:
        hint = "the whole error is in " + (f"rank{rank}.err" if rank is not None else "launcher.log")
    return rank, f"{what}" + (f': "{line}"' if line else "") + f". Hint: {hint}."


_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+)"
                       r".*?Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")


def nccl_timeout(path: Path) -> str | None:
    """One line for the NCCL watchdog timeout in a rank's log ``path``, or None.

    When a collective waits longer than the process group's timeout, NCCL's watchdog thread logs
    ``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=S, OpType=OP, ..., Timeout(ms)=T)
    ran for M milliseconds before timing out`` and aborts the process (torch's
    ``ProcessGroupNCCL.cpp``), so the log ends in faulthandler's "Fatal Python error: Aborted".
    """
    try:
        found = _WATCHDOG.search(path.read_text(errors="replace"))
    except OSError:
        return None
    if found is None:
        return None
    seq, op, limit_ms, ran_ms = found.groups()
    return (f"NCCL {op.lower()} (collective #{seq}) timed out: it waited {int(ran_ms) / 1e3:g} s against a "
            f"{int(limit_ms) / 1e3:g} s timeout (NCCL watchdog)")


def _last_line(path: Path) -> str:
    """The exception line of the last traceback in ``path``, else its last line that is not noise."""
    try:  # torch prefixes a rank's traceback lines with "[rankN]: "
        lines = [re.sub(r"^\[rank\d+\]: ?", "", s) for s in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    starts = [i for i, s in enumerate(lines) if s.startswith("Traceback (most recent call last)")]
    found = next((s for s in lines[starts[-1] + 1:] if s.strip() and not s[0].isspace()), None) if starts else None
    found = found or next((s for s in reversed(lines) if s.strip() and not _NOISE.search(s)), "")
    return found.strip()[:300]


def _stop_uninterrupted(procs, results: Path | None) -> None:
    """:func:`_stop` for each launcher, through more interrupts (:func:`uninterruptible`)."""
    for proc in procs:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)  # first, before anything slow
    uninterruptible(lambda: [_stop(proc, results) for proc in procs])


def _stop(proc, results: Path | None, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, the launcher's process group and every process of this launch; reap it.

    torchrun starts each rank in a session of its own, out of reach of the group kill: ranks are
    found as the launcher's descendants and by the results directory in their environment.
    """
    import psutil

    if proc is None and results is None:
        return
    found = {}
    if proc is not None and proc.poll() is None:  # still running, so the pid is still its own
        with suppress(psutil.Error):
            found = {p.pid: p for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]}
    for p in psutil.process_iter() if results else ():
        with suppress(psutil.Error):
            if p.pid != os.getpid() and p.environ().get(RESULTS_ENV) == str(results):
                found[p.pid] = p
    if proc is not None:
        found.pop(proc.pid, None)  # our own child is reaped by proc.wait, or its exit status reads 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with suppress(ProcessLookupError, PermissionError):
            if proc is not None:
                os.killpg(proc.pid, sig)
        for p in found.values():
            with suppress(psutil.Error):
                p.send_signal(sig)
        found = {p.pid: p for p in psutil.wait_procs(list(found.values()), timeout=grace)[1]}
        with suppress(subprocess.TimeoutExpired):
            if proc is not None:
                proc.wait(timeout=grace)
        if not found and (proc is None or proc.returncode is not None):
            break


def clear_stale_build_lock() -> bool:
    """Remove the build lock of DeepSpeed's CPU comm op when no live process can hold it; True if removed.

    ``torch.utils.cpp_extension.load`` takes a lock file (``FileBaton``, ``<op folder>/lock``, made
    with ``O_EXCL``) around every load, also when nothing needs building, and the others wait for
    the file to go (``torch/utils/file_baton.py``). A rank killed while it holds the lock leaves the
    file, and every later ``deepspeed.init_distributed`` on CPU then waits forever. A lock is stale
    when no rank of a launch and no build (:func:`prepare_deepspeed_ops`) with our
    ``TORCH_EXTENSIONS_DIR`` that started before the lock was made is alive: a process that started
    after it cannot have made it, it can only be waiting on it (counting such waiters as holders
    left a stale lock and its waiters waiting on each other for good).
    """
    import psutil

    ext = _extensions_dir()
    lock = ext / _SHM_OP / "lock"
    try:
        made = lock.stat().st_mtime
    except FileNotFoundError:
        return False
    for p in psutil.process_iter():
        with suppress(psutil.Error):
            env = p.environ() if p.pid != os.getpid() else {}
            if env.get("TORCH_EXTENSIONS_DIR") == str(ext) and (
                    RESULTS_ENV in env or any("ShareMemCommBuilder" in a for a in p.cmdline())) and \
                    p.create_time() <= made + 1:  # 1 s: start times are read from clock ticks since boot
                return False  # a rank of a launch, or a build, that may hold it
    lock.unlink(missing_ok=True)
    return True


def _builds(ext: Path) -> list[int]:
    """Pids of other processes building (or loading) DeepSpeed's CPU op into ``ext`` now."""
    import psutil

    found = []
    for p in psutil.process_iter():
        with suppress(psutil.Error):
            if p.pid != os.getpid() and any("ShareMemCommBuilder" in a for a in p.cmdline()) and \
                    p.environ().get("TORCH_EXTENSIONS_DIR") == str(ext):
                found.append(p.pid)
    return found


def _compiler_error(log: Path) -> bool:
    """True if the build log has a compiler or ninja error (not just a missing ``.so`` after a wait)."""
    with suppress(OSError):
        text = log.read_text(errors="replace")
        return bool(re.search(r"error:|FAILED:|ninja: build stopped|Error building extension", text))
    return False


def _build_once(ext: Path, log_path: Path, timeout: float) -> tuple[int | None, float]:
    """One build of the op in a subprocess: (its exit code, None after ``timeout`` s; seconds taken)."""
    from tqdm.auto import tqdm

    from .placement import place

    script = ("from deepspeed.accelerator import get_accelerator\n"
              "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
              "if b is None or not b.is_compatible():\n"
              "    raise SystemExit(f'{get_accelerator()._name} accelerator: no compatible ShareMemCommBuilder')\n"
              "b.load()\n")
    proc, start = None, time.monotonic()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    # a CPU rank's environment (GPUs hidden) and accelerator, also where this
                                    # process sees a GPU: CUDA's accelerator has no such builder, nothing is built
                                    env=with_ninja({**os.environ, **place(1, gpus=False).rank_env(),
                                                    "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu"}))
        with tqdm(desc="compiling DeepSpeed's CPU comm op (once)", bar_format="{desc}: {elapsed}") as bar:
            while proc.poll() is None and time.monotonic() - start < timeout:
                time.sleep(0.5)
                bar.refresh()
        timed_out = proc.poll() is None
    finally:
        _stop(proc, None)
        if proc is not None and proc.returncode != 0 and not _builds(ext):  # torch's lock outlives a killed build
            (ext / _SHM_OP / "lock").unlink(missing_ok=True)
    return (None if timed_out else proc.returncode), time.monotonic() - start


def prepare_deepspeed_ops(timeout: float = 900, cpu: bool | None = None) -> None:
    """Compile DeepSpeed's CPU comm op once, behind a progress bar; a fast no-op once done.

    On CPU every ``deepspeed.init_distributed`` loads ``deepspeed_shm_comm`` (C++, JIT-built on first
    use into ``TORCH_EXTENSIONS_DIR``, ~1 min on 2 cores) and fails without it; a stale build lock
    is removed first (:func:`clear_stale_build_lock`). Building it here, into
    :func:`cache_dir`, keeps the wait out of a launch's timeout. With CUDA there is no such op.
    ``cpu`` says whether the ranks run on CPU (default: when this process sees no GPU); ranks whose
    GPUs are hidden (``CUDA_VISIBLE_DEVICES=""``) need the op although this process sees one.
    The build runs the Python environment's ninja (:func:`teraflops.warmup.with_ninja`), as the
    ranks do, and a host's warm build (``teraflops warmup``) is copied in first if there is one.

    Raises:
        OpBuildFailed: the build failed (it needs g++ and ninja) or took over ``timeout`` s.
    """
    from . import warmup
    from .machine import detect

    cpu = detect().device != "cuda" if cpu is None else cpu
    if not cpu or sys.platform != "linux":
        return
    ext = _extensions_dir()
    stamp = ext / _SHM_OP / warmup.op_stamp()
    why = warmup.unwritable_reason(ext)  # a TERAFLOPS_CACHE of another user
    if why:
        raise OpBuildFailed(why)
    warmup.seed_op(ext)  # the host's `teraflops warmup` build, copied: nothing to compile
    clear_stale_build_lock()  # a killed run's lock would make every rank wait forever
    if stamp.exists():
        return
    ext.mkdir(parents=True, exist_ok=True)
    log_path = ext / f"{_SHM_OP}.build.{os.getpid()}.log"  # one per process: a waiter must not clobber the builder's
    for attempt in range(2):  # a second try when another process's build, that we waited for, died
        others = _builds(ext)
        code, elapsed = _build_once(ext, log_path, timeout)
        if code == 0:
            break
        line = _last_line(log_path)
        if code is not None and code > 0 and others and attempt == 0 and not _compiler_error(log_path):
            continue  # we waited on the other build's lock; it ended without the op: build it ourselves
        if code is None:
            what = f"not done after {timeout:g} s"
        elif code < 0:
            what = f"the build was killed by {signal.Signals(-code).name} after {elapsed:.0f} s"
        else:
            what = f'"{line}"'
        if others:
            what += f" (after waiting for another build of it, pid {', '.join(map(str, others))}, that did not finish it)"
        missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None]
        hint = (f"it needs {' and '.join(missing)} (apt install g++; pip install ninja)" if missing else
                "the compiler's whole error is in the log" if code and code > 0 else "run it again")
        raise OpBuildFailed(f"compiling DeepSpeed's {_SHM_OP} op failed: {what}. Hint: {hint}; "
                            f"DeepSpeed cannot start on CPU without it. Log: {log_path}")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()


# ---- rank side ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    rank: int
    world_size: int
    local_rank: int
    device: object  # torch.device: cuda:<local_rank> with GPUs, else cpu
    backend: str  # "nccl" or "gloo"


def build_warm_cache(dest: Path | None = None) -> Path:
    """The op half of ``teraflops warmup`` (the other: :func:`teraflops.warmup.build_compile_cache`):
    build DeepSpeed's CPU op into ``dest`` (default :func:`teraflops.warmup.warm_dir`) and make it
    readable by all.

    Returns the op folder. Raises :class:`OpBuildFailed` if the build fails.
    """
    from . import warmup

    dest = Path(dest or warmup.warm_dir())
    saved = {k: os.environ.get(k) for k in ("TERAFLOPS_CACHE", "TORCH_EXTENSIONS_DIR", warmup.WARM_ENV)}
    os.environ["TERAFLOPS_CACHE"], os.environ[warmup.WARM_ENV] = str(dest), str(dest)
    os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        ext = _extensions_dir()
        prepare_deepspeed_ops(cpu=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    (ext / warmup.OP / "lock").unlink(missing_ok=True)
    warmup.readable_by_all(dest)
    return ext / warmup.OP


def init_worker(timeout_s: float = 30, *, deepspeed: bool = False) -> Worker:
    """Join the process group the launcher described (``RANK``, ``WORLD_SIZE``, ``MASTER_*``...).

    The backend and device are the ones :func:`teraflops.placement.place` chose for the launch
    (:func:`~teraflops.placement.rank_device`): NCCL on ``cuda:<local rank>``, or gloo on the CPU with
    at most ``cores // local ranks`` threads per rank. A
    collective that waits over ``timeout_s`` s raises instead of hanging. ``deepspeed=True`` joins
    through ``deepspeed.init_distributed`` (same backend, timeout); an existing group is kept.
    """
    import torch
    import torch.distributed as dist

    from .machine import detect
    from .placement import rank_device

    if "RANK" not in os.environ:
        raise CourseError("init_worker() runs in a rank: start this module with teraflops.distributed.launch")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
    backend, where = rank_device()
    device = torch.device(where)
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        threads = detect().cpu_cores // local_world
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the placement's cores // all ranks: nodes share the cores
            threads = min(threads, int(os.environ["OMP_NUM_THREADS"]))
        torch.set_num_threads(max(1, threads))
    if not dist.is_initialized():
        if deepspeed:
            import deepspeed as ds

            ds.init_distributed(backend, timeout=timedelta(seconds=timeout_s), verbose=False)
        else:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Worker(rank, world, local, device, backend)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
    os.replace(tmp, path)  # a reader sees the old file or all of the new one


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_spec(cls, argv: Sequence[str] | None = None):
    """The ``cls`` Spec that :func:`launch` (``spec=``) wrote for this rank: the file after
    ``--spec`` in ``argv`` (default ``sys.argv``; other options, such as DeepSpeed's
    ``--local_rank``, are ignored), every field checked.

    Raises:
        SpecError: no ``--spec``, the file is unreadable, or a field is missing or wrong (one line).
    """
    from . import spec as wire

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--spec" not in argv or argv.index("--spec") + 1 >= len(argv):
        raise wire.SpecError(f"{cls.__name__}: no --spec PATH on the command line. Hint: start this rank "
                             "program with teraflops.distributed.launch(..., spec=...)")
    return wire.read(cls, Path(argv[argv.index("--spec") + 1]))


def write_result(obj) -> None:
    """Hand ``obj`` (a dataclass, :mod:`teraflops.spec`, or a JSON-able dict; tensors become lists)
    back to :func:`launch`; printed when not launched."""
    from dataclasses import is_dataclass

    if is_dataclass(obj):
        from .spec import to_json

        obj = to_json(obj)
    if RESULTS_ENV in os.environ:
        _write_json(Path(os.environ[RESULTS_ENV]) / f"rank{os.environ.get('RANK', '0')}.json", obj)
    else:
        print(json.dumps(obj, default=str))


def report_progress(done: int, total: int) -> None:
    """Move the notebook's progress bar to ``done`` of ``total`` steps (rank 0 writes, others return)."""
    if os.environ.get("RANK", "0") == "0" and RESULTS_ENV in os.environ:
        _write_json(Path(os.environ[RESULTS_ENV]) / "progress.json", {"done": done, "total": total})


class Fault(NamedTuple):
    kind: str  # one of FAULT_KINDS
    rank: int
    step: int


def parse_fault(spec: str | None) -> Fault | None:
    """``"kill:rank=1:step=3"`` → ``Fault("kill", 1, 3)``; empty or None → None; ValueError otherwise."""
    if not spec:
        return None
    kind, *fields = spec.strip().split(":")
    pairs = dict(f.split("=", 1) for f in fields if "=" in f)
    if kind not in FAULT_KINDS or len(fields) != 2 or set(pairs) != {"rank", "step"} or not all(
            v.isascii() and v.isdigit() for v in pairs.values()):
        raise ValueError(f"{FAULT_ENV}={spec!r} is not KIND:rank=R:step=S with KIND one of "
                         f"{', '.join(FAULT_KINDS)} (e.g. kill:rank=1:step=3)")
    return Fault(kind, int(pairs["rank"]), int(pairs["step"]))


def fault_point(step: int) -> None:
    """Fail here if ``$TERAFLOPS_FAULT`` names this rank and ``step`` (see the module docstring)."""
    fault = parse_fault(os.environ.get(FAULT_ENV))
    if fault is None or fault.step != step or str(fault.rank) != os.environ.get("RANK", "0") or int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
        return
    print(f"{FAULT_ENV}: fault '{fault.kind}' injected in rank {fault.rank} at step {step}", file=sys.stderr,
          flush=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV} at step {step}")
    while True:
        time.sleep(3600)


def finish() -> None:
    """Wait for every rank, then leave the process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
