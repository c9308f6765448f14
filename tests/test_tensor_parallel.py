"""Tensor parallelism (teraflops.parallelization.tensor_parallel): Megatron's formulas, the QKV layout,
and real 2-rank runs (slow): outputs, counted collectives, bytes, and the slow-link failure mode."""

import sys

import pytest
import torch

from teraflops.nodes import cluster as cl
from teraflops.parallelization import tensor_parallel as tp
from teraflops.sizing import PRESETS, TrainConfig, mp_config
from teraflops.workers.tensor_parallel import block_of, per_block

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
