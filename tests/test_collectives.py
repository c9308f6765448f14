"""Unit 5 §1: collective bandwidth as nccl-tests defines it, the alpha-beta fit, ring predictions.

Pure functions are tested in-process against nccl-tests' doc/PERFORMANCE.md; one real sweep on
4 ranks at the tiny preset (marked slow) checks correctness; the CPU preset's full sweep and its fit
are checked where CI runs Unit 5's lecture.
"""

import matplotlib
import numpy as np
import pytest

from teraflops.hardware import alpha_beta as ab
from teraflops.hardware import collectives as co
from teraflops.hardware import comm_budget as cb
from teraflops import datasheets as ds
from teraflops.machine import detect
from teraflops.errors import CourseError
import torch

from teraflops.workers.collective_sweep import Buffers, check_input, count_wrong, counts, pattern

MB = 2**20


# ---- nccl-tests' definitions ---------------------------------------------------------------------


@pytest.mark.parametrize("n, all_reduce, half", [(2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_bus_factors_are_nccl_tests_definitions(n, all_reduce, half):
    assert co.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n) == pytest.approx(all_reduce)
    assert co.bus_factor("all_gather", n) == pytest.approx((n - 1) / n) == pytest.approx(half)
    assert co.bus_factor("reduce_scatter", n) == pytest.approx(half)
    assert co.bus_factor("broadcast", n) == co.bus_factor("reduce", n) == 1.0


def test_algbw_is_size_over_time_and_busbw_applies_the_factor():
    assert co.algbw(64 * MB, 0.1) == pytest.approx(64 * MB / 0.1)
    assert co.busbw(1e9, 0.5, "all_reduce", 4) == pytest.approx(2e9 * 1.5)
    assert co.busbw(1e9, 0.5, "all_gather", 8) == pytest.approx(2e9 * 7 / 8)
    np.testing.assert_allclose(co.algbw([1e3, 1e6], [1e-3, 1e-3]), [1e6, 1e9])


def test_sizes_follow_nccl_tests_whole_buffer_convention():
    # all-gather / reduce-scatter: S is n × the per-rank chunk; a chunk is a multiple of 8 elements
    assert counts("all_reduce", 4096, 4) == (1024, 1024)
    assert counts("all_gather", 4096, 4) == (1024, 256)
    assert counts("reduce_scatter", 1000 * 4, 3) == (3 * 328, 328)
    assert pattern(10, "cpu").tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


@pytest.mark.parametrize("collective", co.COLLECTIVES)
def test_wrong_elements_are_counted_when_the_collective_does_nothing(collective, monkeypatch):
    total, chunk = counts(collective, 4096, 2)
    buf = Buffers(collective, total, chunk, rank=0, world=2, device="cpu")
    monkeypatch.setattr(buf, "run", lambda: None)  # a collective that moves nothing
    assert buf.wrong() == buf.out.numel()


@pytest.mark.parametrize("n", [2, 4])
def test_check_data_catches_a_wrong_or_swapped_chunk(n):
    # reduce-scatter: rank r must get chunk r of the sum; chunk r + 1 (same i mod 8 pattern) is wrong
    total, chunk = counts("reduce_scatter", 4096, n)
    summed = sum(check_input("reduce_scatter", total, chunk, r, "cpu") for r in range(n)).view(n, chunk)
    for r in range(n):
        assert count_wrong("reduce_scatter", summed[r], chunk, r, n) == 0
        assert count_wrong("reduce_scatter", summed[(r + 1) % n], chunk, r, n) == chunk
    # all-gather: the chunks in rank order are right; two swapped are wrong
    gathered = torch.cat([check_input("all_gather", chunk, chunk, q, "cpu") for q in range(n)])
    assert count_wrong("all_gather", gathered, chunk, 0, n) == 0
    swapped = gathered.view(n, chunk)[[1, 0] + list(range(2, n))].reshape(-1)
    assert count_wrong("all_gather", swapped, chunk, 0, n) == 2 * chunk
    # all-reduce: the plain sum
    total, chunk = counts("all_reduce", 4096, n)
    reduced = sum(check_input("all_reduce", total, chunk, r, "cpu") for r in range(n))
    assert count_wrong("all_reduce", reduced, chunk, 1, n) == 0


# ---- the alpha-beta model ------------------------------------------------------------------------


@pytest.mark.parametrize("weighting", ["relative", "ordinary"])
def test_fit_recovers_alpha_and_bandwidth_from_noisy_times(weighting):
    rng = np.random.default_rng(0)
    sizes = 2.0 ** np.arange(10, 27)
    alpha, bw = 200e-6, 0.5e9
    t = (alpha + sizes / bw) * rng.normal(1, 0.03, sizes.size)  # 3% noise
    fit = ab.fit_alpha_beta(sizes, t, weighting=weighting)
    assert fit.r2 >= 0.95
    assert fit.bandwidth == pytest.approx(bw, rel=0.05)
    if weighting == "relative":  # ordinary least squares leaves alpha to the noise of the largest sizes
        assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.predict(1e6) == pytest.approx(fit.alpha + 1e6 / fit.bandwidth)
    assert fit.beta == pytest.approx(1 / fit.bandwidth)


def test_fit_keeps_alpha_non_negative_and_records_the_collective():
    sizes = np.array([1e3, 1e6, 1e7])
    fit = ab.fit_alpha_beta(sizes, [1e-6, 0.9e-3, 9.9e-3], weighting="ordinary",  # free intercept: -100 µs
                            collective="all_reduce", ranks=4)
    assert fit.alpha == 0  # then B alone is fitted: least squares of T = S/B through the origin
    assert fit.bandwidth == pytest.approx(np.sum(sizes**2) / np.sum(sizes * [1e-6, 0.9e-3, 9.9e-3]))
    assert fit.bus_bandwidth == pytest.approx(fit.bandwidth * 1.5)
    assert "µs" in str(fit) and "GB/s" in str(fit) and "R²" in str(fit)


@pytest.mark.parametrize("seconds", [[2e-3, 2e-3, 2e-3], [3e-3, 2e-3, 1e-3]])
def test_fit_refuses_times_that_do_not_grow_with_size(seconds):
    with pytest.raises(co.CollectiveInputError, match="do not grow with size") as info:
        ab.fit_alpha_beta([1e3, 1e6, 1e7], seconds)
    assert "Hint: sweep larger sizes" in str(info.value) and "\n" not in str(info.value)


def test_saturation_size_is_where_achieved_bandwidth_reaches_the_fraction():
    fit = ab.AlphaBeta(alpha=1e-4, bandwidth=1e9, r2=1.0, max_rel_error=0.0)
    s = ab.saturation_size(fit, 0.8)
    assert s == pytest.approx(4 * 1e-4 * 1e9)
    assert s / fit.predict(s) == pytest.approx(0.8 * fit.bandwidth)
    assert ab.saturation_size(fit, 0.5) == pytest.approx(1e5)


def test_saturation_of_a_fit_whose_alpha_clamps_to_zero_is_below_the_smallest_size():
    # Times proportional to size with the smallest one a bit fast: the free fit's α is negative, clamped to 0.
    fit = ab.fit_alpha_beta([1e3, 1e6, 1e7], [0.5e-6, 1e-3, 1e-2])
    assert fit.alpha == 0
    assert ab.saturation_size(fit, 0.8) is None  # not "80% of B from 0 B"
    text = ab.saturation_text(fit, 0.8)
    assert text.startswith(f"below {co.fmt_bytes(1e3)}") and "smallest size measured" in text
    assert "80% of B from below" in str(fit)
    assert ab.saturation_text(ab.AlphaBeta(1e-4, 1e9, 1.0, 0.0), 0.5) == co.fmt_bytes(1e5)
    ab.plot_sweep([{"collective": "all_reduce", "size": 1e3, "busbw": 1e9, "ranks": 2, "backend": "gloo"},
                   {"collective": "all_reduce", "size": 1e7, "busbw": 1e9, "ranks": 2, "backend": "gloo"}],
                  ab.AlphaBeta(0.0, 1e9, 1.0, 0.0, "all_reduce", 2, (1e3, 1e7)))


def test_ring_allreduce_formula():
    # 2(n-1)/n · S/B + 2(n-1)·alpha
    assert ab.ring_allreduce_seconds(1e9, 8, 1e9) == pytest.approx(1.75)
    assert ab.ring_allreduce_seconds(1e9, 2, 1e9, alpha=1e-3) == pytest.approx(1.0 + 2e-3)
    assert ab.ring_allreduce_seconds(1e9, 4, 1e9, alpha=1e-3) == pytest.approx(1.5 + 6e-3)  # 2(n-1) = 6 steps
    # the busbw of a measured all-reduce is the B that gives back its time
    t = ab.ring_allreduce_seconds(64 * MB, 4, 2e9)
    assert co.busbw(64 * MB, t, "all_reduce", 4) == pytest.approx(2e9)


def test_gradient_sync_table_covers_models_and_links():
    rows = cb.gradient_sync_rows(n=8)
    assert [r["params"] for r in rows] == [1e9, 7e9, 13e9, 70e9]
    nvlink, pcie4 = ds.PUBLISHED_LINKS[0].name, ds.PUBLISHED_LINKS[1].name
    assert rows[-1][nvlink] == pytest.approx(1.75 * 140e9 / 450e9)
    assert rows[-1][pcie4] > rows[-1][nvlink]
    fit = ab.AlphaBeta(1e-4, 1e9, 1.0, 0.0, "all_reduce", 4)
    measured = cb.gradient_sync_rows((1e9,), n=4, fit=fit)[0]["measured"]
    assert measured == pytest.approx(2e9 / 1e9 + 1e-4)  # at the fit's own n: alpha + S / B
    text = cb.gradient_sync_table(fit=fit)
    assert "70B" in text and "measured (s)" in text and "InfiniBand" in text


def test_training_flops_and_comm_fraction():
    assert cb.train_flops(7e9, 4096) == pytest.approx(6 * 7e9 * 4096)  # Kaplan et al. 2020: 6 N per token
    assert cb.comm_fraction(1.0, 3.0) == pytest.approx(0.25)
    assert cb.comm_fraction(0.0, 1.0) == 0.0 and cb.comm_fraction(1e308, 1e308) == pytest.approx(0.5)
    for bad in (-1.0, True, "1"):
        with pytest.raises(co.CollectiveInputError, match="Hint:"):
            cb.comm_fraction(bad, 1.0)
    for bad in (dict(params=True), dict(bytes_per_grad=[2, 4]), dict(mfu=7)):
        with pytest.raises(co.CollectiveInputError, match="Hint:"):
            cb.gradient_sync_rows(**bad)
    assert cb.gradient_sync_rows(7e9)[0]["bytes"] == 14e9  # one model as a number


def test_gradient_sync_fraction_does_not_depend_on_model_size():
    rows = cb.gradient_sync_rows(n=8, tokens_per_gpu=4096, peak_flops=1e15, mfu=0.5)
    ib = ds.PUBLISHED_LINKS[-1].name
    assert rows[0]["compute"] == pytest.approx(6 * 1e9 * 4096 / 0.5e15)
    fractions = [r[f"{ib} fraction"] for r in rows]
    assert fractions == pytest.approx([fractions[0]] * 4)  # both grow with the parameters
    assert fractions[0] == pytest.approx(cb.comm_fraction(rows[0][ib], rows[0]["compute"]))
    assert "compute (s)" in cb.gradient_sync_table(n=8, tokens_per_gpu=4096) and "%)" in cb.gradient_sync_table(
        n=8, tokens_per_gpu=4096)
    with pytest.raises(co.CollectiveInputError, match="mfu"):
        cb.gradient_sync_rows(tokens_per_gpu=4096, mfu=1.5)


def test_comm_bound_tokens_is_where_sync_equals_math():
    link = ds.PUBLISHED_LINKS[-1]
    t = cb.comm_bound_tokens(8, link.bandwidth, peak_flops=1e15, mfu=0.4)
    row = cb.gradient_sync_rows((13e9,), 8, tokens_per_gpu=t, peak_flops=1e15, mfu=0.4)[0]
    assert row[f"{link.name} fraction"] == pytest.approx(0.5)
    # an NVLink node tolerates ~9x fewer tokens per GPU than InfiniBand NDR (450 vs 50 GB/s)
    assert cb.comm_bound_tokens(8, 50e9) / cb.comm_bound_tokens(8, 450e9) == pytest.approx(9.0)


@pytest.mark.parametrize("sync, micro, target, k", [
    (1.0, 1.0, 0.5, 1),     # exactly met at k = 1
    (1.0, 1.0, 0.2, 4),     # 1 / (4 + 1) = 0.2 exactly: k stays 4 despite rounding
    (1.0, 1.0, 0.19, 5),
    (0.1, 1.0, 0.5, 1),     # already under budget
    (3.0, 0.01, 0.1, 2700),
    (5.000000001, 1.0, 0.5, 6),  # just above an integer: k = 5 would leave the share above the target
])
def test_accumulation_for_fraction(sync, micro, target, k):
    got = cb.accumulation_for_fraction(sync, micro, target)
    assert got == k and isinstance(got, int)
    assert sync / (got * micro + sync) <= target + 1e-12
    if got > 1:
        assert sync / ((got - 1) * micro + sync) > target


@pytest.mark.parametrize("target", [0, 1, 1.5, True, "0.1"])
def test_accumulation_for_fraction_refuses_bad_targets(target):
    with pytest.raises(co.CollectiveInputError, match="Hint:"):
        cb.accumulation_for_fraction(1.0, 1.0, target)


def test_cross_node_link_adds_a_nodes_ports_up_to_nvlink():
    assert ds.cross_node_link(1).bandwidth == 50e9
    assert ds.cross_node_link(8).bandwidth == 400e9
    assert ds.cross_node_link(16).bandwidth == 450e9  # the NVLink hops inside the node are then the limit
    assert "nccl/issues/412" in ds.cross_node_link(8).source
    for bad in (0, 2.0, True):
        with pytest.raises(ds.LinkInputError, match="Hint:"):
            ds.cross_node_link(bad)


def test_widget_refuses_a_fit_of_another_collective_in_one_line():
    from teraflops.hardware.comm_budget import gradient_sync_widget

    with pytest.raises(co.CollectiveInputError, match="all-reduce fit"):
        gradient_sync_widget(ab.AlphaBeta(5e-3, 0.4e9, 0.99, 0.1, "all_gather", 4))


def test_comm_fraction_plot_and_widget_render_headless():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from teraflops.hardware.comm_budget import gradient_sync_widget

    ax = cb.plot_comm_fraction(8, fit=ab.AlphaBeta(5e-3, 0.4e9, 0.99, 0.1, "all_reduce", 4))
    assert len(ax.lines) == len(ds.PUBLISHED_LINKS) + 1
    ui = gradient_sync_widget()
    row = ui.result
    assert row["params"] == 7e9 and 0 < row["InfiniBand NDR (400 Gb/s) fraction"] < 1
    ui.children[1].value = 64  # GPUs: the ring's 2(n-1)/n grows towards 2
    assert ui.result["InfiniBand NDR (400 Gb/s)"] == pytest.approx(row["InfiniBand NDR (400 Gb/s)"] * (126 / 64) / (14 / 8))
    plt.close("all")


def test_published_links_are_per_direction_with_sources():
    by_name = {l.name: l for l in ds.PUBLISHED_LINKS}
    assert by_name["NVLink 4 (H100 SXM)"].bandwidth == 450e9
    assert by_name["PCIe Gen4 x16"].bandwidth == pytest.approx(31.5e9, rel=0.01)
    assert by_name["PCIe Gen5 x16"].bandwidth == pytest.approx(63.0e9, rel=0.01)
    assert by_name["InfiniBand NDR (400 Gb/s)"].bandwidth == 50e9
    assert all("http" in l.source and "direction" in l.note for l in ds.PUBLISHED_LINKS)
    assert "GB/s per direction" in ds.links_table()


def fake_rows(ranks=4):
    rows = []
    for c in co.COLLECTIVES:
        for s in 2 ** np.arange(10, 20):
            t = 1e-4 + s / 1e9
            rows.append({"collective": c, "size": int(s), "count": int(s) // 4, "type": "float", "seconds": t,
                         "algbw": co.algbw(s, t), "busbw": co.busbw(s, t, c, ranks), "wrong": 0,
                         "ranks": ranks, "backend": "gloo"})
    return rows


def test_bandwidth_table_reads_like_nccl_tests():
    text = co.bandwidth_table(fake_rows())
    for col in ("size (B)", "count (elements)", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"):
        assert col in text
    assert text.count("# Avg bus bandwidth") == 3 and "Out of bounds values : 0 OK" in text


def test_plot_sweep_draws_points_fit_and_ceilings():
    matplotlib.use("Agg")
    rows = fake_rows()
    fig = ab.plot_sweep(rows, ab.fit_rows(rows))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and len(ax.lines) >= 3 + 1 + 1 + len(ds.PUBLISHED_LINKS)


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda: co.bus_factor("allreduce", 4), lambda: co.bus_factor("all_reduce", 1),
    lambda: co.bus_factor("all_reduce", 2.5), lambda: co.algbw(0, 1.0), lambda: co.algbw(1e6, -1.0),
    lambda: ab.fit_alpha_beta([1e3, 1e3], [1e-3, 2e-3]), lambda: ab.fit_alpha_beta([1e3, 1e6], [1e-3, 2e-3], weighting="ols"),
    lambda: ab.fit_alpha_beta([1e3, -1], [1e-3, 2e-3]),
    lambda: ab.ring_allreduce_seconds(1e9, 1, 1e9), lambda: ab.ring_allreduce_seconds(1e9, 8, 0),
    lambda: ab.saturation_size(ab.AlphaBeta(1e-4, 1e9, 1, 0), 1.0),
    lambda: cb.gradient_sync_rows(n=1), lambda: co.sweep(("all_to_everyone",)),
    lambda: co.sweep(sizes=[0, 1024]), lambda: co.sweep(ranks=1),
    lambda: ab.fit_rows(fake_rows(), "broadcast"), lambda: co.sweep(iters=0), lambda: co.sweep(volume_bytes=0),
    lambda: co.sweep(min_iters=-1)])
def test_bad_input_is_one_line_course_error_with_hint(call):
    with pytest.raises(CourseError) as info:
        call()
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and "Hint:" in str(info.value)


def test_sweep_refuses_more_ranks_than_gpus(monkeypatch):
    import teraflops.machine as machine
    import teraflops.sizing  # noqa: F401 - bound to the real detect before it is patched

    monkeypatch.setenv("TERAFLOPS_PRESET", "cpu")
    monkeypatch.setattr(machine, "detect", lambda: type("M", (), {"gpu_count": 2, "device": "cpu"})())
    with pytest.raises(co.CollectiveInputError, match="Hint: ranks <= 2"):
        co.sweep(ranks=4)


def test_sweep_warns_about_sizes_it_skipped(monkeypatch):
    import teraflops.launch.launcher as distributed

    monkeypatch.setenv("TERAFLOPS_PRESET", "cpu")
    row = co.SweepRow(collective="all_reduce", size=4096, count=1024, type="float", iters=3, warmup=1,
                      seconds=1e-3, seconds_max=1e-3, wrong=0)
    sent = []

    def fake_launch(module, where, *, spec, result, **kwargs):
        sent.append(spec)
        return [result(rank=r, world_size=2, backend="gloo", device="cpu", rows=(row,),
                       skipped=(("all_reduce", 2**30),)) for r in range(2)]

    monkeypatch.setattr(distributed, "launch", fake_launch)
    with pytest.warns(UserWarning, match="skipped 1 point.*all_reduce 1 GiB"):
        rows = co.sweep(("all_reduce",), sizes=[4096], ranks=2)
    assert [r["size"] for r in rows] == [4096] and sent[0].sizes == (4096,)


def test_the_spec_comes_from_the_preset_and_crosses_the_wire_unchanged():
    from teraflops.launch.wire import SpecError, from_json, to_json
    from teraflops.sizing import PRESETS

    tiny = PRESETS["tiny"]
    spec = co.sweep_spec(tiny, 4, ("all_gather",), min_iters=10 * tiny.collective.iters)
    assert spec.sizes == tuple(co.default_sizes(tiny, 4)) and spec.collectives == ("all_gather",)
    assert (spec.iters, spec.warmup, spec.volume_bytes) == (tiny.collective.iters, tiny.collective.warmup,
                                                           tiny.collective.volume_bytes)
    assert spec.min_iters == spec.iters  # clamped: never more than the most timed calls
    assert from_json(co.SweepSpec, to_json(spec)) == spec
    with pytest.raises(SpecError, match=r"^SweepSpec: collectives must be some of"):
        from_json(co.SweepSpec, {**to_json(spec), "collectives": ["all_to_all"]})
    with pytest.raises(SpecError, match=r"^SweepSpec: sizes .* must be >= 1"):
        from_json(co.SweepSpec, {**to_json(spec), "iters": 0})


def test_rows_are_the_ranks_rows_with_the_bandwidths_derived_from_them():
    row = co.SweepRow(collective="all_gather", size=4096, count=1024, type="float", iters=3, warmup=1,
                      seconds=2e-3, seconds_max=3e-3, wrong=0)
    result = co.SweepResult(rank=0, world_size=4, backend="gloo", device="cpu", rows=(row,))
    (out,) = co.sweep_rows(result, wall_s=1.5)
    assert out["ranks"] == 4 and out["backend"] == "gloo" and out["wall_s"] == 1.5 and out["seconds_max"] == 3e-3
    assert out["algbw"] == pytest.approx(4096 / 2e-3) and out["busbw"] == pytest.approx(4096 / 2e-3 * 3 / 4)


# ---- the real sweep --------------------------------------------------------------------------------


def test_the_cpu_preset_sweeps_1kb_to_64mb():
    from teraflops.sizing import PRESETS

    sizes = co.default_sizes(PRESETS["cpu"], ranks=4)
    assert min(sizes) <= 1024 and max(sizes) >= 64 * MB, sizes


@pytest.mark.slow
def test_a_real_sweep_on_four_ranks_moves_every_element_right(monkeypatch):
    """Four real ranks, the tiny preset's sizes (1 KB to 4 MB, a few iterations: too few to fit well).
    The CPU preset's full sweep, 1 KB to 64 MB, and its alpha-beta fit (R² >= 0.95) are Unit 5's
    lecture's checked cells, which CI runs once (tests/test_unit05_run.py)."""
    monkeypatch.setenv("TERAFLOPS_PRESET", "tiny")
    rows = co.sweep(ranks=4)
    print(co.bandwidth_table(rows))
    gpus = detect().gpu_count
    if 2 <= gpus < 4:
        pytest.skip(f"4 ranks need 4 GPUs on a GPU machine; this one has {gpus}")
    backend = "nccl" if gpus >= 4 else "gloo"
    assert {r["collective"] for r in rows} == set(co.COLLECTIVES)
    assert all(r["wrong"] == 0 and r["ranks"] == 4 and r["backend"] == backend for r in rows)
    assert all(r["seconds"] > 0 and r["busbw"] > 0 for r in rows)
    fit = ab.fit_rows(rows, "all_reduce")
    assert fit.bandwidth > 0 and fit.alpha >= 0


def test_plot_sweep_labels_stay_in_the_frame_apart_and_off_the_data():
    """"InfiniBand NDR" ran past the frame and the "80 % of B" note sat on a data line."""
    from figure_checks import assert_text_off_lines, assert_texts_inside_and_apart

    matplotlib.use("Agg")
    rows = fake_rows()
    fig = ab.plot_sweep(rows, ab.fit_rows(rows))
    ax = fig.axes[0]
    fig.canvas.draw()
    assert_texts_inside_and_apart(ax)
    measured = [line for line in ax.lines if "ranks" in str(line.get_label())]
    assert measured and assert_text_off_lines(ax, "80% of B", measured) is None
    matplotlib.pyplot.close(fig)
