"""A multi-node run as a Slurm batch job: the sbatch script, and the job submitted, followed, cancelled.

On a Slurm cluster nobody starts the agents of a multi-node run on each node by hand: a batch
script asks the scheduler for an *allocation* (``#SBATCH --nodes=K --ntasks-per-node=1``, sbatch(1),
https://slurm.schedmd.com/sbatch.html), and once it runs, on the first node of the allocation,
``srun`` (srun(1), https://slurm.schedmd.com/srun.html) starts one task per node. Here each task is
one ``torchrun`` agent (https://pytorch.org/docs/stable/elastic/run.html) with ``--nproc-per-node``
ranks; the agents meet in a c10d rendezvous (``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``:
in those docs' multi-node usage, HOST is the node on which the C10d rendezvous backend is hosted,
any node of the job), here the first node of the allocation (``scontrol show hostnames
"$SLURM_JOB_NODELIST" | head -n1``, scontrol(1)), each agent listening on its own node's address
(``--local-addr``, the node's own address: :data:`ADDRESS_RULE`), where its rendezvous stores listen, and
nowhere else (``$TERAFLOPS_LISTEN_ADDRS``, :mod:`teraflops.launch.loopback`: the torchrun command is
``python -m teraflops.launch.loopback torch.distributed.run``).
``srun --kill-on-bad-exit=1`` ends every task once one fails, so a dead rank ends the job and frees
its nodes.

:class:`BatchJob` is that job (frozen) and :meth:`BatchJob.script` its script: what
:func:`teraflops.launch.launcher.launch` submits on a cluster that runs Slurm (``Cluster(...,
slurm=True)``), written into the launch's folder as ``job.sbatch`` and kept in the cluster's
``jobs/`` folder (:func:`archive`), the script a learner takes to a real cluster (there the launch
folder must be on the shared filesystem, and the course's Python environment on every node).
:func:`submit` (``sbatch --parsable``), :class:`Follower` and :func:`job_state` (``scontrol -o show
job``), :func:`queued` (``squeue``) and :func:`cancel` (``scancel``, then waiting until the job has
left its nodes) run on the cluster's login node (:meth:`teraflops.nodes.slurm.Slurm.exec`). The Slurm
variables the script reads (sbatch(1) and srun(1), "OUTPUT ENVIRONMENT VARIABLES"):
``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``, ``SLURM_NODEID`` (the task's node, 0-based, within the
allocation) and ``SLURMD_NODENAME`` (its host name).
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from teraflops.errors import CourseError
from teraflops.launch.loopback import LISTEN_ENV
from teraflops.launch.placement import EMULATION_ENV, VISIBLE_ENV

SCRIPT = "job.sbatch"  # the script's name in the launch folder
OUTPUT = "slurm-%j.out"  # the batch step's output (srun's messages), %j = job id (sbatch(1), "filename pattern")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE")  # squeue(1) "JOB STATE CODES" a job does not leave again
# Reasons a pending job gives when its request, not the queue, keeps it waiting: it must be changed,
# waiting does not help (https://slurm.schedmd.com/job_reason_codes.html; Resources and Priority do wait)
UNSTARTABLE = ("BadConstraints", "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit")
_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SELF_PER_NODE = {"TERAFLOPS_NODE": "$SLURM_NODEID", "NCCL_HOSTID": "$SLURMD_NODENAME"}  # what Slurm says per task
EMULATED_ENV = "TERAFLOPS_EMULATED_NODES"  # "1" in sbatch's environment on emulated nodes (SlurmBatchJob)
_IF_EMULATED = f'if [ "${{{EMULATED_ENV}:-}}" = 1 ]; then'
# The node's own address, for --local-addr and its stores (run inside the srun step's single quotes, so
# none here). Not ``getent hosts $(hostname)``: Debian's and Ubuntu's installers name the host
# ``127.0.1.1`` in /etc/hosts, and files come before DNS (nsswitch.conf), so that answers loopback and
# no other node reaches the agent. The first IPv4 address that is not loopback, from the resolver
# (``getent ahostsv4``: every IPv4 address it gives the name, each hosts-file line naming it), else from
# the interfaces (``hostname -I``: a Debian host whose file names it 127.0.1.1 alone); with none, the
# host name, and one line on stderr saying so.
ADDRESS_RULE = (
    "addr=",
    'for a in $(getent ahostsv4 "$(hostname)" 2>/dev/null | cut -d" " -f1) $(hostname -I 2>/dev/null); do',
    '  case "$a" in 127.*|*:*) ;; *) addr=$a; break ;; esac',
    "done",
    'if [ -z "$addr" ]; then',
    '  addr=$(hostname)',
    '  echo "teraflops: $addr has no address but loopback (getent ahostsv4, hostname -I), so --local-addr is its'
    ' name, which other nodes may not reach. Hint: give the host its network address in /etc/hosts or DNS" >&2',
    "fi",
)


class BatchJobError(CourseError, ValueError):
    """A batch job that cannot be written or submitted; one line with a hint."""


@dataclass(frozen=True)
class BatchJob:
    """One multi-node torchrun run as a Slurm batch job.

    Attributes:
        name: ``--job-name`` (letters, digits, ``_.+-``; what ``squeue`` shows).
        nodes: ``--nodes``, K; one task (one torchrun agent) per node.
        ranks_per_node: torchrun's ``--nproc-per-node``.
        program: what each rank runs, after torchrun's options: the rank wrapper, the module and ``--spec PATH``.
        torchrun: the torchrun command (``python -m teraflops.launch.loopback torch.distributed.run``, or
            ``/venv/bin/torchrun``, whose stores listen on every interface).
        port: TCP port of the c10d rendezvous store on the first node of the allocation.
        time_s: ``--time``, seconds (Slurm keeps whole minutes: rounded up, at least 1 min).
        cpus_per_task: ``--cpus-per-task``: CPUs of each node's task (its agent and all its ranks).
        output: ``--output``, a path (``%j`` becomes the job id).
        gpus_per_node: ``--gpus-per-node`` (0: none asked for).
        env: ``(name, value)`` exported at the top of the script, the same on every node (srun passes
            the batch step's environment on to its tasks).
        node_env: per node of the allocation (``SLURM_NODEID``), ``(name, value)`` exported only
            there; ``TERAFLOPS_NODE`` and ``NCCL_HOSTID`` become ``$SLURM_NODEID`` and
            ``$SLURMD_NODENAME``, what Slurm tells each task.
        torchrun_args: more torchrun options (``--max-restarts 1``...), before ``program``.
        log_dir: torchrun's ``--log-dir``, or None.
        emulated: names in ``env`` or ``node_env`` that only emulated nodes get (their ``eth0``, no
            InfiniBand, NCCL's socket transport, a host id and a slice of one machine's GPUs per
            node): the script exports them only where ``$TERAFLOPS_EMULATED_NODES`` is ``1``, which
            the course sets when it submits to its emulated nodes. On a real cluster the block is
            skipped: Slurm gives each node its GPUs (``--gpus-per-node``), NCCL finds its network.
    """

    name: str
    nodes: int
    ranks_per_node: int
    program: tuple[str, ...]
    torchrun: tuple[str, ...]
    port: int
    time_s: float
    cpus_per_task: int
    output: str
    gpus_per_node: int = 0
    env: tuple[tuple[str, str], ...] = ()
    node_env: tuple[tuple[tuple[str, str], ...], ...] = ()
    torchrun_args: tuple[str, ...] = ()
    log_dir: str | None = None
    emulated: tuple[str, ...] = ()

    def __post_init__(self):
        if not _NAME.fullmatch(self.name or ""):
            raise BatchJobError(f"job name must be 1-64 letters, digits or _.+-, got {self.name!r}. Hint: name='ddp'.")
        for field, lo in (("nodes", 1), ("ranks_per_node", 1), ("cpus_per_task", 1), ("gpus_per_node", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise BatchJobError(f"{field} must be an int >= {lo}, got {value!r}.")
        self._check_port_and_time()
        if not self.program or not self.torchrun:
            raise BatchJobError("a batch job needs a program for its ranks and a torchrun command.")
        if self.node_env and len(self.node_env) != self.nodes:
            raise BatchJobError(f"node_env has {len(self.node_env)} entries for {self.nodes} nodes.")
        bad = [k for k, _ in (*self.env, *(kv for node in self.node_env for kv in node)) if not _VAR.fullmatch(k)]
        if bad:
            raise BatchJobError(f"environment variable names must be shell identifiers, got {bad[0]!r}.")

    def _check_port_and_time(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise BatchJobError(f"port must be a TCP port in [1, 65535], got {self.port!r}.")
        if not isinstance(self.time_s, (int, float)) or not 0 < self.time_s < math.inf:
            raise BatchJobError(f"time_s must be a positive number of seconds, got {self.time_s!r}. Hint: time_s=300.")

    @classmethod
    def of(cls, where, program: Sequence[str], *, torchrun: Sequence[str], port: int, time_s: float, output: str,
           name: str, env: Mapping[str, str] | None = None, cpus_per_node: int | None = None,
           torchrun_args: Sequence[str] = (), log_dir: str | None = None) -> "BatchJob":
        """The job of placement ``where`` (:class:`~teraflops.launch.placement.Placement`: nodes, ranks per
        node, GPUs, each node's environment): ``env`` and the variables every node's ranks share go
        to :attr:`env`, the ones that differ per node to :attr:`node_env`.

        ``--cpus-per-task`` asks for the cores the node's ranks use (ranks × ``OMP_NUM_THREADS``),
        at most ``cpus_per_node``; GPU ranks get ``--gpus-per-node`` = ranks per node.
        """
        per_node = [{**where.rank_env(i), **(env or {})} for i in range(where.nodes)]
        common = {k: v for k, v in per_node[0].items() if all(k in n and n[k] == v for n in per_node)}
        varying = tuple(tuple(sorted((k, str(v)) for k, v in n.items() if k not in common)) for n in per_node)
        emulated = _emulation_names(where, per_node)
        threads = str(common.get("OMP_NUM_THREADS", "1"))
        cpus = where.ranks_per_node * max(1, int(threads) if threads.isdigit() else 1)
        return cls(name=_job_name(name), nodes=where.nodes, ranks_per_node=where.ranks_per_node,
                   program=tuple(map(str, program)), torchrun=tuple(map(str, torchrun)), port=int(port),
                   time_s=float(time_s), output=str(output), cpus_per_task=min(cpus, cpus_per_node or cpus),
                   gpus_per_node=where.ranks_per_node if where.on_gpus else 0,
                   env=tuple(sorted((k, str(v)) for k, v in common.items())),
                   node_env=varying if any(varying) else (), torchrun_args=tuple(map(str, torchrun_args)),
                   log_dir=None if log_dir is None else str(log_dir), emulated=emulated)

    @property
    def time_limit(self) -> str:
        """``--time`` as ``H:MM:SS``, rounded up to whole minutes (Slurm's unit)."""
        minutes = max(1, math.ceil(self.time_s / 60))
        return f"{minutes // 60}:{minutes % 60:02d}:00"

    def torchrun_lines(self) -> list[str]:
        """torchrun's command on each node, as shell words in lines; ``$RDZV_HOST`` (the first node),
        ``$SLURM_JOB_ID`` and ``$addr`` (the node's own address) expand on the node."""
        lit = lambda words: " ".join(_sq(shlex.quote(str(w))) for w in words)  # noqa: E731
        lines = [lit(self.torchrun), lit(["--nnodes", self.nodes, "--nproc-per-node", self.ranks_per_node]),
                 f'--rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:{self.port}" --rdzv-id "$SLURM_JOB_ID"',
                 '--local-addr "$addr"' + (" " + lit(["--log-dir", self.log_dir]) if self.log_dir else "")]
        return lines + ([lit(self.torchrun_args)] if self.torchrun_args else []) + [lit(self.program)]

    def _node_lines(self, real: bool) -> list[str]:
        """The srun step's per-node exports: what differs per node (a ``case`` on ``$SLURM_NODEID``)
        and what Slurm tells each task, the real cluster's (``real``) or the emulated nodes' only,
        inside their ``if``."""
        mine = lambda k: (k in self.emulated) != real  # noqa: E731
        own = [[f"{k}={_sq(shlex.quote(v))}" for k, v in pairs if k not in _SELF_PER_NODE and mine(k)]
               for pairs in self.node_env]
        step = []
        if any(own):  # e.g. each emulated node's share of one machine's GPUs
            step.append('case "$SLURM_NODEID" in')
            step += [f"  {i}) export {' '.join(words)} ;;" if words else f"  {i}) ;;" for i, words in enumerate(own)]
            step.append("esac")
        told = [k for k in _SELF_PER_NODE if mine(k) and any(k == kv[0] for node in self.node_env for kv in node)]
        if told:
            step.append("export " + " ".join(f'{k}="{_SELF_PER_NODE[k]}"' for k in told))
        return step if real or not step else [_IF_EMULATED, *("  " + x for x in step), "fi"]

    def script(self) -> str:
        """The sbatch script (bash): the allocation, the shared environment, the rendezvous host and
        one ``srun`` step running one torchrun agent per node."""
        sb = [f"--job-name={self.name}", f"--nodes={self.nodes}", "--ntasks-per-node=1",
              f"--cpus-per-task={self.cpus_per_task}", *([f"--gpus-per-node={self.gpus_per_node}"]
                                                        if self.gpus_per_node else []),
              f"--time={self.time_limit}", f"--output={self.output}", "--export=ALL"]
        lines = ["#!/bin/bash",
                 f"# {self.nodes} nodes x {self.ranks_per_node} rank{'s' * (self.ranks_per_node != 1)}: one torchrun "
                 "agent per node, started by srun.",
                 "# Written by teraflops.launch.launcher.launch; submit it with `sbatch " + SCRIPT + "`.",
                 *(f"#SBATCH {s}" for s in sb), "set -euo pipefail", "",
                 "# The course's environment, the same on every node (srun passes it on to each task)."]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env if k not in self.emulated]
        emulated = [f"  export {k}={shlex.quote(v)}" for k, v in self.env if k in self.emulated]
        if emulated:
            lines += ["", "# Emulated nodes only (network namespaces of one machine): skipped on a real cluster,",
                      f"# where {EMULATED_ENV} is unset.", _IF_EMULATED, *emulated, "fi"]
        lines += ["", "# The c10d rendezvous store runs on the first node of the allocation.",
                  'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)', "export RDZV_HOST", "",
                  "# One task per node; each resolves its own address and runs one torchrun agent with its ranks.",
                  "# --kill-on-bad-exit: a task that fails ends the others, so the job ends and frees its nodes.",
                  "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '"]
        step = self._node_lines(real=True) + self._node_lines(real=False)
        step += [*ADDRESS_RULE,
                 f'export {LISTEN_ENV}="$addr"',  # its stores listen on the node's own address only
                 "exec " + " \\\n    ".join(self.torchrun_lines()) + "'"]
        lines += ["  " + s for s in step]
        return "\n".join(lines) + "\n"


def _emulation_names(where, per_node: list[dict]) -> tuple[str, ...]:
    """The variables of ``per_node`` (each node's environment) that only emulated nodes get:
    :data:`teraflops.launch.placement.EMULATION_ENV`, and with GPU ranks on several nodes each node's
    slice of one machine's GPUs."""
    slices = {"CUDA_VISIBLE_DEVICES", VISIBLE_ENV} if where.nodes > 1 and where.on_gpus else set()
    return tuple(sorted(k for k in set(EMULATION_ENV) | slices if any(k in n for n in per_node)))


def _sq(text: str) -> str:
    """``text`` inside the script's single-quoted ``bash -c '...'`` step."""
    return text.replace("'", "'\\''")


def _job_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "-", str(text)).strip("-")[:64]
    return name or "teraflops"


@dataclass(frozen=True)
class JobState:
    """What ``scontrol show job`` says of a job.

    Attributes:
        job_id: Slurm's job id.
        state: ``JobState`` (``PENDING``, ``RUNNING``, ``COMPLETING``, ``COMPLETED``, ``FAILED``,
            ``CANCELLED``, ``TIMEOUT``...; squeue(1) "JOB STATE CODES").
        exit_code: the batch script's exit code (``ExitCode=code:signal``).
        signal: the signal that ended it, 0 if none.
        reason: why it waits or ended (``Reason``: ``Resources``, ``None``, ``NonZeroExitCode``...).
        nodes: ``NodeList`` (``node[0-1]``; ``(null)`` while pending).
    """

    job_id: int
    state: str
    exit_code: int = 0
    signal: int = 0
    reason: str = ""
    nodes: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        """``"Slurm job 7 FAILED (exit code 1) on node[0-1]"``."""
        code = f"signal {self.signal}" if self.signal else f"exit code {self.exit_code}"
        where = f" on {self.nodes}" if self.nodes and self.nodes != "(null)" else ""
        why = f", {self.reason}" if self.reason and self.reason != "None" and not self.ended else ""
        return f"Slurm job {self.job_id} {self.state}{f' ({code})' if self.ended else ''}{why}{where}"


def parse_job(job_id: int, text: str) -> JobState | None:
    """The :class:`JobState` in ``scontrol -o show job`` output (one line of ``Key=Value``), else None."""
    fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))
    if "JobState" not in fields:
        return None
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return JobState(job_id, fields["JobState"], int(code) if code.isdigit() else 0, int(sig) if sig.isdigit() else 0,
                    fields.get("Reason", ""), fields.get("NodeList", ""))


def submit(slurm, script: Path, env: Mapping[str, str] | None = None) -> int:
    """``sbatch --parsable SCRIPT`` on the login node; the job id.

    ``env`` is sbatch's own environment, which ``--export=ALL`` hands on to the job (default: this
    process's).

    Raises:
        BatchJobError: sbatch refused the job (its error line, e.g. more CPUs than a node has).
    """
    done = slurm.exec(["sbatch", "--parsable", str(script)], env=None if env is None else dict(env))
    first = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not first.isdigit():
        line = (done.stderr or done.stdout).strip().splitlines()
        raise BatchJobError(f"sbatch refused {script.name}: {line[-1] if line else f'exit code {done.returncode}'}. "
                            "Hint: `sinfo -N -l` shows what the nodes have; the script is in the launch folder.")
    return int(first)


def job_state(slurm, job_id: int) -> JobState | None:
    """The job's :class:`JobState` (``scontrol -o show job ID``), None if Slurm does not know it."""
    done = slurm.exec(["scontrol", "-o", "show", "job", str(job_id)])
    return parse_job(job_id, done.stdout) if done.returncode == 0 else None


def queued(slurm) -> list[int]:
    """Ids of the jobs Slurm holds now (``squeue -h -o %i``: pending, running, completing)."""
    done = slurm.exec(["squeue", "-h", "-o", "%i"])
    return [int(x) for x in done.stdout.split() if x.isdigit()]


def step_daemons(job_id: int) -> list[int]:
    """Pids of the live ``slurmstepd`` processes of job ``job_id`` (``slurmstepd: [ID.batch]``,
    ``[ID.0]``...: the per-node daemon of each step; after the job ends they stay zombies for about
    a second, dead, until slurmd reaps them)."""
    import psutil

    found = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] == "slurmstepd" and f"[{job_id}." in " ".join(p.cmdline()):
                found.append(p.pid)
        except psutil.Error:  # gone, or a zombie (no command line)
            pass
    return found


def cancel(slurm, job_id: int, timeout: float = 30) -> JobState | None:
    """``scancel`` the job (nothing if it has ended) and wait until it has left its nodes
    (an ended state, not ``COMPLETING``, gone from ``squeue``, no live :func:`step_daemons`); its
    last state.

    scancel(1) sends SIGTERM to every step, then SIGKILL after ``KillWait`` s (slurm.conf(5)).
    """
    state = job_state(slurm, job_id)
    if state is not None and not state.ended:
        slurm.exec(["scancel", str(job_id)])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(slurm, job_id)
        if (state is None or state.ended) and job_id not in queued(slurm) and not step_daemons(job_id):
            break
        time.sleep(0.2)
    return state


def archive(slurm, job_id: int, folder: Path) -> Path:
    """Copy the job's script and output from launch folder ``folder`` into the cluster's ``jobs/``
    folder (``<id>.sbatch``, ``slurm-<id>.out``; :attr:`teraflops.nodes.slurm.Slurm.dir`), which outlives
    the launch folder (removed after a run that worked) until the cluster goes down; the script's path."""
    jobs = Path(slurm.dir) / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    for src, dst in ((folder / SCRIPT, f"{job_id}.sbatch"), (folder / OUTPUT.replace("%j", str(job_id)),
                                                             OUTPUT.replace("%j", str(job_id)))):
        if src.exists():
            shutil.copyfile(src, jobs / dst)
    return jobs / f"{job_id}.sbatch"


def archived(slurm) -> list[Path]:
    """The scripts :func:`archive` kept for cluster ``slurm``, oldest job first."""
    found = (Path(slurm.dir) / "jobs").glob("*.sbatch")
    return sorted((p for p in found if p.stem.isdigit()), key=lambda p: int(p.stem))


class Follower:
    """Polls a submitted job (:func:`job_state`) at most every ``every`` s; ``poll()`` is None while it
    is pending or running, then the batch script's exit code (0 for ``COMPLETED``); 1 at once for a
    job pending for a reason of :data:`UNSTARTABLE`. ``last`` is the last :class:`JobState` read."""

    def __init__(self, slurm, job_id: int, every: float = 0.5):
        self.slurm, self.job_id, self.every = slurm, job_id, every
        self.last: JobState | None = None
        self._at = -math.inf

    def poll(self) -> int | None:
        if time.monotonic() - self._at >= self.every:
            self._at = time.monotonic()
            self.last = job_state(self.slurm, self.job_id) or self.last
        if self.last is not None and self.last.state == "PENDING" and self.last.reason in UNSTARTABLE:
            return 1
        if self.last is None or not self.last.ended:
            return None
        if self.last.state == "COMPLETED":
            return 0
        return self.last.exit_code or (-self.last.signal if self.last.signal else 1)
