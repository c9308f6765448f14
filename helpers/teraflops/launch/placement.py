"""Where the ranks of a distributed run go: decided once, here, for every launch of the course.

A :class:`Placement` is the whole decision for one run: the world size, the nodes and ranks per
node, the backend (NCCL or gloo), each rank's device, and the environment every rank gets. Every
caller (ZeRO, data parallel, stragglers, remedies, collectives, rank traces, elastic, the link
probe, the Lab 2 check) asks :func:`place`; none divides by nodes or picks a backend itself, and
:func:`teraflops.launch.rank.init_worker` reads the backend and device from the environment this
module wrote instead of guessing.

The rules (``machine`` is :func:`teraflops.machine.detect`, a stand-in in the tests):

* **NCCL ranks need a GPU each, and at least two GPUs.** NCCL cannot put two ranks of one
  communicator on one GPU (it fails with "Duplicate GPU detected"; NCCL's troubleshooting notes),
  so a run gets one NCCL rank per GPU when the machine has at least 2 GPUs and at least as many as
  the run needs (``min_ranks``: the straggler detector's median needs 3).
* **Otherwise CPU ranks with gloo**, and the GPUs hidden from them (``CUDA_VISIBLE_DEVICES=""``),
  so nothing in a rank touches a GPU it would share. DeepSpeed's launcher sets
  ``CUDA_VISIBLE_DEVICES`` for every rank itself (``deepspeed/launcher/launch.py`` calls the
  accelerator's ``set_visible_devices_envs``, also on CPU), so the decision travels a second time as
  :data:`VISIBLE_ENV`, which the rank wrapper (``launch/scripts/rank_wrapper.py``) puts back before the rank starts:
  the GPUs stay hidden under both torchrun and DeepSpeed's launcher, and a user's own
  ``CUDA_VISIBLE_DEVICES=2,3`` survives.
* **A user's ``CUDA_VISIBLE_DEVICES`` is respected**: ranks are given the GPUs it lists, in order.
* **Emulated nodes** (:class:`teraflops.nodes.cluster.Cluster`): the world size is split evenly over
  the nodes; with GPU ranks each node gets distinct GPUs (node ``i`` the ``i``-th slice of the
  visible list), so local rank ``j`` of two nodes never shares ``cuda:j``; the ranks talk over the
  node's ``eth0`` (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``) with a ``NCCL_HOSTID`` per node so
  NCCL does not take a same-host shortcut past the shaped link.
* Single-node runs keep gloo's and NCCL's sockets on the loopback interface (``GLOO_SOCKET_IFNAME=lo``,
  ``NCCL_SOCKET_IFNAME=lo``: NCCL's bootstrap otherwise takes the first interface that is neither
  ``lo`` nor ``docker*``, NCCL's environment variable docs), so nothing of a one-node run listens
  beyond the machine; its rendezvous stores listen on 127.0.0.1 (:mod:`teraflops.launch.loopback`).
* ``TRITON_INTERPRET`` follows the ranks' device: ``1`` for CPU ranks (a parent on a GPU machine
  has ``0`` set, and a hidden-GPU rank would then find "0 active drivers"), ``0`` for GPU ranks.
* Threads: ``OMP_NUM_THREADS = max(1, cores // world size)`` (emulated nodes share the cores).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from typing import Mapping

from teraflops.errors import CourseError
from teraflops.machine import detect
from teraflops.nodes.cluster import IFNAME
from teraflops.sizing import PRESETS, Preset, preset

BACKEND_ENV = "TERAFLOPS_BACKEND"  # "nccl" or "gloo": what init_worker joins with
VISIBLE_ENV = "TERAFLOPS_CUDA_VISIBLE_DEVICES"  # re-applied by launch/scripts/rank_wrapper.py after the launcher's own
NODE_ENV = "TERAFLOPS_NODE"  # the emulated node a rank runs on
# What only emulated nodes (namespaces of one machine) need; a real cluster's nodes must not get it:
# their veth, no InfiniBand, NCCL's socket transport, a host id per node (teraflops.launch.sbatch)
EMULATION_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_HOSTID", "NCCL_IB_DISABLE", "NCCL_NET")


class PlacementError(CourseError, ValueError):
    """A run cannot be placed as asked (ranks not an int, too few, not a multiple of the nodes...)."""


@dataclass(frozen=True)
class Placement:
    """Where a run's ranks go. Frozen; built by :func:`place`.

    Attributes:
        world_size: ranks in all.
        nodes: emulated nodes the ranks are spread over (1: this machine alone).
        backend: ``"nccl"`` (one rank per GPU) or ``"gloo"`` (CPU ranks).
        gpu_ids: per node, the GPUs (as ``CUDA_VISIBLE_DEVICES`` names them) its ranks use; empty
            tuples for CPU ranks.
        env: what every rank's environment gets (backend, visibility, Triton mode, threads, sockets).
        node_env: per node, what that node's ranks get on top of ``env``.
        note: one line saying why the layout is what it is.
    """

    world_size: int
    nodes: int
    backend: str
    gpu_ids: tuple[tuple[str, ...], ...]
    env: dict = field(default_factory=dict)
    node_env: tuple[dict, ...] = ((),)
    note: str = ""

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def on_gpus(self) -> bool:
        return self.backend == "nccl"

    @property
    def devices(self) -> tuple[str, ...]:
        """Each global rank's device, as the rank sees it: ``cuda:<local rank>`` or ``cpu``."""
        per = self.ranks_per_node
        return tuple(f"cuda:{r % per}" if self.on_gpus else "cpu" for r in range(self.world_size))

    def rank_env(self, node: int = 0) -> dict:
        """The environment the ranks of ``node`` get (``env`` then ``node_env[node]``)."""
        return {**self.env, **dict(self.node_env[node])}

    def with_env(self, **extra: str) -> "Placement":
        """A copy whose ranks also get ``extra`` (e.g. ``OMP_NUM_THREADS="1"``)."""
        return replace(self, env={**self.env, **{k: str(v) for k, v in extra.items()}})


def visible_gpu_ids(count: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """The names of this process's ``count`` visible GPUs as ``CUDA_VISIBLE_DEVICES`` gives them
    (indices or UUIDs, in order), or ``0 .. count-1`` when it is unset. torch numbers the visible
    GPUs from 0 in that order (CUDA C Programming Guide, "CUDA Environment Variables")."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None or not listed.strip():
        return [str(i) for i in range(count)]
    return [s.strip() for s in listed.split(",") if s.strip()][:count]


def place(ranks: int | None = None, *, cpu_ranks: int | None = None, min_ranks: int = 1, cluster=None,
          gpus: bool = True, machine=None, environ: Mapping[str, str] | None = None) -> Placement:
    """Decide where a run's ranks go (see the module docstring for the rules).

    Args:
        ranks: world size wanted; ``None``: one rank per GPU where GPUs are used, else ``cpu_ranks``.
            On GPUs, asking for more ranks than GPUs gives CPU ranks, and the note says so.
        cpu_ranks: world size when the ranks are CPU ranks and ``ranks`` is None.
        min_ranks: the fewest ranks the run can use (the straggler detector: 3).
        cluster: emulated nodes (``.nodes``, ``.node_name(i)``) to spread the ranks over, or None.
        gpus: ``False`` asks for CPU ranks even where GPUs are there (say why in the caller).
        machine: a :class:`teraflops.machine.Machine` (default: this one, detected).
        environ: the environment to read ``CUDA_VISIBLE_DEVICES`` from (default ``os.environ``).

    Raises:
        PlacementError: a world size that is not an int, below ``min_ranks``, or that does not
            split evenly over the nodes; no world size given for CPU ranks.
    """
    if machine is None:
        machine = detect()
    environ = os.environ if environ is None else environ
    nodes = 1 if cluster is None else int(cluster.nodes)
    _check_world_sizes(ranks=ranks, cpu_ranks=cpu_ranks)
    n_gpus = machine.gpu_count if gpus else 0
    want_gpu = ranks if ranks is not None else (n_gpus - n_gpus % nodes)
    if n_gpus >= 2 and min_ranks <= want_gpu <= n_gpus and want_gpu % nodes == 0:
        world, backend, gpu_ids, note = _on_gpus(want_gpu, nodes, visible_gpu_ids(n_gpus, environ))
    else:
        world = ranks if ranks is not None else cpu_ranks
        if world is None:
            raise PlacementError("a run of CPU ranks needs a world size. Hint: place(ranks=N) or place(cpu_ranks=N)")
        backend, gpu_ids, note = "gloo", tuple(() for _ in range(nodes)), _cpu_note(world, machine, gpus, min_ranks)
    if world < min_ranks:
        raise PlacementError(f"{world} ranks are too few: this run needs at least {min_ranks}. "
                             f"Hint: ranks={min_ranks} or more")
    if world % nodes:
        raise PlacementError(f"{world} ranks do not split evenly over {nodes} nodes. "
                             f"Hint: use a multiple of {nodes} ranks")
    env = {BACKEND_ENV: backend, "TRITON_INTERPRET": "0" if backend == "nccl" else "1",
           "OMP_NUM_THREADS": str(max(1, machine.cpu_cores // world))}
    hide = bool(machine.gpu_count) or backend == "nccl"  # CUDA_VISIBLE_DEVICES set wherever there are GPUs to hide
    node_env = tuple(_node_env(i, gpu_ids[i], hide, cluster) for i in range(nodes))
    return Placement(world, nodes, backend, gpu_ids, env, node_env, note)


def _check_world_sizes(**sizes) -> None:
    """Each of ``sizes`` that is given is a positive int (a world size), else PlacementError naming it."""
    for name, v in sizes.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise PlacementError(f"{name} must be a positive int (a world size), got {v!r}")


def _on_gpus(world: int, nodes: int, ids: list[str]) -> tuple[int, str, tuple[tuple[str, ...], ...], str]:
    """(world, "nccl", each node's GPUs, the note) for one NCCL rank per GPU, ``world // nodes`` per node."""
    per = world // nodes
    gpu_ids = tuple(tuple(ids[i * per:(i + 1) * per]) for i in range(nodes))
    note = f"{world} NCCL ranks, one per GPU" + (f", {per} per node on distinct GPUs" if nodes > 1 else "")
    return world, "nccl", gpu_ids, note


def _cpu_note(world: int, machine, gpus: bool, min_ranks: int) -> str:
    """Why a run gets ``world`` CPU ranks with gloo, in one line."""
    if machine.gpu_count == 0:
        return f"{world} CPU ranks with gloo"
    if not gpus:
        return f"{world} CPU ranks with gloo, GPUs hidden (asked for CPU ranks)"
    if machine.gpu_count == 1:
        return f"one GPU cannot host two NCCL ranks, so {world} CPU ranks with gloo, the GPU hidden"
    need = f"at least {min_ranks}" if min_ranks > machine.gpu_count else str(max(world, min_ranks))
    return (f"this run needs {need} ranks and there are {machine.gpu_count} GPUs (one NCCL rank per GPU), "
            f"so {world} CPU ranks with gloo, the GPUs hidden")


def _node_env(i: int, gpu_ids: tuple[str, ...], hide: bool, cluster) -> dict:
    """What node ``i``'s ranks get on top of the placement's ``env``: their GPUs (``""`` hides every GPU
    from a CPU rank, where ``hide``), and the sockets they talk on (loopback on one machine; the node's
    ``eth0``, its own ``NCCL_HOSTID``, on emulated nodes)."""
    visible = ",".join(gpu_ids)
    extra = {"CUDA_VISIBLE_DEVICES": visible, VISIBLE_ENV: visible} if hide else {}
    if cluster is None:
        if sys.platform == "linux":
            extra.update({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})  # one machine: loopback only
        return extra

    # NCCL_NET=Socket: NCCL's own socket transport, so that an external net plugin of a cloud image
    # (aws-ofi-nccl, GCP's gIB / FasTrak) is not loaded and traffic stays on the shaped veth
    # (NCCL's environment variables: NCCL_NET "forces NCCL to use a specific network").
    extra.update({NODE_ENV: str(i), "GLOO_SOCKET_IFNAME": IFNAME, "NCCL_SOCKET_IFNAME": IFNAME,
                  "NCCL_HOSTID": cluster.node_name(i), "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"})
    return extra


def across(placement: Placement, cluster, *, machine=None, environ=None) -> Placement:
    """The same run (world size, CPU or GPU ranks) re-placed over ``cluster``'s nodes."""
    return place(placement.world_size, cluster=cluster, gpus=placement.on_gpus, machine=machine, environ=environ)


def rank_device(environ: Mapping[str, str] | None = None, *, gpu_count: int | None = None) -> tuple[str, str]:
    """``(backend, device)`` for the rank whose environment is ``environ`` (default ``os.environ``).

    Reads :data:`BACKEND_ENV`, written by :func:`place`; a rank started some other way (no such
    variable) takes NCCL on ``cuda:<LOCAL_RANK>`` when there is a GPU per local rank, else gloo on
    the CPU. ``gpu_count`` defaults to ``torch.cuda.device_count()``.

    Raises:
        PlacementError: NCCL was placed but this rank sees no GPU for its local rank.
    """
    environ = os.environ if environ is None else environ
    local = int(environ.get("LOCAL_RANK", "0"))
    local_world = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE") or environ.get("WORLD_SIZE", "1"))
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    backend = environ.get(BACKEND_ENV) or ("nccl" if gpu_count >= max(local_world, 1) and gpu_count else "gloo")
    if backend == "nccl":
        if local >= gpu_count:
            raise PlacementError(f"rank with LOCAL_RANK={local} was placed on a GPU but sees {gpu_count} "
                                 f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES')!r}). "
                                 "Hint: a launcher changed CUDA_VISIBLE_DEVICES; launch through teraflops.launch.launcher.launch")
        return backend, f"cuda:{local}"
    return backend, "cpu"


@dataclass(frozen=True)
class DataParallelPlan:
    """How a data-parallel run is laid out on this machine: a :class:`~teraflops.launch.placement.Placement`
    (ranks, backend, each rank's device and environment) and the preset whose sizes the ranks use
    (the CPU preset's for CPU ranks on a GPU machine), and ``local_device``: where one process of this
    machine computes (the notebook's own kernel: recomputation's sweep, single-process measurements),
    ``"cuda"`` wherever a GPU preset finds a GPU, even when the ranks are CPU ranks (one GPU: too few for
    NCCL ranks, not too few for one process); ``"cpu"`` otherwise."""

    placement: Placement
    preset: Preset
    local_device: str = "cpu"

    @property
    def ranks(self) -> int:
        return self.placement.world_size

    @property
    def env(self) -> dict:
        """What every rank's environment gets (:attr:`Placement.env`)."""
        return self.placement.env

    @property
    def note(self) -> str:
        return self.placement.note


def data_parallel_plan(p: Preset | None = None, ranks_cpu: int | None = None, *, min_ranks: int = 2,
                       cluster=None, machine=None) -> DataParallelPlan:
    """One rank per GPU with NCCL when there are at least two GPUs (and at least ``min_ranks``);
    otherwise ``ranks_cpu`` (default the preset's ``dp.ranks_cpu``) CPU ranks with gloo, the GPUs
    hidden, and the CPU preset's sizes (:func:`teraflops.launch.placement.place` decides; ``cluster``
    spreads the ranks over emulated nodes). A preset for the CPU asks for CPU ranks.

    Raises:
        PlacementError: the ranks cannot be placed (too few, not a multiple of the nodes).
    """
    p, machine = p or preset(), detect() if machine is None else machine
    cpu = p if p.device == "cpu" else PRESETS["cpu"]
    where = place(None, cpu_ranks=ranks_cpu or cpu.dp.ranks_cpu, min_ranks=min_ranks, cluster=cluster,
                  gpus=p.device == "cuda", machine=machine)
    local = "cuda" if p.device == "cuda" and machine.gpu_count else "cpu"
    return DataParallelPlan(where, p if where.on_gpus else cpu, local)
