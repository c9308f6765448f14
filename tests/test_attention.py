import gc

import pytest
import torch
import torch.nn.functional as F

from teraflops import sizing
from teraflops.model_definition import attention
from teraflops.errors import ShapeError
from teraflops.machine import triton_mode


def qkv(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_naive_matches_sdpa(causal):
    q, k, v = qkv((2, 3, 50, 16))
    torch.testing.assert_close(attention.naive_attention(q, k, v, causal), F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def test_wrong_shape_is_one_line_naming_shapes():
    q, k, v = qkv((1, 2, 8, 16))
    with pytest.raises(ShapeError) as e:
        attention.naive_attention(q, k[:, :, :4], v)
    msg = str(e.value)
    assert "(1, 2, 8, 16)" in msg and "(1, 2, 4, 16)" in msg and "\n" not in msg
    assert e.value._render_traceback_() == [f"ShapeError: {msg}"]
    with pytest.raises(ShapeError, match="4-D"):
        attention.naive_attention(q[0], k, v)


def test_sdpa_backend_is_reported():
    q, k, v = qkv((1, 2, 64, 32))
    assert attention.sdpa_backend(q, k, v) in attention.SDPA_KERNELS.values()


@pytest.mark.skipif(triton_mode() == "compiled", reason="checks the CPU peak-memory mechanism; with a GPU the "
                    "Triton kernel needs CUDA tensors (test_naive_oom_becomes_a_data_point covers CUDA)")
def test_memory_models_match_measurement():
    res = attention.attention_sweep((512,), 1, 2, 32, torch.float32, "cpu", impls=("naive", "triton"),
                                    min_run_time=0.01, progress=False)
    naive, tri = res
    assert naive.peak_bytes == pytest.approx(attention.naive_peak_bytes(1, 2, 512, 32, 4), rel=0.05)
    assert tri.peak_bytes == pytest.approx(attention.flash_peak_bytes(1, 2, 512, 32, 4), rel=0.05)
    assert tri.max_error < 1e-5


def test_memory_ratio_at_cpu_sizes_is_at_least_4x_and_grows():
    p = sizing.preset("cpu")
    res = attention.attention_sweep(p.attention.seq_lens, p.attention.batch, p.attention.heads, p.attention.head_dim, p.attention.dtype,
                                    "cpu", impls=("naive", "sdpa"), min_run_time=0.01, progress=False)
    ratios = [attention.memory_ratio(res, n, flash_impl="sdpa") for n in p.attention.seq_lens]
    assert ratios[-1] >= 4
    assert ratios == sorted(ratios)


def test_hbm_traffic_models():
    # Standard: 4Nd + 4N^2 elements; flash with a huge SRAM reads everything once: 4Nd.
    assert attention.standard_attention_hbm_bytes(1024, 64, 2) == (4 * 1024 * 64 + 4 * 1024**2) * 2
    assert attention.flash_attention_hbm_bytes(1024, 64, 2, sram_bytes=10**9) == 4 * 1024 * 64 * 2
    small, large = (attention.flash_attention_hbm_bytes(16384, 64, 2, m) for m in (64 * 1024, 256 * 1024))
    assert small > large  # more on-chip memory, fewer passes over K and V


@pytest.mark.gpu
def test_naive_oom_becomes_a_data_point():
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    n = int((free / 4 / 2) ** 0.5) + 4096  # two N×N fp32 matrices do not fit
    res = attention.attention_sweep((n,), 1, 1, 64, torch.float32, "cuda", impls=("naive",), min_run_time=0.01,
                                    progress=False)
    assert res[0].oom and res[0].peak_bytes is None


def test_sweep_releases_memory_after_the_except_block(monkeypatch):
    import sys

    seen = []

    def oom(q, k, v):  # an injected out-of-memory error standing in for the GPU's
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setitem(attention.IMPL_FUNCS, "naive", oom)
    monkeypatch.setattr(attention, "release_cached_memory", lambda device: seen.append(sys.exc_info()[0]))
    res = attention.attention_sweep((64,), 1, 1, 16, torch.float32, "cpu", impls=("naive", "sdpa"),
                                    min_run_time=0.0, progress=False)
    assert [r.oom for r in res] == [True, False]
    assert seen == [None], "empty_cache ran while the out-of-memory traceback was still being handled"


def test_training_sweep_measures_forward_and_backward_of_each_implementation():
    n, d = 512, 16
    res = attention.training_sweep((n,), 1, 1, d, torch.float32, "cpu", impls=("naive", "flash2-pytorch", "sdpa"),
                                   min_run_time=0.0, progress=False)
    by = {r.impl: r for r in res}
    assert list(by) == ["naive", "flash2-pytorch", "sdpa"]
    assert all(r.seconds > 0 and r.max_error < 1e-4 for r in res), res  # gradients against SDPA's
    # autograd keeps naive attention's N×N probabilities and the backward makes dP and dS: at least two
    # N×N fp32 matrices at once; the tiled FlashAttention-2 never holds one
    assert by["naive"].peak_bytes >= 2 * n * n * 4, res
    assert by["flash2-pytorch"].peak_bytes < n * n * 4, res
    assert attention.memory_ratio(res, n, "flash2-pytorch") > 2, res
    assert attention.training_flops(1, 1, n, d) == 3.5 * 4 * n * n * d
    assert "fwd+bwd time" in attention.training_table(res, 1, 1, d)


def test_training_sweep_leaves_the_tiled_pytorch_version_out_at_long_lengths():
    res = attention.training_sweep((64,), 1, 1, 16, torch.float32, "cpu", impls=("flash2-pytorch", "sdpa"),
                                   min_run_time=0.0, progress=False, tiled_pytorch_max_n=32)
    assert [r.impl for r in res] == ["sdpa"]
