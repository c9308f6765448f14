"""Self-test worker: a few all-reduces across the ranks; used by the tests of :mod:`teraflops.launch.launcher`.

``python -m teraflops.workers.selftest [--steps N] [--timeout S] [--deepspeed]``, started by
:func:`~teraflops.launch.launcher.launch`. At each step every rank contributes ``rank + 1`` to an
all-reduce (SUM), so each rank ends with ``sum = steps * world_size * (world_size + 1) / 2``. Each
step first passes :func:`~teraflops.launch.faults.fault_point`, so ``TERAFLOPS_FAULT=kill:rank=1:step=2``
kills rank 1 before its third all-reduce.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from teraflops.launch.faults import fault_point
from teraflops.launch.rank import finish, init_worker, report_progress, write_result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=30, help="seconds a collective waits for the others")
    p.add_argument("--deepspeed", action="store_true", help="initialise through deepspeed.init_distributed")
    a = p.parse_args(argv)
    w = init_worker(a.timeout, deepspeed=a.deepspeed)
    total = 0.0
    for step in range(a.steps):
        fault_point(step)
        t = torch.full((4,), float(w.rank + 1), device=w.device)
        dist.all_reduce(t)
        total += t[0].item()
        report_progress(step + 1, a.steps)
    write_result({"rank": w.rank, "world_size": w.world_size, "sum": total, "backend": w.backend,
                  "device": str(w.device), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "triton_interpret": os.environ.get("TRITON_INTERPRET")})
    finish()


if __name__ == "__main__":
    main()
