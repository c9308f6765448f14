"""FlashAttention-2 forward and backward as autograd Functions (tiled PyTorch and Triton) against
SDPA and its autograd gradients.

On a CPU the Triton kernels run in the interpreter (fp32 only); the ``gpu`` tests check fp16 and
bf16 on CUDA with the tolerances stated there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import teraflops  # noqa: F401  (configures Triton before the kernel module is imported)
from teraflops import machine
from teraflops.model_definition import flash_pytorch as fp
from teraflops.model_definition import flash_triton as ft

INTERPRETER = machine.triton_mode() == "interpreter"
FP32_TOL = 1e-4  # the acceptance bound; both implementations land near 1e-6 on these sizes
IMPLS = {"pytorch": fp.FlashAttentionPytorch, "triton": ft.FlashAttentionTriton}


def _inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], do


def _run(fn, q, k, v, do):
    """O, the saved tensors of O's shape minus the last dim, and dQ, dK, dV of ``fn``."""
    for t in (q, k, v):
        t.grad = None
    o = fn(q, k, v)
    saved = [t for t in getattr(o.grad_fn, "saved_tensors", ()) if t.shape == q.shape[:-1]]
    o.backward(do)
    return o.detach(), saved, [t.grad.clone() for t in (q, k, v)]


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("n", [17, 100, 128, 257])
def test_matches_sdpa_and_its_gradients_fp32(impl, n, d, causal):
    shape = (1, 2, n, d) if n % 2 else (2, n, d)  # both layouts: (batch, heads, n, d) and (batch, n, d)
    (q, k, v), do = _inputs(shape, seed=n + d)
    o, saved, grads = _run(lambda *a: IMPLS[impl].apply(*a, causal), q, k, v, do)
    ref, _, ref_grads = _run(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal), q, k, v, do)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert _err(o, ref) < FP32_TOL
    for name, got, want in zip("QKV", grads, ref_grads):
        assert got.shape == want.shape and _err(got, want) < FP32_TOL, f"d{name}: {_err(got, want):.2e}"
    # exactly one saved tensor of shape (batch, n_queries) (per head), and it is the log-sum-exp
    assert len(saved) == 1 and saved[0].dtype == torch.float32
    scores = q.detach().double() @ k.detach().double().transpose(-2, -1) / d**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    assert _err(saved[0], scores.logsumexp(-1)) < FP32_TOL


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32), (48, 80)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_pytorch_tiles_of_any_size_give_the_same_answer(blocks):
    """Tiles that do not divide N, and query tiles smaller or larger than key tiles (the causal
    loop bounds depend on both)."""
    (q, k, v), do = _inputs((1, 2, 100, 16), seed=3)
    for causal in (False, True):
        o, lse = fp.flash_forward(q, k, v, causal, block_q=blocks[0], block_k=blocks[1])
        grads = fp.flash_backward(q, k, v, o, lse, do, causal, block_q=blocks[0], block_k=blocks[1])
        _, _, want = _run(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal), q, k, v, do)
        assert _err(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal)) < FP32_TOL
        assert max(_err(g, w) for g, w in zip(grads, want)) < FP32_TOL


@pytest.mark.parametrize("blocks", [(16, 16), (32, 16), (16, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_triton_backward_with_small_tiles(blocks):
    """Forced small tiles: many key and query tiles, partial last tiles, the causal loop bounds."""
    (q, k, v), do = _inputs((1, 1, 70, 16), seed=4)
    for causal in (False, True):
        o, lse = ft._forward(q.detach(), k.detach(), v.detach(), causal, 0.25)
        grads = ft._backward(q.detach(), k.detach(), v.detach(), o, lse, do, causal, 0.25,
                             block_m=blocks[0], block_n=blocks[1])
        _, _, want = _run(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal, scale=0.25), q, k, v, do)
        assert max(_err(g, w) for g, w in zip(grads, want)) < FP32_TOL


def test_different_query_and_key_lengths_in_pytorch():
    (q, _, _), do = _inputs((2, 33, 16), seed=5)
    (k, v, _), _ = _inputs((2, 90, 16), seed=6)
    for causal in (False, True):
        o, _, grads = _run(lambda *a: fp.FlashAttentionPytorch.apply(*a, causal), q, k, v, do)
        ref, _, want = _run(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal), q, k, v, do)
        assert _err(o, ref) < FP32_TOL and max(_err(g, w) for g, w in zip(grads, want)) < FP32_TOL


def test_a_fully_masked_first_tile_stays_finite():
    """A row whose first key tile is all masked: exp(m − m_new) would be exp(−inf + inf) = NaN."""
    m, l, acc = torch.full((2,), float("-inf")), torch.zeros(2), torch.zeros(2, 4)
    v = torch.randn(3, 4)
    masked = torch.full((2, 3), float("-inf"))
    m, l, acc = fp.fold_tile(m, l, acc, masked, v)
    assert torch.equal(l, torch.zeros(2)) and torch.equal(acc, torch.zeros(2, 4)) and (m == float("-inf")).all()
    s = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, 2.0, 2.0]])
    m, l, acc = fp.fold_tile(m, l, acc, s, v)
    assert torch.allclose(acc / l[:, None], torch.softmax(s, -1) @ v)


def test_a_row_with_no_visible_key_gives_zero_output_and_minus_inf_lse():
    """With no key to attend to (SDPA's top-left causal mask never leaves a row empty, so here the
    key sequence is empty), the tiled forward gives O = 0, not 0/0 = NaN, and L = −inf."""
    q = torch.randn(1, 5, 16)
    k = v = torch.randn(1, 0, 16)
    o, lse = fp.flash_forward(q, k, v)
    assert torch.equal(o, torch.zeros_like(o)) and (lse == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETER, reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.bfloat16, 5e-2)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(2, 4, 257, 64), (1, 2, 1024, 128), (2, 100, 16)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_half_precision_gradients(shape, dtype, tol, causal):
    """fp16 within 5e-3 and bf16 within 5e-2 of SDPA's output and gradients, absolute, for unit-normal
    inputs: bf16 keeps 8 bits of mantissa (a relative step of 2⁻⁸ ≈ 4e-3 on values of order 1, and dK
    and dQ sum N products), fp16 11 bits. Both implementations, Triton and tiled PyTorch."""
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs sm80 or newer (the Triton kernel refuses it below)")
    (q, k, v), do = _inputs(shape, dtype=dtype, device="cuda", seed=7)
    ref, _, want = _run(lambda *a: F.scaled_dot_product_attention(*a, is_causal=causal), q, k, v, do)
    for fn in IMPLS.values():
        o, saved, grads = _run(lambda *a: fn.apply(*a, causal), q, k, v, do)
        assert o.dtype == dtype and len(saved) == 1
        assert _err(o, ref) < tol
        for got, w in zip(grads, want):
            assert got.dtype == dtype and _err(got, w) < tol


def test_backward_tiles_fit_the_shared_memory_of_each_gpu_class():
    for smem in (64 * 1024, 99 * 1024, 163 * 1024, 227 * 1024):
        for d in (16, 64, 128, 256):
            bm, bn, _ = ft.backward_tiles(d, 2, smem, 4096)
            assert ft.backward_smem_bytes(bm, bn, d, 2) <= 0.9 * smem or (bm, bn) == (16, 16)
    assert ft.backward_tiles(64, 4, None, 4096)[:2] == (64, 64)  # the interpreter
    assert ft.backward_tiles(64, 4, None, 17)[:2] == (32, 32)  # no tile longer than the sequence needs
    # a T4's 64 KiB: smaller tiles than an H100's 227 KiB, smaller still at d = 128
    assert ft.backward_tiles(64, 2, 227 * 1024, 4096)[:2] == (64, 64)
    assert ft.backward_tiles(64, 2, 64 * 1024, 4096)[:2] == (64, 32)
    assert ft.backward_tiles(128, 2, 64 * 1024, 4096)[:2] == (16, 16)
