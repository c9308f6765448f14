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


# ---- the degree sweep: rows built from recorded runs, then one live 4-rank run


def _recorded_run(cfg, tp_degree, *, rate=None, nodes=1, step_s=0.5, comm_s=0.1, small_s=0.002, per_call=None):
    """A launch as the ranks would hand it back: each rank's counted step (``per_call`` bytes per collective;
    by default Megatron's 4 per block of the block's activations) and its times."""
    if per_call is None:
        per_call = [] if tp_degree == 1 else [cfg.micro_batch * cfg.seq_len * cfg.d_model * 4] * (4 * cfg.layers)
    results = [tp.TensorParallelResult(rank=r, world_size=tp_degree, backend="gloo", device="cpu", params=1000,
                                       config=cfg, runs=(tp.ModeResult("tp", [step_s] * 3, [comm_s] * 3, sum(per_call),
                                                                       len(per_call)),),
                                       max_abs_diff=0.0, loss_diff=0.0, layer_calls=[], layer_bytes=[], other_calls=0,
                                       small_allreduce_s=[] if tp_degree == 1 else [small_s] * 5)
               for r in range(tp_degree)]
    link = "loopback" if rate is None else f"{rate / 1e6:g} MB/s"
    return tp.TensorParallelRun(results, tp.mode_rows(results, nodes=nodes, link=link), nodes, link, rate)


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_a_degree_rows_bytes_and_calls_are_megatrons_exactly(degree):
    row = tp.degree_row(_recorded_run(CFG, degree))
    tokens = CFG.micro_batch * CFG.seq_len
    want = 0 if degree == 1 else CFG.layers * 4 * tokens * CFG.d_model * 4  # 2 + 2 all-reduces of b·s·h fp32 per block
    assert row["formula_bytes"] == want == row["bytes_per_step"] and row["tokens"] == tokens
    assert row["formula_calls"] == row["calls_per_step"] == (0 if degree == 1 else 4 * CFG.layers)
    assert row["wire_bytes"] == pytest.approx(want * (2 * (degree - 1) / degree))  # a ring's bytes over each link
    assert row["predicted_comm_ms"] is None and row["predicted_share"] is None  # loopback: no rate to price
    assert row["alpha_s"] == (None if degree == 1 else pytest.approx(0.002 / (2 * (degree - 1))))


def test_separate_q_k_v_would_show_as_bytes_beside_the_formula_not_equal_to_it():
    per_block = [CFG.micro_batch * CFG.seq_len * CFG.d_model * 4] * 6  # backward all-reduces q, k and v's inputs apart
    row = tp.degree_row(_recorded_run(CFG, 2, per_call=per_block * CFG.layers))
    assert row["bytes_per_step"] == 1.5 * row["formula_bytes"] and row["calls_per_step"] == 6 * CFG.layers


def test_across_a_link_the_prediction_is_the_ring_at_the_links_rate_with_the_measured_alpha():
    rate, small = 50e6, 0.006
    row = tp.degree_row(_recorded_run(CFG, 4, rate=rate, nodes=2, step_s=0.5, comm_s=0.3, small_s=small))
    alpha = small / (2 * 3)
    one = 2 * 3 / 4 * CFG.micro_batch * CFG.seq_len * CFG.d_model * 4 / rate + 2 * 3 * alpha  # Patarasuk & Yuan
    assert row["alpha_s"] == pytest.approx(alpha)
    assert row["predicted_comm_ms"] == pytest.approx(4 * CFG.layers * one * 1e3)
    compute_ms = 500 - 300
    assert row["predicted_share"] == pytest.approx(row["predicted_comm_ms"] / (row["predicted_comm_ms"] + compute_ms))
    assert tp.predicted_comm_seconds(CFG, 1, rate) == 0


def test_the_degree_table_orders_loopback_first_and_prints_both_models():
    rows = tp.degree_rows([_recorded_run(CFG, 4, rate=50e6, nodes=2), _recorded_run(CFG, 2), _recorded_run(CFG, 1)])
    assert [(r["nodes"], r["tp"]) for r in rows] == [(1, 1), (1, 2), (2, 4)]
    text = tp.degree_table(rows)
    assert "2 nodes, 50 MB/s" in text and "α-β ms" in text and "Megatron" in text and "–" in text


def test_the_sweep_reuses_known_runs_and_launches_only_the_rest(monkeypatch):
    launched = []

    def fake_run(cfg, degree, *, cluster=None, **kwargs):
        launched.append((degree, cluster is not None))
        return _recorded_run(cfg, degree, rate=None if cluster is None else 50e6, nodes=1 if cluster is None else 2)

    class FakeCluster:
        def __init__(self, nodes, link):
            self.nodes, self.link = nodes, link

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tp, "run", fake_run)
    monkeypatch.setattr(tp, "Cluster", FakeCluster)
    monkeypatch.setattr(tp, "unavailable", lambda: None)
    known = [_recorded_run(CFG, 2), _recorded_run(CFG, 2, rate=50e6, nodes=2), None]
    got = tp.degree_sweep(CFG, (1, 2, 4), 50e6, known=known, steps=1, warmup=0)
    assert launched == [(1, False), (4, False), (4, True)] and got["unavailable"] is None
    assert [(r["nodes"], r["tp"]) for r in got["rows"]] == [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)]
    launched.clear()
    monkeypatch.setattr(tp, "unavailable", lambda: "needs root")
    got = tp.degree_sweep(CFG, (1, 2), 50e6, steps=1, warmup=0)
    assert launched == [(1, False), (2, False)] and "needs root" in got["unavailable"]
    with pytest.raises(tp.TensorParallelError, match="divides the 4 heads"):
        tp.degree_sweep(CFG, (1, 3))


@pytest.mark.slow
def test_four_rank_tp_inside_a_node_counts_megatrons_bytes_exactly():
    """The sweep's live degree 4 at a tiny size: counts and bytes, not speed."""
    got = tp.degree_sweep(CFG, (4,), steps=1, warmup=0)
    (row,) = got["rows"]
    (run,) = got["runs"]
    assert row["tp"] == 4 and row["nodes"] == 1 and got["unavailable"] is None
    assert row["bytes_per_step"] == row["formula_bytes"] == 4 * CFG.layers * CFG.micro_batch * CFG.seq_len * CFG.d_model * 4
    assert row["calls_per_step"] == row["formula_calls"] == 4 * CFG.layers
    for r in run.results:
        assert r.max_abs_diff < 1e-5 and r.other_calls == 0 and len(r.small_allreduce_s) > 0
        assert r.runs[0].bytes_per_step == row["formula_bytes"]  # every rank hands over the same bytes
    assert row["alpha_s"] > 0 and row["predicted_comm_ms"] is None
