"""Rank side of the ZeRO-1 check (Unit 2, exercise 3): the learner's optimizer against DDP + AdamW.

``python -m teraflops.workers.zero1_check --spec PATH`` (a :class:`teraflops.parallelization.zero.Zero1CheckSpec`), started by
:func:`teraflops.grading.unit02.zero1_optimizer` through :func:`~teraflops.launch.launcher.launch`.

The spec's ``source`` is the learner's class block; it runs in a namespace with only ``torch``,
``dist`` (``torch.distributed``), ``math``, ``nn`` and ``F`` (:func:`teraflops.workers.learner_code.define`).
Every rank builds the same small MLP (:func:`~teraflops.workers.learner_code.mlp`) of the spec's ``mlp`` sizes (Ψ = ``spec.psi`` parameters, 517 with the check's
:data:`~teraflops.parallelization.zero.ZERO1_MLP`: not divisible by any world size from 2 to 10, so
the flat vector needs padding) and trains four copies of it for the spec's ``steps`` steps on the
same rank-specific batches of ``batch`` rows, every optimizer with the spec's ``hyper`` (``HYPER``):

* the learner's: ``opt = CLASS(model.parameters(), **HYPER)``; ``opt.zero_grad()``, backward, ``opt.step()``;
* the reference: the model wrapped in ``DistributedDataParallel`` with ``torch.optim.AdamW(**HYPER)``;
* two wrong references, DDP + AdamW with the gradient scaled by ``world_size`` (summed, not
  averaged) and by ``1/world_size`` (averaged twice), so the check can name those mistakes.

The references use their own process group, so the learner's collectives never interleave with
DDP's. The check's ``HYPER`` (:data:`~teraflops.parallelization.zero.ZERO1_HYPER`) has a large ``eps``,
so that the wrong references move differently. An exception in the learner's code is caught and reported (where, type,
first line, time) instead of crashing the rank.

Result per rank (:func:`~teraflops.launch.rank.write_result`, a :class:`teraflops.parallelization.zero.Zero1CheckResult`): ``psi``, ``world_size``, ``hyper``,
``error``, ``params`` (the learner's final flat parameters), ``grad_left`` (max |grad| seen right
after the learner's ``zero_grad()``), ``optimizers`` (each ``torch.optim.Optimizer`` found among the
learner object and its attributes: type, whether torch.optim's own, hyperparameters, elements owned,
elements of state tensors with dim > 0), ``comm`` (elements the learner's code passed to each
``torch.distributed`` collective); rank 0 adds ``initial``, ``ref`` and ``alt`` (the flat parameters of the references).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from teraflops.launch.faults import fault_point
from teraflops.launch.rank import init_worker, read_spec, report_progress, write_result
from teraflops.parallelization.zero import OptimizerInfo, Zero1CheckResult, Zero1CheckSpec
from teraflops.workers.learner_code import (LearnerCalls, define, flat, mlp, mlp_batch, optimizers_in, rank_error,
                                           run_and_exit)

_COLLECTIVES = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_gather_single",
                "all_gather_into_tensor", "all_gather",
                "broadcast", "reduce", "all_to_all_single", "_reduce_scatter_base", "_all_gather_base")


def make_model(spec: Zero1CheckSpec) -> nn.Module:
    """The model every rank trains: :func:`~teraflops.workers.learner_code.mlp` of ``spec.mlp`` features
    (6 parameter tensors, ``spec.psi`` elements), initialised from seed 0."""
    return mlp(spec.mlp)


class _CommLog:
    """Counts the elements the learner's code passes to each collective (``active`` only while it runs)."""

    def __init__(self):
        self.active, self.elements = False, {}

    def install(self) -> None:
        from torch.distributed import distributed_c10d  # where the functions live: wrap both names

        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                wrapped = self._wrap(name, fn)
                for module in (dist, distributed_c10d):
                    if getattr(module, name, None) is fn:
                        setattr(module, name, wrapped)

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.active:
                sizes = [a.numel() if isinstance(a, torch.Tensor) else
                         sum(t.numel() for t in a if isinstance(t, torch.Tensor)) if isinstance(a, (list, tuple)) else 0
                         for a in (*args, *kwargs.values())]
                self.elements[name] = self.elements.get(name, 0) + max(sizes, default=0)
            return fn(*args, **kwargs)

        return counted


def _describe(opt: torch.optim.Optimizer, names) -> OptimizerInfo:
    """Type (``torch``: one of torch.optim's own), first group's hyperparameters among ``names``,
    elements owned, and elements of state tensors with dim > 0 (AdamW's ``step`` is a 0-dim tensor:
    not counted)."""
    group = opt.param_groups[0] if opt.param_groups else {}
    state = sum(t.numel() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    owned = sum(p.numel() for g in opt.param_groups for p in g["params"])
    hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k in names}
    return OptimizerInfo(type=type(opt).__name__, torch=type(opt).__module__.startswith("torch.optim"), state=state,
                         owned=owned, **hyper)


def main(argv: list[str] | None = None) -> None:
    a = read_spec(Zero1CheckSpec, argv)
    hyper = asdict(a.hyper)
    w = init_worker(a.timeout_s)
    ref_group = dist.new_group()  # DDP's collectives stay apart from the learner's (default group)
    n = w.world_size
    base = make_model(a).to(w.device)
    model = copy.deepcopy(base)
    refs = {}
    for key, scale in (("ref", 1.0), ("sum", float(n)), ("double", 1.0 / n)):
        m = nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=ref_group)
        refs[key] = (m, torch.optim.AdamW(m.parameters(), **hyper), scale)
    comm = _CommLog()
    learner = LearnerCalls(comm)
    result = {**w.identity(), "psi": sum(p.numel() for p in base.parameters()), "hyper": hyper, "steps": a.steps,
              "params": None, "grad_left": 0.0, "optimizers": [], "comm": comm.elements}
    if w.rank == 0:
        result["initial"] = flat(base.parameters())

    cls = learner("class definition", define, a.source, a.name)
    opt = None if learner.error else learner(f"{a.name}(params, ...)", cls, model.parameters(), **hyper)
    for step in range(a.steps):
        if learner.error:
            break
        fault_point(step)
        x, y = mlp_batch(a.mlp, a.batch, step, w.rank, w.device)
        learner("zero_grad()", opt.zero_grad)
        if learner.error:
            break
        result["grad_left"] = max([result["grad_left"]] + [p.grad.abs().max().item() for p in model.parameters()
                                                           if p.grad is not None])
        F.mse_loss(model(x), y).backward()
        learner("step()", opt.step)
        if learner.error:
            break
        try:
            for m, ref_opt, scale in refs.values():
                ref_opt.zero_grad()
                (scale * F.mse_loss(m(x), y)).backward()
                ref_opt.step()
        except Exception as e:  # noqa: BLE001 - another rank's learner code failed and left the group
            learner.error = rank_error("the DDP reference", e, secondary=True)
            break
        report_progress(step + 1, a.steps)
    if not learner.error:
        result["params"] = flat(model.parameters())
        result["optimizers"] = [_describe(o, hyper) for o in optimizers_in(opt)]
        if w.rank == 0:
            result["ref"] = flat(refs["ref"][0].module.parameters())
            result["alt"] = {k: flat(refs[k][0].module.parameters()) for k in ("sum", "double")}
    write_result(Zero1CheckResult(**result, error=learner.error))
    learner.leave_group()


if __name__ == "__main__":
    run_and_exit(main)
