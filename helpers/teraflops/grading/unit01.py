"""Checks for Unit 1 (Model definition). Each takes the learner's function and nothing else.

References: :mod:`teraflops.model_definition.roofline` (intensities), :mod:`teraflops.model_definition.attention` (SDPA as the
reference attention), :mod:`teraflops.model_definition.profiling` (the verdict rule).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from teraflops.model_definition import roofline
from teraflops.model_definition.profiling import classify, count_ops
from teraflops.grading.core import (check_cases, close, exercise, expect_tensor, fail, kernel_setting, max_error,
    reveal)

def _size(dtype) -> int:
    return roofline.bytes_per_element(dtype)


def _byte_mistakes(denominator: str) -> list:
    """Mistakes in the byte count, common to both intensity exercises, as (holds, hint) pairs;
    ``holds(got, want, dtype, shape)``."""
    return [
        (lambda g, w, d, s: close(g, w * _size(d)),
         f"you counted elements, not bytes: the denominator is {denominator} × bytes per element of the dtype"),
        *[(lambda g, w, d, s, b=b: close(g, w * _size(d) / b), f"you used {b} bytes per element for every dtype: "
           "take it from the dtype (torch.empty((), dtype=dtype).element_size())") for b in (1, 2, 4, 8)],
    ]


def _check_intensity(fn, what: str, shapes, reference, mistakes, default_hint: str) -> None:
    """:func:`~.core.check_cases` over ``shapes`` (their last item is the dtype); ``mistakes`` hold
    as ``holds(got, want, dtype, shape)``."""
    check_cases(fn, what, "FLOP per byte", shapes, reference,
                [(lambda g, w, s, holds=holds: holds(g, w, s[-1], s), hint) for holds, hint in mistakes], default_hint,
                lambda s: f"{'×'.join(str(x) for x in s[:-1])} {s[-1]}",
                lambda got, want: f"got {got:.4g}, expected {want:.4g} FLOP/byte")


@exercise(1, "arithmetic intensity of a matmul")
def matmul_intensity(fn) -> None:
    """``fn(m, n, k, dtype) -> float``: FLOP/byte of ``(m×k) @ (k×n)`` with minimum traffic."""
    shapes = [(4096, 4096, 4096, torch.float32), (1, 8192, 8192, torch.bfloat16),
              (128, 512, 256, torch.float16), (64, 64, 2048, torch.float32)]
    mistakes = _byte_mistakes("(m·k + k·n + m·n)") + [
        (lambda g, w, d, s: close(g, w / 2), "one multiply-add is 2 FLOPs, so a matmul does 2·m·n·k"),
        (lambda g, w, d, s: close(g, 2 * s[0] * s[1] * s[2] / ((s[0] * s[2] + s[2] * s[1]) * _size(d))),
         "the output C (m×n) has to be written too"),
    ]
    _check_intensity(fn, "matmul_intensity", shapes, roofline.matmul_intensity, mistakes,
                     "FLOPs = 2·m·n·k; bytes = (m·k + k·n + m·n) × bytes per element")


@exercise(2, "arithmetic intensity of softmax")
def softmax_intensity(fn) -> None:
    """``fn(rows, cols, dtype) -> float``: 5 FLOPs per element over 2 elements moved."""
    shapes = [(4096, 4096, torch.float32), (32, 50257, torch.bfloat16), (1, 128, torch.float16)]
    mistakes = _byte_mistakes("2 × rows × cols") + [
        (lambda g, w, d, s: close(g, w * 2), "the output is written once too: bytes = 2 × elements × element size"),
    ]
    _check_intensity(fn, "softmax_intensity", shapes, roofline.softmax_intensity, mistakes,
                     "count 5 FLOPs per element (max, subtract, exp, sum, divide); read the input once, "
                     "write the output once")


def _qkv(shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=dtype) * scale for _ in range(3))


def _attention64(q, k, v, dim=-1, scale=True):
    """fp64 reference attention (or a plausible mistake: no scale, softmax over the wrong dim)."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if scale else 1.0)
    return torch.softmax(s, dim) @ v


def _tolerance(v: torch.Tensor) -> float:
    """fp32 rounding of a correct answer grows with the values: 2e-5 × max|v| (≥ 1e-5)."""
    return max(1e-5, 2e-5 * v.abs().max().item())


@exercise(3, "naive attention")
def naive_attention(fn) -> None:
    """``fn(q, k, v) -> out``: softmax(q kᵀ/√d) v for (B, H, N, d); must not call SDPA.

    Compared with an fp64 reference (tolerance :func:`_tolerance`); each call gets fresh copies of
    the inputs, so an in-place change of q, k or v cannot leak into the next call.
    """
    for shape, scale in [((2, 3, 64, 32), 1.0), ((1, 2, 33, 16), 1.0), ((1, 1, 16, 64), 8.0)]:
        q, k, v = _qkv(shape, scale=scale)
        ops = count_ops(lambda: fn(q.clone(), k.clone(), v.clone()))
        if any("scaled_dot_product" in op for op in ops):
            fail("it calls scaled_dot_product_attention; this exercise builds attention by hand "
                 "(matmul, softmax, matmul) so you can measure what it materialises")
        out = expect_tensor("output", fn(q.clone(), k.clone(), v.clone()), shape, q.dtype)
        err, tol = max_error(out, _attention64(q, k, v)), _tolerance(v)
        if err <= tol:
            continue
        d = shape[-1]
        if math.isnan(err):
            fail(f"output has NaN or inf for inputs of magnitude ~{scale}. Hint: exp overflows; "
                 "subtract the row maximum before exp (or use torch.softmax)")
        if max_error(out, _attention64(q, k, v, scale=False)) <= tol:
            fail(f"max error {err:.2e} against the reference. Hint: scale the scores by 1/√d = 1/√{d} before the softmax")
        if max_error(out, _attention64(q, k, v, dim=-2)) <= tol:
            fail(f"max error {err:.2e} against the reference. Hint: the softmax runs over the keys, the last dimension (dim=-1)")
        fail(f"max error {err:.2e} against the reference for shape {shape} (tolerance {tol:.1e}). "
             f"Hint: {reveal('compare each step with the exercise text: the scores, their softmax and the product with v', 'scores = q @ kᵀ / √d, softmax over the last dim, then @ v')}")


naive_attention.__wrapped__.hints = {
    "must match the size": "q @ kᵀ needs k.transpose(-2, -1); on a 4-D tensor .T reverses all four dims",
    "cannot be multiplied": "q @ kᵀ needs k.transpose(-2, -1) (keys' last two dims swapped)",
    "Expected size for first two dimensions": "q @ kᵀ needs k.transpose(-2, -1): multiply q by the keys with their last two dims swapped",
}


class _WideReductions(torch.overrides.TorchFunctionMode):
    """Watches a learner's online softmax for reductions that read a whole row at once.

    A reduction (max, sum, logsumexp, sort, ...) over the last dim counts as *wide* when that dim
    is longer than ``block`` and its input is a view of ``x`` itself, or (for ``block > 1``) any
    tensor as wide as a row of ``x``. Reductions over per-row statistics (the running m and l,
    or per-block results stacked together) never count. Also notes any softmax call.
    """

    REDUCTIONS = {"max", "amax", "sum", "nansum", "mean", "logsumexp", "special_logsumexp", "cumsum",
                  "cummax", "logcumsumexp", "topk", "sort", "kthvalue", "norm", "vector_norm"}

    def __init__(self, x: torch.Tensor, block: int):
        super().__init__()
        self.x_storage = x.untyped_storage().data_ptr()
        self.cols, self.block = x.shape[-1], block
        self.widest = 0
        self.softmax = False

    def _reduces_last_dim(self, t: torch.Tensor, args, kwargs) -> bool:
        dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.Tensor) else None)
        if dim is None:
            return True  # a full reduction
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        return any(d % t.dim() == t.dim() - 1 for d in dims if isinstance(d, int))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if "softmax" in name:
            self.softmax = True
        t = args[0] if args else kwargs.get("input")
        binary = len(args) > 1 and isinstance(args[1], torch.Tensor)  # torch.max(a, b) is elementwise
        if name in self.REDUCTIONS and isinstance(t, torch.Tensor) and t.dim() > 0 and not binary:
            width = t.shape[-1]
            of_x = t.untyped_storage().data_ptr() == self.x_storage
            row_wide = self.block > 1 and width == self.cols
            if width > self.block and (of_x or row_wide) and self._reduces_last_dim(t, args, kwargs):
                self.widest = max(self.widest, width)
        return func(*args, **kwargs)


@exercise(4, "online softmax")
def online_softmax(fn) -> None:
    """``fn(x, block_size) -> softmax(x, dim=-1)`` computed one block of columns at a time.

    Besides the values, checks that no max/sum reduction spans more than ``block_size`` columns.
    """
    g = torch.Generator().manual_seed(1)
    cases = [
        ("rising rows", torch.linspace(-5, 20, 100).repeat(3, 1), 16),  # the max changes in every block
        ("random", torch.randn(4, 257, generator=g), 64),
        ("block of one", torch.randn(2, 9, generator=g), 1),
        ("block wider than the row", torch.randn(2, 10, generator=g), 32),
        ("large values", torch.randn(3, 130, generator=g) * 1000, 32),
        ("very negative rows", torch.randn(3, 70, generator=g) * 10 - 200, 16),  # exp(x - 0) underflows to 0
    ]
    for name, x, block in cases:
        x_in = x.clone()
        with _WideReductions(x_in, block) as seen:
            got = fn(x_in, block)
        if seen.softmax:
            fail("it calls softmax; compute it yourself from a running max and a running sum")
        if seen.widest:
            fail(f"on '{name}' a max or sum read {seen.widest} columns at once, but block_size={block}: "
                 "read x one block of columns at a time (x[..., start:start + block_size])")
        out = expect_tensor(f"output ({name})", got, tuple(x.shape), x.dtype)
        want = torch.softmax(x.double(), -1)
        err = max_error(out, want)
        # fp32 rounding of a correct answer: x − m loses up to one ulp of |x| (1.5e-5 near 200)
        if not math.isnan(err) and ((out.double() - want).abs() <= 1e-6 + 3e-5 * want.abs()).all():
            continue
        if math.isnan(err):
            fail(f"NaN/inf on '{name}' (block_size={block}). Hint: exp(x - m) with m the running maximum "
                 "never overflows, and never divides 0 by 0; start m at -inf and l at 0")
        fail(f"max error {err:.2e} on '{name}' (block_size={block}). Hint: " + reveal(
            "when a block raises the running max, the sum so far was taken against the old max and must be rescaled",
            "l = l·exp(m − m_new) + Σ exp(x_block − m_new); start m at -inf, not 0"))


_TORCH_MATH = {"mm", "bmm", "addmm", "baddbmm", "matmul", "_softmax", "softmax", "exp", "div", "mul"}

_KERNEL_HINTS = {
    "must be Tensor, not tensor": "inside a @triton.jit kernel use triton.language (tl.exp, tl.max, tl.sum), not torch",
    "incompatible dimensions": "check the tl.dot shapes: (BLOCK_M, D) @ (D, BLOCK_N) for the scores, "
                               "(BLOCK_M, BLOCK_N) @ (BLOCK_N, D) for p @ v",
}


@exercise(5, "FlashAttention forward kernel in Triton")
def flash_attention(fn) -> None:
    """``fn(q, k, v) -> out`` built on the learner's Triton kernel; compared with SDPA.

    fp32 within 1e-5 under the interpreter (CPU); fp16 within 2e-3 when compiled on a GPU.
    """
    device, dtype, tol = kernel_setting()
    # N=300 spans several key tiles for any block size a kernel would use (the rescale matters).
    for shape in [(1, 2, 128, 32), (2, 1, 100, 16), (1, 1, 300, 16)]:
        q, k, v = (t.to(device) for t in _qkv(shape, dtype))
        fn(q, k, v)  # first call: compiling and autotuning may run torch ops of their own
        ops = count_ops(lambda: fn(q, k, v))
        torch_math = sorted(op for op in ops if op in _TORCH_MATH or "scaled_dot_product" in op)
        if torch_math:
            fail(f"the attention math ran in PyTorch ({', '.join(torch_math)}), not in your Triton kernel: "
                 "flash_attention should only allocate the output and launch attention_kernel")
        out = expect_tensor("output", fn(q, k, v), shape, dtype)
        want = F.scaled_dot_product_attention(q, k, v)
        err = max_error(out, want)
        if math.isnan(err):
            fail(f"output has NaN/inf for shape {shape}. Hint: mask out-of-range keys with -inf *before* "
                 "the row max, and rows beyond N must not be stored")
        if err > tol:
            rows = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(shape[-1])
            unnormalised = torch.exp(rows - rows.amax(-1, keepdim=True)) @ v.float()
            if max_error(out, unnormalised) <= 100 * tol:
                fail(f"max error {err:.2e} against SDPA for shape {shape}: the output is not normalised. "
                     "Hint: divide acc by l once, after the loop")
            fail(f"max error {err:.2e} against SDPA for shape {shape} (tolerance {tol:g}). Hint: " + reveal(
                "acc and l were summed against the old running max: rescale both when a tile raises it",
                "multiply acc and l by alpha = exp(m_old − m_new) before adding the new tile, and divide by l once at the end"))


flash_attention.__wrapped__.hints = _KERNEL_HINTS


# Cases for Exercise 6: (name, FLOPs, bytes, (peak FLOP/s, bandwidth B/s, launch floor s), why).
_GPU = (100e12, 2e12, 5e-6)  # an imaginary GPU: 100 TFLOP/s, 2 TB/s, 5 µs floor
_CPU = (1e11, 1e10, 2e-6)  # a CPU-like machine: 100 GFLOP/s, 10 GB/s, 2 µs floor
_CLASSIFY_CASES = [
    ("8192³ matmul on a GPU", 2 * 8192**3, 3 * 8192**2 * 2, _GPU, "a large square matmul reuses each byte thousands of times"),
    ("add of 2^28 elements on a GPU", 2**28, 3 * 2**28 * 2, _GPU, "one FLOP per 6 bytes is far left of the ridge point"),
    ("GEMV 1×8192 @ 8192×8192 on a GPU", 2 * 8192**2, (8192 + 8192**2 + 8192) * 2, _GPU,
     "a matrix-vector product reads every weight once for 2 FLOPs"),
    ("add of 1024 elements on a GPU", 1024, 3 * 1024 * 2, _GPU, "its ideal time (ns) is far below the 5 µs launch floor"),
    ("64×64 matmul on a GPU", 2 * 64**3, 3 * 64**2 * 2, _GPU, "even a compute-heavy op is launch-bound when it is tiny"),
    ("add of 10^5 elements on a CPU", 10**5, 3 * 10**5 * 4, _CPU,
     "1.2 MB at 10 GB/s is 120 µs, far above a 2 µs floor, though it is only 10^5 FLOPs"),
    ("add of 65,536 elements on a CPU", 65536, 3 * 65536 * 4, _CPU, "0.8 MB at 10 GB/s is 79 µs: memory, not overhead"),
    ("matmul at the ridge point on a CPU", 2 * 10**9, 2 * 10**8, _CPU, "FLOPs/peak equals bytes/bandwidth: count a tie as math"),
    ("op just above the floor on a CPU", 10, 25_000, _CPU, "its ideal time, 2.5 µs, is above the 2 µs floor"),
    ("small balanced op on a CPU", 150_000, 15_000, _CPU,
     "1.5 µs of math and 1.5 µs of memory overlap: the ideal time is the larger, 1.5 µs, not their sum"),
]


@exercise(6, "math, memory or framework overhead")
def classify_op(fn) -> None:
    """``fn(flops, nbytes, peak_flops, bandwidth, launch_floor) -> "math" | "memory" | "framework overhead"``."""
    for name, flops, nbytes, (peak, bw, floor), why in _CLASSIFY_CASES:
        want = classify(flops, nbytes, peak, bw, floor)
        got = fn(flops, nbytes, peak, bw, floor)
        if got not in ("math", "memory", "framework overhead"):
            fail(f"returned {got!r} for {name}; return one of 'math', 'memory', 'framework overhead'")
        if got != want:
            fail(f"{name} (peak {peak:.0e} FLOP/s, {bw:.0e} B/s, floor {floor * 1e6:g} µs): you said {got!r}, "
                 f"it is {want!r} ({why}). Hint: compare FLOPs/peak with bytes/bandwidth, and the larger with the floor")
