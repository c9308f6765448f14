"""The hand-built FSDP check (Unit 2, exercise 10) passes the reference layer and names plausible mistakes.

Launched checks start real gloo ranks (~20-30 s on 2 busy CPU cores, fp32 and bf16 runs); the
rest judges reports like the ranks write.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from teraflops.errors import ExerciseFailed, NotAttempted
from teraflops.grading import unit02 as check
from teraflops.launch.placement import data_parallel_plan
from teraflops.parallelization.hand_fsdp import FSDP_TOL, FsdpCheckResult, plain_mlp

from test_zero1_check import notebook_class, solution_cell

class ShardedLinear(nn.Module):
    """FSDP by hand for one nn.Linear: this rank keeps a 1/n fp32 shard of the flattened, padded
    weight and bias; the full weight exists only while forward or backward runs."""

    class _Gathered(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, layer):
            dtype = layer.compute_dtype or x.dtype
            w, b = layer.gather(dtype)
            ctx.layer = layer
            ctx.save_for_backward(x)  # the input only: w and b are freed when forward returns
            return F.linear(x.to(dtype), w, b).to(x.dtype)

        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            layer = ctx.layer
            dtype = layer.compute_dtype or x.dtype
            w, _ = layer.gather(dtype)  # gathered again
            g = grad_out.to(dtype).reshape(-1, grad_out.shape[-1])
            x2 = x.to(dtype).reshape(-1, x.shape[-1])
            grad_x = (g @ w).to(x.dtype).view_as(x)
            grads = torch.zeros(layer.size * layer.world, dtype=dtype, device=x.device)
            grads[:layer.total] = torch.cat([(g.T @ x2).reshape(-1), g.sum(0)])
            grad_shard = torch.empty(layer.size, dtype=dtype, device=x.device)
            dist.reduce_scatter_single(grad_shard, grads)  # the sum of this rank's shard only
            return grad_x, grad_shard.float() / layer.world, None

    def __init__(self, linear, compute_dtype=None):
        super().__init__()
        self.world, rank = dist.get_world_size(), dist.get_rank()
        self.compute_dtype = compute_dtype
        self.weight_shape = tuple(linear.weight.shape)
        self.numels = [linear.weight.numel(), linear.bias.numel()]
        self.total = sum(self.numels)
        self.size = math.ceil(self.total / self.world)
        flat = torch.zeros(self.size * self.world, device=linear.weight.device)
        flat[:self.total] = torch.cat([linear.weight.detach().reshape(-1), linear.bias.detach()]).float()
        self.shard = nn.Parameter(flat[rank * self.size:(rank + 1) * self.size].clone())

    def gather(self, dtype):
        flat = torch.empty(self.size * self.world, dtype=dtype, device=self.shard.device)
        dist.all_gather_single(flat, self.shard.detach().to(dtype))
        w, b = flat[:self.total].split(self.numels)
        return w.view(self.weight_shape), b

    def forward(self, x):
        return self._Gathered.apply(x, self.shard, self)

    def full_parameters(self):
        return self.gather(torch.float32)


REFERENCE = check.class_source(ShardedLinear)


def notebook_layer(source: str):
    cls = notebook_class(source, "ShardedLinear")
    cls.forward.__globals__.update(F=F, nn=nn)
    return cls


def edited(*old_new: str):
    source = REFERENCE
    for old, new in zip(old_new[::2], old_new[1::2]):
        assert old in source, old
        source = source.replace(old, new)
    return notebook_layer(source)


def fails(cls, *phrases: str) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check.fsdp_linear(cls)
    msg = str(e.value)
    assert msg.startswith("Exercise 10 (FSDP by hand): "), msg
    assert "\n" not in msg
    for phrase in phrases:
        assert phrase in msg, msg
    return msg


# --- launched ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_reference_passes(capsys):
    check.fsdp_linear(notebook_layer(REFERENCE))
    assert "✓ Exercise 10 (FSDP by hand): passed" in capsys.readouterr().out


@pytest.mark.slow
def test_reference_passes_on_4_ranks(monkeypatch, capsys):
    monkeypatch.setattr(check, "data_parallel_plan", lambda ranks_cpu=None: data_parallel_plan(ranks_cpu=4))
    check.fsdp_linear(notebook_layer(REFERENCE))
    assert "passed" in capsys.readouterr().out


@pytest.mark.slow
def test_all_gather_without_freeing_fails():
    cls = edited("            ctx.save_for_backward(x)  # the input only: w and b are freed when forward returns",
                 "            ctx.save_for_backward(x, w)",
                 "            (x,) = ctx.saved_tensors", "            (x, w) = ctx.saved_tensors",
                 "            w, _ = layer.gather(dtype)  # gathered again", "")
    fails(cls, "backward gathered nothing", "Hint: free the full weight when forward returns")


@pytest.mark.slow
def test_reduce_instead_of_reduce_scatter_fails():
    cls = edited("            dist.reduce_scatter_single(grad_shard, grads)  # the sum of this rank's shard only",
                 "            dist.all_reduce(grads)\n"
                 "            grad_shard = grads[dist.get_rank() * layer.size:(dist.get_rank() + 1) * layer.size]")
    fails(cls, "your backward all-reduces", "Hint: dist.reduce_scatter_single")


# --- without launching ---------------------------------------------------------------------------------

def test_placeholder_is_not_attempted_without_launching(monkeypatch):
    from teraflops.course.labs import strip_solution

    monkeypatch.setattr(check, "launch", lambda *a, **k: pytest.fail("the check launched ranks"))
    with pytest.raises(NotAttempted, match="not attempted"):
        check.fsdp_linear(notebook_layer(strip_solution(solution_cell(REFERENCE))))


def test_the_checks_model_pads_every_shard():
    sizes = [p.numel() for p in plain_mlp().parameters()]
    layers = [w + b for w, b in zip(sizes[::2], sizes[1::2])]
    assert all(any(t % n for t in layers) for n in (2, 3, 4))


SIZES = [p.numel() for p in plain_mlp().parameters()]


def reports(n=2, **change) -> list:
    from teraflops.launch.wire import from_json

    psi = sum(SIZES)
    g = torch.Generator().manual_seed(0)
    single = torch.randn(psi, generator=g)
    out = []
    for r in range(n):
        runs = []
        for dtype in ("float32", "bfloat16"):
            run = {"dtype": dtype, "params": single.tolist(), "held": sum(-(-s // n) for s in SIZES) - 3,
                   "held_dtypes": ["float32"], "forward_gathers": 3, "backward_gathers": 3, "scatters": 3, "reduces": 0,
                   "kept": 0, "single": single.tolist(), "summed": (single + 0.1).tolist()}
            run.update({k: v(r, run) if callable(v) else v for k, v in change.items()})
            runs.append(run)
        out.append({"rank": r, "world_size": n, "backend": "gloo", "device": "cpu", "error": None, "runs": runs,
                    "sizes": SIZES})
    return [from_json(FsdpCheckResult, rep) for rep in out]


def judged(results) -> str:
    with pytest.raises(ExerciseFailed) as e:
        check._judge_fsdp(results)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_judge_passes_correct_reports():
    check._judge_fsdp(reports(2))
    check._judge_fsdp(reports(4))


@pytest.mark.parametrize("change, phrase", [
    ({"held_dtypes": ["bfloat16"]}, "the optimizer needs fp32 master shards"),
    ({"held": sum(SIZES)}, "a 1/2 shard of each is at most"),
    ({"scatters": 0, "reduces": 3}, "your backward all-reduces"),
    ({"backward_gathers": 0}, "backward gathered nothing"),
    ({"kept": 264}, "keeps its gathered weight as an attribute"),
    ({"params": lambda r, run: run["summed"]}, "match the gradients summed over the 2 ranks"),
    ({"params": lambda r, run: [x + 2 * FSDP_TOL["float32"] for x in run["single"]]}, "in fp32, after the steps"),
    ({"params": lambda r, run: [x + (1e-3 if run["dtype"] == "float32" else 0) for x in run["single"]]},
     "differ from one process on the global batch by up to 1.00e-03"),
])
def test_judge_names_the_mistake(change, phrase):
    assert phrase in judged(reports(**change))


def test_bf16_has_its_own_stated_tolerance():
    check._judge_fsdp(reports(params=lambda r, run: [x + (1e-3 if run["dtype"] == "bfloat16" else 0)
                                                      for x in run["single"]]))
    assert "with compute_dtype=torch.bfloat16" in judged(reports(
        params=lambda r, run: [x + (5e-3 if run["dtype"] == "bfloat16" else 0) for x in run["single"]]))
