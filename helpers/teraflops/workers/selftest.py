"""Self-test worker: a few all-reduces across the ranks; used by the tests of :mod:`teraflops.launch.launcher`.

``python -m teraflops.workers.selftest --spec PATH`` (a :class:`teraflops.launch.selftest.SelftestSpec`),
started by :func:`teraflops.launch.selftest.run` through :func:`~teraflops.launch.launcher.launch`. At
each step every rank contributes ``rank + 1`` to an all-reduce (SUM), so each rank ends with
``sum = steps * world_size * (world_size + 1) / 2``. Each step first passes
:func:`~teraflops.launch.faults.fault_point`, so ``TERAFLOPS_FAULT=kill:rank=1:step=2`` kills rank 1
before its third all-reduce. Hands back a :class:`teraflops.launch.selftest.SelftestResult`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from teraflops.launch.faults import fault_point
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.launch.selftest import SelftestResult, SelftestSpec


def main(argv: list[str] | None = None) -> None:
    spec = read_spec(SelftestSpec, argv)
    w = init_worker(spec.timeout_s, deepspeed=spec.deepspeed)
    total = 0.0
    for step in range(spec.steps):
        fault_point(step)
        t = torch.full((4,), float(w.rank + 1), device=w.device)
        dist.all_reduce(t)
        total += t[0].item()
        report_progress(step + 1, spec.steps)
    write_result(SelftestResult(**w.identity(), sum=total, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                triton_interpret=os.environ.get("TRITON_INTERPRET")))
    finish()


if __name__ == "__main__":
    main()
