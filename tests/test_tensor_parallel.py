"""Tensor parallelism (teraflops.parallelization.tensor_parallel): Megatron's formulas, the QKV layout,
and real 2-rank runs (slow): outputs, counted collectives, bytes, and the slow-link failure mode."""

import sys

import pytest
import torch

from teraflops.nodes import cluster as cl
from teraflops.parallelization import tensor_parallel as tp
from teraflops.sizing import PRESETS, TrainConfig, mp_config
from teraflops.workers.tensor_parallel import block_of, one_rank_steps, per_block, sgd

REASON = cl.unavailable() if sys.platform == "linux" else "needs Linux"
CFG = TrainConfig(vocab=64, d_model=64, layers=2, heads=4, seq_len=32, micro_batch=8, lr=0.01)


def test_megatron_formula_is_two_all_reduces_of_the_activations_per_phase():
    got = tp.megatron_per_layer(tokens=8 * 32, hidden=64)
    assert got["forward"] == {"calls": {"all_reduce": 2}, "bytes": 2 * 8 * 32 * 64 * 4}
    assert got["backward"] == got["forward"]
    sp = tp.megatron_per_layer(256, 64, dtype_bytes=2, sequence_parallel=True)
    assert sp["forward"]["calls"] == {"all_gather": 2, "reduce_scatter": 2} and sp["forward"]["bytes"] == 2 * 256 * 64 * 2
    assert tp.dp_bytes_per_step(1000) == 4000
    with pytest.raises(tp.TensorParallelError, match="tokens = batch"):
        tp.megatron_per_layer(0, 64)


def test_interleaved_qkv_gives_each_rank_whole_heads_of_q_k_and_v():
    h, degree = 8, 2
    w = torch.arange(3 * h, dtype=torch.float32)[:, None].expand(3 * h, h)  # row i holds i
    got = tp.interleave_qkv(w, degree)[:, 0]
    q, k, v = torch.arange(h), torch.arange(h, 2 * h), torch.arange(2 * h, 3 * h)
    shard0 = torch.cat([q[:4], k[:4], v[:4]]).float()  # rank 0: heads 0-1 (head_dim 2) of each
    assert torch.equal(got[:12], shard0) and torch.equal(got[12:], torch.cat([q[4:], k[4:], v[4:]]).float())
    assert tp.interleave_qkv(torch.arange(3.0 * h), degree).shape == (3 * h,)  # the bias
    with pytest.raises(tp.TensorParallelError, match="divisible"):
        tp.interleave_qkv(torch.zeros(3 * h, h), 3)


def test_a_degree_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(tp.TensorParallelError, match="divides the 4 heads"):
        tp.check_degree(CFG, 3)
    with pytest.raises(tp.TensorParallelError, match="split over 3"):
        tp.run(TrainConfig(**{**CFG.__dict__, "heads": 6, "d_model": 48}), 3, modes=("tp", "dp"))
    with pytest.raises(tp.TensorParallelError, match="modes"):
        tp.spec_for(CFG, ("pp",))


def test_collectives_are_grouped_by_block_and_phase():
    assert block_of("GPT.blocks.1.fc2") == 1 and block_of("GPT.head") is None and block_of("GPT.blocks") is None
    records = [("all_reduce", "forward", "GPT.blocks.0.proj", 10), ("all_reduce", "backward", "GPT.blocks.0.qkv", 10),
               ("all_reduce", "forward", "GPT.blocks.1.fc2", 7), ("all_reduce", "forward", "GPT", 1)]
    calls, nbytes, other = per_block(records, 2)
    assert calls == [{"forward/all_reduce": 1, "backward/all_reduce": 1}, {"forward/all_reduce": 1}] and other == 1
    assert nbytes[1] == {"forward/all_reduce": 7}


def _foreach_sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, foreach=True)  # what SGD's default picks on CUDA, a foreach device


def test_the_sharded_step_mixes_dtensor_and_plain_tensors_so_foreach_sgd_fails_and_the_rank_sgd_steps():
    """The CPU is no ``foreach`` device, so gloo ranks never took the multi-tensor path; forced here on a
    1-rank gloo mesh in this process, it fails as SGD's CUDA default does."""
    cfg = TrainConfig(vocab=64, d_model=32, layers=2, heads=2, seq_len=16, micro_batch=4, lr=0.05)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        one_rank_steps(cfg, "cpu", steps=1, optimizer=_foreach_sgd)
    got = one_rank_steps(cfg, "cpu", steps=3)
    assert got["dtensor_params"] == 8 * cfg.layers and got["plain_params"] > 0  # qkv/proj/fc1/fc2 weight + bias
    assert got["losses"][-1] < got["losses"][0]
    assert sgd([torch.nn.Parameter(torch.ones(1))], 0.1).defaults["foreach"] is False


@pytest.mark.gpu
@pytest.mark.slow
def test_the_sharded_step_trains_on_one_nccl_rank():
    """The TP rank's step on CUDA (one NCCL rank: the same DTensor/plain mix as ``tp`` ranks)."""
    got = one_rank_steps(CFG, "cuda", steps=3)
    assert got["dtensor_params"] > 0 and got["plain_params"] > 0 and got["losses"][-1] < got["losses"][0]


@pytest.mark.gpu
@pytest.mark.slow
def test_two_rank_tp_on_gpus_matches_the_reference():
    """Where two GPUs are there the ranks are NCCL ranks (placement): the launch of the CPU test."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL ranks, this machine has {torch.cuda.device_count()}")
    got = tp.run(CFG, 2, modes=("tp", "dp"), steps=1, warmup=0)
    assert all(r.backend == "nccl" and r.max_abs_diff < 1e-4 for r in got.results)


def test_the_presets_size_an_activation_heavy_model():
    for p in PRESETS.values():
        cfg = mp_config(p)
        assert all(cfg.heads % d == 0 for d in p.mp.tp_degrees)
        assert cfg.micro_batch * cfg.seq_len > 9 * cfg.d_model  # TP's bytes per step ≫ DP's (see link test)


@pytest.mark.slow
def test_two_rank_tp_matches_the_reference_and_counts_megatron_2_plus_2():
    got = tp.run(CFG, 2, modes=("tp",), steps=1, warmup=0)
    want = tp.megatron_per_layer(CFG.micro_batch * CFG.seq_len, CFG.d_model)
    for r in got.results:
        assert r.max_abs_diff < 1e-5 and r.loss_diff < 1e-5
        assert r.other_calls == 0  # nothing outside the blocks communicates
        for calls, nbytes in zip(tp.layer_counts(r), tp.layer_bytes(r)):
            for phase in ("forward", "backward"):
                assert calls[phase] == want[phase]["calls"]
                assert abs(nbytes[phase] / want[phase]["bytes"] - 1) < 0.05
    assert len(tp.layer_counts(got.results[0])) == CFG.layers
    assert "block 1" in tp.count_table(got.results[0]) and "tp" in str(got)


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"emulated nodes unavailable: {REASON}")
def test_across_a_slow_link_tp_communicates_a_far_larger_share_than_dp():
    """One launch across the link, both modes (the lecture's link_comparison adds the one-node run)."""
    cfg = mp_config(PRESETS["cpu"])  # tiny's batch leaves DP too little compute to make the point
    with cl.Cluster(2, cl.Link(rate=tp.scaled_rate(tp.FABRICS[0])), name="tp1") as c:
        got = tp.run(cfg, 2, modes=("tp", "dp"), steps=2, warmup=1, cluster=c)
    print(got)
    across = {r["mode"]: r for r in got.rows}
    assert across["tp"]["bytes_per_step"] > 5 * across["dp"]["bytes_per_step"]
    # the share of the step spent communicating is timed: printed above, not compared (the load moves it)
    assert all(0 <= r["comm_share"] <= 1 and r["comm_ms"] >= 0 for r in got.rows)


def _row(mode, step_ms, comm_ms, nbytes):
    return {"mode": mode, "step_ms": step_ms, "comm_ms": comm_ms, "comm_share": comm_ms / step_ms, "bytes_per_step": nbytes}


def test_tp_and_dp_across_the_link_are_compared_in_seconds_and_bytes_not_shares():
    """Recorded GPU-like rows: compute is ~1 ms beside the link's seconds, so both shares are ≈ 1 and their
    ratio says nothing; the seconds and bytes on the link still show TP's cost."""
    gpu_like = tp.link_ratios([_row("tp", 4301, 4300, 2_150_000_000), _row("dp", 101, 100, 50_000_000)])
    assert gpu_like["share_ratio"] == pytest.approx(1.0, abs=0.02)
    assert gpu_like["comm_ratio"] == pytest.approx(43.0) and gpu_like["bytes_ratio"] == pytest.approx(43.0)
    cpu_like = tp.link_ratios([_row("tp", 1000, 900, 40e6), _row("dp", 1500, 100, 4e6)])
    assert cpu_like["share_ratio"] > 10 and cpu_like["comm_ratio"] == pytest.approx(9.0)


class _Placement:
    def __init__(self, on_gpus, world=2):
        self.on_gpus, self.world_size = on_gpus, world


def test_model_parallel_sizes_follow_the_ranks_device_and_the_link():
    """The GPU preset's GPT on CPU ranks (fewer GPUs than ranks) takes the CPU preset's sizes; across the
    emulated link its batch shrinks until a TP step's activations cross in LINK_STEP_S; the launch's timeout
    is its steps' FLOPs at the rank's FLOP/s plus its bytes over the link, not a constant."""
    from teraflops import gpu_fit

    big, small = mp_config(PRESETS["gpu"]), mp_config(PRESETS["cpu"])
    assert tp.fitted(big, _Placement(True)) == big  # NCCL ranks: the fitted GPU preset as it is
    on_cpu = tp.fitted(big, _Placement(False))
    for k in ("vocab", "d_model", "layers", "seq_len", "micro_batch"):
        assert getattr(on_cpu, k) <= getattr(small, k)
    assert on_cpu.d_model % on_cpu.heads == 0 and on_cpu.heads % 2 == 0
    rate = tp.scaled_rate(tp.FABRICS[0])
    assert gpu_fit.tp_step_bytes(big) / rate > 20  # the GPU preset across the link: tens of seconds a step
    across = tp.fitted(big, _Placement(True), rate, dp=True)
    assert gpu_fit.tp_step_bytes(across) / rate <= gpu_fit.LINK_STEP_S and across.micro_batch % 2 == 0
    assert across.micro_batch * across.seq_len > 9 * across.d_model  # still activation-heavy: TP's bytes ≫ DP's
    slow = tp.fitted(small, _Placement(False), rate / 100, dp=True)
    assert slow.micro_batch < small.micro_batch and gpu_fit.tp_step_bytes(slow) / (rate / 100) <= gpu_fit.LINK_STEP_S
    assert gpu_fit.tp_step_bytes(across) == 4 * across.layers * across.micro_batch * across.seq_len * across.d_model * 4
    t = gpu_fit.launch_timeout(10, gpu_fit.train_step_flops(big), 1e12, gpu_fit.tp_step_bytes(big), rate)
    assert t == pytest.approx(gpu_fit.LAUNCH_START_S + gpu_fit.TIMEOUT_MARGIN * 10 * (
        6 * gpu_fit.gpt_params(big.vocab, big.d_model, big.layers, big.heads, big.seq_len) * big.micro_batch
        * big.seq_len / 1e12 + gpu_fit.tp_step_bytes(big) / rate))
    assert gpu_fit.launch_timeout(10, 1e9, 1e12) < t  # no link, less to wait for
