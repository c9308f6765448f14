"""Checks for Unit 2 (Parallelization). Each takes the learner's function or class and nothing else.

A distributed exercise runs the learner's code in a real process group: the check ships the code
(its source, see :func:`class_source`) to ranks started by :func:`teraflops.launch.launcher.launch`
(gloo on CPU, NCCL with GPUs; the layout is :func:`teraflops.launch.placement.data_parallel_plan`), where a
worker of :mod:`teraflops.workers` runs it next to a reference built from torch's own parallel
classes and reports what it saw; the check turns the reports into one line.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import math
import re
import textwrap
import types

import torch

from teraflops.launch.launcher import LaunchFailed, launch
from teraflops.errors import PLACEHOLDER_MESSAGE
from teraflops.parallelization.model_states import Precision, comm_volume, model_states
from teraflops.parallelization.zero import (ALL_GATHERS, PAPER_FACTOR, Zero1CheckResult, Zero1CheckSpec,
    comm_bytes_per_step)
from teraflops.launch.placement import data_parallel_plan
from teraflops.grading.core import check_cases, close, exercise, fail, reveal
from teraflops.comm_cost import FABRICS, ring_allreduce_seconds, scaled_rate
from teraflops.parallelization import tensor_parallel
from teraflops.parallelization.hand_ddp import DDP_TOL, DdpCheckResult, DdpCheckSpec
from teraflops.parallelization.hand_fsdp import FSDP_TOL, FsdpCheckResult, FsdpCheckSpec
from teraflops.parallelization.sharded_optimizer import SHARDED_TOL, ShardedCheckResult, ShardedCheckSpec
from teraflops.sizing import TrainConfig

# --- exercises 1 and 2: model-state bytes and communication per stage --------------------------


def _check_cases(fn, what: str, cases, reference, mistakes, default_hint: str, describe) -> None:
    """:func:`~.core.check_cases` in bytes; ``mistakes`` are ``(mistaken(*case) -> bytes, hint)``."""
    check_cases(fn, what, "bytes", cases, reference,
                [(lambda g, w, c, mistaken=mistaken: close(g, mistaken(*c)), hint) for mistaken, hint in mistakes],
                default_hint, lambda c: describe(*c), lambda got, want: f"got {got:,.0f} bytes, expected {want:,.0f}")


def _states_bytes(psi, stage, nd, k):
    return model_states(psi, stage, nd, Precision("check", 2, 2, k)).total_bytes


@exercise(1, "model-state bytes per stage")
def model_state_bytes(fn) -> None:
    """``fn(psi, stage, nd, k=12) -> float``: bytes of model states per device for mixed-precision
    Adam (2Ψ parameters + 2Ψ gradients + KΨ optimizer states) under ZeRO ``stage`` on ``nd`` devices."""
    cases = [(7.5e9, s, 64, 12) for s in range(4)] + [(1.3e9, s, 8, 12) for s in range(4)] + [(7e10, 2, 1024, 8)]

    def shifted(psi, stage, nd, k):  # stage s computed as stage s + 1
        return _states_bytes(psi, min(stage + 1, 3), nd, k)

    mistakes = [
        (lambda psi, s, nd, k: _states_bytes(psi, 0, nd, k),
         "each stage divides more of the states by Nd: stage 1 the optimizer states, stage 2 also the "
         "gradients, stage 3 also the parameters"),
        (lambda psi, s, nd, k: _states_bytes(psi, s, nd, k) / 1e9, "return bytes, not GB"),
        (lambda psi, s, nd, k: _states_bytes(psi, s, nd, k) / 2**30, "return bytes, not GiB"),
        (lambda psi, s, nd, k: _states_bytes(psi, 2 if s == 3 else s, nd, k),
         "stage 3 (P_os+g+p) partitions the parameters too: every state is divided by Nd"),
        (lambda psi, s, nd, k: _states_bytes(psi, 2 if s == 1 else s, nd, k),
         "stage 1 (P_os) partitions only the optimizer states; every device still holds all gradients"),
        (shifted, "stage 0 is plain data parallelism (nothing partitioned); stage 1 is P_os"),
        (lambda psi, s, nd, k: _states_bytes(psi, max(s - 1, 0), nd, k),
         "stage 1 already partitions the optimizer states (stage >= 1), stage 2 the gradients too, stage 3 the "
         "parameters too"),
        (lambda psi, s, nd, k: model_states(psi, s, nd, Precision("fp32", 4, 4, k)).total_bytes,
         "mixed precision keeps parameters and gradients in fp16: 2 bytes each, not 4"),
        (lambda psi, s, nd, k: model_states(psi, s, nd, Precision("k12", 2, 2, 12)).total_bytes,
         "use the k argument for the optimizer bytes per parameter, not a fixed 12"),
    ]
    _check_cases(fn, "model_state_bytes", cases, _states_bytes, mistakes,
                 "bytes per device = params + grads + optimizer, with 2Ψ, 2Ψ and KΨ, each divided by Nd "
                 "once its stage partitions it",
                 lambda psi, s, nd, k: f"Ψ = {psi:.3g}, stage {s}, Nd = {nd}, K = {k}")


@exercise(2, "communication volume per stage")
def comm_volume_bytes(fn) -> None:
    """``fn(psi, stage, bytes_per_element=2) -> float``: bytes each rank sends per step under ZeRO
    ``stage``, by the paper's accounting (§7): 2Ψ elements for stages 0-2, 3Ψ for stage 3."""
    cases = [(7.5e9, s, 2) for s in range(4)] + [(1e6, s, 4) for s in range(4)]
    mistakes = [
        (lambda psi, s, b: comm_volume(psi, 2 if s == 3 else s, b),
         "stage 3 all-gathers the parameters in the forward pass and again in the backward pass, then "
         "reduce-scatters the gradients: 3Ψ"),
        (lambda psi, s, b: comm_volume(psi, s, b) / 2,
         "an all-reduce is a reduce-scatter (Ψ) followed by an all-gather (Ψ): 2Ψ, not Ψ"),
        (lambda psi, s, b: comm_volume(psi, s, 1), "multiply elements by bytes_per_element"),
        *[(lambda psi, s, b, fixed=fixed: comm_volume(psi, s, fixed), "use the bytes_per_element argument, "
           f"not a fixed {fixed}") for fixed in (2, 4)],
        (lambda psi, s, b: comm_volume(psi, s, b) / psi, "return bytes for the whole model (Ψ parameters), not per parameter"),
    ]
    _check_cases(fn, "comm_volume_bytes", cases, comm_volume, mistakes,
                 "stages 0-2 move 2Ψ elements per step (reduce-scatter + all-gather), stage 3 moves 3Ψ",
                 lambda psi, s, b: f"Ψ = {psi:.3g}, stage {s}, {b} bytes per element")




# --- exercise 3: hand-built ZeRO-1 ------------------------------------------------------------

def class_source(cls: type) -> str:
    """The source of the block that defines ``cls`` (dedented, decorators included).

    ``inspect.getsource`` finds a class through its module's file, which a class defined in a
    Jupyter cell does not have (its module is ``__main__``; Python 3.11). Its methods know where they
    were compiled, though: ``__code__.co_filename`` is a file, or the name IPython gives the cell,
    whose lines IPython registers in :mod:`linecache`. The ``class`` statement around a method is
    found there; ``inspect.getsource`` is the fallback for a class without methods of its own.

    Raises:
        ExerciseFailed: no source found (a class made by ``exec`` of a string, say).
    """
    funcs = [inspect.unwrap(getattr(v, "__func__", v)) for v in vars(cls).values()]  # unwrap @torch.no_grad()
    codes = [f.__code__ for f in funcs if isinstance(f, types.FunctionType)
             and f.__qualname__.rsplit(".<locals>.", 1)[-1].startswith(cls.__name__ + ".")]
    for code in sorted(codes, key=lambda c: c.co_firstlineno):
        found = _class_block(linecache.getlines(code.co_filename), code.co_firstlineno - 1, cls.__name__)
        if found:
            return found
    try:
        return textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        fail(f"cannot find the source code of {cls.__name__}, and the check runs it in other processes. "
             "Hint: define the class in a notebook cell of its own, without cell magics such as %%time, and run it")


def _class_block(lines: list[str], inside: int, name: str) -> str | None:
    """The innermost ``class name`` block of ``lines`` that holds line ``inside`` (0-based), dedented,
    with its decorators; None if there is none."""
    for i in range(min(inside, len(lines)) - 1, -1, -1):
        if not re.match(rf"\s*class\s+{re.escape(name)}\b", lines[i]):
            continue
        block = inspect.getblock(lines[i:])
        if i + len(block) <= inside:
            continue  # a class of the same name that ends before the method
        start = i
        while start > 0 and lines[start - 1].lstrip().startswith("@"):
            start -= 1
        source = textwrap.dedent("".join(lines[start:i] + block))
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.ClassDef) and tree.body[0].name == name:
            return source
    return None


_ONLY = "torch, dist (torch.distributed), math, nn and F"
_SAME_CALLS = "every rank must call the same collectives in the same order, with tensors of the same size"
_PAD = "pad the flat vector to a multiple of the world size, so that every rank's shard has the same size"
_ERROR_HINTS = {  # {substring of "Type: message": hint}; the first match wins
    "NameError": f"only the class's own code goes to the ranks, with {_ONLY} defined: make helper functions "
                 "methods of the class, and import anything else inside it",
    "outputShape[0] * worldSize": _PAD,  # gloo, reduce_scatter_single
    "invalid tensor size": _PAD,  # gloo, all_gather_single
    "size times world size": _PAD,  # NCCL: "input tensor must be the same size as output size times world size"
    "non-empty list of Tensors": "params may be a generator (model.parameters()), used up after one pass: "
                                 "make it a list first (self.params = list(params))",
    "default process group twice": "the check has already started the process group: use it (dist.get_rank(), ...)",
    "leaf Variable that requires grad": "change parameters in place only under torch.no_grad() (decorate step with it)",
    "Tensors must be CUDA": "create your flat buffers on the parameters' device (device=p.device)",
    "same device": "create your flat buffers on the parameters' device (device=p.device)",
    "Connection closed by peer": _SAME_CALLS,
    "imed out": _SAME_CALLS,
}
LAUNCH_TIMEOUT = 120  # seconds for the whole check launch, start-up included
ZERO1_TOL = 2e-5  # max |parameter difference| from DDP + AdamW after the worker's steps
_ALL_GATHER = ("all-gather the updated shards into the full flat vector (dist.all_gather_single) and copy it "
               "back into the parameters on every rank")


def _rank_error(results: list[Zero1CheckResult], hints: dict[str, str] | None = None) -> str | None:
    """One line for the error the learner's code raised first in any rank (None if none did);
    ``hints`` ({substring: hint}) are tried before :data:`_ERROR_HINTS`."""
    errors = [(r.error, r.rank) for r in results if r.error]
    if not errors:
        return None
    (first, rank) = min(errors, key=lambda er: (er[0].secondary, er[0].time))  # the cause, not the fallout
    text = f"{first.type}: {first.message}"
    same = sum(f"{e.type}: {e.message}" == text for e, _ in errors) == len(results)
    hint = next((h for needle, h in {**(hints or {}), **_ERROR_HINTS}.items() if needle in text), "")
    message = f": {first.message.rstrip('.')}" if first.message else " (with no message)"
    return (f"your {first.where} raised {first.type}{'' if same else f' on rank {rank}'}{message}"
            + (f". Hint: {hint}" if hint else ""))


def _fmt(v) -> str:
    return f"({', '.join(map(str, v))})" if isinstance(v, (list, tuple)) else str(v)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _judge_zero1(results: list[Zero1CheckResult], tol: float = ZERO1_TOL) -> None:
    """Fail with the first problem the ranks' reports show (see :mod:`teraflops.workers.zero1_check`):
    an error, then the parameters (finite, gradients cleared, moved, equal on every rank, AdamW's),
    then the optimizer state each rank holds, then the traffic."""
    error = _rank_error(results)
    if error:
        fail(error)
    r0 = results[0]
    params = [torch.tensor(r.params, dtype=torch.float64) for r in results]
    ref, initial = (torch.tensor(t, dtype=torch.float64) for t in (r0.ref, r0.initial))
    _zero1_parameters_finite(params)
    _zero1_gradients_cleared(results)
    _zero1_parameters_moved(params, initial, r0.steps)
    _zero1_ranks_agree(params, initial, r0.psi, r0.world_size, tol)
    opts = [o for r in results for o in r.optimizers]
    _zero1_matches_adamw(r0, params[0], ref, opts, tol)
    _zero1_state_sharded(results, opts)
    _zero1_gradient_reduce_scattered(r0.comm, r0.steps, r0.psi)


def _zero1_parameters_finite(params: list[torch.Tensor]) -> None:
    if not all(torch.isfinite(p).all() for p in params):
        fail("after step() the parameters hold NaN or inf. Hint: AdamW divides by √v + eps: "
             "check that every rank's shard gets its gradient before the AdamW step")


def _zero1_gradients_cleared(results: list[Zero1CheckResult]) -> None:
    grad_left = max(r.grad_left for r in results)
    if grad_left > 0:
        fail(f"after zero_grad() the parameters still hold gradients (max |grad| {grad_left:.2e}), so the next "
             "backward() adds to them. Hint: set p.grad = None for every parameter in zero_grad()")


def _zero1_parameters_moved(params: list[torch.Tensor], initial: torch.Tensor, steps: int) -> None:
    if max(_max_diff(p, initial) for p in params) == 0:
        fail(f"after {steps} calls of step() the parameters have not changed: the update stayed in your shard. "
             f"Hint: {_ALL_GATHER}")


def _zero1_ranks_agree(params: list[torch.Tensor], initial: torch.Tensor, psi: int, n: int, tol: float) -> None:
    """Every rank holds the same parameters; where they differ, say whether each rank moved only its shard."""
    spread, other = max((_max_diff(p, params[0]), r) for r, p in enumerate(params))
    if spread > tol:
        size = math.ceil(psi / n)
        own = [slice(r * size, min((r + 1) * size, psi)) for r in range(n)]
        others = [torch.ones(psi, dtype=torch.bool).index_fill_(0, torch.arange(psi)[own[r]], False) for r in range(n)]
        only_own = all(torch.equal(p[others[r]], initial[others[r]]) for r, p in enumerate(params))
        why = "each rank updated only its own shard" if only_own else "yet data parallelism keeps every replica identical"
        fail(f"after step() the ranks hold different parameters (max difference {spread:.2e} between rank 0 and "
             f"rank {other}): {why}. Hint: {_ALL_GATHER}")


def _zero1_matches_adamw(r0: Zero1CheckResult, mine: torch.Tensor, ref: torch.Tensor, opts: list, tol: float) -> None:
    """Rank 0's parameters against DDP + AdamW; off, the first mistake that explains it: another torch
    optimizer, hyperparameters not passed on, the gradients summed or averaged twice."""
    err = _max_diff(mine, ref)
    if err > tol:
        lead = (f"after {r0.steps} steps your parameters differ from DDP + AdamW by up to {err:.2e} "
                f"(tolerance {tol:.0e})")
        _zero1_optimizer_is_adamw(lead, opts)
        _zero1_hyperparameters_passed_on(lead, opts, r0.hyper)
        _zero1_gradients_averaged_once(lead, mine, r0.alt, r0.world_size, tol)
        fail(f"{lead}. Hint: rank r owns elements [r·S, (r+1)·S) of the padded flat vector; it reduce-scatters "
             "the flat gradient (SUM), divides by the world size and steps AdamW (lr, betas, eps, weight_decay "
             "as given) on that shard only")


def _zero1_optimizer_is_adamw(lead: str, opts: list) -> None:
    kind = next((o.type for o in opts if o.torch and o.type != "AdamW"), None)
    if kind:
        extra = (": its weight_decay adds an L2 term to the gradient, AdamW decays the weights directly"
                 if kind == "Adam" else "")
        fail(f"{lead}; your shard's optimizer is torch.optim.{kind}{extra}. Hint: use torch.optim.AdamW")


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def _zero1_hyperparameters_passed_on(lead: str, opts: list, hyper: dict) -> None:
    for o in opts:
        for k, want in hyper.items() if o.torch else ():
            got = getattr(o, k, None)
            if got is not None and _as_list(got) != _as_list(want):
                fail(f"{lead}: your AdamW has {k}={_fmt(got)}, but the check built your class with {k}={_fmt(want)}. "
                     "Hint: pass lr, betas, eps and weight_decay on to the AdamW")


def _zero1_gradients_averaged_once(lead: str, mine: torch.Tensor, alt: dict, n: int, tol: float) -> None:
    """Rank 0's parameters against the wrong references: DDP fed the summed gradients, or the mean divided again."""
    off = {k: _max_diff(mine, torch.tensor(v, dtype=torch.float64)) for k, v in alt.items()}
    if off["sum"] <= tol:
        fail(f"{lead}, and match DDP fed the sum of the gradients instead of their mean. Hint: "
             f"reduce_scatter_single sums over the {n} ranks: divide the shard's gradient by the world size")
    if off["double"] <= tol:
        fail(f"{lead}, and match DDP with the gradients divided by the world size twice. Hint: "
             "reduce_scatter_single (SUM) then one division by the world size gives the mean")


def _zero1_state_sharded(results: list[Zero1CheckResult], opts: list) -> None:
    """An optimizer the check can see, holding about 2·⌈Ψ/N⌉ state elements on each rank and 2Ψ over all of them."""
    r0 = results[0]
    n, psi = r0.world_size, r0.psi
    full, want = 2 * psi, 2 * math.ceil(psi / n)
    aligned = 2 * -(-math.ceil(psi / n) // 128) * 128  # shards padded to 128 elements, as DeepSpeed aligns them
    if not opts:
        fail("the parameters are right, but no torch.optim optimizer is among your object's attributes, so the "
             "check cannot see the optimizer state each rank holds. Hint: keep the AdamW that owns this rank's "
             "shard as an attribute (self.optimizer = torch.optim.AdamW([shard], ...))")
    states = [sum(o.state for o in r.optimizers) for r in results]
    worst = max(range(n), key=lambda r: states[r])
    if states[worst] > min(aligned, full - 1):
        who = "each rank holds" if len(set(states)) == 1 else f"rank {worst} holds"
        whole = " = 2Ψ, the whole AdamW state" if states[worst] == full else ""
        fail(f"{who} {states[worst]:,} optimizer-state elements{whole} (Ψ = {psi:,} parameters, N = {n} ranks), "
             f"expected 2·⌈Ψ/N⌉ = {want:,}. Hint: give AdamW only this rank's shard (a 1/N slice of the flat "
             "parameters), not all the parameters")
    if sum(states) < full:
        fail(f"the ranks' optimizers hold {sum(states):,} state elements in all, fewer than 2Ψ = {full:,}: some "
             "parameters are updated without AdamW state. Hint: every element of the flat vector belongs to "
             "exactly one rank's shard, and that rank's AdamW steps it")


def _zero1_gradient_reduce_scattered(comm: dict, steps: int, psi: int) -> None:
    scattered = sum(v for k, v in comm.items() if "reduce_scatter" in k or k == "reduce")
    if comm.get("all_reduce", 0) >= steps * psi and scattered < steps * psi:
        fail(f"your step() all-reduces the whole gradient ({comm['all_reduce'] // steps:,} elements a step), "
             "though each rank updates only its shard. Hint: dist.reduce_scatter_single hands each rank the sum "
             "of its own slice only: half the traffic of an all-reduce")


@exercise(3, "hand-built ZeRO-1")
def zero1_optimizer(cls) -> None:
    """``cls``: the learner's ``Zero1AdamW`` class (the class itself, not an instance), with
    ``__init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)``,
    ``zero_grad(self)`` and ``step(self)``.

    Its source (see :func:`class_source`) runs in ``plan.ranks`` processes (``plan =
    data_parallel_plan()``) where only ``torch``, ``dist`` (``torch.distributed``), ``math``, ``nn``
    and ``F`` are defined: a class that uses anything else must import it itself. Each rank trains a
    517-parameter MLP for 3 steps with it, next to the same model under DDP + ``torch.optim.AdamW``
    (:mod:`teraflops.workers.zero1_check`). Passing needs, on every rank: parameters within
    :data:`ZERO1_TOL` of DDP's (hence identical across ranks), and a ``torch.optim`` optimizer among
    the object's attributes holding at most 2·⌈Ψ/N⌉ state elements. The launch takes ~10 s on CPU,
    mostly starting processes. A class whose source still holds the lab's placeholder is "not
    attempted" at once, without launching.

    Named mistakes: an exception in any rank (its first line), gradients left by ``zero_grad``,
    parameters never updated or different across ranks (no all-gather), torch.optim.Adam instead of
    AdamW, hyperparameters not passed on, summed instead of averaged gradients, full (2Ψ) optimizer
    state, all-reduce instead of reduce-scatter.
    """
    if not isinstance(cls, type):
        fail(f"pass the class itself, check.zero1_optimizer(Zero1AdamW), not a {type(cls).__name__}")
    source = class_source(cls)
    if PLACEHOLDER_MESSAGE in source:
        raise NotImplementedError(PLACEHOLDER_MESSAGE)  # the decorator reports "not attempted"
    plan = data_parallel_plan()
    try:
        results = launch("teraflops.workers.zero1_check", plan.placement, spec=Zero1CheckSpec(source, cls.__name__),
                         result=Zero1CheckResult, timeout=LAUNCH_TIMEOUT, desc="ZeRO-1 check")
    except LaunchFailed as e:
        if "timed out after" not in str(e):
            raise
        fail(f"the ranks did not finish within {LAUNCH_TIMEOUT} s (the check's steps take well under a second). "
             f"Hint: look for a loop that never ends in your step() or __init__; {_SAME_CALLS}")
    _judge_zero1(results)


# --- exercise 4: reading DeepSpeed's comms log --------------------------------------------------

def _log(entries: dict) -> dict:
    """A comms log in DeepSpeed's format from ``{op: {msg_size: count}}`` (latencies, algbw and busbw
    filled with plausible values; they do not enter the byte count)."""
    return {op: {size: [n, [0.5] * n, [1.0] * n, [1.0] * n] for size, n in sizes.items()}
            for op, sizes in entries.items()}


@exercise(4, "bytes per step from DeepSpeed's comms log")
def comms_log_bytes(fn) -> None:
    """``fn(comms, world_size, steps) -> float``: bytes per rank per step from DeepSpeed's comms
    logger data ``{op: {msg_size: [count, latencies, algbws, busbws]}}``, counted as
    :func:`teraflops.parallelization.zero.comm_bytes_per_step` does."""
    cases = [  # shaped like the logs of stages 0, 2 and 3 on 2, 4 and 8 ranks
        (_log({"all_reduce": {4_000_000: 3, 4: 3}}), 2, 3),
        (_log({"reduce": {1_000_000: 8, 600_000: 4}, "all_gather_into_tensor": {700_000: 4}, "all_reduce": {4: 4}}), 4, 4),
        (_log({"all_gather_into_tensor": {65_536: 20, 512: 50}, "reduce_scatter_tensor": {2_000_000: 5},
               "broadcast": {8: 5}}), 8, 5),
    ]
    world_blind = {**PAPER_FACTOR, **{op: 1 for op in ALL_GATHERS}}

    def counted(factors, per_step=True, use_count=True):
        def f(comms, world, steps):
            total = sum(factors.get(op, world) * size * (e[0] if use_count else 1)
                        for op, sizes in comms.items() for size, e in sizes.items())
            return total / steps if per_step else total
        return f

    mistakes = [
        (counted(world_blind), "all_gather_into_tensor logs the shard this rank sends: the gathered "
                               "output is world_size times larger"),
        (counted({**PAPER_FACTOR, "all_reduce": 1}), "count an all-reduce twice: it is a reduce-scatter plus an all-gather"),
        (counted({**world_blind, "all_reduce": 1}), "all-gathers log the shard (× world_size) and an all-reduce counts twice"),
        (counted(PAPER_FACTOR, per_step=False), "divide by the number of steps the log covers"),
        (counted(PAPER_FACTOR, use_count=False), "each entry is [count, ...]: multiply the message size by how often it was sent"),
    ]
    _check_cases(fn, "comms_log_bytes", cases, comm_bytes_per_step, mistakes,
                 "for each op and message size: size × count × (2 for all-reduce, world_size for all-gathers, "
                 "1 otherwise), summed and divided by steps",
                 lambda comms, world, steps: f"a log of {', '.join(comms)} on {world} ranks over {steps} steps")


# --- exercises 5 and 6: tensor parallelism's bytes, and the degree a link sustains -------------

TP_DEGREES = (2, 4, 8, 16, 32, 64)


def _tp_layer_bytes(batch, seq_len, hidden, dtype_bytes):
    per_phase = tensor_parallel.megatron_per_layer(batch * seq_len, hidden, dtype_bytes)
    return per_phase["forward"]["bytes"] + per_phase["backward"]["bytes"]


@exercise(5, "tensor parallelism's bytes per layer")
def tp_bytes_per_layer(fn) -> None:
    """``fn(batch, seq_len, hidden, dtype_bytes) -> float``: bytes one TP rank hands to all-reduce per
    transformer block per training step (forward and backward), Megatron-LM §3: 4 all-reduces of
    ``b·s·h`` elements. Checked on formula cases, then against the bytes ``CommDebugMode`` counted in a
    real 2-rank run (:func:`teraflops.parallelization.tensor_parallel.run`)."""
    cases = [(8, 1024, 4096, 2), (1, 4096, 8192, 2), (16, 128, 64, 4), (4, 32, 256, 4)]
    mistakes = [
        (lambda b, s, h, d: _tp_layer_bytes(b, s, h, d) / 2,
         "the backward all-reduces too: 2 in the forward (after the row-parallel layers) and 2 in the backward "
         "(the input gradients of the column-parallel layers)"),
        (lambda b, s, h, d: _tp_layer_bytes(b, s, h, d) / 4, "a block has 2 all-reduces per phase, forward and backward: 4"),
        (lambda b, s, h, d: 12 * h * h * d, "TP communicates activations (b·s·h), not the block's 12h² parameters"),
        (lambda b, s, h, d: _tp_layer_bytes(b, s, h, d) / d, "multiply elements by dtype_bytes"),
        (lambda b, s, h, d: _tp_layer_bytes(b, s, h, d) * 8, "return bytes, not bits"),
        (lambda b, s, h, d: _tp_layer_bytes(b, s, h, d) * 3, "the fused QKV projection is one column-parallel layer: one "
         "backward all-reduce, not one each for q, k and v"),
    ]
    _check_cases(fn, "tp_bytes_per_layer", cases, _tp_layer_bytes, mistakes,
                 "4 all-reduces per block and step (2 forward, 2 backward), each of batch·seq_len·hidden elements",
                 lambda b, s, h, d: f"batch {b}, seq_len {s}, hidden {h}, {d} bytes per element")
    cfg = TrainConfig(vocab=64, d_model=64, layers=2, heads=4, seq_len=32, micro_batch=8, lr=0.01)
    measured = tensor_parallel.run(cfg, 2, modes=("tp",), steps=1, warmup=0).results[0]
    counted = [b["forward"] + b["backward"] for b in tensor_parallel.layer_bytes(measured)]
    got = fn(cfg.micro_batch, cfg.seq_len, cfg.d_model, 4)
    if any(abs(got / c - 1) > 0.05 for c in counted):
        fail(f"a real 2-rank run counted {counted} bytes per block; your formula gives {got:,.0f}")


def _tp_comm_seconds(tokens, hidden, layers, n, bandwidth, dtype_bytes):
    return 4 * layers * ring_allreduce_seconds(tokens * hidden * dtype_bytes, n, bandwidth)


def _max_tp_degree(tokens, hidden, layers, bandwidth, budget_s, dtype_bytes=2, factor=lambda n: 2 * (n - 1) / n,
                   calls=4):
    best = 1
    for n in TP_DEGREES:
        if calls * layers * factor(n) * tokens * hidden * dtype_bytes / bandwidth <= budget_s:
            best = n
    return best


@exercise(6, "the TP degree a link sustains")
def max_tp_degree(fn) -> None:
    """``fn(tokens, hidden, layers, bandwidth, budget_s, dtype_bytes=2) -> int``: the largest degree of
    :data:`TP_DEGREES` whose TP communication per step (4·L ring all-reduces of ``tokens·hidden``
    elements, each ``2(n−1)/n · S / bandwidth``) fits in ``budget_s``; 1 if none does."""
    shapes = [(4096, 8192, 80, 450e9, 2), (4096, 4096, 32, 50e9, 2), (2048, 1024, 8, 1e9, 4)]  # NVLink 4, IB NDR, slow
    fractions = (0.9, 1.2, 1.6, 1.8, 1.95, 2.1)  # budgets in units of one step's all-reduced bytes / bandwidth
    cases = [(t, h, layers, bw, f * 4 * layers * t * h * d / bw, d) for t, h, layers, bw, d in shapes for f in fractions]
    mistakes = [
        (lambda *c: _max_tp_degree(*c, factor=lambda n: 1.0),
         "a ring all-reduce moves 2(n−1)/n of the buffer over each rank's link, not the buffer once"),
        (lambda *c: _max_tp_degree(*c, factor=lambda n: 2.0), "the ring factor is 2(n−1)/n, which is below 2 for small n"),
        (lambda *c: _max_tp_degree(*c, calls=2), "count the backward's 2 all-reduces per block as well as the forward's"),
        (lambda *c: _max_tp_degree(*c[:5], dtype_bytes=1), "multiply elements by dtype_bytes"),
    ]
    def reference(*c):
        return _max_tp_degree(*c)

    answers = [(fn(*c), reference(*c), c) for c in cases]
    for got, want, c in answers:
        if isinstance(got, bool) or not isinstance(got, int):
            fail(f"return an int degree, got {got!r}. Hint: one of {TP_DEGREES}, or 1")
    wrong = [a for a in answers if a[0] != a[1]]
    if wrong:
        got, want, c = wrong[0]
        hint = next((h for m, h in mistakes if all(m(*a[2]) == a[0] for a in answers)), None) or reveal(
            "your answers fit none of the usual mistakes", "the largest n with 4·L · 2(n−1)/n · tokens·hidden·"
            "dtype_bytes / bandwidth ≤ budget_s")
        fail(f"for {c[0]} tokens, hidden {c[1]}, {c[2]} layers, {c[3] / 1e9:g} GB/s, a {c[4] * 1e3:g} ms budget: "
             f"got degree {got}, expected {want}. Hint: {hint}")
    _max_tp_degree_on_a_real_run(fn)


def _max_tp_degree_on_a_real_run(fn) -> None:
    """The answer held to what a real 4-rank TP run all-reduces: the budget is the ring time of the bytes
    CommDebugMode counted per block over the scaled InfiniBand link Unit 2 §6 runs across, so degree 4 just
    fits and 1 % less leaves degree 2."""
    cfg = TrainConfig(vocab=64, d_model=64, layers=2, heads=4, seq_len=32, micro_batch=8, lr=0.01)
    measured = tensor_parallel.run(cfg, 4, modes=("tp",), steps=1, warmup=0).results[0]
    per_block = [b["forward"] + b["backward"] for b in tensor_parallel.layer_bytes(measured)]  # 4 all-reduces each
    tokens, rate = cfg.micro_batch * cfg.seq_len, scaled_rate(FABRICS[0])
    step_s = sum(4 * ring_allreduce_seconds(b / 4, 4, rate) for b in per_block)
    for budget, want in ((step_s * (1 + 1e-9), 4), (0.99 * step_s, 2)):  # 1e-9: summed in another order
        got = fn(tokens, cfg.d_model, cfg.layers, rate, budget, 4)
        if got != want:
            fail(f"a real 4-rank run all-reduced {per_block[0]:,} bytes per block ({cfg.layers} blocks): over a "
                 f"{rate / 1e6:g} MB/s link its ring all-reduces take {step_s * 1e3:.1f} ms per step; with a "
                 f"{budget * 1e3:.2f} ms budget your function says degree {got}, the run says {want}. Hint: the "
                 "counted bytes are tokens·hidden·dtype_bytes per all-reduce, 4 per block")


# --- exercise 7: a sharded optimizer for any optimizer -----------------------------------------

_BROADCAST = ("after the owners step, broadcast every parameter from the rank that owns it "
              "(dist.broadcast(p.data, src=owner)), in the same order on every rank")


def _launch_check(worker: str, spec, result, desc: str, ranks: int | None = None) -> list:
    """The ranks' reports of one launched check (``ranks``: CPU ranks, default the plan's); a launch
    that runs out of time fails with the usual hint."""
    plan = data_parallel_plan(ranks_cpu=ranks)
    try:
        return launch(worker, plan.placement, spec=spec, result=result, timeout=LAUNCH_TIMEOUT, desc=desc)
    except LaunchFailed as e:
        if "timed out after" not in str(e):
            raise
        fail(f"the ranks did not finish within {LAUNCH_TIMEOUT} s (the check's steps take well under a second). "
             f"Hint: look for a loop that never ends or a wait that nothing answers; {_SAME_CALLS}")


def _learner_class(cls, call: str) -> str:
    """The source of the learner's class ``cls`` to ship to the ranks; "not attempted" while it still
    holds the lab's placeholder."""
    if not isinstance(cls, type):
        fail(f"pass the class itself, {call}, not a {type(cls).__name__}")
    source = class_source(cls)
    if PLACEHOLDER_MESSAGE in source:
        raise NotImplementedError(PLACEHOLDER_MESSAGE)  # the decorator reports "not attempted"
    return source


def _judge_sharded(results, tol: float | None = None) -> None:
    """Fail with the first problem the ranks' reports show (see :mod:`teraflops.workers.sharded_check`):
    an error, then for each optimizer case in turn its warnings, its groups, its parameters and where
    its state is held."""
    tol = SHARDED_TOL if tol is None else tol
    error = _rank_error(results)
    if error:
        fail(error)
    shapes = results[0].shapes
    for i, run0 in enumerate(results[0].runs):
        runs = [r.runs[i] for r in results]
        _sharded_no_warning(runs, run0.case)
        _sharded_groups_recorded(run0, len(shapes))
        _sharded_parameters(runs, tol)
        _sharded_state_on_one_rank([set(run.stateful) for run in runs], results[0].world_size, shapes, run0.case)


def _sharded_no_warning(runs, case: str) -> None:
    said = sorted({m for run in runs for m in run.warnings})
    if said:
        fail(f"your step() with torch.optim.{case} emitted a warning: {said[0]}. Hint: use the collectives "
             "torch recommends (dist.reduce_scatter_single, dist.all_gather_single), and nothing deprecated")


def _sharded_groups_recorded(run0, parameters: int) -> None:
    if run0.group_sizes != [2, parameters - 2]:
        fail(f"with torch.optim.{run0.case} your optimizer's param_groups hold {run0.group_sizes} parameters, "
             f"expected [2, {parameters - 2}] (the two groups the check gave). Hint: call "
             "super().__init__(params, defaults) and let add_param_group record every group, so that "
             "schedulers and zero_grad() see all of them")


def _sharded_parameters(runs, tol: float) -> None:
    """The parameters after the steps: finite, moved, the same on every rank, and those of DDP with the
    unsharded optimizer."""
    run0, case = runs[0], runs[0].case
    params = [torch.tensor(run.params, dtype=torch.float64) for run in runs]
    ref, initial = (torch.tensor(t, dtype=torch.float64) for t in (run0.ref, run0.initial))
    if not all(torch.isfinite(p).all() for p in params):
        fail(f"after step() with torch.optim.{case} the parameters hold NaN or inf")
    if max(_max_diff(p, initial) for p in params) == 0:
        fail(f"after the steps with torch.optim.{case} the parameters have not changed. Hint: step the wrapped "
             f"optimizer, then {_BROADCAST}")
    spread, other = max((_max_diff(p, params[0]), r) for r, p in enumerate(params))
    if spread > tol:
        fail(f"after step() with torch.optim.{case} the ranks hold different parameters (max difference "
             f"{spread:.2e} between rank 0 and rank {other}): each rank updated only the parameters it owns. "
             f"Hint: {_BROADCAST}")
    _sharded_matches_reference(run0, params[0], ref, initial, tol)


def _sharded_matches_reference(run0, mine: torch.Tensor, ref: torch.Tensor, initial: torch.Tensor, tol: float) -> None:
    """Rank 0's parameters against DDP + the unsharded optimizer; off, whether the second group is to blame."""
    err = _max_diff(mine, ref)
    if err > tol:
        case, (lo, hi) = run0.case, run0.second
        lead = (f"after the steps with torch.optim.{case} your parameters differ from DDP + the unsharded "
                f"torch.optim.{case} by up to {err:.2e} (tolerance {tol:.0e})")
        if torch.equal(mine[lo:hi], initial[lo:hi]):
            fail(f"{lead}: the second parameter group never moved. Hint: override add_param_group to call "
                 "super().add_param_group(group) and hand this rank's part of the group to the wrapped optimizer, "
                 "so a group added after construction is stepped too")
        if _max_diff(mine[:lo], ref[:lo]) <= tol:
            fail(f"{lead}, in the second parameter group. Hint: give the wrapped optimizer each group's own "
                 "settings (its lr, weight_decay...) with the group's parameters, not only the defaults")
        fail(f"{lead}. Hint: pass **kwargs on to optimizer_cls, and let the wrapped optimizer step exactly "
             "this rank's parameters with their gradients (DDP has already averaged them)")


def _sharded_state_on_one_rank(held: list[set], n: int, shapes, case: str) -> None:
    """``held``: per rank, the indices of the parameters it holds optimizer state for; each on exactly one of the
    ``n`` ranks."""
    for p in range(len(shapes)):
        owners = [r for r in range(n) if p in held[r]]
        if len(owners) > 1:
            fail(f"with torch.optim.{case} the state of parameter {p} (shape {tuple(shapes[p])}) is "
                 f"held on ranks {owners}: every rank keeps a full optimizer. Hint: assign each parameter to one "
                 "rank and give the wrapped optimizer on each rank only the parameters that rank owns")
        if not owners:
            fail(f"with torch.optim.{case} no rank holds optimizer state for parameter {p} (shape "
                 f"{tuple(shapes[p])}). Hint: keep the wrapped optimizer as an attribute, and make "
                 "every parameter belong to exactly one rank's wrapped optimizer")


@exercise(7, "a sharded optimizer")
def sharded_optimizer(cls) -> None:
    """``cls``: the learner's ``torch.optim.Optimizer`` subclass (the class itself), built as
    ``cls(params, optimizer_cls, **kwargs)`` with ``params`` a list of parameter-group dicts, and
    supporting ``add_param_group``, ``zero_grad()`` and ``step()``.

    Its source runs in ``plan.ranks`` processes (:func:`teraflops.launch.placement.data_parallel_plan`)
    with only ``torch``, ``dist``, ``math``, ``nn`` and ``F`` defined
    (:mod:`teraflops.workers.sharded_check`): a DDP-wrapped 517-parameter MLP trained 3 steps with
    ``torch.optim.AdamW`` (two groups given as dicts) and ``torch.optim.SGD`` with momentum (second
    group added with ``add_param_group``), next to DDP with the unsharded optimizer. Passing needs:
    no warning during ``step()``, both groups in ``param_groups``, parameters within
    :data:`~teraflops.parallelization.sharded_optimizer.SHARDED_TOL` of the reference on every
    rank, and each parameter's optimizer state on exactly one rank.

    Named mistakes: an exception in any rank, a warning (deprecated collectives), groups not recorded,
    no broadcast (ranks differ or nothing moves), a group added later never stepped, a group's own
    settings dropped, full state on every rank, state nowhere to be seen.
    """
    source = _learner_class(cls, "check.sharded_optimizer(ShardedOptimizer)")
    results = _launch_check("teraflops.workers.sharded_check", ShardedCheckSpec(source, cls.__name__),
                            ShardedCheckResult, "sharded-optimizer check")
    _judge_sharded(results)


# --- exercises 8 and 9: DDP by hand, overlapped with backward ----------------------------------

_BEFORE_ACCUMULATION = ("a hook registered with register_hook runs before the gradient is accumulated into p.grad "
                        "(None at the first step): use p.register_post_accumulate_grad_hook(hook), whose hook "
                        "receives the parameter once p.grad holds its gradient")
_DDP_HINTS = {  # errors in the learner's wrapper: {substring of "Type: message": hint}
    "NoneType": _BEFORE_ACCUMULATION,
    "Expected parameter `tensor` of type torch.Tensor": _BEFORE_ACCUMULATION,  # dist.all_reduce(None)
    "finish_gradient_synchronization": "define finish_gradient_synchronization(self), which waits on every "
                                       "all-reduce launched during backward",
    "bucket_size_mb": "take the bucket size as __init__(self, module, bucket_size_mb)",
}
_WAIT = ("keep the handle of each dist.all_reduce(..., async_op=True) and call .wait() on every one in "
         "finish_gradient_synchronization(), then divide by the world size")
BUCKET_SIZES_MB = (1.0, 0.004)  # the bucketed check: all of TiedLM's 1,320 gradients in one bucket; ~1,000 per bucket


def _judge_ddp(results, tol: float = DDP_TOL) -> None:
    """Fail with the first problem the ranks' reports show (see :mod:`teraflops.workers.ddp_check`): an
    error, then for each bucket size in turn the broadcast at wrap time, the handles waited on, the
    overlap with backward, the calls a step and the parameters."""
    error = _rank_error(results, _DDP_HINTS)
    if error:
        fail(error)
    n, sizes = results[0].world_size, results[0].sizes
    for i, run0 in enumerate(results[0].runs):
        runs = [r.runs[i] for r in results]
        how = "per parameter" if run0.bucket_mb is None else f"with bucket_size_mb={run0.bucket_mb}"
        _ddp_replicas_start_equal(runs)
        _ddp_all_reduces_waited(runs, how)
        _ddp_overlaps_backward(run0, how)
        _ddp_calls_per_step(run0, sizes, how)
        _ddp_parameters(runs, n, how, tol)


def _ddp_replicas_start_equal(runs) -> None:
    initial = torch.tensor(runs[0].initial, dtype=torch.float64)
    for r, run in enumerate(runs):
        if not torch.equal(torch.tensor(run.wrapped, dtype=torch.float64), initial):
            fail(f"right after wrapping, rank {r}'s parameters differ from rank 0's (every rank's model starts "
                 "from its own random seed). Hint: in __init__, broadcast every parameter from rank 0 "
                 "(dist.broadcast(p.data, src=0)) so all replicas start equal")


def _ddp_all_reduces_waited(runs, how: str) -> None:
    unwaited = max(run.unwaited for run in runs)
    if unwaited:
        fail(f"{how}, finish_gradient_synchronization() returned with {unwaited} asynchronous all-reduce(s) not "
             f"waited on, so step() may read gradients still being summed. Hint: {_WAIT}")


def _ddp_overlaps_backward(run0, how: str) -> None:
    during, after = run0.backward_calls, run0.finish_calls
    if not any(during):
        where = ("after backward(), in finish_gradient_synchronization()" if any(after)
                 else "nowhere")
        fail(f"{how}, your wrapper all-reduced {sum(after)} gradients {where}: no communication overlaps the "
             "backward pass. Hint: launch each all-reduce from a hook, "
             "p.register_post_accumulate_grad_hook(hook), with async_op=True")


def _ddp_calls_per_step(run0, sizes: list[int], how: str) -> None:
    """All-reduce calls a step: one per parameter, or per bucket, none larger than a bucket."""
    per_step, params = run0.backward_calls[0] + run0.finish_calls[0], len(sizes)
    if run0.bucket_mb is None and per_step != params:
        why = (" (the tied embedding/output weight is one parameter: one hook, one all-reduce)"
               if per_step > params else ": some gradients were never averaged")
        fail(f"per parameter, your wrapper made {per_step} all-reduce calls a step for {params} parameters{why}. "
             "Hint: register one hook on each parameter of module.parameters() that requires a gradient")
    if run0.bucket_mb is not None:
        _ddp_buckets(run0, sizes, per_step, how)


def _ddp_buckets(run0, sizes: list[int], per_step: int, how: str) -> None:
    params = len(sizes)
    cap = int(run0.bucket_mb * 1e6 / 4)  # fp32 elements a bucket holds (MB = 1e6 bytes)
    fewest = math.ceil(sum(sizes) / cap)
    if per_step >= params and params > fewest:
        fail(f"{how}, your wrapper made {per_step} all-reduce calls a step for {params} parameters: one per "
             f"parameter, not per bucket. Hint: group the parameters into buckets of at most "
             f"{run0.bucket_mb} MB and all-reduce a bucket (one flat tensor) once its last gradient is ready")
    if per_step < fewest or run0.largest > max(cap, max(sizes)):
        fail(f"{how}, your wrapper's largest all-reduce held {run0.largest:,} elements ({per_step} calls a "
             f"step): a bucket may hold at most {cap:,} fp32 elements (or one larger parameter). Hint: start "
             "a new bucket when the next parameter would overflow the current one")


def _ddp_parameters(runs, n: int, how: str, tol: float) -> None:
    """The parameters after the steps: the same on every rank, DDP's (not DDP's on summed gradients), and
    one process's on the global batch."""
    run0, steps = runs[0], len(runs[0].backward_calls)
    params_t = [torch.tensor(run.params, dtype=torch.float64) for run in runs]
    spread, other = max((_max_diff(p, params_t[0]), r) for r, p in enumerate(params_t))
    if spread > tol:
        fail(f"{how}, after {steps} steps the ranks hold different parameters (max difference {spread:.2e} "
             f"between rank 0 and rank {other}). Hint: every gradient must be all-reduced and waited on before "
             "step()")
    ref, single, summed = (torch.tensor(t, dtype=torch.float64) for t in (run0.ref, run0.single, run0.summed))
    err = _max_diff(params_t[0], ref)
    if err > tol:
        lead = (f"{how}, after {steps} steps your parameters differ from DistributedDataParallel's by up to "
                f"{err:.2e} (tolerance {tol:.0e})")
        if _max_diff(params_t[0], summed) <= 1e-4:
            fail(f"{lead}, and match DDP fed the sum of the gradients. Hint: dist.all_reduce sums over the {n} "
                 "ranks: divide each gradient by the world size")
        fail(f"{lead}. Hint: {_WAIT}; each gradient exactly once (a tied weight is one parameter)")
    err = _max_diff(params_t[0], single)
    if err > tol:
        fail(f"{how}, your parameters match DDP's but differ from one process on the global batch by {err:.2e} "
             f"(tolerance {tol:.0e})")


def _ddp_check(cls, call: str, bucket_mb=None) -> None:
    source = _learner_class(cls, call)
    results = _launch_check("teraflops.workers.ddp_check", DdpCheckSpec(source, cls.__name__, bucket_mb=bucket_mb),
                            DdpCheckResult, "DDP check")
    _judge_ddp(results)


@exercise(8, "DDP overlapped with backward")
def ddp_overlap(cls) -> None:
    """``cls``: the learner's ``nn.Module`` wrapper (the class itself), built as ``cls(module)``, with
    ``forward(*inputs)`` and ``finish_gradient_synchronization()``: rank 0's parameters broadcast at
    wrap time, one asynchronous all-reduce per parameter launched from a post-accumulate hook during
    ``backward()``, waited on and averaged in ``finish_gradient_synchronization()``.

    Runs on ``plan.ranks`` processes (:mod:`teraflops.workers.ddp_check`): 5 SGD steps of
    :class:`~teraflops.parallelization.hand_ddp.TiedLM` (tied embedding and output weight; every rank
    starts from its own seed) next to ``DistributedDataParallel`` and one process on the global
    batch; parameters must agree within :data:`~teraflops.parallelization.hand_ddp.DDP_TOL` (fp32).

    Named mistakes: an exception (``register_hook`` reading ``.grad`` before accumulation), no
    broadcast at wrap time, handles not waited on, all-reduces only after backward (no overlap), a
    tied weight reduced twice, summed instead of averaged gradients.
    """
    _ddp_check(cls, "check.ddp_overlap(DDPOverlap)")


@exercise(9, "DDP with gradient buckets")
def ddp_bucketed(cls) -> None:
    """``cls``: as :func:`ddp_overlap`, built as ``cls(module, bucket_size_mb)``: gradients grouped in
    buckets of at most ``bucket_size_mb`` MB (1e6 bytes; a larger parameter alone), one asynchronous
    all-reduce per bucket launched from the hooks once the bucket's last gradient is ready. Checked
    with :data:`BUCKET_SIZES_MB` (one bucket for the whole model, then ~1,000 fp32 elements each):
    the same parameters as DDP and one process, at least the buckets the size needs, no call larger
    than a bucket, fewer calls than parameters."""
    _ddp_check(cls, "check.ddp_bucketed(DDPBucketed)", BUCKET_SIZES_MB)


# --- exercise 10: FSDP by hand -------------------------------------------------------------------

_FSDP_HINTS = {
    "full_parameters": "define full_parameters(self) -> (weight, bias): the full fp32 tensors, all-gathered",
    "compute_dtype": "take the compute dtype as __init__(self, linear, compute_dtype=None)",
}


def _judge_fsdp(results) -> None:
    """Fail with the first problem the ranks' reports show (see :mod:`teraflops.workers.fsdp_check`)."""
    error = _rank_error(results, _FSDP_HINTS)
    if error:
        fail(error)
    n, sizes = results[0].world_size, results[0].sizes
    bound = sum(math.ceil(s / n) for s in sizes)  # every tensor's own padded shard: the most a rank may hold
    for i, run0 in enumerate(results[0].runs):
        runs = [r.runs[i] for r in results]
        how = "in fp32" if run0.dtype == "float32" else f"with compute_dtype=torch.{run0.dtype}"
        if any(r.held_dtypes != ["float32"] for r in runs):
            fail(f"{how}, your layers' parameters are {runs[0].held_dtypes}: the optimizer needs fp32 master shards. "
                 "Hint: keep the shard an fp32 nn.Parameter; cast only the gathered weight to the compute dtype")
        held = max(r.held for r in runs)
        if held > bound:
            fail(f"{how}, a rank holds {held:,} parameter elements of the model's {sum(sizes):,}; a 1/{n} shard of each "
                 f"is at most {bound:,}. Hint: keep only this rank's slice of the flattened, padded weight and bias as "
                 "the parameter; the full weight exists only while the layer runs")
        if run0.scatters == 0 and run0.reduces > 0:
            fail(f"{how}, your backward all-reduces (or reduces) the gradients, so every rank receives the whole "
                 "gradient though it steps only its shard. Hint: dist.reduce_scatter_single hands each rank the sum "
                 "of its own shard: 1/n of the traffic an all-reduce delivers")
        if run0.kept or run0.backward_gathers == 0:
            why = ("a layer keeps its gathered weight as an attribute after forward" if run0.kept else
                   "backward gathered nothing, so the weights gathered in forward stayed alive until backward")
            fail(f"{how}, {why}: all-gather without freeing holds the full model on every rank, what FSDP exists to "
                 "avoid. Hint: free the full weight when forward returns (save only the input for backward) and "
                 "all-gather it again in backward, e.g. in a torch.autograd.Function")
        params = torch.tensor(run0.params, dtype=torch.float64)
        single, summed = (torch.tensor(t, dtype=torch.float64) for t in (run0.single, run0.summed))
        tol = FSDP_TOL[run0.dtype]
        if not torch.isfinite(params).all():
            fail(f"{how}, the parameters hold NaN or inf after the steps")
        err = _max_diff(params, single)
        if err > tol:
            lead = (f"{how}, after the steps your full parameters differ from one process "
                    f"on the global batch by up to {err:.2e} (tolerance {tol:.0e})")
            if _max_diff(params, summed) <= tol:
                fail(f"{lead}, and match the gradients summed over the {n} ranks. Hint: reduce_scatter_single sums: "
                     "divide the shard's gradient by the world size")
            fail(f"{lead}. Hint: in backward, the weight's gradient is grad_out.T @ input (the bias's, grad_out "
                 "summed over rows), flattened and padded like the parameters, reduce-scattered, divided by the "
                 "world size and returned in fp32 as the shard's gradient")


@exercise(10, "FSDP by hand")
def fsdp_linear(cls) -> None:
    """``cls``: the learner's ``nn.Module`` (the class itself) built as ``cls(linear, compute_dtype=None)``
    from an ``nn.Linear``: its only parameter(s) this rank's fp32 shard of the flattened, padded weight
    and bias; ``forward(x)`` all-gathers the full weight (in ``compute_dtype`` when given), frees it,
    gathers it again in backward and reduce-scatters the weight's gradient (averaged, fp32, to the
    shard); ``full_parameters()`` returns the full fp32 ``(weight, bias)``.

    Runs on ``plan.ranks`` processes (:mod:`teraflops.workers.fsdp_check`): every Linear of a 3-layer
    MLP wrapped, 5 SGD steps in fp32 and with bf16 compute, against one process on the global batch
    (tolerances :data:`~teraflops.parallelization.hand_fsdp.FSDP_TOL`). Named mistakes: an exception,
    non-fp32 master shards, full parameters held, all-reduce instead of reduce-scatter, all-gather
    without freeing (nothing gathered in backward, or the full weight kept), summed gradients.
    """
    source = _learner_class(cls, "check.fsdp_linear(ShardedLinear)")
    results = _launch_check("teraflops.workers.fsdp_check", FsdpCheckSpec(source, cls.__name__), FsdpCheckResult,
                            "FSDP check")
    _judge_fsdp(results)
