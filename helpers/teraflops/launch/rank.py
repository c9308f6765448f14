"""The rank side of a launch: what each rank program calls.

A rank program (``teraflops.workers.*``, started by :func:`teraflops.launch.launcher.launch`) reads
its Spec (:func:`read_spec`), joins the process group (:func:`init_worker`), moves the notebook's
progress bar (:func:`report_progress`), hands back its Result (:func:`write_result`; every Result
starts with a :class:`RankIdentity`, filled by :meth:`Worker.identity`) and leaves (:func:`finish`).
Nothing here imports torch at module level: the wrapper and the watchdog stay light.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, is_dataclass
from datetime import timedelta
from pathlib import Path
from typing import Sequence

from teraflops.errors import CourseError
from teraflops.launch import wire
from teraflops.launch.placement import rank_device
from teraflops.launch.wire import RESULTS_ENV, write_json
from teraflops.machine import detect


@dataclass(frozen=True)
class RankIdentity:
    """Who handed a Result back: the fields every rank program's Result starts with (each Result
    dataclass inherits them; :meth:`Worker.identity` fills them in the rank).

    Attributes:
        rank, world_size: this rank and the ranks of the launch.
        backend: the process group's, ``"gloo"`` or ``"nccl"``.
        device: where the rank ran, ``"cpu"`` or ``"cuda:<local rank>"``.
        node: keyword-only; the emulated node the rank ran on, which the launcher fills in after a
            multi-node launch (None otherwise).
    """

    rank: int
    world_size: int
    backend: str
    device: str
    node: int | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Worker:
    rank: int
    world_size: int
    local_rank: int
    device: object  # torch.device: cuda:<local_rank> with GPUs, else cpu
    backend: str  # "nccl" or "gloo"

    def identity(self) -> dict:
        """This rank's :class:`RankIdentity` fields, as keywords of its Result: ``Result(**w.identity(), ...)``."""
        return dict(rank=self.rank, world_size=self.world_size, backend=self.backend, device=str(self.device))


def init_worker(timeout_s: float = 30, *, deepspeed: bool = False) -> Worker:
    """Join the process group the launcher described (``RANK``, ``WORLD_SIZE``, ``MASTER_*``...).

    The backend and device are the ones :func:`teraflops.launch.placement.place` chose for the launch
    (:func:`~teraflops.launch.placement.rank_device`): NCCL on ``cuda:<local rank>``, or gloo on the CPU with
    at most ``cores // local ranks`` threads per rank. A
    collective that waits over ``timeout_s`` s raises instead of hanging. ``deepspeed=True`` joins
    through ``deepspeed.init_distributed`` (same backend, timeout); an existing group is kept.
    """
    import torch
    import torch.distributed as dist


    if "RANK" not in os.environ:
        raise CourseError("init_worker() runs in a rank: start this module with teraflops.launch.launcher.launch")
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


def read_spec(cls, argv: Sequence[str] | None = None):
    """The ``cls`` Spec that :func:`launch` (``spec=``) wrote for this rank: the file after
    ``--spec`` in ``argv`` (default ``sys.argv``; other options, such as DeepSpeed's
    ``--local_rank``, are ignored), every field checked.

    Raises:
        SpecError: no ``--spec``, the file is unreadable, or a field is missing or wrong (one line).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--spec" not in argv or argv.index("--spec") + 1 >= len(argv):
        raise wire.SpecError(f"{cls.__name__}: no --spec PATH on the command line. Hint: start this rank "
                             "program with teraflops.launch.launcher.launch(..., spec=...)")
    return wire.read(cls, Path(argv[argv.index("--spec") + 1]))


def write_result(obj) -> None:
    """Hand ``obj`` (a dataclass, :mod:`teraflops.launch.wire`, or a JSON-able dict; tensors become lists)
    back to :func:`launch`; printed when not launched."""
    if is_dataclass(obj):
        obj = wire.to_json(obj)
    if RESULTS_ENV in os.environ:
        write_json(Path(os.environ[RESULTS_ENV]) / f"rank{os.environ.get('RANK', '0')}.json", obj)
    else:
        print(json.dumps(obj, default=str))


def report_progress(done: int, total: int) -> None:
    """Move the notebook's progress bar to ``done`` of ``total`` steps (rank 0 writes, others return)."""
    if os.environ.get("RANK", "0") == "0" and RESULTS_ENV in os.environ:
        write_json(Path(os.environ[RESULTS_ENV]) / "progress.json", {"done": done, "total": total})


def finish() -> None:
    """Wait for every rank, then leave the process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
