"""Unit 5 §2: gradient accumulation and compression hooks under DDP, with all-reduce bytes counted in the ranks.

The ratios, the table, the byte counters and the input checks are tested in-process; one real
launch of four gloo ranks at the tiny preset (marked slow, ~25 s) checks the acceptance criteria:
accumulation k = 4 cuts the measured bytes per sample 4×, fp16/bf16 hooks halve bytes per step,
PowerSGD cuts far more, and every loss is finite with its difference from the baseline reported.
"""

import dataclasses
import math

import matplotlib
import pytest
import torch

from teraflops.parallelization import ddp_sync as dp
from teraflops.hardware import remedies as rm
from teraflops.sizing import dp_config, preset
from teraflops.launch.placement import data_parallel_plan
from teraflops.launch.wire import SpecError, from_json, to_json
from teraflops.workers import remedies as wr


def row(setting, k=1, steps=8, per_step=400.0, per_sample=25.0, step_ms=10.0, eval_loss=4.0):
    return {"setting": setting, "k": k, "steps": steps, "bytes_per_step": per_step, "bytes_per_sample": per_sample,
            "step_ms": step_ms, "eval_loss": eval_loss, "final_loss": eval_loss}


# ---- pure functions ------------------------------------------------------------------------------


def test_ratios_compare_with_the_baseline_row_by_name():
    rows = [row("fp16", per_step=200, per_sample=12.5, eval_loss=4.01), row("baseline"),
            row("accumulate", k=4, steps=2, per_sample=6.25, step_ms=20, eval_loss=4.1)]
    rm.add_ratios(rows)
    fp16, base, acc = rows
    assert base["sample_cut"] == base["step_cut"] == 1 and base["eval_delta"] == 0
    assert fp16["step_cut"] == pytest.approx(2) and fp16["sample_cut"] == pytest.approx(2)
    assert fp16["eval_delta"] == pytest.approx(0.01)
    assert acc["sample_cut"] == pytest.approx(4) and acc["step_cut"] == pytest.approx(1)
    assert acc["speedup"] == pytest.approx((10 / 1) / (20 / 4))  # time per micro-batch: 10 ms against 5 ms
    assert acc["eval_delta"] == pytest.approx(0.1)


def test_table_reads_at_a_glance():
    rows = rm.add_ratios([row("baseline"), row("accumulate", k=4, steps=2, per_sample=6.25, eval_loss=4.0762),
                          row("bf16", per_step=200, per_sample=12.5, eval_loss=4.0000038)])
    text = rm.remedies_table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + 3 and "bytes/step" in lines[0] and "bytes/sample" in lines[0] and "Δ eval" in lines[0]
    assert "4.00×" in lines[3] and "+0.0762" in lines[3]
    assert "2.00×" in lines[4] and "+3.8e-06" in lines[4]  # a tiny difference is shown, not rounded to 0
    assert "400 B" in lines[2] and "6.25 B" in lines[3]


@pytest.mark.parametrize("rows, match", [
    ([], "non-empty"), ("rows", "non-empty"), ([{"setting": "baseline"}], "lacks"),
    ([row("baseline", per_step=0)], "> 0")])
def test_bad_rows_give_one_line_errors(rows, match):
    with pytest.raises(rm.RemediesError, match=match) as info:
        rm.add_ratios(rows)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"settings": ("baseline", "int8")}, "int8"), ({"settings": ()}, "none given"),
    ({"accum": 0}, "accum"), ({"micro_batches": 6, "accum": 4}, "multiple"),
    ({"powersgd_start": 1}, "start"), ({"powersgd_rank": 0}, "rank")])
def test_bad_settings_fail_before_any_launch_in_one_line(kwargs, match):
    plan = data_parallel_plan(preset("tiny"))
    settings = kwargs.pop("settings", rm.SETTINGS)
    with pytest.raises(rm.RemediesError, match=match) as info:
        rm.remedies_spec(plan, settings, **kwargs)
    assert "\n" not in str(info.value) and "Hint:" in str(info.value)


def test_the_spec_carries_the_preset_sizes_and_is_checked_when_read():
    p = preset("tiny")
    spec = rm.remedies_spec(data_parallel_plan(p))
    assert spec.micro_batches == p.remedy.micro_batches and spec.accum == p.remedy.accum
    assert spec.model == dp_config(p) and spec.bucket_mb == p.dp.bucket_mb and spec.settings == rm.SETTINGS
    assert from_json(rm.RemediesSpec, to_json(spec)) == spec
    with pytest.raises(SpecError, match=r"^RemediesSpec: accum must be an int >= 1") as info:
        from_json(rm.RemediesSpec, {**to_json(spec), "accum": 0})
    assert "\n" not in str(info.value)


def ranks(runs_per_rank, world=2, micro_batch=2, powersgd_rank=2):
    """Typed results of ``world`` ranks (rank r's runs: ``runs_per_rank[r]``, dicts of RemedyResult fields)."""
    cfg = dataclasses.replace(dp_config(preset("tiny")), micro_batch=micro_batch)
    return [rm.RemediesResult(rank=r, world_size=world, backend="gloo", device="cpu", params=100, config=cfg,
                              micro_batches=4, powersgd_rank=powersgd_rank, powersgd_start=2,
                              runs=tuple(rm.RemedyResult(**{"bucket_mb": 2.0, **run}) for run in runs))
            for r, runs in enumerate(runs_per_rank)]


def test_all_reduce_counter_counts_payload_bytes_and_restores(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: seen.append(t.dtype))
    original = torch.distributed.all_reduce
    with wr.AllReduceBytes() as counter:
        torch.distributed.all_reduce(torch.zeros(10))  # fp32: 40 bytes
        torch.distributed.all_reduce(torch.zeros(3, 4, dtype=torch.float16), async_op=True)  # 24 bytes
    assert counter.bytes == 40 + 24 and counter.calls == 2 and seen == [torch.float32, torch.float16]
    assert torch.distributed.all_reduce is original


def test_counting_hook_adds_the_bucket_buffer_then_delegates():
    class Bucket:
        def buffer(self):
            return torch.zeros(100)

    tally, calls = {"bucket_bytes": 0, "buckets": 0}, []
    hook = wr.counting_hook(lambda state, bucket: calls.append(state) or "future", tally)
    assert hook("state", Bucket()) == "future" and calls == ["state"]
    assert tally == {"bucket_bytes": 400, "buckets": 1}


def test_rows_take_the_last_step_as_bytes_per_step_and_the_whole_run_per_sample():
    def run(setting, k, step_bytes, losses):
        n = len(step_bytes)
        return {"setting": setting, "k": k, "losses": losses, "step_s": [None] + [0.01] * (n - 1),
                "step_bytes": step_bytes, "step_bucket_bytes": [400] * n, "step_calls": [1] * n,
                "step_buckets": [1] * n, "eval_loss": losses[-1]}
    runs = [run("baseline", 1, [400] * 4, [4.0, 3.8, 3.6, 3.4]),
            run("powersgd", 1, [400, 400, 20, 20], [4.0, 3.9, 3.8, 3.7])]
    results = ranks([runs, runs], powersgd_rank=1)
    base, psgd = rm.remedy_rows(results)
    assert psgd["label"] == "PowerSGD rank 1" and psgd["samples"] == 16 and psgd["steps"] == 4
    assert psgd["bytes_per_step"] == 20 and psgd["bytes_per_sample"] == pytest.approx(840 / 16)
    assert psgd["step_cut"] == pytest.approx(20) and psgd["sample_cut"] == pytest.approx(1600 / 840)
    assert base["losses"] == [4.0, 3.8, 3.6, 3.4] and psgd["eval_delta"] == pytest.approx(0.3)
    assert base["step_ms"] == pytest.approx(10) and base["samples_per_s"] == pytest.approx(4 / 0.01)


def test_rows_refuse_ranks_that_counted_different_bytes():
    run = {"setting": "baseline", "k": 1, "losses": [4.0], "step_s": [None], "step_bytes": [400],
           "step_bucket_bytes": [400], "step_calls": [1], "step_buckets": [1], "eval_loss": 4.0}
    results = ranks([[run], [{**run, "step_bytes": [200]}]])
    with pytest.raises(rm.RemediesError, match="different") as info:
        rm.remedy_rows(results)
    assert "\n" not in str(info.value)


def test_run_launches_once_and_returns_the_rows_with_the_launch_fields(monkeypatch):
    p = preset("tiny")
    plan = data_parallel_plan(p, ranks_cpu=2)
    step = {"k": 1, "losses": [4.0, 3.9], "step_s": [None, 0.01], "step_bytes": [400, 400],
            "step_bucket_bytes": [400, 400], "step_calls": [1, 1], "step_buckets": [1, 1], "eval_loss": 3.8}
    results = ranks([[{**step, "setting": "baseline"}, {**step, "setting": "fp16"}]] * 2)
    calls = []
    monkeypatch.setattr(dp, "launch", lambda module, where, **kw: calls.append((module, where, kw)) or results)
    out = rm.run(("baseline", "fp16"), micro_batches=2, accum=1, plan=plan, timeout=7)
    assert len(calls) == 1 and calls[0][0] == rm.WORKER and calls[0][1] == plan.placement and calls[0][2]["timeout"] == 7
    assert isinstance(out, rm.RemediesRun) and isinstance(out, dp.RankLaunch)
    assert (out.params, out.ranks, out.backend, out.config) == (100, 2, "gloo", results[0].config)
    assert calls[0][2]["spec"].settings == ("baseline", "fp16") and calls[0][2]["result"] is rm.RemediesResult
    assert [r["setting"] for r in out.rows] == ["baseline", "fp16"] and out.wall_s >= 0 and len(out.load_avg) == 2
    assert "bytes/step" in str(out)


# ---- the real run -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(remedies_tiny_run):
    """Every setting in one launch of four gloo ranks at the tiny preset (16 micro-batches each; conftest)."""
    return remedies_tiny_run


@pytest.mark.slow
def test_real_run_accumulation_cuts_bytes_per_sample_by_k(tiny_run):
    print(tiny_run, f"\nwall {tiny_run.wall_s:.1f} s, {tiny_run.ranks} {tiny_run.backend} ranks")
    rows = {r["setting"]: r for r in tiny_run.rows}
    base, acc, acc_sync = rows["baseline"], rows["accumulate"], rows["accumulate-sync"]
    assert tiny_run.ranks == 4 and base["bytes_per_step"] == base["bucket_bytes_per_step"] == 4 * tiny_run.params
    assert acc["k"] == 4 and acc["steps"] == base["steps"] / 4
    assert acc["sample_cut"] == pytest.approx(4, rel=0.03) and acc["step_cut"] == pytest.approx(1, rel=0.03)
    # the control: the same updates without no_sync send k times the bytes and reach the same loss
    assert acc_sync["sample_cut"] == pytest.approx(1, rel=0.03)
    assert acc_sync["buckets_per_step"] == 4 * acc["buckets_per_step"]
    assert acc_sync["eval_loss"] == pytest.approx(acc["eval_loss"], abs=1e-4)


@pytest.mark.slow
def test_real_run_compression_cuts_bytes_per_step_and_reports_the_loss_cost(tiny_run):
    rows = {r["setting"]: r for r in tiny_run.rows}
    for name in ("fp16", "bf16"):
        assert rows[name]["step_cut"] == pytest.approx(2, rel=0.03), name
        assert rows[name]["bucket_bytes_per_step"] == rows["baseline"]["bytes_per_step"]  # fp32 in, 16 bits out
    psgd = rows["powersgd"]
    assert psgd["step_cut"] > 4 and psgd["step_cut"] > rows["fp16"]["step_cut"] * 2
    assert psgd["calls_per_step"] == 3  # uncompressed vectors, then all P, then all Q (one bucket on gloo)
    for r in tiny_run.rows:
        assert math.isfinite(r["eval_loss"]) and all(math.isfinite(v) for v in r["losses"])
        assert math.isfinite(r["eval_delta"]) and r["step_ms"] > 0
    assert "Δ eval" in str(tiny_run) and "PowerSGD rank 2" in str(tiny_run)


@pytest.mark.slow
def test_real_run_plot_has_loss_curves_and_byte_bars(tiny_run):
    matplotlib.use("Agg")
    fig = rm.plot_remedies(tiny_run.rows)
    ax_loss, ax_bytes = fig.axes
    curves = {(r.get("samples_per_micro_batch", 1), tuple(r["losses"])) for r in tiny_run.rows}
    assert len(ax_loss.lines) == len(curves) and len(ax_bytes.patches) == len(tiny_run.rows)
    legend = [t.get_text() for t in ax_loss.get_legend().get_texts()]
    assert len(set(legend)) == len(legend) == len(ax_loss.lines)
    matplotlib.pyplot.close(fig)


def _synthetic_rows():
    rows = []
    for i, (name, per_sample, losses) in enumerate([
            ("baseline", 4e6, [3.0, 2.5, 2.0]), ("accumulate", 1e6, [3.0, 2.4, 1.9]),
            ("accumulate-sync", 1e6, [3.0, 2.4, 1.9]), ("fp16", 2e6, [3.0, 2.6, 2.1]),
            ("bf16", 2e6, [3.0, 2.6, 2.1]), ("powersgd", 0.3e6, [3.0, 2.7, 2.3])]):
        rows.append({"setting": name, "k": 4 if "acc" in name else 1, "steps": 3, "bytes_per_step": per_sample * 4,
                     "bytes_per_sample": per_sample, "step_ms": 10.0, "eval_loss": losses[-1], "losses": losses,
                     "samples_per_micro_batch": 4 if "acc" in name else 1, "label": name})
    return rows


def test_plot_merges_identical_curves_and_keeps_bar_ratios():
    """Six legend entries for three visible lines, and log-scale bars that distorted the ratios."""
    matplotlib.use("Agg")
    fig = rm.plot_remedies(_synthetic_rows())
    ax_loss, ax_bytes = fig.axes
    legend = [t.get_text() for t in ax_loss.get_legend().get_texts()]
    assert len(ax_loss.lines) == len(legend) == len(set(legend)) == 4
    assert "accumulate = accumulate-sync (identical losses)" in legend
    assert ax_bytes.get_xscale() == "linear"
    widths = sorted(p.get_width() for p in ax_bytes.patches)
    assert widths[-1] / widths[0] == pytest.approx(4e6 / 0.3e6)
    fig.canvas.draw()
    frame = ax_bytes.get_window_extent()
    for t in ax_bytes.texts:
        box = t.get_window_extent()
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1, t.get_text()
    matplotlib.pyplot.close(fig)
