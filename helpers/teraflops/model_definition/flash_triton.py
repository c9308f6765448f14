"""The course's FlashAttention kernels, forward and backward, written in Triton.

Standard attention computes ``S = Q Kᵀ``, ``P = softmax(S)`` and ``O = P V`` as three separate
passes, so the N×N matrices ``S`` and ``P`` are written to and read back from HBM: its HBM traffic
is Θ(N·d + N²) elements per head. FlashAttention (Dao, Fu, Ermon, Rudra and Ré, 2022,
"FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", arXiv:2205.14135,
Algorithm 1) never forms them. Each program instance here:

1. loads one tile of ``BLOCK_M`` query rows into on-chip memory (registers and shared memory),
   where it stays for the whole kernel;
2. loops over the keys and values in tiles of ``BLOCK_N`` rows. For each tile it computes the
   scores ``s = q kᵀ · scale``, updates a running row maximum ``m`` and a running row sum
   ``l = Σ exp(s - m)``, rescales the output accumulator by ``exp(m_old - m_new)`` and adds
   ``exp(s - m_new) · v``. This is the online softmax of Milakov and Gimelshein (2018, "Online
   normalizer calculation for softmax", arXiv:1805.02867): the result is exact, not approximate;
3. divides the accumulator by ``l`` and writes its tile of ``O`` to HBM once, together with the
   log-sum-exp ``m + log l`` of each row (what a backward pass needs to recompute ``P``).

With on-chip memory (SRAM) of M elements, Theorem 2 of the paper counts Θ(N²·d²/M) HBM accesses
per head, against Θ(N·d + N²) for standard attention: for typical head dimensions (d = 64 to 128)
and SRAM (around 100 KB per streaming multiprocessor), d² is many times smaller than M, so many
times fewer bytes move, and the N×N matrices never occupy memory at all.

This kernel uses the loop order of FlashAttention-2 (Dao 2023, arXiv:2307.08691): query tiles in
the outer, parallel loop and key/value tiles in the inner loop, so each tile of O is written
once. Algorithm 1 of the first paper nests the loops the other way round; the arithmetic is the
same.

Implementation notes:

* ``exp2`` is cheaper than ``exp`` on a GPU, so the scale is multiplied by log2(e) once and the
  running maximum is kept in base-2 units; the log-sum-exp is converted back to natural log.
* Accumulators (``m``, ``l``, ``acc``) are fp32 whatever the input dtype.
* With ``causal=True`` the key loop stops at the query tile's diagonal block: the tiles
  strictly below the diagonal need no mask, and only the diagonal tile is masked.
* Sequence lengths that are not a multiple of the tile sizes are handled with masks.

The backward pass (FlashAttention-2, Algorithm 2; :func:`_backward`) rebuilds ``P = exp(S − L)``
tile by tile from the saved log-sum-exp ``L``, with ``D = rowsum(dO ∘ O)``: one kernel per key tile
accumulates dK and dV, one per query tile accumulates dQ (no atomics). Its tile sizes come from the
device's shared memory (:func:`backward_tiles`). :class:`FlashAttentionTriton` packages forward and
backward as a ``torch.autograd.Function`` (the interface of
:class:`teraflops.model_definition.flash_pytorch.FlashAttentionPytorch`).

On a GPU the forward kernel is compiled and autotuned over a few tile shapes; on a CPU-only machine
``teraflops`` runs it in Triton's interpreter (NumPy, one program instance at a time), which is
exact but slow, and supports fp32 only.
"""

from __future__ import annotations

from teraflops import machine as _machine

_machine.configure_triton()  # TRITON_INTERPRET must be set before the @triton.jit below

import math  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from teraflops.errors import DTypeError, ShapeError, expect_shape  # noqa: E402

__all__ = ["FlashAttentionTriton", "flash_attention", "flops"]

# Tile sizes under the interpreter: the ones a GPU would use for d = 64 (128 query rows, 64 keys),
# so that on a CPU, too, no program ever holds more than a 128×64 tile of scores; the point of the
# kernel is that the N×N matrix never exists. Bigger tiles run faster in the interpreter (its cost
# is Python per program and per loop step: at (B, H, N, d) = (1, 2, 1024, 32) fp32 on a 2-core CPU,
# 128×64 took about 1–2 s per call, 1024×1024 0.1 s), but a 1024×1024 tile *is* the score matrix
# at N = 1024, which would make the memory comparison with naive attention meaningless.
_INTERPRETER_BLOCK_M = 128
_INTERPRETER_BLOCK_N = 64


# --- tile loads and stores, shared by every kernel below --------------------------------------
#
# Each kernel reads and writes tiles of one head's (N_CTX, HEAD_DIM) matrices, and the last tile of
# a sequence whose length is not a multiple of the tile size runs past its end. These helpers hold
# that end-of-sequence mask once. Triton inlines a @triton.jit function called from a kernel, so
# they cost nothing at run time (and the interpreter runs them as ordinary Python).

@triton.jit
def load_rows(ptr, rows, offs_d, stride_n, stride_d, N_CTX):
    """The tile ``ptr[rows, :]`` of one head's (N_CTX, HEAD_DIM) matrix; rows at or past ``N_CTX`` read as 0."""
    return tl.load(ptr + rows[:, None] * stride_n + offs_d[None, :] * stride_d,
                   mask=rows[:, None] < N_CTX, other=0.0)


@triton.jit
def store_rows(ptr, rows, offs_d, stride_n, stride_d, N_CTX, tile):
    """Write ``tile`` to ``ptr[rows, :]`` in the pointer's dtype; rows at or past ``N_CTX`` are skipped."""
    tl.store(ptr + rows[:, None] * stride_n + offs_d[None, :] * stride_d,
             tile.to(ptr.dtype.element_ty), mask=rows[:, None] < N_CTX)


@triton.jit
def flash_fwd_tiles(acc, l_i, m_i, q, k_base, v_base,
                     stride_kn, stride_kd, stride_vn, stride_vd,
                     lo, hi, offs_m, offs_n, offs_d, N_CTX, qk_scale,
                     BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
    """Fold key/value tiles ``[lo, hi)`` into the running (acc, l, m) of one query tile.

    ``MASK`` masks keys at or past ``N_CTX`` and, with ``CAUSAL``, keys after the query row.
    ``m_i`` is in base-2 units: it is the maximum of ``s * log2(e)``.
    """
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASK:
            k = tl.load(k_ptrs, mask=cols[:, None] < N_CTX, other=0.0)
        else:
            k = tl.load(k_ptrs)
        # mechanism: online softmax
        # scores of this tile, already in base-2 units: (BLOCK_M, BLOCK_N) fp32
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if MASK:
            keep = cols[None, :] < N_CTX
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            s = tl.where(keep, s, float("-inf"))
        # online softmax: every row has seen at least one unmasked key by now, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASK:
            v = tl.load(v_ptrs, mask=cols[:, None] < N_CTX, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
        # end mechanism
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(Q, K, V, O, LSE, sm_scale,
                      stride_qb, stride_qh, stride_qn, stride_qd,
                      stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd,
                      stride_ob, stride_oh, stride_on, stride_od,
                      H, N_CTX, N_BUCKET,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One program = one tile of ``BLOCK_M`` query rows of one (batch, head).

    Grid: ``(cdiv(N_CTX, BLOCK_M), batch * H)``. ``N_BUCKET`` (unused in the body) is the
    autotuner's key for the length: :func:`length_bucket` of ``N_CTX``. ``LSE`` is a contiguous fp32 (batch, H, N_CTX)
    tensor; ``O`` has the strides given. Causal masking requires ``BLOCK_M % BLOCK_N == 0``.
    """
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)  # int64: batch * stride can pass 2**31 elements
    off_h = (off_bh % H).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    o_base = O + off_b * stride_ob + off_h * stride_oh

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_CTX

    # the query tile: loaded once, kept on chip for the whole loop
    q = load_rows(q_base, offs_m, offs_d, stride_qn, stride_qd, N_CTX)

    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Key tiles [0, split) need no mask; tiles [split, end) are masked.
    if CAUSAL:
        # every key strictly left of the diagonal tile is <= every query row of this tile; the
        # diagonal tile(s) take the causal mask (and the end of the sequence); nothing after them
        split = start_m * BLOCK_M
        end = tl.minimum(split + BLOCK_M, N_CTX)
    else:
        # only the last, partial key tile is masked (none when N_CTX is a multiple of BLOCK_N)
        split = (N_CTX // BLOCK_N) * BLOCK_N
        end = N_CTX
    acc, l_i, m_i = flash_fwd_tiles(acc, l_i, m_i, q, k_base, v_base,
                                     stride_kn, stride_kd, stride_vn, stride_vd,
                                     0, split, offs_m, offs_n, offs_d, N_CTX, qk_scale,
                                     BLOCK_N, False, False, INPUT_PRECISION)
    acc, l_i, m_i = flash_fwd_tiles(acc, l_i, m_i, q, k_base, v_base,
                                     stride_kn, stride_kd, stride_vn, stride_vd,
                                     split, end, offs_m, offs_n, offs_d, N_CTX, qk_scale,
                                     BLOCK_N, True, CAUSAL, INPUT_PRECISION)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # ln(2): back to natural log
    tl.store(LSE + off_bh.to(tl.int64) * N_CTX + offs_m, lse, mask=row_ok)
    store_rows(o_base, offs_m, offs_d, stride_on, stride_od, N_CTX, acc)


# --- autotuning (compiled mode only) ---------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_N <= BLOCK_M and both powers of two, so
# BLOCK_M % BLOCK_N == 0 as the causal split needs. Shapes from the usual Ampere/Hopper choices.
_GPU_CONFIGS = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 4),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 32, 4, 4),
    (64, 64, 4, 3),
    (64, 32, 4, 4),
    (64, 64, 4, 2),
    (32, 32, 4, 1),  # the fallback for fp32 with a large head_dim
    (16, 16, 2, 1),
]


def _smem_budget_bytes(device) -> int:
    """Shared memory one block may use on ``device`` (227 KiB on H100/H200, 163 KiB on A100),
    from Triton's driver; 160 KiB if the driver cannot say."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - an estimate is enough for pruning
        return 160 * 1024


def tile_smem_bytes(block_m: int, block_n: int, stages: int, head_dim: int, elem_bytes: int) -> int:
    """Shared memory of one program's tiles (bytes): the Q tile plus ``stages`` pipelined K and V
    tiles, ``elem_bytes · head_dim · (BLOCK_M + 2 · BLOCK_N · stages)``. A lower bound (Triton may
    also stage the score tile), hence the 10 % margin in :func:`fitting_configs`."""
    return elem_bytes * head_dim * (block_m + 2 * block_n * stages)


def fitting_configs(configs, head_dim: int, elem_bytes: int, smem_budget: int, keep: int = 4) -> list:
    """The autotuner's candidates on a device with ``smem_budget`` bytes of shared memory per
    block (64 KiB on a T4 (sm75), 99 KiB on an L4/A10/RTX 4090, 163 KiB on an A100, 227 KiB on an
    H100): the tile shapes whose tiles fit in 90 % of it, at most ``keep`` of them (the listed
    order is best-first, so autotuning a new length times a few kernels, not 11), or the
    smallest one if none fits. ``configs``: ``triton.Config`` objects (or objects with ``.kwargs``
    ``BLOCK_M``/``BLOCK_N`` and ``.num_stages``)."""
    def smem(c):
        return tile_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, head_dim, elem_bytes)

    kept = [c for c in configs if smem(c) <= 0.9 * smem_budget][:keep]
    return kept or [min(configs, key=smem)]


def _prune_configs(configs, named_args, **kwargs):
    """Triton's ``early_config_prune``: :func:`fitting_configs` on the device of ``Q``."""
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    q = named_args["Q"]
    return fitting_configs(configs, head_dim, q.element_size(), _smem_budget_bytes(q.device))


def length_bucket(n: int) -> int:
    """The autotuner's key for a sequence length: ``n`` rounded up to a power of two, so that the
    kernel is tuned once per power of two, not at every new length (tuning takes about a minute
    at N = 65,536)."""
    return triton.next_power_of_2(max(int(n), 1))


def tensor_core_dtype(capability: tuple[int, int]) -> torch.dtype:
    """The 16-bit dtype the kernel's ``tl.dot`` runs on tensor cores on a GPU of ``capability``:
    bf16 from Ampere (sm80) on, fp16 before (a T4, sm75, has fp16 tensor cores and no bf16 ones;
    Triton cannot compile a bf16 ``tl.dot`` there)."""
    return torch.bfloat16 if tuple(capability) >= (8, 0) else torch.float16


def check_dtype_for(dtype: torch.dtype, capability: tuple[int, int]) -> None:
    """Raise a one-line :class:`DTypeError` when ``dtype`` cannot run the compiled kernel on a GPU of
    ``capability`` (bf16 before sm80)."""
    if dtype == torch.bfloat16 and tuple(capability) < (8, 0):
        raise DTypeError(f"flash_attention: bf16 needs a GPU of compute capability 8.0 or newer (this one is "
                         f"sm{capability[0]}{capability[1]}): use torch.float16")


def _make_autotuned():
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in _GPU_CONFIGS
    ]
    return triton.autotune(
        configs=configs,
        key=["N_BUCKET", "HEAD_DIM", "CAUSAL"],  # the autotuner adds the tensors' dtypes itself
        prune_configs_by={"early_config_prune": _prune_configs},
    )(_flash_fwd_kernel)


_flash_fwd_autotuned = _make_autotuned() if _machine.triton_mode() == "compiled" else None


# --- the public API --------------------------------------------------------------------------

_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DIMS = "(batch, heads, seq_len, head_dim)"


def _check_inputs(q, k, v) -> None:
    """Raise ShapeError/DTypeError, with a one-line message, unless q, k, v are usable."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(
                f"flash_attention: {name} must be a torch.Tensor; got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ShapeError(
                f"flash_attention: q, k, v must be 4-D {_DIMS}; got {name} {tuple(t.shape)}")
    hint = "q, k and v must have the same shape (no cross-attention or grouped heads here)"
    expect_shape("flash_attention: k", k, tuple(q.shape), hint=hint)
    expect_shape("flash_attention: v", v, tuple(q.shape), hint=hint)
    d = q.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ShapeError(
            f"flash_attention: head_dim must be a power of two between 16 and 256, got {d}")
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(
            f"flash_attention: q, k, v must have the same dtype; "
            f"got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise DTypeError(
            f"flash_attention: q, k, v must be on the same device; "
            f"got q {q.device}, k {k.device}, v {v.device}")
    if _machine.triton_mode() == "interpreter":
        if q.dtype != torch.float32:
            name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, str(q.dtype))
            raise DTypeError(
                f"flash_attention: {name} is not supported by the Triton interpreter on CPU: "
                f"use torch.float32 (got {q.dtype})")
    else:
        if q.device.type != "cuda":
            raise DTypeError(
                f"flash_attention: the compiled Triton kernel needs CUDA tensors; "
                f"got q on {q.device}: move q, k, v to 'cuda'")
        if q.dtype not in _GPU_DTYPES:
            raise DTypeError(
                f"flash_attention: dtype must be torch.float16, torch.bfloat16 or "
                f"torch.float32; got {q.dtype}")
        check_dtype_for(q.dtype, torch.cuda.get_device_capability(q.device))


def _forward(q, k, v, causal: bool, sm_scale: float, block_m: int | None = None,
             block_n: int | None = None):
    """Launch the kernel; returns (O, LSE). Inputs must already be checked.

    ``block_m``/``block_n`` force tile sizes (tests use small ones to exercise many tiles);
    ``None`` means the interpreter defaults on CPU and autotuning on a GPU.
    """
    B, H, N, D = q.shape
    o = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # only fp32 operands care
    args = (q, k, v, o, lse, float(sm_scale),
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), H, N, length_bucket(N))
    meta = dict(HEAD_DIM=D, CAUSAL=bool(causal), INPUT_PRECISION=precision)

    if block_m is None and _flash_fwd_autotuned is not None:
        def grid(cfg):
            return (triton.cdiv(N, cfg["BLOCK_M"]), B * H)
        with torch.cuda.device(q.device):  # launch on q's GPU, not the current one
            _flash_fwd_autotuned[grid](*args, **meta)
        return o, lse

    if block_m is None:
        block_m, block_n = _INTERPRETER_BLOCK_M, _INTERPRETER_BLOCK_N
    block_n = block_n or block_m
    if block_m % block_n:
        raise ValueError(f"block_m ({block_m}) must be a multiple of block_n ({block_n})")
    # no point in tiles far longer than the sequence (a power of two at least 16 for tl.dot)
    cap = max(16, triton.next_power_of_2(N))
    block_m, block_n = min(block_m, cap), min(block_n, cap)
    grid = (triton.cdiv(N, block_m), B * H)
    _flash_fwd_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, **meta)
    return o, lse


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    sm_scale: float | None = None, return_lse: bool = False):
    """Exact softmax attention, ``softmax(q kᵀ · sm_scale) v``, computed by a FlashAttention kernel.

    The forward pass of FlashAttention (Dao et al. 2022, arXiv:2205.14135, Algorithm 1, with the
    online softmax of Milakov & Gimelshein 2018): the N×N score matrix is never written to
    memory, so memory use is O(N·d) instead of O(N²) and HBM traffic falls from Θ(N·d + N²) to
    Θ(N²·d²/M) per head (M: on-chip memory). The result equals
    ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)``
    up to rounding.

    Args:
        q, k, v: tensors of shape (batch, heads, seq_len, head_dim), all the same shape, dtype
            and device. ``head_dim`` must be a power of two in [16, 256]. Any strides are
            accepted (e.g. a (batch, seq_len, heads, head_dim) tensor ``.transpose(1, 2)``).
            Dtype: torch.float16, torch.bfloat16 or torch.float32 on a CUDA GPU; torch.float32
            only in the Triton interpreter (CPU), which has no bf16. fp32 inputs use full-fp32
            (IEEE) matmuls, not TF32.
        causal: if True, query i attends only to keys j <= i (top-left aligned; q and k have the
            same length here).
        sm_scale: factor applied to the scores before the softmax; default ``1 / sqrt(head_dim)``.
        return_lse: also return the log-sum-exp of each row of scaled scores.

    Returns:
        ``O`` of shape (batch, heads, seq_len, head_dim), contiguous, in the input dtype; with
        ``return_lse=True`` the pair ``(O, LSE)``, where ``LSE`` has shape (batch, heads, seq_len),
        dtype torch.float32, and holds ``log Σ_j exp(sm_scale · q_i · k_j)`` in natural log
        (over the unmasked keys when causal).

    Raises:
        teraflops.errors.ShapeError: q, k, v not 4-D, of different shapes, or a head_dim that is
            not a power of two in [16, 256].
        teraflops.errors.DTypeError: not tensors, mixed dtypes or devices, a dtype other than
            fp16/bf16/fp32 on a GPU, anything but fp32 in the interpreter, or CPU tensors when
            the kernel is compiled for a GPU.

    Example:
        >>> dev = "cuda" if torch.cuda.is_available() else "cpu"
        >>> q = k = v = torch.randn(1, 2, 128, 32, device=dev)
        >>> flash_attention(q, k, v, causal=True).shape
        torch.Size([1, 2, 128, 32])
    """
    _check_inputs(q, k, v)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = _forward(q, k, v, causal, float(sm_scale))
    return (o, lse) if return_lse else o


def flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool = False) -> float:
    """Floating-point operations of one attention forward pass, by the usual convention.

    Counts the two matmuls only: ``Q Kᵀ`` and ``P V`` each take N²·d multiply-adds, i.e. 2·N²·d
    FLOPs, per head, so the total is ``4 · batch · heads · seq_len² · head_dim``, halved when
    ``causal`` (half the score matrix is masked). Softmax exponentials, scaling and masking are not counted. This is
    the convention of the FlashAttention-2 paper (Dao 2023, arXiv:2307.08691, section 4.1) and
    of Tri Dao's benchmark script (``benchmarks/benchmark_flash_attention.py`` in
    Dao-AILab/flash-attention), so TFLOP/s computed from it compare with published numbers.

    Args:
        batch, heads, seq_len, head_dim: the (B, H, N, d) of q, k and v.
        causal: whether the causal mask is applied.

    Returns:
        The FLOP count as a float (divide by seconds and 1e12 for TFLOP/s).
    """
    f = 4.0 * batch * heads * seq_len * seq_len * head_dim
    return f / 2 if causal else f


# --- the backward pass (FlashAttention-2, Algorithm 2) ---------------------------------------
#
# Three kernels, as in FlashAttention-2: ``D = rowsum(dO ∘ O)`` per query row first; then one
# program per key tile accumulates that tile's dK and dV on chip over every query tile that can see
# it; then one program per query tile accumulates its dQ over the key tiles. Splitting dQ from
# dK/dV costs a second recomputation of P but needs no atomic adds. Each pair of tiles rebuilds the
# probabilities from the saved log-sum-exp, P = exp(S − L), so no N×N matrix is ever stored.
# Every tile is masked (end of sequence, causal): simpler than the forward's split into masked and
# unmasked loops, at the cost of a few masked selects per tile.

@triton.jit
def head_offsets(off_bh, H, stride_b, stride_h, N_CTX):
    """Where program axis 1's (batch, head) ``off_bh`` starts: in the (batch, H, N_CTX, HEAD_DIM)
    tensors with strides ``stride_b``, ``stride_h``, and in the contiguous (batch · H, N_CTX) rows of
    L and D. int64: batch · stride can pass 2**31 elements."""
    base = (off_bh // H).to(tl.int64) * stride_b + (off_bh % H).to(tl.int64) * stride_h
    return base, off_bh.to(tl.int64) * N_CTX


# The dK/dV kernel holds a key tile and streams the query tiles past it; the dQ kernel holds a query
# tile and streams the key tiles. Each kind of tile is loaded by one helper, used by both kernels.

@triton.jit
def load_key_tile(K, V, base, offs_n, offs_d, stride_n, stride_d, N_CTX):
    """Rows ``offs_n`` of K and V of one head (0 past the end of the sequence)."""
    k = load_rows(K + base, offs_n, offs_d, stride_n, stride_d, N_CTX)
    v = load_rows(V + base, offs_n, offs_d, stride_n, stride_d, N_CTX)
    return k, v


@triton.jit
def load_query_tile(Q, DO, LSE, DELTA, base, row_base, offs_m, offs_d, stride_n, stride_d, N_CTX):
    """Rows ``offs_m`` of Q and dO of one head, with their log-sum-exp L and D = rowsum(dO ∘ O)
    (0 past the end of the sequence)."""
    q = load_rows(Q + base, offs_m, offs_d, stride_n, stride_d, N_CTX)
    do = load_rows(DO + base, offs_m, offs_d, stride_n, stride_d, N_CTX)
    row_ok = offs_m < N_CTX
    lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)
    return q, do, lse, delta


@triton.jit
def _flash_bwd_preprocess(O, DO, DELTA, stride_ob, stride_oh, stride_on, stride_od,
                          stride_dob, stride_doh, stride_don, stride_dod, H, N_CTX,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """``DELTA[bh, i] = Σ_d dO[i, d] · O[i, d]`` (fp32, contiguous (batch · H, N_CTX))."""
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    o_base, row_base = head_offsets(off_bh, H, stride_ob, stride_oh, N_CTX)
    do_base, _ = head_offsets(off_bh, H, stride_dob, stride_doh, N_CTX)  # dO has strides of its own
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    o = load_rows(O + o_base, offs_m, offs_d, stride_on, stride_od, N_CTX).to(tl.float32)
    do = load_rows(DO + do_base, offs_m, offs_d, stride_don, stride_dod, N_CTX).to(tl.float32)
    tl.store(DELTA + row_base + offs_m, tl.sum(o * do, 1), mask=offs_m < N_CTX)


@triton.jit
def _flash_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale,
                    stride_b, stride_h, stride_n, stride_d, H, N_CTX,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One program = one tile of ``BLOCK_N`` keys of one (batch, head): its dK and dV.

    All of Q, K, V, dO, dK, dV are contiguous (batch, H, N_CTX, HEAD_DIM) with the same strides;
    LSE and DELTA contiguous fp32 (batch · H, N_CTX). Grid ``(cdiv(N_CTX, BLOCK_N), batch · H)``.
    """
    start_n = tl.program_id(0) * BLOCK_N
    base, row_base = head_offsets(tl.program_id(1), H, stride_b, stride_h, N_CTX)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < N_CTX
    k, v = load_key_tile(K, V, base, offs_n, offs_d, stride_n, stride_d, N_CTX)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # query rows before start_n see none of these keys when causal
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, N_CTX, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_CTX
        q, do, lse, delta = load_query_tile(Q, DO, LSE, DELTA, base, row_base, offs_m, offs_d,
                                            stride_n, stride_d, N_CTX)
        # mechanism: backward tile
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N)
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)  # P rebuilt from the log-sum-exp
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=INPUT_PRECISION)  # dV += Pᵀ dO
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)  # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])  # dS = P ∘ (dP − D), D = rowsum(dO ∘ O)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=INPUT_PRECISION)  # dK += dSᵀ Q
        # end mechanism
    dk = dk * sm_scale  # S = Q Kᵀ · scale: the scale comes back in dK (and dQ)
    store_rows(DK + base, offs_n, offs_d, stride_n, stride_d, N_CTX, dk)
    store_rows(DV + base, offs_n, offs_d, stride_n, stride_d, N_CTX, dv)


@triton.jit
def _flash_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, sm_scale,
                  stride_b, stride_h, stride_n, stride_d, H, N_CTX,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One program = one tile of ``BLOCK_M`` query rows of one (batch, head): its dQ.

    Layouts as :func:`_flash_bwd_dkdv`. Grid ``(cdiv(N_CTX, BLOCK_M), batch · H)``.
    """
    start_m = tl.program_id(0) * BLOCK_M
    base, row_base = head_offsets(tl.program_id(1), H, stride_b, stride_h, N_CTX)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_CTX
    q, do, lse, delta = load_query_tile(Q, DO, LSE, DELTA, base, row_base, offs_m, offs_d,
                                        stride_n, stride_d, N_CTX)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, N_CTX) if CAUSAL else N_CTX  # later keys: masked for every row
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N_CTX
        k, v = load_key_tile(K, V, base, offs_n, offs_d, stride_n, stride_d, N_CTX)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * sm_scale
        keep = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)  # dQ += dS K
    store_rows(DQ + base, offs_m, offs_d, stride_n, stride_d, N_CTX, dq * sm_scale)


# (BLOCK_M, BLOCK_N, num_warps), best first. The backward keeps four tiles on chip per program (Q
# and dO of BLOCK_M rows, K and V of BLOCK_N rows, double-buffered) plus two fp32 accumulators, so
# its tiles are smaller than the forward's.
_BWD_CONFIGS = [(64, 64, 4), (64, 32, 4), (32, 32, 4), (16, 16, 2)]


def backward_smem_bytes(block_m: int, block_n: int, head_dim: int, elem_bytes: int, stages: int = 2) -> int:
    """Shared memory of one backward program's tiles (bytes): Q, dO, K and V tiles, ``stages`` deep,
    ``elem_bytes · head_dim · 2 · (BLOCK_M + BLOCK_N) · stages``. A lower bound, as
    :func:`tile_smem_bytes`."""
    return elem_bytes * head_dim * 2 * (block_m + block_n) * stages


def backward_tiles(head_dim: int, elem_bytes: int, smem_budget: int | None, n_ctx: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the backward kernels for a device with ``smem_budget``
    bytes of shared memory per block (None: the interpreter, where the first config is used): the
    first of ``_BWD_CONFIGS`` whose tiles fit in 90 % of it, else the smallest; tiles no longer than
    the sequence rounded up to a power of two (at least 16, what ``tl.dot`` needs)."""
    fits = [c for c in _BWD_CONFIGS if smem_budget is None
            or backward_smem_bytes(c[0], c[1], head_dim, elem_bytes) <= 0.9 * smem_budget]
    bm, bn, warps = (fits or _BWD_CONFIGS[-1:])[0]
    cap = max(16, triton.next_power_of_2(n_ctx))
    return min(bm, cap), min(bn, cap), warps


def _backward(q, k, v, o, lse, do, causal: bool, sm_scale: float, block_m: int | None = None,
              block_n: int | None = None):
    """Launch the three backward kernels; returns (dQ, dK, dV) in the inputs' dtype and shape.

    q, k, v, o, do: (batch, H, N, d), already checked; lse: (batch, H, N) fp32 from :func:`_forward`.
    ``block_m``/``block_n`` force tile sizes (tests); by default :func:`backward_tiles` on q's device.
    """
    B, H, N, D = q.shape
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk, dv
    compiled = _machine.triton_mode() == "compiled"
    bm, bn, warps = backward_tiles(D, q.element_size(), _smem_budget_bytes(q.device) if compiled else None, N)
    bm, bn = block_m or bm, block_n or bn
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    lse = lse.contiguous()
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    launch = dict(num_warps=warps) if compiled else {}
    strides = (*q.stride(),)
    meta = dict(HEAD_DIM=D, CAUSAL=bool(causal), INPUT_PRECISION=precision, **launch)
    with torch.cuda.device(q.device) if q.is_cuda else _nullcontext():
        _flash_bwd_preprocess[(triton.cdiv(N, bm), B * H)](o, do, delta, *o.stride(), *do.stride(), H, N,
                                                           HEAD_DIM=D, BLOCK_M=bm, **launch)
        _flash_bwd_dkdv[(triton.cdiv(N, bn), B * H)](q, k, v, do, lse, delta, dk, dv, float(sm_scale),
                                                     *strides, H, N, BLOCK_M=bm, BLOCK_N=bn, **meta)
        _flash_bwd_dq[(triton.cdiv(N, bm), B * H)](q, k, v, do, lse, delta, dq, float(sm_scale),
                                                   *strides, H, N, BLOCK_M=bm, BLOCK_N=bn, **meta)
    return dq, dk, dv


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 forward and backward in Triton, as an autograd Function.

    ``FlashAttentionTriton.apply(q, k, v, is_causal=False)``: q, k, v of shape (batch, n, d) or
    (batch, heads, n, d), one shape, dtype and device (see :func:`flash_attention` for what each
    mode accepts). Returns O of that shape and dtype; saves q, k, v, O and the log-sum-exp, fp32 of
    shape (batch, n) (or (batch, heads, n)), the only saved tensor of that shape. ``backward``
    returns dQ, dK, dV (and None for ``is_causal``).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        three_d = q.dim() == 3
        q4, k4, v4 = (t.unsqueeze(1) if three_d else t for t in (q, k, v))  # (batch, 1, n, d): one head
        _check_inputs(q4, k4, v4)
        o, lse = _forward(q4, k4, v4, bool(is_causal), 1.0 / math.sqrt(q.shape[-1]))
        if three_d:
            o, lse = o.squeeze(1), lse.squeeze(1)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        if q.dim() == 3:
            q, k, v, o, do, lse = (t.unsqueeze(1) for t in (q, k, v, o, do, lse))
        dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.is_causal, 1.0 / math.sqrt(q.shape[-1]))
        if ctx.saved_tensors[0].dim() == 3:
            dq, dk, dv = dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)
        return dq, dk, dv, None
