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
from teraflops.hardware.alpha_beta import ring_allreduce_seconds
from teraflops.parallelization import tensor_parallel
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
    "outputShape[0] * worldSize": _PAD,  # gloo, reduce_scatter_tensor
    "invalid tensor size": _PAD,  # gloo, all_gather_into_tensor
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
_ALL_GATHER = ("all-gather the updated shards into the full flat vector (dist.all_gather_into_tensor) and copy it "
               "back into the parameters on every rank")


def _rank_error(results: list[Zero1CheckResult]) -> str | None:
    """One line for the error the learner's code raised first in any rank (None if none did)."""
    errors = [(r.error, r.rank) for r in results if r.error]
    if not errors:
        return None
    (first, rank) = min(errors, key=lambda er: (er[0].secondary, er[0].time))  # the cause, not the fallout
    text = f"{first.type}: {first.message}"
    same = sum(f"{e.type}: {e.message}" == text for e, _ in errors) == len(results)
    hint = next((h for needle, h in _ERROR_HINTS.items() if needle in text), "")
    message = f": {first.message.rstrip('.')}" if first.message else " (with no message)"
    return (f"your {first.where} raised {first.type}{'' if same else f' on rank {rank}'}{message}"
            + (f". Hint: {hint}" if hint else ""))


def _fmt(v) -> str:
    return f"({', '.join(map(str, v))})" if isinstance(v, (list, tuple)) else str(v)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _judge_zero1(results: list[Zero1CheckResult], tol: float = ZERO1_TOL) -> None:
    """Fail with the first problem the ranks' reports show (see :mod:`teraflops.workers.zero1_check`)."""
    error = _rank_error(results)
    if error:
        fail(error)
    r0 = results[0]
    n, psi, steps, hyper = r0.world_size, r0.psi, r0.steps, r0.hyper
    params = [torch.tensor(r.params, dtype=torch.float64) for r in results]
    ref, initial = (torch.tensor(t, dtype=torch.float64) for t in (r0.ref, r0.initial))
    if not all(torch.isfinite(p).all() for p in params):
        fail("after step() the parameters hold NaN or inf. Hint: AdamW divides by √v + eps: "
             "check that every rank's shard gets its gradient before the AdamW step")
    grad_left = max(r.grad_left for r in results)
    if grad_left > 0:
        fail(f"after zero_grad() the parameters still hold gradients (max |grad| {grad_left:.2e}), so the next "
             "backward() adds to them. Hint: set p.grad = None for every parameter in zero_grad()")
    if max(_max_diff(p, initial) for p in params) == 0:
        fail(f"after {steps} calls of step() the parameters have not changed: the update stayed in your shard. "
             f"Hint: {_ALL_GATHER}")
    spread, other = max((_max_diff(p, params[0]), r) for r, p in enumerate(params))
    if spread > tol:
        size = math.ceil(psi / n)
        own = [slice(r * size, min((r + 1) * size, psi)) for r in range(n)]
        others = [torch.ones(psi, dtype=torch.bool).index_fill_(0, torch.arange(psi)[own[r]], False) for r in range(n)]
        only_own = all(torch.equal(p[others[r]], initial[others[r]]) for r, p in enumerate(params))
        why = "each rank updated only its own shard" if only_own else "yet data parallelism keeps every replica identical"
        fail(f"after step() the ranks hold different parameters (max difference {spread:.2e} between rank 0 and "
             f"rank {other}): {why}. Hint: {_ALL_GATHER}")
    opts = [o for r in results for o in r.optimizers]
    err = _max_diff(params[0], ref)
    if err > tol:
        lead = f"after {steps} steps your parameters differ from DDP + AdamW by up to {err:.2e} (tolerance {tol:.0e})"
        kind = next((o.type for o in opts if o.torch and o.type != "AdamW"), None)
        if kind:
            extra = (": its weight_decay adds an L2 term to the gradient, AdamW decays the weights directly"
                     if kind == "Adam" else "")
            fail(f"{lead}; your shard's optimizer is torch.optim.{kind}{extra}. Hint: use torch.optim.AdamW")
        for o in opts:
            for k, want in hyper.items() if o.torch else ():
                got = getattr(o, k, None)
                if got is not None and (list(got) if isinstance(got, (list, tuple)) else got) != (
                        list(want) if isinstance(want, (list, tuple)) else want):
                    fail(f"{lead}: your AdamW has {k}={_fmt(got)}, but the check built your class with {k}={_fmt(want)}. "
                         "Hint: pass lr, betas, eps and weight_decay on to the AdamW")
        alt = {k: _max_diff(params[0], torch.tensor(v, dtype=torch.float64)) for k, v in r0.alt.items()}
        if alt["sum"] <= tol:
            fail(f"{lead}, and match DDP fed the sum of the gradients instead of their mean. Hint: "
                 f"reduce_scatter_tensor sums over the {n} ranks: divide the shard's gradient by the world size")
        if alt["double"] <= tol:
            fail(f"{lead}, and match DDP with the gradients divided by the world size twice. Hint: "
                 "reduce_scatter_tensor (SUM) then one division by the world size gives the mean")
        fail(f"{lead}. Hint: rank r owns elements [r·S, (r+1)·S) of the padded flat vector; it reduce-scatters "
             "the flat gradient (SUM), divides by the world size and steps AdamW (lr, betas, eps, weight_decay "
             "as given) on that shard only")
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
    comm = r0.comm
    scattered = sum(v for k, v in comm.items() if "reduce_scatter" in k or k == "reduce")
    if comm.get("all_reduce", 0) >= steps * psi and scattered < steps * psi:
        fail(f"your step() all-reduces the whole gradient ({comm['all_reduce'] // steps:,} elements a step), "
             "though each rank updates only its shard. Hint: dist.reduce_scatter_tensor hands each rank the sum "
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
    if not wrong:
        return
    got, want, c = wrong[0]
    hint = next((h for m, h in mistakes if all(m(*a[2]) == a[0] for a in answers)), None) or reveal(
        "your answers fit none of the usual mistakes", "the largest n with 4·L · 2(n−1)/n · tokens·hidden·dtype_bytes"
        " / bandwidth ≤ budget_s")
    fail(f"for {c[0]} tokens, hidden {c[1]}, {c[2]} layers, {c[3] / 1e9:g} GB/s, a {c[4] * 1e3:g} ms budget: "
         f"got degree {got}, expected {want}. Hint: {hint}")
