"""Rank side of the hand-built DDP checks (Unit 2, exercises 8 and 9): the learner's wrapper against
``DistributedDataParallel`` and against one process on the global batch.

``python -m teraflops.workers.ddp_check --spec PATH`` (a
:class:`teraflops.parallelization.hand_ddp.DdpCheckSpec`), started by
:func:`teraflops.grading.unit02.ddp_overlap` and :func:`~teraflops.grading.unit02.ddp_bucketed`.

Every rank builds :class:`~teraflops.parallelization.hand_ddp.TiedLM` from its own seed (rank r:
seed r), so only a broadcast at wrap time makes the replicas equal. The learner's wrapper, torch's
DDP (its own process group) and torch's DDP with the loss scaled by the world size (what summed,
not averaged, gradients give) train copies with SGD for the spec's steps on rank-specific batches;
one process trains rank 0's model on the concatenated global batch. Each step:
``zero_grad``, forward, ``backward()``, ``finish_gradient_synchronization()``, ``step()``; the
all-reduce calls the learner's code makes are counted by phase, and the asynchronous handles not
waited on when ``finish_gradient_synchronization()`` returns are counted (``learner_code.CommLog``).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from teraflops.launch.rank import init_worker, read_spec, report_progress, write_result
from teraflops.parallelization.hand_ddp import DdpCheckResult, DdpCheckSpec, DdpRun, lm_loss, tied_lm, token_batch
from teraflops.workers.learner_code import CommLog, LearnerCalls, define, flat, rank_error, run_and_exit


def main(argv: list[str] | None = None) -> None:
    a = read_spec(DdpCheckSpec, argv)
    w = init_worker(a.timeout_s)
    n = w.world_size
    ddp_group = dist.new_group()  # torch's DDP stays apart from the learner's collectives (default group)
    comm = CommLog()
    learner, runs = LearnerCalls(comm), []

    cls = learner("class definition", define, a.source, a.name)
    mine_init, rank0_init = tied_lm(w.rank).to(w.device), tied_lm(0).to(w.device)
    for bucket in (a.bucket_mb or (None,)):
        if learner.error:
            break
        model = copy.deepcopy(mine_init)
        args = {} if bucket is None else {"bucket_size_mb": bucket}
        wrapper = learner(f"{a.name}(module{'' if bucket is None else f', bucket_size_mb={bucket}'})", cls, model, **args)
        if learner.error:
            break
        wrapped = flat(model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=a.lr)
        refs = [nn.parallel.DistributedDataParallel(copy.deepcopy(mine_init), process_group=ddp_group)
                for _ in range(2)]
        ref_opts = [torch.optim.SGD(r.parameters(), lr=a.lr) for r in refs]
        single = copy.deepcopy(rank0_init)
        single_opt = torch.optim.SGD(single.parameters(), lr=a.lr)
        backward_calls, finish_calls, largest, unwaited = [], [], 0, 0
        for step in range(a.steps):
            x, y = (t.to(w.device) for t in token_batch(step, w.rank))
            opt.zero_grad()
            before = len(comm.log)
            loss = learner("forward", wrapper, x)
            if learner.error:
                break
            learner("backward() (your hooks)", lm_loss(loss, y).backward)
            middle = len(comm.log)
            if learner.error:
                break
            learner("finish_gradient_synchronization()", wrapper.finish_gradient_synchronization)
            if learner.error:
                break
            unwaited += comm.unwaited()
            comm.works.clear()
            calls = comm.log[before:]
            backward_calls.append(sum(name == "all_reduce" for name, _ in comm.log[before:middle]))
            finish_calls.append(sum(name == "all_reduce" for name, _ in comm.log[middle:]))
            largest = max([largest] + [size for name, size in calls if name == "all_reduce"])
            opt.step()
            try:
                for r, ro, scale in zip(refs, ref_opts, (1.0, float(n))):
                    ro.zero_grad()
                    (scale * lm_loss(r(x), y)).backward()
                    ro.step()
            except Exception as e:  # noqa: BLE001 - another rank's learner code failed and left the group
                learner.error = rank_error("the DDP reference", e, secondary=True)
                break
            xs, ys = zip(*(token_batch(step, r) for r in range(n)))
            single_opt.zero_grad()
            lm_loss(single(torch.cat(xs).to(w.device)), torch.cat(ys).to(w.device)).backward()
            single_opt.step()
        if learner.error:
            break
        first = w.rank == 0
        runs.append(DdpRun(
            bucket_mb=bucket, wrapped=wrapped, params=flat(model.parameters()), backward_calls=backward_calls,
            finish_calls=finish_calls, largest=largest, unwaited=unwaited,
            ref=flat(refs[0].module.parameters()) if first else None, single=flat(single.parameters()) if first else None,
            summed=flat(refs[1].module.parameters()) if first else None,
            initial=flat(rank0_init.parameters()) if first else None))
        report_progress(len(runs), len(a.bucket_mb or (None,)))
    write_result(DdpCheckResult(**w.identity(), error=learner.error, runs=runs,
                                sizes=[p.numel() for p in mine_init.parameters()]))
    learner.leave_group()


if __name__ == "__main__":
    run_and_exit(main)
