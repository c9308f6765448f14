"""A fused kernel: RMSNorm as one Triton kernel against the chain of eager PyTorch ops.

RMSNorm (Zhang and Sennrich, 2019, "Root Mean Square Layer Normalization", arXiv:1910.07467;
used in Llama, Mistral, Gemma, ...) scales each row ``x`` of length ``D`` by the inverse of its
root mean square and by a learned weight ``w`` of length ``D``::

    y = x / sqrt(mean(x²) + eps) * w

In eager PyTorch that is a chain of six kernels, and every one of them reads its inputs from HBM
and writes its output back (:func:`rmsnorm_eager` lists them). The arithmetic is trivial (a few
FLOPs per element), so the time is the bytes moved: the chain moves about 7 rows' worth of
memory per row of output, where a fused kernel that loads a row once, reduces it on chip and
writes the result once moves 2 (:func:`bytes_moved` counts both). On a GPU the fused kernel should
therefore be several times faster on large tensors; :func:`compare` measures it.

The kernel gives one program instance to each row and keeps the whole row on chip (registers),
so it handles rows of up to ``MAX_D`` elements; Triton's layer-norm tutorial shows the two-pass
variant for longer rows. All arithmetic is fp32 whatever the input dtype.

On a CPU-only machine ``teraflops`` runs the kernel in Triton's interpreter (NumPy, one program
instance at a time, fp32 only): the result is exact, but the time measures Python, not memory
traffic, and the "fused" kernel is hundreds of times slower than eager there. :func:`compare`
reports that time honestly and labels it.
"""

from __future__ import annotations

from teraflops import machine as _machine

_machine.configure_triton()  # TRITON_INTERPRET must be set before the @triton.jit below

import contextlib  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from teraflops.errors import DTypeError, ShapeError  # noqa: E402
from teraflops.model_definition.flash_triton import tensor_core_dtype
from teraflops.tables import table  # noqa: E402
from teraflops.timing import benchmark, format_seconds

__all__ = ["rmsnorm_triton", "rmsnorm_eager", "bytes_moved", "Traffic", "compare", "fused_table", "MAX_D"]

MAX_D = 65536  # longest row one program keeps on chip (64 K fp32 = 256 KiB of registers across warps)


@triton.jit
def rmsnorm_kernel(X, W, Y, stride_x, stride_y, D, eps, BLOCK_D: tl.constexpr):
    """One program = one row: load x (D elements) and w once, reduce on chip, store y once.

    Grid: ``(rows,)``. ``BLOCK_D`` is ``D`` rounded up to a power of two; the tail is masked.
    """
    row = tl.program_id(0).to(tl.int64)  # int64: rows * stride can pass 2**31 elements
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / D  # masked lanes are 0, so they add nothing
    inv_rms = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_rms * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dtype_name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def _check_inputs(x, weight) -> None:
    """Raise ShapeError/DTypeError, with a one-line message, unless x and weight are usable."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"rmsnorm_triton: {name} must be a torch.Tensor; got {type(t).__name__}")
    if x.dim() < 1:
        raise ShapeError("rmsnorm_triton: x must have at least one dimension (..., D); got a 0-D tensor")
    d = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != d:
        raise ShapeError(f"rmsnorm_triton: weight must have shape ({d},) to match x's last dimension; "
                         f"got {tuple(weight.shape)}. Hint: one weight per feature, torch.ones({d})")
    if d > MAX_D:
        raise ShapeError(f"rmsnorm_triton: rows of {d} elements are longer than MAX_D = {MAX_D}, which one "
                         "program keeps on chip. Hint: normalise over a shorter last dimension")
    if x.dtype != weight.dtype:
        raise DTypeError(f"rmsnorm_triton: x and weight must have the same dtype; got x {x.dtype}, "
                         f"weight {weight.dtype}. Hint: weight.to(x.dtype)")
    if x.device != weight.device:
        raise DTypeError(f"rmsnorm_triton: x and weight must be on the same device; got x on {x.device}, "
                         f"weight on {weight.device}")
    if _machine.triton_mode() == "interpreter":
        if x.dtype != torch.float32:
            raise DTypeError(f"rmsnorm_triton: {_dtype_name(x.dtype)} is not supported by the Triton "
                             f"interpreter on CPU: use torch.float32 (got {x.dtype})")
    else:
        if x.device.type != "cuda":
            raise DTypeError(f"rmsnorm_triton: the compiled Triton kernel needs CUDA tensors; got x on "
                             f"{x.device}: move x and weight to 'cuda'")
        if x.dtype not in _GPU_DTYPES:
            raise DTypeError(f"rmsnorm_triton: dtype must be torch.float16, torch.bfloat16 or "
                             f"torch.float32; got {x.dtype}")


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension in one fused Triton kernel.

    ``y = x / sqrt(mean(x², dim=-1) + eps) * weight``, computed in fp32 and stored in x's dtype;
    equal to :func:`rmsnorm_eager` and to ``torch.nn.functional.rms_norm(x, (D,), weight, eps)`` up
    to rounding.

    Args:
        x: tensor of shape (..., D), any number of leading dimensions, ``1 <= D <= MAX_D``.
            torch.float16, torch.bfloat16 or torch.float32 on a CUDA GPU; torch.float32 only in
            the Triton interpreter (CPU), which has no bf16.
        weight: shape (D,), same dtype and device as ``x``.
        eps: added to the mean square before the square root (Llama uses 1e-5 or 1e-6).

    Returns:
        ``y``: same shape, dtype and device as ``x``, contiguous.

    Raises:
        teraflops.errors.ShapeError: 0-D ``x``, a weight that is not ``(D,)``, or ``D > MAX_D``.
        teraflops.errors.DTypeError: not tensors, mixed dtypes or devices, a dtype other than
            fp16/bf16/fp32 on a GPU, anything but fp32 in the interpreter, or CPU tensors when the
            kernel is compiled for a GPU.

    Example:
        >>> dev = "cuda" if torch.cuda.is_available() else "cpu"
        >>> x = torch.randn(4, 1000, device=dev)
        >>> rmsnorm_triton(x, torch.ones(1000, device=dev)).shape
        torch.Size([4, 1000])
    """
    _check_inputs(x, weight)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.numel() and x2.stride(-1) != 1:
        x2 = x2.contiguous()  # the kernel walks a row with unit stride
    w = weight.contiguous()
    y = torch.empty_like(x2, memory_format=torch.contiguous_format)
    rows = x2.shape[0]
    if y.numel() == 0:
        return y.reshape(x.shape)
    block = triton.next_power_of_2(d)
    # warps per row: the heuristic of Triton's layer-norm tutorial (more warps for longer rows)
    warps = min(max(block // 256, 1), 8)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        rmsnorm_kernel[(rows,)](x2, w, y, x2.stride(0), y.stride(0), d, float(eps), BLOCK_D=block,
                                 num_warps=warps)
    return y.reshape(x.shape)


# The eager chain: one PyTorch op (one kernel launch, one round trip to memory) per line. Kept as
# a list so that bytes_moved() and rmsnorm_eager() describe the same ops.
EAGER_OPS = (
    ("x.pow(2)", "read x, write x² (R·D each)"),
    (".mean(-1, keepdim=True)", "read x² (R·D), write mean square (R)"),
    ("+ eps", "read R, write R"),
    ("torch.rsqrt", "read R, write R"),
    ("x * inv_rms", "read x (R·D) and inv_rms (R), write R·D"),
    ("* weight", "read R·D and weight (D), write y (R·D)"),
)


def rmsnorm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm as the chain of eager PyTorch ops a model written op by op runs (see ``EAGER_OPS``).

    Each line below is a separate kernel that reads its inputs from memory and writes a new
    tensor, all in x's dtype. Shapes: ``x`` (..., D), ``weight`` (D,) → same shape as ``x``.
    """
    mean_sq = x.pow(2).mean(-1, keepdim=True)
    inv_rms = torch.rsqrt(mean_sq + eps)
    return x * inv_rms * weight


@dataclass(frozen=True)
class Traffic:
    """Modelled bytes read and written from memory by the eager chain and by the fused kernel.

    Attributes:
        rows, d: R rows of D elements (R is the product of the leading dimensions).
        element_bytes: bytes per element of the dtype.
        eager_ops: ``(op, bytes read, bytes written)`` for each op of the eager chain.
        eager: total bytes of the eager chain.
        fused: total bytes of the fused kernel.
    """

    rows: int
    d: int
    element_bytes: int
    eager_ops: tuple
    eager: int
    fused: int

    @property
    def ratio(self) -> float:
        """eager / fused: how many times more bytes the chain moves."""
        return self.eager / self.fused if self.fused else float("nan")


def bytes_moved(shape, dtype=torch.float32) -> Traffic:
    """Bytes each implementation moves between memory and the chip: a model, not a measurement.

    With R rows of D elements and ``b`` bytes per element (x, weight, y and every intermediate in
    the same dtype), each eager op reads its inputs and writes its output once:

    ============================  =============  =========
    op                            read           written
    ============================  =============  =========
    ``x.pow(2)``                  R·D            R·D
    ``.mean(-1, keepdim=True)``   R·D            R
    ``+ eps``                     R              R
    ``torch.rsqrt``               R              R
    ``x * inv_rms``               R·D + R        R·D
    ``* weight``                  R·D + D        R·D
    ============================  =============  =========

    so the chain moves ``(7·R·D + 6·R + D) · b`` bytes and the fused kernel, which reads x and the
    weight once and writes y once, ``(2·R·D + D) · b``: about 3.5× fewer for wide rows. The model
    ignores caches (a GPU's L2 may hold a small intermediate between two kernels, so small tensors
    move fewer bytes than counted) and counts the weight once for the fused kernel (each program
    reads it, but from L2 after the first). Bandwidth = bytes / measured time.

    Args:
        shape: the shape of x, (..., D).
        dtype: a torch dtype (for its element size); default torch.float32.

    Returns:
        a :class:`Traffic`.

    Example:
        >>> bytes_moved((4, 1000)).eager, bytes_moved((4, 1000)).fused
        (116096, 36000)
    """
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise ShapeError(f"bytes_moved: shape must be (..., D) with sizes >= 0; got {shape}")
    d = shape[-1]
    r = math.prod(shape[:-1])
    b = torch.empty((), dtype=dtype).element_size()
    rd = r * d
    counts = ((rd, rd), (rd, r), (r, r), (r, r), (rd + r, rd), (rd + d, rd))
    ops = tuple((name, rd_ * b, wr * b) for (name, _), (rd_, wr) in zip(EAGER_OPS, counts))
    eager = sum(x + y for _, x, y in ops)
    return Traffic(rows=r, d=d, element_bytes=b, eager_ops=ops, eager=eager, fused=(2 * rd + d) * b)


def _time(fn, compiled: bool, min_run_time: float) -> float:
    """Seconds per call: triton.testing.do_bench on a GPU (median, after warm-up, with the L2 cache
    flushed between calls), teraflops.timing.benchmark (torch.utils.benchmark) on a CPU."""
    if compiled:
        return float(triton.testing.do_bench(fn, return_mode="median")) * 1e-3  # do_bench gives ms

    return benchmark(fn, min_run_time=min_run_time).median


def compare(shape=None, dtype=None, *, eps: float = 1e-6, library: bool = True,
            min_run_time: float = 0.2, seed: int = 0) -> list[dict]:
    """Time the eager chain, the fused Triton kernel and (``library``) ``F.rms_norm`` in one run.

    Args:
        shape: shape of x, (..., D). Default (16384, 4096) on a GPU, (256, 1000) on a CPU.
        dtype: default torch.bfloat16 on a GPU of sm80 or newer, torch.float16 on older GPUs (no
            native bf16), torch.float32 on a CPU (the interpreter's only dtype).
        eps: RMSNorm's epsilon.
        library: also time ``torch.nn.functional.rms_norm`` (PyTorch ≥ 2.4), PyTorch's own kernel.
        min_run_time: seconds of measurement per implementation on a CPU.
        seed: for the random x and weight.

    Returns:
        one dict per implementation: ``impl``, ``shape``, ``dtype``, ``mode`` ("compiled" or
        "interpreter"), ``bytes`` (modelled, :func:`bytes_moved`), ``time_s`` (measured median
        seconds per call), ``gb_per_s`` (modelled bytes / measured time, 1e9 bytes), ``speedup``
        (eager time / this time) and ``max_err`` (max |y - eager y|, the eager result computed in
        float64 as the reference).

    In the interpreter the fused kernel runs as Python, one row at a time: its time says nothing
    about memory traffic, and it is far slower than eager. The rows say so in ``mode``.
    """
    mode = _machine.triton_mode()
    compiled = mode == "compiled"
    device = "cuda" if compiled else "cpu"
    shape = tuple(shape) if shape is not None else ((16384, 4096) if compiled else (256, 1000))
    if dtype is None:  # bf16 where the GPU has it natively (sm80+), fp16 on older GPUs (a T4 emulates bf16)

        dtype = tensor_core_dtype(torch.cuda.get_device_capability()) if compiled else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device=device, dtype=dtype)
    ref = rmsnorm_eager(x.double(), w.double(), eps)
    traffic = bytes_moved(shape, dtype)

    impls = [("eager chain", lambda: rmsnorm_eager(x, w, eps), traffic.eager),
             ("fused Triton", lambda: rmsnorm_triton(x, w, eps), traffic.fused)]
    if library and hasattr(torch.nn.functional, "rms_norm"):
        impls.append(("F.rms_norm", lambda: torch.nn.functional.rms_norm(x, (shape[-1],), w, eps),
                      traffic.fused))
    rows = []
    for name, fn, nbytes in impls:
        err = (fn().double() - ref).abs().max().item() if x.numel() else 0.0
        t = _time(fn, compiled, min_run_time)
        rows.append(dict(impl=name, shape=shape, dtype=dtype, mode=mode, bytes=nbytes, time_s=t,
                         gb_per_s=nbytes / t / 1e9 if t > 0 else float("nan"), max_err=err))
    for r in rows:
        r["speedup"] = rows[0]["time_s"] / r["time_s"] if r["time_s"] > 0 else float("nan")
    return rows


def fused_table(rows: list[dict]) -> str:
    """The :func:`compare` rows as a text table: time, modelled MB, GB/s and speedup over eager."""
    out = table([(r["impl"], "x".join(map(str, r["shape"])), _dtype_name(r["dtype"]),
                  r["mode"] if r["impl"] == "fused Triton" else "PyTorch", format_seconds(r["time_s"]),
                  r["bytes"] / 1e6, r["gb_per_s"], r["speedup"], r["max_err"]) for r in rows],
                ["impl", "shape", "dtype", "runs as", "time", "MB (model)", "GB/s", "speedup", "max err"])
    if rows and rows[0]["mode"] == "interpreter":
        out += ("\nTriton interpreter (CPU): the fused kernel runs as NumPy, one row per program, so its time is "
                "Python overhead, not memory traffic; run on a GPU for the real comparison.")
    return out
