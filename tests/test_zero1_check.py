"""The ZeRO-1 check (Unit 2, exercise 3) passes the reference class and names plausible mistakes.

Each launched check starts real gloo ranks (~10-15 s on 2 busy CPU cores, mostly start-up), so only
the mistakes the acceptance criteria name are launched; the other mistakes are judged from reports
like the ranks write. Wrong answers are the reference with a line changed, defined the way a Jupyter
cell defines them (:func:`notebook_class`), so the launched tests also prove that the check finds
the source of a class that ``inspect.getsource`` cannot find.
"""

import ast
import inspect
import itertools
import linecache
import math
import os

import pytest
import torch
import torch.distributed as dist

from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit02 as check
from teraflops.course.labs import BEGIN, END, PLACEHOLDER, strip_solution


# The reference solution (the solution notebook holds it, with its method bodies between solution markers).
class Zero1AdamW:
    """ZeRO stage 1 by hand: every rank keeps all the parameters and gradients, but AdamW's state
    (exp_avg and exp_avg_sq, 2 numbers per parameter) only for its own 1/N shard of them."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)  # Ψ
        self.shard_size = math.ceil(self.numel / self.world)  # ⌈Ψ/N⌉: pad so N equal shards tile it
        device = self.params[0].device
        # One flat fp32 vector of all the parameters, padded with zeros at the end.
        self.flat = torch.zeros(self.shard_size * self.world, device=device)
        self.flat[:self.numel] = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        # This rank's shard, elements [rank·S, (rank+1)·S), as a tensor of its own. AdamW owns it
        # alone, so it creates state for S elements, not Ψ.
        start = self.rank * self.shard_size
        self.shard = self.flat[start:start + self.shard_size].clone().requires_grad_(True)
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        # 1. This rank's gradients, flattened and padded like the parameters.
        grads = torch.zeros_like(self.flat)
        grads[:self.numel] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                                        for p in self.params])
        # 2. Reduce-scatter: rank r receives the SUM over all ranks of slice r only. Divide by N:
        #    DDP averages the gradients.
        self.shard.grad = torch.empty_like(self.shard)
        dist.reduce_scatter_single(self.shard.grad, grads, op=dist.ReduceOp.SUM)
        self.shard.grad /= self.world
        # 3. AdamW updates this rank's shard, and nothing else.
        self.optimizer.step()
        # 4. All-gather: every rank receives every rank's updated shard, i.e. all the new parameters.
        dist.all_gather_single(self.flat, self.shard)
        # 5. Copy them back into the model's parameters.
        offset = 0
        for p in self.params:
            p.copy_(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


# --- helpers ---------------------------------------------------------------------------------------

_cells = itertools.count(1)


def notebook_class(source: str, name: str = "Zero1AdamW") -> type:
    """Define a class the way a Jupyter cell does: IPython compiles the cell under a made-up file
    name and registers its lines in linecache (IPython.core.compilerop.CachingCompiler.cache)."""
    filename = f"/tmp/ipykernel_{os.getpid()}/{next(_cells)}.py"  # no such file exists
    linecache.cache[filename] = (len(source), None, [line + "\n" for line in source.splitlines()], filename)
    namespace = {"__name__": "__main__", "torch": torch, "dist": dist, "math": math, "nn": torch.nn}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


REFERENCE = check.class_source(Zero1AdamW)


def edited(*old_new: str) -> type:
    """The reference with some lines changed, defined in a (simulated) notebook cell."""
    source = REFERENCE
    for old, new in zip(old_new[::2], old_new[1::2]):
        assert old in source, old
        source = source.replace(old, new)
    return notebook_class(source)


def solution_cell(source: str) -> str:
    """The class as the solution notebook holds it: each method body between nbgrader's markers."""
    lines = source.splitlines()
    for fn in reversed([n for n in ast.parse(source).body[0].body if isinstance(n, ast.FunctionDef)]):
        first, end, indent = fn.body[0].lineno - 1, fn.end_lineno, " " * fn.body[0].col_offset
        lines[first:end] = [indent + BEGIN, *lines[first:end], indent + END]
    return "\n".join(lines)


def fails(cls, *phrases: str) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check.zero1_optimizer(cls)
    msg = str(e.value)
    assert msg.startswith("Exercise 3 (hand-built ZeRO-1): "), msg
    assert "\n" not in msg, "a check message must be one line"
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(check, "launch", lambda *a, **k: pytest.fail("the check launched ranks"))


# --- launched checks (~10 s each: the ranks' start-up) -------------------------------------------

@pytest.mark.slow
def test_reference_passes(capsys):
    check.zero1_optimizer(Zero1AdamW)
    assert "✓ Exercise 3 (hand-built ZeRO-1): passed" in capsys.readouterr().out


@pytest.mark.slow
def test_forgotten_all_gather_fails():
    cls = edited("dist.all_gather_single(self.flat, self.shard)",  # keeps only its own new shard
                 "self.flat[self.rank * self.shard_size:(self.rank + 1) * self.shard_size] = self.shard")
    fails(cls, "after step() the ranks hold different parameters", "each rank updated only its own shard",
          "Hint: all-gather the updated shards", "dist.all_gather_single")


@pytest.mark.slow
def test_unsharded_optimizer_state_fails():
    fails(Unsharded, "each rank holds 1,034 optimizer-state elements = 2Ψ", "expected 2·⌈Ψ/N⌉ = 518",
          "Hint: give AdamW only this rank's shard")


@pytest.mark.slow
def test_error_in_a_rank_is_one_line_with_a_hint():
    cls = edited("math.ceil(self.numel / self.world)", "self.numel // self.world",  # no padding
                 "torch.zeros(self.shard_size * self.world, device=device)", "torch.zeros(self.numel, device=device)")
    fails(cls, "your step() raised RuntimeError: ", "Hint: pad the flat vector to a multiple of the world size")


# --- without launching ---------------------------------------------------------------------------

def test_the_lab_placeholder_is_not_attempted_without_launching(no_launch):
    lab_cell = strip_solution(solution_cell(REFERENCE))
    assert lab_cell.count(PLACEHOLDER) == 3
    for cls in (Placeholder, notebook_class(lab_cell)):  # answered at once: no_launch fails the test on a launch
        with pytest.raises(NotAttempted, match=r"^Exercise 3 \(hand-built ZeRO-1\): not attempted"):
            check.zero1_optimizer(cls)


def test_source_of_a_class_defined_in_a_notebook_cell():
    cls = notebook_class("import torch\n\nSTEPS = 3\n\n" + REFERENCE + "\nSTEPS += 1\n")
    with pytest.raises((OSError, TypeError)):
        inspect.getsource(cls)  # Python 3.11 looks for the class in __main__'s file: why the check has its own way
    assert check.class_source(cls) == REFERENCE
    assert REFERENCE.startswith("class Zero1AdamW:") and "@torch.no_grad()" in REFERENCE


def test_class_without_source_fails(no_launch):
    namespace = {}
    exec("class Zero1AdamW:\n    def step(self):\n        pass\n", namespace)  # no file, no linecache entry
    fails(namespace["Zero1AdamW"], "cannot find the source code of Zero1AdamW")
    fails(Zero1AdamW.step, "pass the class itself")


# --- judging reports (what the ranks saw), without launching --------------------------------------

def reports(n: int = 2, **change) -> list:
    """The ranks' reports for a correct class, with ``change`` applied (keys of the report), read
    as the check reads them (:class:`teraflops.parallelization.zero.Zero1CheckResult`)."""
    from dataclasses import asdict

    from teraflops.launch.wire import from_json
    from teraflops.parallelization.zero import ZERO1_HYPER, Zero1CheckResult, Zero1CheckSpec

    HYPER, PSI = asdict(ZERO1_HYPER), Zero1CheckSpec("", "").psi

    g = torch.Generator().manual_seed(0)
    initial = torch.randn(PSI, generator=g)
    ref = initial + 0.01 * torch.randn(PSI, generator=g)
    shard = math.ceil(PSI / n)
    adamw = {"type": "AdamW", "torch": True, "state": 2 * shard, "owned": shard, **{k: list(v) if isinstance(v, tuple) else v
                                                                      for k, v in HYPER.items()}}
    out = []
    for r in range(n):
        rep = {"rank": r, "world_size": n, "backend": "gloo", "device": "cpu", "psi": PSI, "hyper": HYPER, "steps": 3, "error": None,
               "params": ref.tolist(), "grad_left": 0.0, "optimizers": [adamw],
               "comm": {"reduce_scatter_single": 3 * shard * n, "all_gather_single": 3 * shard * n},
               "initial": initial.tolist(), "ref": ref.tolist(),
               "alt": {"sum": (ref + 0.003).tolist(), "double": (ref - 0.003).tolist()}}
        rep.update({k: v(r, rep) if callable(v) else v for k, v in change.items()})
        out.append(rep)
    return [from_json(Zero1CheckResult, rep) for rep in out]


def judged(results) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check._judge_zero1(results)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_judge_passes_a_correct_report():
    check._judge_zero1(reports())
    check._judge_zero1(reports(4))


@pytest.mark.parametrize("change, phrase", [
    ({"params": lambda r, rep: rep["alt"]["sum"]}, "Hint: reduce_scatter_single sums over the 2 ranks: divide"),
    ({"params": lambda r, rep: rep["alt"]["double"]}, "divided by the world size twice"),
    ({"params": lambda r, rep: rep["alt"]["sum"], "optimizers": lambda r, rep: [{**rep["optimizers"][0], "type": "Adam"}]},
     "your shard's optimizer is torch.optim.Adam: its weight_decay adds an L2 term"),
    ({"params": lambda r, rep: rep["alt"]["sum"], "optimizers": lambda r, rep: [{**rep["optimizers"][0], "eps": 1e-8}]},
     "your AdamW has eps=1e-08, but the check built your class with eps=0.001"),
    ({"params": lambda r, rep: [x + 1e-3 for x in rep["ref"]]}, "differ from DDP + AdamW by up to 1.00e-03"),
    ({"params": lambda r, rep: rep["initial"]}, "parameters have not changed"),
    ({"params": lambda r, rep: rep["ref"] if r == 0 else rep["initial"]}, "ranks hold different parameters"),
    ({"grad_left": 0.5}, "after zero_grad() the parameters still hold gradients"),
    ({"params": lambda r, rep: [float("nan")] * len(rep["ref"])}, "NaN or inf"),
    ({"optimizers": []}, "no torch.optim optimizer is among your object's attributes"),
    ({"optimizers": lambda r, rep: [{**rep["optimizers"][0], "state": 800 if r else 518}]}, "rank 1 holds 800"),
    ({"optimizers": lambda r, rep: [{**rep["optimizers"][0], "state": 100}]}, "fewer than 2Ψ = 1,034"),
    ({"comm": {"all_reduce": 3 * 518, "all_gather_single": 3 * 518}}, "all-reduces the whole gradient (518 elements"),
])
def test_judge_names_the_mistake(change, phrase):
    assert phrase in judged(reports(**change))


def test_judge_reports_the_first_error_not_its_fallout():
    def error(r, rep):
        if r == 1:
            return {"where": "step()", "type": "IndexError", "message": "index 501 is out of bounds", "time": 1.0}
        return {"where": "step()", "type": "RuntimeError", "message": "Connection closed by peer [127.0.0.1]:1234",
                "time": 2.0}

    assert judged(reports(error=error)) == "your step() raised IndexError on rank 1: index 501 is out of bounds"
    same = {"where": "zero_grad()", "type": "NameError", "message": "name 'np' is not defined", "time": 1.0}
    assert judged(reports(error=same)).startswith("your zero_grad() raised NameError: name 'np' is not defined. "
                                                 "Hint: only the class's own code goes to the ranks")


# --- wrong answers defined in this file ----------------------------------------------------------

class Unsharded:
    """DDP by hand: all-reduce the gradients, AdamW over all the parameters (2Ψ state per rank)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.optimizer.step()


class Placeholder:
    """The lab's skeleton, as the learner receives it."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        raise NotImplementedError("Exercise: replace this line with your code")

    def zero_grad(self):
        raise NotImplementedError("Exercise: replace this line with your code")

    def step(self):
        raise NotImplementedError("Exercise: replace this line with your code")


def test_the_checks_mlp_has_psi_parameters_that_no_small_world_size_divides():
    from teraflops.parallelization.zero import Zero1CheckSpec
    from teraflops.workers.zero1_check import make_model

    spec = Zero1CheckSpec("", "")
    assert sum(p.numel() for p in make_model(spec).parameters()) == spec.psi == 517
    assert all(spec.psi % n for n in range(2, 11))  # every shard of the flat vector needs padding
