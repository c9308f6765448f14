"""Rank side of Unit 2's overlap comparison: when each wrapper of
:data:`teraflops.parallelization.hand_ddp.WRAPPERS` starts its all-reduces, and what backward hides.

``python -m teraflops.workers.ddp_overlap --spec PATH`` (a
:class:`teraflops.parallelization.hand_ddp.OverlapSpec`), started by
:func:`teraflops.parallelization.hand_ddp.overlap`.

Per mode, the course GPT (:func:`teraflops.workers.common.build_model`) is wrapped and trained
``steps`` SGD steps on this rank's micro-batches. Every all-reduce the wrapper launches is
timestamped (``learner_code.CommLog``); a launch before ``backward()`` returns counts as overlapped.
The first step is a warm-up; medians over the rest. Result: an
:class:`~teraflops.parallelization.hand_ddp.OverlapResult`.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.parallelization.hand_ddp import WRAPPERS, OverlapResult, OverlapRun, OverlapSpec
from teraflops.workers.common import build_model, make_data, rank_batch, sync_device
from teraflops.workers.learner_code import CommLog


def main(argv: list[str] | None = None) -> None:
    a = read_spec(OverlapSpec, argv)
    w = init_worker(a.timeout_s)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // w.world_size))
    data = make_data(a.model, a.steps, w.world_size)
    comm = CommLog()
    comm.install()
    comm.active = True
    runs = []
    for mode in a.modes:
        model = build_model(a.model, w.device)
        args = {"bucket_size_mb": a.bucket_mb} if mode == "bucketed" else {}
        ddp = WRAPPERS[mode](model, **args)
        opt = torch.optim.SGD(model.parameters(), lr=a.model.lr)
        rows = []
        for step in range(a.steps):
            x, y = (t.to(w.device) for t in rank_batch(data, step, w.rank, w.world_size, a.model.micro_batch))
            opt.zero_grad()
            start = time.perf_counter()
            loss = lm_loss(ddp(x), y)
            first = len(comm.log)
            backward = time.perf_counter()
            loss.backward()
            sync_device(w.device)
            returned = time.perf_counter()
            ddp.finish_gradient_synchronization()
            sync_device(w.device)
            done = time.perf_counter()
            opt.step()
            launched = [t for (name, _), t in zip(comm.log[first:], comm.times[first:]) if name == "all_reduce"]
            rows.append((len(launched), sum(t < returned for t in launched), returned - backward, done - returned,
                         time.perf_counter() - start))
        kept = rows[1:] or rows
        runs.append(OverlapRun(mode=mode, calls=kept[0][0], in_backward=kept[0][1],
                               backward_s=statistics.median(r[2] for r in kept),
                               wait_s=statistics.median(r[3] for r in kept),
                               step_s=statistics.median(r[4] for r in kept)))
        report_progress(len(runs), len(a.modes))
    write_result(OverlapResult(**w.identity(), runs=runs))
    finish()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
