"""Starting a launch's ranks with one launcher per node, started by this process: torchrun agents
(https://pytorch.org/docs/stable/elastic/run.html), one per emulated node with c10d rendezvous on
node 0, or DeepSpeed's launcher on this machine.

:class:`TorchrunAgents` is the :class:`teraflops.launch.plan.Starter` of a launch that is not a Slurm
batch job: :func:`launch_commands` gives each node's command line, each launcher runs in a session of
its own with its output in ``launcher.log`` (``launcher<i>.log`` for node ``i``), the watchdog gets
their process groups, and :meth:`TorchrunAgents.stop` stops them and every rank they started
(:mod:`teraflops.launch.processes`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Sequence

from teraflops.launch import leftovers, loopback
from teraflops.launch.processes import stop_all

WRAPPER = Path(__file__).resolve().parent / "scripts" / "rank_wrapper.py"


def torchrun_command() -> list[str]:
    """This environment's torchrun, its stores listening on one address: ``python -m
    teraflops.launch.loopback torch.distributed.run`` (the program of the ``torchrun`` script;
    :mod:`teraflops.launch.loopback`)."""
    return [sys.executable, "-m", "teraflops.launch.loopback", "torch.distributed.run"]


def spec_args(spec_path: Path | None) -> list[str]:
    """A rank's command-line arguments: ``--spec PATH``, or none for a launch without a Spec."""
    return [] if spec_path is None else ["--spec", str(spec_path)]


def launch_commands(where, module: str, spec_path: Path | None = None, *, launcher: str = "torchrun",
                    port: int = 29500, rdzv_id: str = "teraflops", launcher_args: Sequence[str] = (),
                    cluster=None, log_dir: Path | None = None) -> list[list[str]]:
    """The command line of each node's launcher for placement ``where`` (one per node; what
    :class:`TorchrunAgents` starts): torchrun (``torch.distributed.run``) with ``--nproc-per-node``, or
    DeepSpeed's launcher with ``--num_gpus``; on emulated nodes, inside the node's namespace with
    c10d rendezvous on node 0 (``is_host`` and ``--local-addr`` said, as torch finds both by hostname,
    which a namespace shares with the machine). torchrun runs as :func:`torchrun_command` (its stores
    listen on one address), and one-node c10d gets ``--local-addr 127.0.0.1``: rank 0's agent hosts
    the store it shares with the ranks on its local address, by default its host name
    (``dynamic_rendezvous.py``, ``_create_tcp_store_server``). Each rank runs ``launch/scripts/rank_wrapper.py
    MODULE --spec SPEC_PATH`` (nothing after MODULE without ``spec_path``). ``log_dir``: torchrun's
    ``--log-dir`` (inside the launch folder: no ``/tmp/torchelastic_*`` per launch)."""
    nproc = str(where.ranks_per_node)
    tail = [*launcher_args, str(WRAPPER), module, *spec_args(spec_path)]
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


def launchers_code(procs) -> int | None:
    """The launchers' exit code: the first non-zero one as soon as any fails, 0 when all are done."""
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    return failed[0] if failed else (0 if None not in codes else None)


class TorchrunAgents:
    """The ranks of ``plan`` (a :class:`teraflops.launch.plan.LaunchPlan`) started by one launcher per
    node: torchrun agents (on emulated nodes, inside each node's namespace, its stores listening on
    the node's own address) or DeepSpeed's launcher (one node). A :class:`teraflops.launch.plan.Starter`."""

    refused = None  # this process starts its launchers itself: nobody refuses them
    hosts = None  # the ranks' exit records name their node; the diagnosis says "on <host>" only for batch jobs

    def __init__(self, plan):
        self.plan = plan
        self.procs: list[subprocess.Popen] = []
        self.watchdog: subprocess.Popen | None = None

    def start(self) -> None:
        p = self.plan
        cmds = launch_commands(p.where, p.module, p.spec_path, launcher=p.launcher, port=p.port, rdzv_id=p.results.name,
                               launcher_args=p.launcher_args, cluster=p.cluster, log_dir=p.results / "torchelastic")
        for node, node_cmd in enumerate(cmds):
            node_env = {**p.env, **p.where.node_env[node], **p.user_env}
            if p.cluster is not None:  # the node's own address: its stores listen there, nowhere else
                node_env[loopback.LISTEN_ENV] = p.cluster.address(node)
            with open(p.results / ("launcher.log" if node == 0 else f"launcher{node}.log"), "wb") as log:
                self.procs.append(subprocess.Popen(node_cmd, env=node_env, stdin=subprocess.DEVNULL, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        self.watchdog = leftovers.start_watchdog(p.results, p.port, [q.pid for q in self.procs])  # stops it all if we die

    def poll(self) -> int | None:
        return launchers_code(self.procs)

    def stop(self) -> None:
        stop_all(self.procs, self.plan.results)

    def explain(self, code: int | None, rank: int | None, why: str) -> tuple[int | None, str]:
        return rank, why

    def outcome(self) -> str:
        return ""
