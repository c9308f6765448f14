"""Rank side of the hand-built FSDP check (Unit 2, exercise 10): the learner's sharded layer against
one process on the global batch.

``python -m teraflops.workers.fsdp_check --spec PATH`` (a
:class:`teraflops.parallelization.hand_fsdp.FsdpCheckSpec`), started by
:func:`teraflops.grading.unit02.fsdp_linear`.

Every ``nn.Linear`` of :func:`~teraflops.parallelization.hand_fsdp.plain_mlp` is wrapped in the
learner's class; the model trains with SGD over ``model.parameters()`` (the shards) on
rank-specific batches, its output cast to fp32 for the loss. One process trains the unsharded
model on the concatenated global batch, and once more with the loss × world size (summed
gradients). Collective calls are counted by phase (first step); after the first forward, tensors
a layer keeps as attributes at least as large as its full weight are counted.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from teraflops.launch.rank import init_worker, read_spec, report_progress, write_result
from teraflops.parallelization.hand_fsdp import FsdpCheckResult, FsdpCheckSpec, FsdpRun, fsdp_batch, plain_mlp
from teraflops.workers.learner_code import CommLog, LearnerCalls, define, flat, run_and_exit

_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter")
_REDUCES = ("all_reduce", "reduce")


def _count(log, names) -> int:
    return sum(name in names for name, _ in log)


def main(argv: list[str] | None = None) -> None:
    a = read_spec(FsdpCheckSpec, argv)
    w = init_worker(a.timeout_s)
    n = w.world_size
    comm = CommLog()
    learner, runs = LearnerCalls(comm), []

    cls = learner("class definition", define, a.source, a.name)
    base = plain_mlp()
    for dtype in a.dtypes:
        if learner.error:
            break
        compute = None if dtype == "float32" else getattr(torch, dtype)
        model = copy.deepcopy(base).to(w.device)
        linears = [i for i, m in enumerate(model) if isinstance(m, nn.Linear)]
        for i in linears:
            model[i] = learner(f"{a.name}(linear, compute_dtype={compute})", cls, model[i], compute_dtype=compute)
            if learner.error:
                break
        if learner.error:
            break
        opt = torch.optim.SGD(model.parameters(), lr=a.lr)
        singles = [copy.deepcopy(base) for _ in range(2)]
        single_opts = [torch.optim.SGD(m.parameters(), lr=a.lr) for m in singles]
        counts, kept = {}, 0
        for step in range(a.steps):
            x, y = fsdp_batch(step, w.rank)
            opt.zero_grad()
            start = len(comm.log)
            out = learner("forward", model, x.to(w.device))
            if learner.error:
                break
            middle = len(comm.log)
            if step == 0:
                full = {i: base[i].weight.numel() for i in linears}
                kept = sum(t.numel() for i in linears for t in vars(model[i]).values()
                           if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.numel() >= full[i]
                           and t.untyped_storage().nbytes() > 0)
            learner("backward (your autograd.Function or hooks)", F.mse_loss(out.float(), y.to(w.device)).backward)
            if learner.error:
                break
            if step == 0:
                fwd, bwd = comm.log[start:middle], comm.log[middle:]
                counts = dict(forward_gathers=_count(fwd, _GATHERS), backward_gathers=_count(bwd, _GATHERS),
                              scatters=_count(comm.log[start:], _SCATTERS), reduces=_count(comm.log[start:], _REDUCES))
            opt.step()
            xs, ys = zip(*(fsdp_batch(step, r) for r in range(n)))
            for m, o, scale in zip(singles, single_opts, (1.0, float(n))):
                o.zero_grad()
                (scale * F.mse_loss(m(torch.cat(xs)), torch.cat(ys))).backward()
                o.step()
        if learner.error:
            break
        full_params = []
        for i in linears:
            got = learner("full_parameters()", model[i].full_parameters)
            if learner.error:
                break
            full_params += [t.detach().float().cpu() for t in got]
        if learner.error:
            break
        first = w.rank == 0
        runs.append(FsdpRun(dtype=dtype, params=flat(full_params), held=sum(p.numel() for p in model.parameters()),
                            held_dtypes=sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}),
                            kept=kept, single=flat(singles[0].parameters()) if first else None,
                            summed=flat(singles[1].parameters()) if first else None, **counts))
        report_progress(len(runs), len(a.dtypes))
    write_result(FsdpCheckResult(**w.identity(), error=learner.error, runs=runs,
                                 sizes=[p.numel() for p in base.parameters()]))
    learner.leave_group()


if __name__ == "__main__":
    run_and_exit(main)
