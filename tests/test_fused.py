"""Tests for teraflops.compilation.fused: the fused RMSNorm Triton kernel against the eager chain.

On a CPU-only machine the kernel runs in Triton's interpreter (fp32 only); the ``gpu`` test checks
fp16 and bf16 on CUDA and is skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

import teraflops  # noqa: F401  (configures Triton before the kernel module is imported)
from teraflops import machine
from teraflops.compilation import fused
from teraflops.errors import DTypeError, ShapeError

INTERPRETER = machine.triton_mode() == "interpreter"
DEVICE = "cpu" if INTERPRETER else "cuda"


def _xw(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("shape", [(1, 1), (4, 16), (3, 1000), (2, 5, 77), (7, 1024), (2, 3, 4097)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_eager_fp32(shape):
    x, w = _xw(shape)
    y = fused.rmsnorm_triton(x, w, eps=1e-6)
    ref = fused.rmsnorm_eager(x, w, eps=1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    lib = torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-6)
    torch.testing.assert_close(y, lib, atol=1e-5, rtol=1e-5)


def test_non_contiguous_rows_and_empty():
    x, w = _xw((8, 300))
    xt = x.t().contiguous().t()  # same values, column-major: last-dim stride != 1
    torch.testing.assert_close(fused.rmsnorm_triton(xt, w), fused.rmsnorm_eager(x, w), atol=1e-5, rtol=1e-5)
    empty = torch.empty(0, 300, device=DEVICE)
    assert fused.rmsnorm_triton(empty, w).shape == (0, 300)


def test_eps_matters_for_a_zero_row():
    x = torch.zeros(2, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    y = fused.rmsnorm_triton(x, w, eps=1e-6)
    assert torch.isfinite(y).all() and (y == 0).all()


def test_shape_errors():
    x, w = _xw((4, 32))
    with pytest.raises(ShapeError, match=r"weight must have shape \(32,\)"):
        fused.rmsnorm_triton(x, w[:31])
    with pytest.raises(ShapeError, match="weight must have shape"):
        fused.rmsnorm_triton(x, w.view(1, 32))
    with pytest.raises(ShapeError, match="0-D"):
        fused.rmsnorm_triton(torch.tensor(1.0, device=DEVICE), w)
    with pytest.raises(ShapeError, match="MAX_D"):
        big = fused.MAX_D + 1
        fused.rmsnorm_triton(torch.zeros(1, big, device=DEVICE), torch.ones(big, device=DEVICE))


def test_dtype_errors_are_one_line():
    x, w = _xw((4, 32))
    with pytest.raises(DTypeError, match="same dtype") as e:
        fused.rmsnorm_triton(x, w.double())
    assert "\n" not in str(e.value)
    with pytest.raises(DTypeError, match="torch.Tensor"):
        fused.rmsnorm_triton([1.0, 2.0], w)


@pytest.mark.skipif(not INTERPRETER, reason="the interpreter's fp32-only rule")
def test_interpreter_rejects_bf16():
    x, w = _xw((4, 32), dtype=torch.bfloat16)
    with pytest.raises(DTypeError, match="bf16 is not supported by the Triton interpreter"):
        fused.rmsnorm_triton(x, w)


def test_bytes_model_by_hand():
    # R = 4 rows, D = 1000, fp32 (4 bytes). Eager: 7·R·D + 6·R + D = 28000 + 24 + 1000 = 29024
    # elements = 116096 bytes. Fused: 2·R·D + D = 9000 elements = 36000 bytes.
    t = fused.bytes_moved((4, 1000), torch.float32)
    assert (t.rows, t.d, t.element_bytes) == (4, 1000, 4)
    assert t.eager == 116096 and t.fused == 36000
    assert [op[1:] for op in t.eager_ops] == [(16000, 16000), (16000, 16), (16, 16), (16, 16),
                                               (16016, 16000), (20000, 16000)]
    assert t.ratio == pytest.approx(116096 / 36000)
    # leading dims multiply into rows; bf16 halves every count
    t2 = fused.bytes_moved((2, 2, 1000), torch.bfloat16)
    assert t2.eager == 116096 // 2 and t2.fused == 18000
    with pytest.raises(ShapeError):
        fused.bytes_moved(())


def test_compare_rows_and_table():
    rows = fused.compare((8, 100), min_run_time=0.01)
    assert [r["impl"] for r in rows][:2] == ["eager chain", "fused Triton"]
    assert rows[0]["speedup"] == 1.0
    for r in rows:
        assert r["time_s"] > 0 and r["max_err"] < 1e-5
    assert rows[1]["bytes"] == fused.bytes_moved((8, 100)).fused
    text = fused.fused_table(rows)
    assert "fused Triton" in text and "MB (model)" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_half_precision(dtype):
    x, w = _xw((64, 4096), dtype=dtype)
    ref = fused.rmsnorm_eager(x.float(), w.float())
    torch.testing.assert_close(fused.rmsnorm_triton(x, w).float(), ref, atol=2e-2, rtol=2e-2)
