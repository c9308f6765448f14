"""Is it math, memory or framework overhead? Profile a step and give each operator a verdict.

Three library tools, one per column:

* time per operator: ``torch.profiler`` (self time on the CPU, or on the GPU when there is one),
  https://pytorch.org/docs/stable/profiler.html;
* FLOPs per operator: ``torch.utils.flop_counter.FlopCounterMode`` (matmul-family ops and
  attention; elementwise ops count 0 there). Its table has the GPU attention kernels; we map
  PyTorch's CPU flash-attention kernels to the same formulas;
* bytes per operator: a ``TorchDispatchMode`` that adds up the sizes of every tensor an aten
  operator reads and writes (inputs + outputs: the minimum traffic, as in
  :mod:`teraflops.model_definition.roofline`), and counts operator calls.

Verdict (:func:`classify`), per call of an operator, against the measured ceilings and the launch
floor: its ideal time is ``max(FLOPs / peak, bytes / bandwidth)`` (the roofline). If even that is
below the launch floor, fixed per-op cost dominates: **framework overhead**. Otherwise it is
**math**-bound when ``FLOPs / peak ≥ bytes / bandwidth`` and **memory**-bound when not.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from teraflops.ceilings import Ceilings
from teraflops.tables import table
from teraflops.timing import format_seconds

VERDICTS = ("math", "memory", "framework overhead")

# Ops that only re-describe memory (no kernel, no traffic): not counted as launches.
METADATA_OPS = {"view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "permute",
                 "unsqueeze", "squeeze", "reshape", "alias", "detach", "slice", "select",
                 "split", "split_with_sizes", "unbind", "_reshape_alias", "lift_fresh"}


def _op_name(func) -> str:
    return func.overloadpacket.__name__


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.nbytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = _op_name(func)
        if name not in METADATA_OPS:
            self.calls[name] += 1
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.nbytes[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


def count_ops(fn: Callable[[], object]) -> Counter:
    """Run ``fn()`` once and count the aten operators it dispatched (views and other
    metadata-only ops excluded): in eager mode, one per kernel launch, roughly."""
    with _OpRecorder() as rec:
        fn()
    return rec.calls


def classify(flops: float, nbytes: float, peak_flops: float, bandwidth: float, launch_floor: float) -> str:
    """Verdict for one operator call: ``"math"``, ``"memory"`` or ``"framework overhead"``.

    The verdict is about what *limits* the operator, so it uses its ideal (roofline) times, not its
    measured time: a measured time says how slow an op was, not why.

    Args:
        flops: FLOPs per call; nbytes: bytes moved per call.
        peak_flops: FLOP/s; bandwidth: bytes/s; launch_floor: seconds of the smallest op.
    """
    t_math = flops / peak_flops
    t_mem = nbytes / bandwidth
    if max(t_math, t_mem) < launch_floor:
        return "framework overhead"
    return "math" if t_math >= t_mem else "memory"


@dataclass(frozen=True)
class OpRow:
    name: str
    calls: int
    seconds: float  # total self time of all calls
    flops: float  # total
    nbytes: float  # total

    @property
    def intensity(self) -> float:
        return self.flops / self.nbytes if self.nbytes else float("nan")

    def verdict(self, c: Ceilings, launch_floor: float) -> str:
        n = max(self.calls, 1)
        return classify(self.flops / n, self.nbytes / n, c.peak_flops, c.bandwidth, launch_floor)


# SDPA's aten kernels (CPU flash, CUDA flash / efficient / cuDNN), forward and backward
_SDPA_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _attention_flops() -> dict:
    """FlopCounterMode formulas for SDPA's aten kernels, counted the course's one way: torch's own
    SDPA counts (``sdpa_flop_count``, ``sdpa_backward_flop_count``: the two matmuls of each pass),
    halved when the kernel is causal, as FlashAttention-2 counts (Dao 2023, arXiv:2307.08691, §4.1;
    :func:`teraflops.model_definition.flash_triton.flops`, and :mod:`teraflops.triage.verdict` for traces). Torch's table counts
    a causal kernel as full and has no entry for the CPU kernels. The kernels take the same leading
    arguments (query, key, value; backward: grad_out first); ``is_causal`` is found by its name in
    each op's schema."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def formula(op, count, backward):
        names = [a.name for a in op.default._schema.arguments]

        def flops(*args, **kwargs):
            causal = bool(kwargs.get("is_causal", dict(zip(names, args)).get("is_causal", False)))
            n = count(*args[:4]) if backward else count(*args[:3])
            return n // 2 if causal else n
        return flops

    mapping = {}
    for name in _SDPA_KERNELS:
        for suffix, count, backward in (("", fc.sdpa_flop_count, False),
                                        ("_backward", fc.sdpa_backward_flop_count, True)):
            op = getattr(aten, name + suffix, None)
            if op is not None:
                mapping[op] = formula(op, count, backward)
    return mapping


def profile_ops(fn: Callable[[], object], device: str, warmup: int = 2) -> list[OpRow]:
    """Profile one call of ``fn`` (after ``warmup`` calls) and return one row per aten operator,
    sorted by total self time (GPU time on CUDA, CPU time otherwise)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    for _ in range(warmup):
        fn()
    rec = _OpRecorder()
    flop_mode = FlopCounterMode(display=False, custom_mapping=_attention_flops())
    with flop_mode, rec:
        fn()
    flops = defaultdict(float)
    for op, n in flop_mode.get_flop_counts().get("Global", {}).items():
        flops[getattr(op, "__name__", str(op))] += n
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    times = {}
    for evt in prof.key_averages():
        if evt.key.startswith("aten::"):
            # On a GPU an op's kernels may be launched by a child op (SDPA → _flash_attention_forward):
            # the recorded ops never nest in one another, so their inclusive device time is theirs.
            us = evt.device_time_total if device == "cuda" else evt.self_cpu_time_total
            times[evt.key[len("aten::"):]] = us * 1e-6
    rows = [OpRow(name, calls, times.get(name, 0.0), flops.get(name, 0.0), rec.nbytes[name])
            for name, calls in rec.calls.items()]
    return sorted(rows, key=lambda r: r.seconds, reverse=True)


def ops_table(rows: list[OpRow], c: Ceilings, launch_floor: float, top: int = 12) -> str:
    """Top operators: calls, time, GFLOP, MB (1e6 bytes), FLOP/byte and verdict."""
    total = sum(r.seconds for r in rows) or 1.0
    body = [(r.name, r.calls, format_seconds(r.seconds), f"{100 * r.seconds / total:.0f}%", r.flops / 1e9,
             r.nbytes / 1e6, r.intensity, r.verdict(c, launch_floor)) for r in rows[:top]]
    return table(body, ["operator", "calls", "self time", "share", "GFLOP", "MB", "FLOP/byte", "verdict"])
