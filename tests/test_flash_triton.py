"""Tests for teraflops.model_definition.flash_triton: the FlashAttention forward kernel against PyTorch's SDPA.

On a CPU-only machine the kernel runs in Triton's interpreter (fp32 only); the test marked
``gpu`` checks fp16 and bf16 on CUDA and is skipped elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import teraflops  # noqa: F401  (configures Triton before the kernel module is imported)
from teraflops.model_definition import flash_triton as ft
from teraflops import machine
from teraflops.errors import DTypeError, ShapeError

INTERPRETER = machine.triton_mode() == "interpreter"
DEVICE = "cpu" if INTERPRETER else "cuda"
FP32_TOL = 1e-5


def _qkv(shape, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
            for _ in range(3)]


def _scores(q, k, causal, scale):
    """Scaled scores in float64, with -inf above the diagonal when causal."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _reference_lse(q, k, causal, scale):
    return torch.logsumexp(_scores(q, k, causal, scale), dim=-1)


def _reference_attention(q, k, v, causal, scale):
    """softmax(q kᵀ · scale) v in float64, independent of any TF32 setting."""
    p = torch.softmax(_scores(q, k, causal, scale), dim=-1)
    return p @ v.double()


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 16), (2, 3, 100, 32), (1, 2, 257, 64), (1, 1, 64, 128), (1, 1, 17, 256)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_matches_sdpa_fp32(shape, causal):
    q, k, v = _qkv(shape)
    o, lse = ft.flash_attention(q, k, v, causal=causal, return_lse=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == shape[:3] and lse.dtype == torch.float32
    assert _max_err(o, ref) < FP32_TOL


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (64, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_many_small_tiles(blocks, causal):
    """Force small tiles so the loop crosses full, partial and diagonal tiles, as on a GPU."""
    shape = (1, 2, 100, 32)  # 100 is not a multiple of any block size here
    q, k, v = _qkv(shape, seed=1)
    scale = 1 / math.sqrt(shape[-1])
    o, lse = ft._forward(q, k, v, causal, scale, block_m=blocks[0], block_n=blocks[1])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert _max_err(o, ref) < FP32_TOL
    assert _max_err(lse, _reference_lse(q, k, causal, scale)) < FP32_TOL


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_matches_logsumexp(causal):
    q, k, v = _qkv((2, 2, 129, 32), seed=2)
    scale = 0.2
    _, lse = ft.flash_attention(q, k, v, causal=causal, sm_scale=scale, return_lse=True)
    assert _max_err(lse, _reference_lse(q, k, causal, scale)) < FP32_TOL


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_non_contiguous_inputs(causal):
    """(batch, seq, heads, dim) tensors viewed as (batch, heads, seq, dim): strides, not copies."""
    b, n, h, d = 2, 77, 3, 32
    q, k, v = (t.transpose(1, 2) for t in _qkv((b, n, h, d), seed=3))
    assert not q.is_contiguous()
    o = ft.flash_attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                         is_causal=causal)
    assert o.shape == (b, h, n, d)
    assert _max_err(o, ref) < FP32_TOL


def test_custom_sm_scale():
    q, k, v = _qkv((1, 2, 100, 16), seed=4)
    for scale in (0.05, 1.0):
        o = ft.flash_attention(q, k, v, sm_scale=scale)
        ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
        assert _max_err(o, ref) < FP32_TOL


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _qkv((1, 1, 40, 64), seed=5)
    assert torch.equal(ft.flash_attention(q, k, v),
                       ft.flash_attention(q, k, v, sm_scale=1 / math.sqrt(64)))


def _one_line_error(exc_type, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        ft.flash_attention(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("flash_attention:")
    return msg


def test_error_not_4d():
    q = torch.randn(2, 64, 32)
    msg = _one_line_error(ShapeError, q, q, q)
    assert "4-D" in msg and "(2, 64, 32)" in msg


def test_error_shape_mismatch_names_both_shapes():
    q = torch.randn(1, 2, 64, 32)
    k = torch.randn(1, 2, 48, 32)
    msg = _one_line_error(ShapeError, q, k, q)
    assert "(1, 2, 64, 32)" in msg and "(1, 2, 48, 32)" in msg


@pytest.mark.parametrize("d", [8, 48, 512])
def test_error_head_dim(d):
    q = torch.randn(1, 1, 4, d)
    msg = _one_line_error(ShapeError, q, q, q)
    assert "power of two between 16 and 256" in msg and f"got {d}" in msg


def test_error_mixed_dtypes():
    q = torch.randn(1, 1, 4, 16)
    msg = _one_line_error(DTypeError, q, q.double(), q)
    assert "torch.float32" in msg and "torch.float64" in msg


@pytest.mark.skipif(not INTERPRETER, reason="only the Triton interpreter lacks bf16")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_error_half_precision_in_interpreter(dtype):
    q = torch.randn(1, 1, 4, 16, dtype=dtype)
    msg = _one_line_error(DTypeError, q, q, q)
    assert "Triton interpreter" in msg and "torch.float32" in msg


def test_course_errors_render_as_one_line():
    q = torch.randn(2, 64, 32)
    with pytest.raises(ShapeError) as info:
        ft.flash_attention(q, q, q)
    lines = info.value._render_traceback_()
    assert len(lines) == 1 and lines[0].startswith("ShapeError: flash_attention:")


def test_flops_convention():
    assert ft.flops(1, 1, 4, 2) == 4 * 4 * 4 * 2
    assert ft.flops(2, 16, 4096, 64) == 4.0 * 2 * 16 * 4096**2 * 64
    assert ft.flops(2, 16, 4096, 64, causal=True) == ft.flops(2, 16, 4096, 64) / 2
    assert isinstance(ft.flops(1, 1, 1, 16), float)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETER, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)],
                         ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 4, 1000, 64), (1, 8, 1024, 128), (1, 2, 257, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_half_precision_matches_sdpa(shape, dtype, tol, causal):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs compute capability 8.0 or newer: the kernel refuses it below "
                    "(flash_triton.check_dtype_for)")
    q, k, v = _qkv(shape, dtype=dtype, device="cuda", seed=6)
    o, lse = ft.flash_attention(q, k, v, causal=causal, return_lse=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert o.dtype == dtype and o.shape == q.shape
    assert _max_err(o, ref) < tol
    scale = 1 / math.sqrt(shape[-1])
    assert _max_err(lse, _reference_lse(q, k, causal, scale)) < tol
    # fp32 on the GPU must use IEEE fp32 matmuls, not TF32 (which would miss 1e-5 by far)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    o32 = ft.flash_attention(q32, k32, v32, causal=causal)
    assert _max_err(o32, _reference_attention(q32, k32, v32, causal, scale)) < FP32_TOL


def test_tile_choice_fits_the_shared_memory_of_each_gpu_class():
    # Stand-in device properties: shared memory per block of a T4 (sm75), an L4 / RTX 4090, an H100.
    from types import SimpleNamespace as Cfg

    from teraflops.model_definition import flash_triton as ft

    configs = [Cfg(kwargs={"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in ft._GPU_CONFIGS]
    for smem, head_dim in ((64 * 1024, 64), (64 * 1024, 128), (99 * 1024, 128), (227 * 1024, 128)):
        kept = ft.fitting_configs(configs, head_dim, 2, smem)
        assert 1 <= len(kept) <= 4, (smem, head_dim, len(kept))  # a new length tunes a few kernels, not 11
        for c in kept:
            assert ft.tile_smem_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, head_dim, 2) <= 0.9 * smem
    t4 = ft.fitting_configs(configs, 64, 2, 64 * 1024)
    assert (128, 64, 3) not in [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages) for c in t4]  # 64 KiB: too big


def test_dtype_from_capability_and_length_buckets():
    from teraflops.model_definition import flash_triton as ft
    from teraflops.errors import DTypeError

    assert ft.tensor_core_dtype((7, 5)) == torch.float16 and ft.tensor_core_dtype((8, 0)) == torch.bfloat16
    assert ft.tensor_core_dtype((9, 0)) == torch.bfloat16
    with pytest.raises(DTypeError, match="sm75.*torch.float16"):
        ft.check_dtype_for(torch.bfloat16, (7, 5))
    ft.check_dtype_for(torch.float16, (7, 5))
    ft.check_dtype_for(torch.bfloat16, (8, 9))
    # The autotuner is keyed on the length's power of two: 40,000 and 65,536 share one tuning.
    assert ft.length_bucket(40_000) == ft.length_bucket(65_536) == 65_536 and ft.length_bucket(1) == 1
