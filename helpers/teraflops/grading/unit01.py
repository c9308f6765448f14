"""Checks for Unit 1 (Model definition). Each takes the learner's function and nothing else.

References: :mod:`teraflops.roofline` (intensities), :mod:`teraflops.attention` (SDPA as the
reference attention), :mod:`teraflops.profiling` (the verdict rule).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import roofline
from ..machine import detect, triton_mode
from ..profiling import classify, count_ops
from .core import exercise, expect_tensor, fail, max_error

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-30)


def _number(what: str, got) -> float:
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        fail(f"{what} should return a number (FLOP per byte), got {type(got).__name__}")
    return float(got)


@exercise(1, "arithmetic intensity of a matmul")
def matmul_intensity(fn) -> None:
    """``fn(m, n, k, dtype) -> float``: FLOP/byte of ``(m×k) @ (k×n)`` with minimum traffic."""
    for m, n, k, dtype in [(4096, 4096, 4096, torch.float32), (1, 8192, 8192, torch.bfloat16),
                           (128, 512, 256, torch.float16), (64, 64, 2048, torch.float32)]:
        got = _number("matmul_intensity", fn(m, n, k, dtype))
        want = roofline.matmul_intensity(m, n, k, dtype)
        if _close(got, want):
            continue
        s = roofline.bytes_per_element(dtype)
        case = f"for m={m}, n={n}, k={k}, {dtype}: got {got:.4g}, expected {want:.4g} FLOP/byte"
        if _close(got, want * s):
            fail(f"{case}. Hint: you counted elements, not bytes; multiply by the element size ({s} bytes)")
        if _close(got, want / 2):
            fail(f"{case}. Hint: one multiply-add is 2 FLOPs, so a matmul does 2·m·n·k")
        if _close(got, 2 * m * n * k / ((m * k + k * n) * s)):
            fail(f"{case}. Hint: the output C (m×n) has to be written too")
        fail(f"{case}. Hint: FLOPs = 2·m·n·k; bytes = (m·k + k·n + m·n) × bytes per element")


@exercise(2, "arithmetic intensity of softmax")
def softmax_intensity(fn) -> None:
    """``fn(rows, cols, dtype) -> float``: 5 FLOPs per element over 2 elements moved."""
    for rows, cols, dtype in [(4096, 4096, torch.float32), (32, 50257, torch.bfloat16), (1, 128, torch.float16)]:
        got = _number("softmax_intensity", fn(rows, cols, dtype))
        want = roofline.softmax_intensity(rows, cols, dtype)
        if _close(got, want):
            continue
        s = roofline.bytes_per_element(dtype)
        case = f"for {rows}×{cols} {dtype}: got {got:.4g}, expected {want:.4g} FLOP/byte"
        if _close(got, want * s):
            fail(f"{case}. Hint: you counted elements, not bytes; multiply by the element size ({s} bytes)")
        if _close(got, want * 2):
            fail(f"{case}. Hint: the output is written once too: bytes = 2 × elements × element size")
        fail(f"{case}. Hint: count 5 FLOPs per element (max, subtract, exp, sum, divide); "
             "read the input once, write the output once")


def _qkv(shape, dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=dtype) * scale for _ in range(3))


@exercise(3, "naive attention")
def naive_attention(fn) -> None:
    """``fn(q, k, v) -> out``: softmax(q kᵀ/√d) v for (B, H, N, d); must not call SDPA."""
    for shape, scale in [((2, 3, 64, 32), 1.0), ((1, 2, 33, 16), 1.0), ((1, 1, 16, 64), 8.0)]:
        q, k, v = _qkv(shape, scale=scale)
        ops = count_ops(lambda: fn(q, k, v))
        if any("scaled_dot_product" in op for op in ops):
            fail("it calls scaled_dot_product_attention; this exercise builds attention by hand "
                 "(matmul, softmax, matmul) so you can measure what it materialises")
        out = expect_tensor("output", fn(q, k, v), shape, q.dtype)
        want = F.scaled_dot_product_attention(q, k, v)
        err = max_error(out, want)
        if err <= 1e-5:
            continue
        d = shape[-1]
        if math.isnan(err):
            fail(f"output has NaN or inf for inputs of magnitude ~{scale}. Hint: exp overflows; "
                 "subtract the row maximum before exp (or use torch.softmax)")
        unscaled = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
        if max_error(out, unscaled) <= 1e-5:
            fail(f"max error {err:.2e} against SDPA. Hint: scale the scores by 1/√d = 1/√{d} before the softmax")
        wrong_dim = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), -2) @ v
        if max_error(out, wrong_dim) <= 1e-5:
            fail(f"max error {err:.2e} against SDPA. Hint: the softmax runs over the keys, the last dimension (dim=-1)")
        fail(f"max error {err:.2e} against SDPA for shape {shape} (tolerance 1e-5). "
             "Hint: scores = q @ kᵀ / √d, softmax over the last dim, then @ v")


@exercise(4, "online softmax")
def online_softmax(fn) -> None:
    """``fn(x, block_size) -> softmax(x, dim=-1)`` computed one block of columns at a time."""
    g = torch.Generator().manual_seed(1)
    cases = [
        ("rising rows", torch.linspace(-5, 20, 100).repeat(3, 1), 16),  # the max changes in every block
        ("random", torch.randn(4, 257, generator=g), 64),
        ("block of one", torch.randn(2, 9, generator=g), 1),
        ("block wider than the row", torch.randn(2, 10, generator=g), 32),
        ("large values", torch.randn(3, 130, generator=g) * 1000, 32),
    ]
    for name, x, block in cases:
        out = expect_tensor(f"output ({name})", fn(x.clone(), block), tuple(x.shape), x.dtype)
        err = max_error(out, torch.softmax(x, -1))
        if err <= 1e-6:
            continue
        if math.isnan(err):
            fail(f"NaN/inf on '{name}' (block_size={block}). Hint: exp(x - m) with m the running maximum "
                 "never overflows; start m at -inf and l at 0")
        fail(f"max error {err:.2e} on '{name}' (block_size={block}). Hint: when a block raises the running "
             "max from m to m_new, rescale the running sum: l = l·exp(m − m_new) + Σ exp(x_block − m_new)")


@exercise(5, "FlashAttention forward kernel in Triton")
def flash_attention(fn) -> None:
    """``fn(q, k, v) -> out`` built on the learner's Triton kernel; compared with SDPA.

    fp32 within 1e-5 under the interpreter (CPU); fp16 within 2e-3 when compiled on a GPU.
    """
    interp = triton_mode() == "interpreter"
    device = "cpu" if interp else detect().device
    dtype, tol = (torch.float32, 1e-5) if interp else (torch.float16, 2e-3)
    for shape in [(1, 2, 128, 32), (2, 1, 100, 16)]:
        q, k, v = (t.to(device) for t in _qkv(shape, dtype))
        out = expect_tensor("output", fn(q, k, v), shape, dtype)
        err = max_error(out, F.scaled_dot_product_attention(q, k, v))
        if math.isnan(err):
            fail(f"output has NaN/inf for shape {shape}. Hint: mask out-of-range keys with -inf *before* "
                 "the row max, and rows beyond N must not be stored")
        if err > tol:
            fail(f"max error {err:.2e} against SDPA for shape {shape} (tolerance {tol:g}). Hint: rescale acc "
                 "and l by alpha = exp(m_old − m_new) before adding the new tile, and divide by l once at the end")


# Cases for Exercise 6 on an imaginary GPU: 100 TFLOP/s, 2 TB/s, 5 µs launch floor.
_PEAK, _BW, _FLOOR = 100e12, 2e12, 5e-6
_CLASSIFY_CASES = [
    ("8192³ matmul", 2 * 8192**3, 3 * 8192**2 * 2, 0.012, "a large square matmul reuses each byte thousands of times"),
    ("add of 2^28 elements", 2**28, 3 * 2**28 * 2, 0.0008, "one FLOP per 6 bytes is far left of the ridge point"),
    ("GEMV 1×8192 @ 8192×8192", 2 * 8192**2, (8192 + 8192**2 + 8192) * 2, 7e-5, "a matrix-vector product reads every weight once for 2 FLOPs"),
    ("add of 1024 elements", 1024, 3 * 1024 * 2, 6e-6, "its ideal time (ns) is far below the 5 µs launch floor"),
    ("64×64 matmul", 2 * 64**3, 3 * 64**2 * 2, 7e-6, "even a compute-heavy op is launch-bound when it is tiny"),
]


@exercise(6, "math, memory or framework overhead")
def classify_op(fn) -> None:
    """``fn(flops, nbytes, seconds, peak_flops, bandwidth, launch_floor) -> "math" | "memory" | "framework overhead"``."""
    for name, flops, nbytes, seconds, why in _CLASSIFY_CASES:
        want = classify(flops, nbytes, seconds, _PEAK, _BW, _FLOOR)
        got = fn(flops, nbytes, seconds, _PEAK, _BW, _FLOOR)
        if got not in ("math", "memory", "framework overhead"):
            fail(f"returned {got!r} for {name}; return one of 'math', 'memory', 'framework overhead'")
        if got != want:
            fail(f"{name} on a 100 TFLOP/s, 2 TB/s GPU with a 5 µs floor: you said {got!r}, it is {want!r} "
                 f"({why}). Hint: compare FLOPs/peak with bytes/bandwidth, and both with the launch floor")
