import pytest
import torch

from teraflops.model_definition import launch_overhead, profiling
from teraflops.ceilings import Ceilings
from teraflops.errors import ShapeError
from teraflops.models import TransformerBlock

GPU = dict(peak_flops=100e12, bandwidth=2e12, launch_floor=5e-6)


@pytest.mark.parametrize("flops,nbytes,verdict", [
    (2 * 8192**3, 3 * 8192**2 * 2, "math"),
    (2**28, 3 * 2**28 * 2, "memory"),
    (1024, 3 * 1024 * 2, "framework overhead"),
])
def test_classify(flops, nbytes, verdict):
    assert profiling.classify(flops, nbytes, **GPU) == verdict


def test_gelu_chain_is_eight_launches_fused_is_one():
    x = torch.randn(64)
    assert sum(profiling.count_ops(lambda: launch_overhead.gelu_chain(x)).values()) == 8
    assert sum(profiling.count_ops(lambda: launch_overhead.gelu_fused(x)).values()) == 1
    torch.testing.assert_close(launch_overhead.gelu_chain(x), launch_overhead.gelu_fused(x))


def test_profile_of_a_block_has_matmuls_as_math_and_norms_as_memory():
    block = TransformerBlock(256, 4)
    x = torch.randn(4, 128, 256)
    rows = {r.name: r for r in profiling.profile_ops(lambda: block(x).sum().backward(), "cpu")}
    c = Ceilings(1e11, 1e10, torch.float32, "cpu", 1, 1)  # a CPU-like machine: ridge point 10
    assert rows["mm"].flops > 0 and rows["mm"].verdict(c, 1e-6) == "math"
    assert rows["native_layer_norm"].flops == 0 and rows["native_layer_norm"].verdict(c, 1e-6) == "memory"
    attn = [r for name, r in rows.items() if "scaled_dot_product" in name]
    assert attn and all(r.flops > 0 for r in attn)  # CPU attention kernels get torch's SDPA formulas
    assert "verdict" in profiling.ops_table(list(rows.values()), c, 1e-6)


def test_launch_floor_is_the_smallest_time():
    """The floor is the sweep's smallest median, wherever it falls (given timings), and a live sweep
    gives one positive median per size."""
    from types import SimpleNamespace

    given = [(1, SimpleNamespace(median=3e-6)), (1 << 10, SimpleNamespace(median=2e-6)),
             (1 << 20, SimpleNamespace(median=4e-4))]
    assert launch_overhead.launch_floor(given) == 2e-6
    sweep = launch_overhead.op_time_vs_size((1, 1 << 20), "cpu", min_run_time=0.02)
    assert [n for n, _ in sweep] == [1, 1 << 20] and all(t.median > 0 for _, t in sweep)
    assert launch_overhead.launch_floor(sweep) == min(t.median for _, t in sweep)


def test_block_rejects_wrong_shape_in_one_line():
    with pytest.raises(ShapeError, match=r"expects \(batch, seq_len, 64\), got \(2, 64\)"):
        TransformerBlock(64, 2)(torch.randn(2, 64))


@pytest.mark.parametrize("backward", [False, True])
def test_causal_attention_counts_half_the_flops_of_full_attention(backward):
    """One convention across the course (FlashAttention-2's, as flash_triton.flops and triage count):
    4·B·H·N²·d forward, halved when causal; the backward 2.5× the forward."""
    b, h, n, d = 2, 2, 64, 16

    def attention(causal):
        q, k, v = (torch.randn(b, h, n, d, requires_grad=backward) for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return lambda: out.sum().backward(retain_graph=True) if backward else \
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa_flops(causal):
        rows = profiling.profile_ops(attention(causal), "cpu", warmup=0)
        return sum(r.flops for r in rows if "attention" in r.name)

    full = 4 * b * h * n * n * d * (2.5 if backward else 1)
    assert sdpa_flops(False) == pytest.approx(full) and sdpa_flops(True) == pytest.approx(full / 2)
