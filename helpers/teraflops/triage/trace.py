"""Reading a profiled step: the events of a Chrome trace, and each operator call's FLOPs and bytes.

:func:`load_trace` reads what ``torch.profiler.profile(record_shapes=True).export_chrome_trace(path)``
wrote (:func:`record` writes one), validated; :func:`is_collective` says which events are
communication; :func:`op_cost` estimates one operator call's work from its recorded shapes and dtypes.
:mod:`teraflops.triage.verdict` turns them into a verdict.

An operator's estimate comes from its ``Input Dims`` / ``Input type``; a range that is not an ``aten::``
operator (autograd nodes, hooks, ``record_function`` ranges) has none: its work is in the ``aten::``
operators it calls. FLOPs follow ``torch.utils.flop_counter`` (matmul family, SDPA kernels forward and
backward, halved when causal; elementwise ops count 0); bytes are the minimum traffic as in
:mod:`teraflops.model_definition.roofline`: tensor inputs plus an output estimate (matmul ``M·N``; SDPA
the query's shape; elementwise and reductions the largest input; in-place ops (``add_``) the first
input, which ``copy_``, ``fill_``… only write). Views and allocations move no bytes. A ``TensorList``
input has no dtype in the trace: 4 bytes per element is assumed.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

from teraflops.errors import CourseError
from teraflops.model_definition.profiling import METADATA_OPS

__all__ = ["TriageError", "DTYPE_BYTES", "COMM_CATEGORIES", "GEMM_KERNEL", "is_collective", "op_cost", "record",
           "load_trace"]

DTYPE_BYTES = {"double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
               "c10::complex<double>": 16, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "TensorList": 4}
COMM_CATEGORIES = ("cpu_op", "user_annotation", "kernel")  # event categories a collective is read from
_COLLECTIVE = re.compile(r"^(gloo|nccl):|^c10d::|record_param_comms|all_?reduce|all_?gather"
                         r"|reduce_?scatter|broadcast|all_?to_?all|barrier", re.IGNORECASE)
GEMM_KERNEL = re.compile(r"gemm|matmul|mma|cutlass|flash|attention|triton_tem", re.IGNORECASE)
_WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "to", "contiguous"}
_SDPA = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"}
_SDPA_BLHD = {"_flash_attention_forward", "_efficient_attention_forward"}  # (batch, seq, heads, dim)
# where an SDPA kernel's is_causal (custom_mask_type for the efficient forward: 1 or 2 is causal) sits
# among its arguments (native_functions.yaml), read from the trace's "Concrete Inputs"
_CAUSAL_ARG = {"_scaled_dot_product_flash_attention": 4, "_scaled_dot_product_flash_attention_for_cpu": 4,
               "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_cudnn_attention": 6,
               "_flash_attention_forward": 8, "_efficient_attention_forward": 9,
               "_scaled_dot_product_flash_attention_backward": 11,
               "_scaled_dot_product_flash_attention_for_cpu_backward": 7,
               "_scaled_dot_product_efficient_attention_backward": 11,
               "_scaled_dot_product_cudnn_attention_backward": 14, "_flash_attention_backward": 11,
               "_efficient_attention_backward": 14}
_SDPA_BACKWARD = {k for k in _CAUSAL_ARG if k.endswith("_backward")}  # (grad_out, query, key, value, ...)


class TriageError(CourseError, ValueError):
    """A trace or wait times that :func:`triage` cannot read; one line with a hint."""


def is_collective(name: str, cat: str = "cpu_op") -> bool:
    """Whether a trace event is communication: ``gloo:all_reduce``, ``nccl:all_reduce``,
    ``c10d::allreduce_``, ``record_param_comms``; never an ``aten::`` op. A GPU kernel (``cat``
    ``"kernel"``) only when it is NCCL's (``ncclDevKernel_AllReduce_…``)."""
    if cat == "kernel":
        return name.lower().startswith("nccl")
    return not name.startswith("aten::") and bool(_COLLECTIVE.search(name))


def _tensors(args: dict) -> list[tuple[tuple, int]]:
    """``(shape, bytes per element)`` of each tensor input of an op event (scalars dropped)."""
    out = []
    for d, t in zip(args.get("Input Dims", []), args.get("Input type", [])):
        if t in DTYPE_BYTES and isinstance(d, list):
            out += [(tuple(int(x) for x in shape), DTYPE_BYTES[t]) for shape in (d if t == "TensorList" else [d])]
    return out


def op_cost(name: str, args: dict) -> tuple[float, float]:
    """``(FLOPs, bytes)`` of one call of operator ``name`` (e.g. ``"aten::mm"``) from its trace event's
    ``args`` (``Input Dims``, ``Input type``; ``Concrete Inputs``: a causal SDPA kernel does half the
    FLOPs ``torch.utils.flop_counter`` counts), before children are subtracted; see the module docstring.
    Raises ``ValueError``, ``TypeError``, ``IndexError`` or ``AssertionError`` on shapes that do not fit."""
    from torch.utils import flop_counter as fc

    op = name.split("::")[-1]
    ts = _tensors(args)
    s = [shape for shape, _ in ts]
    if not name.startswith("aten::") or op in METADATA_OPS or op in _NO_TRAFFIC or not ts:
        return 0.0, 0.0
    big = max(ts, key=lambda t: math.prod(t[0]))  # elementwise ops and reductions: the largest input
    flops, out, out_size = 0, math.prod(big[0]), big[1]
    if op in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = s[op.startswith(("addmm", "baddbmm")):][:2]  # addmm(bias, a, b)
        flops = (fc.mm_flop if len(a) == 2 else fc.bmm_flop)(a, b)
        out, out_size = math.prod(a[:-1]) * b[-1], ts[0][1]
    elif op in ("matmul", "linear") and len(s) >= 2:  # counted when they are leaves (else children do it)
        a, b = s[0], (s[1] if op == "matmul" else s[1][::-1])  # linear: weight [N, K]
        batch = math.prod(np.broadcast_shapes(a[:-2], b[:-2])) if op == "matmul" else math.prod(a[:-2])
        m, n = (a[-2] if len(a) > 1 else 1), (b[-1] if len(b) > 1 else 1)
        flops, out, out_size = 2 * batch * m * n * a[-1], batch * m * n, ts[0][1]
    elif op in _SDPA or op in _SDPA_BLHD or op in _SDPA_BACKWARD:
        blhd = op in _SDPA_BLHD or op in ("_flash_attention_backward", "_efficient_attention_backward")
        x = [tuple(t[i] for i in (0, 2, 1, 3)) if blhd else t for t in s[:4]]
        if op in _SDPA_BACKWARD:  # writes the gradients of query, key and value
            g, q, k, v = x
            flops, out, out_size = fc.sdpa_backward_flop_count(g, q, k, v), math.prod(q) + math.prod(k) + math.prod(v), ts[1][1]
        else:
            q, k, v = x[:3]
            flops, out, out_size = fc.sdpa_flop_count(q, k, v), math.prod(q[:-1]) * v[-1], ts[0][1]
        concrete = args.get("Concrete Inputs") or []
        flag = concrete[_CAUSAL_ARG[op]] if len(concrete) > _CAUSAL_ARG[op] else ""
        if flag in ("True", "1", "2"):  # a causal kernel skips the masked half (Dao et al. count it so)
            flops /= 2
    elif op.endswith("_"):  # in place: the first input is also the output, read and written...
        out, out_size = (0 if op in _WRITE_ONLY else math.prod(s[0])), ts[0][1]  # ...or only written (copy_)
    return float(flops), float(sum(math.prod(x) * b for x, b in ts) + out * out_size)


def record(fn: Callable[[], object], path, warmup: int = 2) -> Path:
    """Call ``fn()`` ``warmup`` times, profile one more call with ``torch.profiler`` (CPU, plus CUDA
    when there is a GPU; ``record_shapes=True``) and write its Chrome trace to ``path``; returns it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, record_shapes=True) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return Path(path)


def load_trace(trace) -> tuple[list[dict], int | None]:
    """The complete events (``ph == "X"``) of a Chrome trace, and the rank that wrote it (the trace's
    ``distributedInfo``, ``None`` if absent). ``trace``: a path (``.json`` or ``.json.gz``), a loaded
    dict with ``traceEvents``, or a bare list of events. Raises :class:`TriageError`."""
    hint = "Hint: write one with teraflops.triage.verdict.record(fn, path) or prof.export_chrome_trace(path)"
    if isinstance(trace, (str, Path)):
        p = Path(trace)
        try:
            with open(p, "rb") as f:
                gz = f.read(2) == b"\x1f\x8b"  # gzip's magic number, whatever the file is called
            with (gzip.open(p, "rt") if gz else open(p)) as f:
                trace = json.load(f)
        except FileNotFoundError:
            raise TriageError(f"trace file not found: {p}. {hint}") from None
        except (ValueError, OSError, EOFError, zlib.error) as e:  # JSONDecodeError, UnicodeDecodeError, gzip
            raise TriageError(f"{p} is not a JSON trace ({' '.join(str(e).split())[:80]}). {hint}") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise TriageError(f"a Chrome trace is a dict with a 'traceEvents' list, got {type(trace).__name__}"
                          f"{' without traceEvents' if isinstance(trace, dict) else ''}. {hint}")
    out = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    for e in out:
        if not (number(e.get("ts")) and number(e.get("dur")) and e["dur"] >= 0 and isinstance(e.get("name"), str)
                and isinstance(e.get("args", {}), dict)):
            raise TriageError(f"malformed trace event {str(e)[:60]}: needs a name, finite numbers ts and dur >= 0 "
                              f"(µs) and args a dict. {hint}")
    if not any(e.get("cat") == "cpu_op" for e in out):
        raise TriageError(f"the trace has no operator events (cat 'cpu_op'; {len(out)} complete events). {hint}")
    info = trace.get("distributedInfo") if isinstance(trace, dict) else None
    return out, info.get("rank") if isinstance(info, dict) else None


