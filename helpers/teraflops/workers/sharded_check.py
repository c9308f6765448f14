"""Rank side of the sharded-optimizer check (Unit 2, exercise 7): the learner's wrapper against DDP
with the unsharded optimizer.

``python -m teraflops.workers.sharded_check --spec PATH`` (a
:class:`teraflops.parallelization.sharded_optimizer.ShardedCheckSpec`), started by
:func:`teraflops.grading.unit02.sharded_optimizer` through :func:`~teraflops.launch.launcher.launch`.

For each optimizer case (AdamW given two groups as dicts; SGD with momentum, its second group added
with ``add_param_group``), every rank wraps the same MLP in ``DistributedDataParallel`` twice: one
copy stepped by ``CLASS(groups, torch.optim.<name>, **kwargs)``, one by ``torch.optim.<name>(groups,
**kwargs)``, on the same rank-specific batches. DDP averages the gradients (its own process group,
so its collectives never interleave with the learner's); the learner's class only shards the state
and broadcasts. Warnings raised while the learner's ``step()`` runs are recorded (all of them:
``warnings.simplefilter("always")``). Result: a
:class:`~teraflops.parallelization.sharded_optimizer.ShardedCheckResult`.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from teraflops.launch.rank import init_worker, read_spec, report_progress, write_result
from teraflops.parallelization.sharded_optimizer import ShardedCheckResult, ShardedCheckSpec, ShardedRun
from teraflops.workers.learner_code import (CommLog, LearnerCalls, define, flat, mlp, mlp_batch, optimizers_in,
                                           rank_error, run_and_exit)


def _groups(model: nn.Module, case) -> tuple[list[dict], dict]:
    """The case's two groups over ``model``: the first Linear layer (defaults), then the rest."""
    params = list(model.parameters())
    return [{"params": params[:2]}], {"params": params[2:], **case.second}


def _stateful(opt, model: nn.Module) -> list[int]:
    """Indices of ``model``'s parameters that some optimizer among ``opt`` and its attributes holds
    non-empty state for."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    held = set()
    for o in optimizers_in(opt):
        for p, s in o.state.items():
            if s and id(p) in index:
                held.add(index[id(p)])
    return sorted(held)


def main(argv: list[str] | None = None) -> None:
    a = read_spec(ShardedCheckSpec, argv)
    w = init_worker(a.timeout_s)
    ddp_group = dist.new_group()  # DDP's all-reduces stay apart from the learner's (default group)
    base = mlp(a.mlp).to(w.device)
    comm = CommLog()
    learner, runs = LearnerCalls(comm), []

    cls = learner("class definition", define, a.source, a.name)
    for case in a.cases:
        if learner.error:
            break
        mine = nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=ddp_group)
        ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=ddp_group)
        optimizer_cls = getattr(torch.optim, case.name)
        first, second = _groups(mine.module, case)
        if case.added:
            opt = learner(f"{a.name}(params, torch.optim.{case.name}, ...)", cls, first, optimizer_cls, **case.kwargs)
            if not learner.error:
                learner("add_param_group(...)", opt.add_param_group, second)
        else:
            opt = learner(f"{a.name}(params, torch.optim.{case.name}, ...)", cls, first + [second], optimizer_cls,
                          **case.kwargs)
        rfirst, rsecond = _groups(ref.module, case)
        ref_opt = optimizer_cls(rfirst + [rsecond], **case.kwargs)
        caught = []
        for step in range(a.steps):
            if learner.error:
                break
            x, y = mlp_batch(a.mlp, a.batch, step, w.rank, w.device)
            learner("zero_grad()", opt.zero_grad)
            if learner.error:
                break
            F.mse_loss(mine(x), y).backward()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                learner("step()", opt.step)
            caught += [f"{type(m.message).__name__}: {m.message}" for m in seen]
            if learner.error:
                break
            try:
                ref_opt.zero_grad()
                F.mse_loss(ref(x), y).backward()
                ref_opt.step()
            except Exception as e:  # noqa: BLE001 - another rank's learner code failed and left the group
                learner.error = rank_error("the DDP reference", e, secondary=True)
        if learner.error:
            break
        n_first = sum(p.numel() for p in first[0]["params"])
        groups = getattr(opt, "param_groups", [])
        runs.append(ShardedRun(
            case=case.name, params=flat(mine.module.parameters()),
            group_sizes=[len(g.get("params", [])) for g in groups], group_lrs=[float(g.get("lr", 0.0)) for g in groups],
            stateful=_stateful(opt, mine.module), warnings=sorted(set(caught))[:5],
            second=(n_first, sum(p.numel() for p in base.parameters())),
            ref=flat(ref.module.parameters()) if w.rank == 0 else None,
            initial=flat(base.parameters()) if w.rank == 0 else None))
        report_progress(len(runs), len(a.cases))
    write_result(ShardedCheckResult(**w.identity(), error=learner.error, runs=runs,
                                    shapes=[list(p.shape) for p in base.parameters()], comm=comm.calls))
    learner.leave_group()


if __name__ == "__main__":
    run_and_exit(main)
