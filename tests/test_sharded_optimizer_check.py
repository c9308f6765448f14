"""The sharded-optimizer check (Unit 2, exercise 7) passes the reference class and names plausible mistakes.

Launched checks start real gloo ranks (~15 s on 2 busy CPU cores), so only a few wrong answers are
launched; the rest are judged from reports like the ranks write. Wrong answers are the reference
with a line changed, defined the way a Jupyter cell defines them.
"""

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit02 as check
from teraflops.parallelization.sharded_optimizer import SHARDED_CASES, ShardedCheckResult

from test_zero1_check import notebook_class


class ShardedOptimizer(torch.optim.Optimizer):
    """Optimizer-state sharding for any torch optimizer: each parameter belongs to one rank, whose
    wrapped optimizer alone keeps its state; after the step every owner broadcasts its parameters."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.owner = {}
        self.loads = [0] * self.world
        self.local = None
        super().__init__(params, kwargs)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            r = min(range(self.world), key=lambda k: self.loads[k])
            self.owner[p] = r
            self.loads[r] += p.numel()
            if r == self.rank:
                mine.append(p)
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = mine
        if self.local is None:
            self.local = self.optimizer_cls([local], **self.kwargs)
        else:
            self.local.add_param_group(local)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        for group, local in zip(self.param_groups, self.local.param_groups):
            for k, v in group.items():
                if k != "params":
                    local[k] = v
        loss = self.local.step(closure, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.data, src=self.owner[p])
        return loss


REFERENCE = check.class_source(ShardedOptimizer)


def edited(*old_new: str) -> type:
    source = REFERENCE
    for old, new in zip(old_new[::2], old_new[1::2]):
        assert old in source, old
        source = source.replace(old, new)
    return notebook_class(source, "ShardedOptimizer")


def fails(cls, *phrases: str) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check.sharded_optimizer(cls)
    msg = str(e.value)
    assert msg.startswith("Exercise 7 (a sharded optimizer): "), msg
    assert "\n" not in msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


# --- launched checks -------------------------------------------------------------------------------

@pytest.mark.slow
def test_reference_passes(capsys):
    check.sharded_optimizer(notebook_class(REFERENCE, "ShardedOptimizer"))
    assert "✓ Exercise 7 (a sharded optimizer): passed" in capsys.readouterr().out


@pytest.mark.slow
def test_forgotten_broadcast_fails():
    fails(edited("dist.broadcast(p.data, src=self.owner[p])", "pass"),
          "the ranks hold different parameters", "Hint: after the owners step, broadcast every parameter")


@pytest.mark.slow
def test_full_state_on_every_rank_fails():
    fails(edited("if r == self.rank:\n                mine.append(p)", "mine.append(p)",
                 "dist.broadcast(p.data, src=self.owner[p])", "pass"),
          "is held on ranks [0, 1]", "Hint: assign each parameter to one rank")


# --- without launching -----------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(check, "launch", lambda *a, **k: pytest.fail("the check launched ranks"))


def test_placeholder_is_not_attempted_without_launching(no_launch):
    from teraflops.course.labs import strip_solution
    from test_zero1_check import solution_cell

    lab_cell = strip_solution(solution_cell(REFERENCE))
    with pytest.raises(NotAttempted, match=r"^Exercise 7 \(a sharded optimizer\): not attempted"):
        check.sharded_optimizer(notebook_class(lab_cell, "ShardedOptimizer"))


def test_the_reference_steps_without_a_warning_on_one_rank(tmp_path):
    """In one process (a world of 1) the reference equals the unsharded optimizer, with warnings as errors."""
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29641")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        for case in SHARDED_CASES:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
            ps = list(model.parameters())
            opt = ShardedOptimizer([{"params": ps[:2]}], getattr(torch.optim, case.name), **case.kwargs)
            opt.add_param_group({"params": ps[2:], **case.second})
            ref_opt = getattr(torch.optim, case.name)([{"params": ref[:2]}, {"params": ref[2:], **case.second}],
                                                      **case.kwargs)
            for step in range(3):
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
                for o, params in ((opt, ps), (ref_opt, ref)):
                    o.zero_grad()
                    h = x @ params[0].T + params[1]
                    (h @ params[2].T + params[3]).square().mean().backward()
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    opt.step()
                ref_opt.step()
            assert all(torch.equal(a, b) for a, b in zip(ps, ref))
            assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    finally:
        if started:
            dist.destroy_process_group()


# --- judging reports, without launching ------------------------------------------------------------

def reports(n: int = 2, **change) -> list:
    """Reports of a correct class on ``n`` ranks, ``change`` applied per case run ({field: value or
    fn(rank, run)})."""
    from teraflops.launch.wire import from_json

    shapes = [[32, 8], [32], [32], [32], [5, 32], [5]]
    psi = sum(math.prod(s) for s in shapes)
    g = torch.Generator().manual_seed(0)
    initial = torch.randn(psi, generator=g)
    ref = initial + 0.01 * torch.randn(psi, generator=g)
    out = []
    for r in range(n):
        runs = []
        for case in SHARDED_CASES:
            run = {"case": case.name, "params": ref.tolist(), "group_sizes": [2, 4], "group_lrs": [0.01, 0.003],
                   "stateful": [p for p in range(6) if p % n == r], "warnings": [], "second": [288, psi],
                   "ref": ref.tolist(), "initial": initial.tolist()}
            run.update({k: v(r, run) if callable(v) else v for k, v in change.items()})
            runs.append(run)
        out.append({"rank": r, "world_size": n, "backend": "gloo", "device": "cpu", "error": None, "runs": runs,
                    "shapes": shapes, "comm": {"broadcast": 18}})
    return [from_json(ShardedCheckResult, rep) for rep in out]


def judged(results) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check._judge_sharded(results)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_judge_passes_a_correct_report():
    check._judge_sharded(reports())
    check._judge_sharded(reports(4))


@pytest.mark.parametrize("change, phrase", [
    ({"warnings": ["FutureWarning: `torch.distributed.reduce_scatter_tensor` is deprecated."]},
     "emitted a warning: FutureWarning: `torch.distributed.reduce_scatter_tensor` is deprecated."),
    ({"group_sizes": [2]}, "param_groups hold [2] parameters, expected [2, 4]"),
    ({"params": lambda r, run: run["initial"]}, "the parameters have not changed"),
    ({"params": lambda r, run: run["ref"] if r == 0 else run["initial"]}, "the ranks hold different parameters"),
    ({"params": lambda r, run: run["ref"][:288] + run["initial"][288:]}, "the second parameter group never moved"),
    ({"params": lambda r, run: run["ref"][:288] + [x + 1e-3 for x in run["ref"][288:]]},
     "in the second parameter group. Hint: give the wrapped optimizer each group's own settings"),
    ({"params": lambda r, run: [x + 1e-3 for x in run["ref"]]}, "Hint: pass **kwargs on to optimizer_cls"),
    ({"stateful": list(range(6))}, "the state of parameter 0 (shape (32, 8)) is held on ranks [0, 1]"),
    ({"stateful": lambda r, run: [p for p in run["stateful"] if p != 5]}, "no rank holds optimizer state for parameter 5"),
    ({"params": lambda r, run: [float("nan")] * len(run["ref"])}, "NaN or inf"),
])
def test_judge_names_the_mistake(change, phrase):
    assert phrase in judged(reports(**change))


def test_judge_reports_a_rank_error_first():
    from teraflops.launch.wire import from_json

    results = reports()
    error = {"where": "step()", "type": "KeyError", "message": "owner", "time": 1.0}
    bad = [from_json(ShardedCheckResult, {**r.__dict__, "error": error, "runs": [],
                                          "shapes": r.shapes}) for r in results]
    assert judged(bad) == "your step() raised KeyError: owner"


@pytest.mark.slow
def test_reference_passes_on_4_ranks(monkeypatch, capsys):
    from teraflops.launch.placement import data_parallel_plan

    monkeypatch.setattr(check, "data_parallel_plan", lambda ranks_cpu=None: data_parallel_plan(ranks_cpu=4))
    check.sharded_optimizer(notebook_class(REFERENCE, "ShardedOptimizer"))
    assert "passed" in capsys.readouterr().out
