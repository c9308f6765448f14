"""figures for a room: the course's figures drawn at the ``room`` scale (``TERAFLOPS_FIG_SCALE``,
:mod:`teraflops.plots`: fonts and lines 1.6×) keep their text inside the axes, apart from each other and
from the legend, and their tick labels apart.

Each case re-runs a test that draws a lecture's figure from made-up data (its own assertions included) at
that scale, keeps the figures it drew (``plt.close`` is held back) and checks them with
:func:`figure_checks.assert_figure_readable`. The figures drawn from real runs (Units 1, 3, 5 and 6
through ``teraflops demo``) are checked the same way in ``tests/test_demo.py``.
"""

from __future__ import annotations

import importlib

import pytest

from figure_checks import assert_figure_readable
from teraflops import plots

CASES = [  # (unit, test module, test function): at least one figure of each unit that has made-up data
    (1, "test_roofline", "test_roofline_labels_do_not_overlap_and_stay_inside"),
    (1, "test_figures_room", "draw_attention_sweep"),
    (2, "test_model_states", "test_plot_and_widget_render_headless"),
    (3, "test_figures_room", "draw_straggler_idle"),
    (4, "test_batching", "test_sweep_table_and_plot"),
    (5, "test_collectives", "test_plot_sweep_labels_stay_in_the_frame_apart_and_off_the_data"),
    (5, "test_collectives", "test_comm_fraction_plot_and_widget_render_headless"),
    (5, "test_contention", "test_plot_draws_aggregate_per_transfer_and_the_reference"),
    (5, "test_remedies", "test_plot_merges_identical_curves_and_keeps_bar_ratios"),
]


def draw_attention_sweep():
    from teraflops.model_definition import attention as at

    rows = [at.AttentionResult(impl, n, 1e-3 * (n / 256) ** (2 if impl == "naive" else 1.5),
                               (at.naive_peak_bytes if impl == "naive" else at.flash_peak_bytes)(1, 4, n, 32, 4), 0.0)
            for n in (256, 512, 1024, 2048) for impl in ("naive", "sdpa")]
    at.plot_sweep(rows, 1, 4, 32, 4)


def draw_straggler_idle():
    from teraflops.orchestration import stragglers

    stragglers.plot_idle_vs_delay([{"delay_ms": d, "late_ms": d, "healthy_idle": d / (d + 60), "predicted_idle": d / (d + 55),
                                    "straggler_idle": 0.02, "name": f"{d} ms", "injection": "constant"}
                                   for d in (0, 50, 100, 200)])


@pytest.mark.parametrize("unit, module, name", CASES, ids=[f"unit{u}-{n}" for u, _, n in CASES])
def test_figures_are_readable_at_room_scale(unit, module, name, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.close("all")
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda *args, **kwargs: None)  # keep what the test drew
    try:
        with matplotlib.rc_context(plots.rc("room")):
            getattr(importlib.import_module(module), name)()
            figures = [plt.figure(n) for n in plt.get_fignums()]
            assert figures, f"{module}.{name} drew no figure"
            for fig in figures:
                assert_figure_readable(fig)
    finally:
        close("all")
