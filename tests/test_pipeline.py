"""Pipeline parallelism (teraflops.parallelization.pipeline): the bubble formula, the stage split, and one
real 2-stage run of GPipe and 1F1B (slow)."""

import dataclasses

import pytest
import torch

from teraflops.parallelization import pipeline as pp
from teraflops.sizing import PRESETS, pp_config
from teraflops.workers.common import build_model
from teraflops.workers.pipeline import in_flight, probe_input, timed


def test_bubble_formula_and_its_errors():
    assert pp.bubble_fraction(2, 1) == 0.5 and pp.bubble_fraction(4, 13) == 3 / 16 and pp.bubble_fraction(1, 8) == 0
    with pytest.raises(pp.PipelineError, match="micro_batches must be a positive int"):
        pp.bubble_fraction(2, 0)


def test_stages_chained_compute_the_whole_model():
    cfg = pp_config(PRESETS["tiny"])
    gpt = build_model(cfg)
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    stages = [pp.stage_module(gpt, i, 2) for i in range(2)]
    assert [len(s.blocks) for s in stages] == [cfg.layers // 2] * 2
    assert torch.allclose(stages[1](stages[0](x)), gpt(x), atol=1e-6)
    with pytest.raises(pp.PipelineError, match="one stage per block"):
        pp.stage_module(gpt, 0, cfg.layers + 1)


def test_in_flight_counts_forwards_not_yet_backwarded():
    gpipe = [["F", 0, 0, 1], ["F", 1, 1, 2], ["B", 0, 3, 4], ["B", 1, 4, 5]]
    one_f_one_b = [["F", 0, 0, 1], ["B", 0, 1, 2], ["F", 1, 2, 3], ["B", 1, 3, 4]]
    assert in_flight(gpipe) == 2 and in_flight(one_f_one_b) == 1


def test_a_later_stage_probes_its_memory_with_activations_on_its_own_device():
    """On the CPU every device is the CPU; the meta device stands in for a CUDA stage's."""
    cfg = pp_config(PRESETS["tiny"])
    x = torch.randint(0, cfg.vocab, (2 * cfg.micro_batch, cfg.seq_len))
    meta = torch.device("meta")
    later = probe_input(cfg, 1, x, meta)
    assert later.device == meta and later.shape == (cfg.micro_batch, cfg.seq_len, cfg.d_model)
    assert later.dtype == torch.float32
    assert torch.equal(probe_input(cfg, 0, x, meta), x[: cfg.micro_batch])  # the first stage takes the tokens


def test_each_chunk_is_timed_between_two_device_synchronisations():
    """On a GPU a chunk's call returns once its kernels are queued: the stage's device is synchronised
    before the start and before the end are read, so busy time is the kernels', not the enqueue's."""
    log = []

    class Stage:
        def forward_one_chunk(self, chunk, *args, **kwargs):
            log.append(("F", chunk))

        def backward_one_chunk(self, chunk, *args, **kwargs):
            log.append(("B", chunk))

    stage, events = Stage(), []
    timed(stage, events, [0.0], sync=lambda: log.append("sync"))
    stage.forward_one_chunk(0)
    stage.backward_one_chunk(0, loss=None)
    assert log == ["sync", ("F", 0), "sync", "sync", ("B", 0), "sync"]
    assert [e[:2] for e in events] == [["F", 0], ["B", 0]] and all(e[3] >= e[2] >= 0 for e in events)


@pytest.mark.gpu
@pytest.mark.slow
def test_two_cuda_stages_run_both_schedules():
    """Where two GPUs are there the stages are NCCL ranks on CUDA (placement): the CPU test's launch."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for CUDA stages, this machine has {torch.cuda.device_count()}")
    rows = pp.run(pp_config(PRESETS["tiny"]), 2, micro_batches=(2, 4), steps=1, warmup=1)
    assert all(r["refused"] is None and 0 <= r["bubble"] < 1 and r["loss_diff"] < 1e-4 for r in rows)  # not timed: a fraction's bounds


def ideal_results(p: int, m: int, t_f: float = 1.0, t_b: float = 2.0) -> list[pp.PipelineResult]:
    """The recorded timings of a perfect GPipe step (no transfer time, every forward ``t_f`` s, every backward
    ``t_b`` s): stage ``s`` runs micro-batch ``i``'s forward from ``(s + i) t_f``; the last stage's backwards
    start when its forwards end, and each stage's backward ``i`` runs ``p - 1 - s`` backward slots later.
    Span = (m + p − 1)(t_f + t_b) and busy = m(t_f + t_b) on every stage, so the bubble is the formula's."""
    span = (m + p - 1) * (t_f + t_b)
    out = []
    for s in range(p):
        events = [["F", i, (s + i) * t_f, (s + i + 1) * t_f] for i in range(m)]
        b0 = (m + p - 1) * t_f + (p - 1 - s) * t_b
        events += [["B", i, b0 + i * t_b, b0 + (i + 1) * t_b] for i in range(m)]
        run = pp.ScheduleResult(schedule="gpipe", micro_batches=m, refused=None, busy_s=[sum(e[3] - e[2] for e in events)],
                                span_s=[span], events=events, peak_in_flight=in_flight(events), saved_bytes=100,
                                loss_diff=0.0 if s == p - 1 else None)
        out.append(pp.PipelineResult(rank=s, world_size=p, backend="gloo", device="cpu", stage=s, runs=(run,)))
    return out


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (2, 8), (4, 4), (4, 13)])
def test_bubble_from_recorded_busy_intervals_is_the_formula_for_a_perfect_schedule(p, m):
    (row,) = pp.bubble_rows(ideal_results(p, m))
    assert row["bubble"] == pytest.approx(pp.bubble_fraction(p, m)) == pytest.approx(row["theory"])
    assert row["bubble_per_stage"] == pytest.approx([pp.bubble_fraction(p, m)] * p)
    assert row["peak_in_flight"] == [m] * p and row["activation_bytes"] == [100 * m] * p
    assert row["step_ms"] == pytest.approx((m + p - 1) * 3e3)


def test_bubble_is_the_median_over_steps_per_stage_then_the_mean_over_stages():
    results = ideal_results(2, 4)
    stage0, stage1 = (r.runs[0] for r in results)
    results[0] = dataclasses.replace(results[0], runs=(dataclasses.replace(stage0, busy_s=[6, 9, 3], span_s=[10] * 3),))
    results[1] = dataclasses.replace(results[1], runs=(dataclasses.replace(stage1, busy_s=[8, 8, 2], span_s=[10] * 3),))
    (row,) = pp.bubble_rows(results)
    assert row["bubble_per_stage"] == pytest.approx([0.4, 0.2]) and row["bubble"] == pytest.approx(0.3)
    assert row["step_ms"] == pytest.approx(10e3)


def test_a_refused_schedule_is_a_row_without_measurements():
    run = pp.ScheduleResult(schedule="1f1b", micro_batches=1, refused="n_microbatches must be greater than or equal to "
                            "the number of stages", busy_s=[], span_s=[], events=[], peak_in_flight=0, saved_bytes=1,
                            loss_diff=None)
    results = [pp.PipelineResult(rank=s, world_size=2, backend="gloo", device="cpu", stage=s, runs=(run,))
               for s in range(2)]
    (row,) = pp.bubble_rows(results)
    assert row["refused"].startswith("n_microbatches") and "bubble" not in row and row["theory"] == 0.5


def _order(events) -> list[tuple]:
    return [(kind, mb) for kind, mb, *_ in sorted(events, key=lambda e: e[2])]


@pytest.mark.slow
def test_two_stage_schedules_run_each_micro_batch_once_each_way_and_1f1b_bounds_memory():
    """One real 2-stage launch. The bubble's size is the machine's (a busy core beside a stage reads as
    bubble: scripts/benchmark.py prints it against the formula); asserted here is the schedule itself: every
    micro-batch's forward and backward once per stage in the schedule's order, the in-flight bound, the
    refusal of m < p, the loss of the unsplit model, and a bubble that is a fraction."""
    cfg = pp_config(PRESETS["cpu"])
    rows = pp.run(cfg, 2, micro_batches=(1, 4, 8), steps=1, warmup=1)
    print(pp.bubble_table(rows))
    got = {(r["schedule"], r["m"]): r for r in rows}
    assert sorted(got) == sorted((s, m) for s in ("gpipe", "1f1b") for m in (1, 4, 8))
    assert "must be greater than or equal" in got[("1f1b", 1)]["refused"] and "bubble" not in got[("1f1b", 1)]
    for (schedule, m), r in got.items():
        if r["refused"]:
            continue
        assert r["p"] == 2 and r["theory"] == pp.bubble_fraction(2, m) and r["loss_diff"] < 1e-5
        assert all(0 <= b < 1 for b in r["bubble_per_stage"]) and r["step_ms"] > 0
        for stage, events in enumerate(r["events"]):
            order = _order(events)
            assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]), order
            assert [mb for kind, mb in order if kind == "F"] == list(range(m))  # forwards in micro-batch order
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
            if schedule == "gpipe":  # all forwards, then all backwards: every micro-batch in flight at once
                assert [kind for kind, _ in order] == ["F"] * m + ["B"] * m
                assert r["peak_in_flight"][stage] == m
            else:  # 1F1B: stage s holds at most p - s micro-batches
                assert r["peak_in_flight"][stage] <= 2 - stage


class _Placement:
    def __init__(self, on_gpus):
        self.on_gpus = on_gpus


@pytest.mark.parametrize("on_gpus", [False, True])
def test_the_gpu_presets_pipeline_on_cpu_ranks_takes_cpu_sizes_and_a_timeout_from_its_flops(monkeypatch, on_gpus):
    """On 2-3 GPUs the 4 stages are gloo CPU ranks: the GPU preset's GPT (10¹³-10¹⁴ FLOPs a stage-step)
    becomes the CPU preset's; the launch's timeout is its FLOPs at the rank's measured FLOP/s."""
    from teraflops import gpu_fit

    seen = {}
    monkeypatch.setattr(pp, "place", lambda ranks, cpu_ranks: _Placement(on_gpus))
    monkeypatch.setattr(pp, "rank_flops", lambda device, world: {"cpu": 1e10, "cuda": 1e13}[device] / world)
    monkeypatch.setattr(pp.launcher, "launch", lambda worker, placement, spec, result, timeout, desc:
                        seen.update(spec=spec, timeout=timeout) or [])
    monkeypatch.setattr(pp, "bubble_rows", lambda results: [])
    big = pp_config(PRESETS["gpu"])
    pp.run(big, 4, micro_batches=(4, 8), steps=1, warmup=1)
    cfg = seen["spec"].model
    if on_gpus:
        assert cfg == big
    else:
        small = pp_config(PRESETS["cpu"])
        assert cfg.d_model <= small.d_model and cfg.vocab <= small.vocab and cfg.micro_batch <= small.micro_batch
        assert 4 <= cfg.layers <= big.layers
    rate = 1e13 if on_gpus else 1e10 / 4
    want = gpu_fit.launch_timeout(2, 2 * 12 * gpu_fit.train_step_flops(cfg), rate)
    assert seen["timeout"] == pytest.approx(want) and seen["timeout"] > gpu_fit.LAUNCH_START_S


# ---- the sweep over stages: rows of several p in one table


@pytest.mark.parametrize("p", [2, 4])
def test_the_stage_tables_formula_column_is_the_bubble_fraction(p):
    rows = [row for m in (1, 4, 8) for row in pp.bubble_rows(ideal_results(p, m))]
    for row in rows:
        assert row["theory"] == pp.bubble_fraction(p, row["m"]) == (p - 1) / (row["m"] + p - 1)
        assert row["bubble"] == pytest.approx(row["theory"])  # a perfect schedule's recorded timings
    text = pp.stage_table(rows)
    for m in (1, 4, 8):
        assert f"{(p - 1) / (m + p - 1):.0%}" in text
    assert "points off" in text and "+0" in text


def test_the_stage_sweep_reuses_a_known_stage_count_and_launches_the_others(monkeypatch):
    launched = []

    def fake_run(cfg, stages, *, micro_batches, **kwargs):
        launched.append((stages, tuple(micro_batches)))
        return [row for m in micro_batches for row in pp.bubble_rows(ideal_results(stages, m))]

    monkeypatch.setattr(pp, "run", fake_run)
    known = [row for m in (1, 4, 8, 16) for row in pp.bubble_rows(ideal_results(2, m))]
    rows = pp.stage_sweep(pp_config(PRESETS["tiny"]), (2, 4), micro_batches=(1, 4, 8), known=known)
    assert launched == [(4, (1, 4, 8))]
    assert [(r["p"], r["m"]) for r in rows] == [(2, 1), (2, 4), (2, 8), (4, 1), (4, 4), (4, 8)]
    launched.clear()
    rows = pp.stage_sweep(pp_config(PRESETS["tiny"]), (4,), micro_batches=(4,), known=known)  # p = 2 is not asked for
    assert launched == [(4, (4,))] and {r["p"] for r in rows} == {4}


def test_a_refused_row_in_the_stage_table_keeps_its_formula():
    run = pp.ScheduleResult(schedule="1f1b", micro_batches=1, refused="Number of microbatches (1) must be greater",
                            busy_s=[], span_s=[], events=[], peak_in_flight=0, saved_bytes=1, loss_diff=None)
    results = [pp.PipelineResult(rank=s, world_size=4, backend="gloo", device="cpu", stage=s, runs=(run,))
               for s in range(4)]
    text = pp.stage_table(pp.bubble_rows(results))
    assert "refused" in text and "75%" in text
