"""What the lecture widgets draw and print, checked headless (the browser suite checks them live)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from teraflops import widgets  # noqa: E402
from teraflops.compilation import batching  # noqa: E402
from teraflops.hardware import alpha_beta as ab  # noqa: E402
from teraflops.hardware import comm_budget  # noqa: E402
from teraflops.model_definition import attention  # noqa: E402
from teraflops.parallelization import model_states  # noqa: E402


@pytest.mark.parametrize("log2_n, heads, batch, size", [(8, 1, 1, 1), (13, 32, 1, 2), (16, 32, 8, 2), (18, 128, 64, 4),
                                                        (10, 8, 1, 4)])
def test_attention_memory_labels_apart_inside_the_frame_and_title_without_e_notation(log2_n, heads, batch, size):
    fig, ax = attention.attention_memory_figure(log2_n, 64, heads, batch, size)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if "GB" in t.get_text()]
    h100, h200 = (t.get_window_extent(r) for t in labels)
    assert h100.x1 <= h200.x0, "the H100 and H200 labels overlap"
    frame = ax.get_window_extent(r)
    for box in (h100, h200):
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1, "a capacity label runs past the frame"
    assert "e+" not in ax.get_title() and "e-" not in ax.get_title(), ax.get_title()
    plt.close(fig)


def test_gb_and_count_read_as_words():
    assert widgets.gb_text(29700.4) == "29,700" and widgets.gb_text(0.0625) == "0.0625"
    assert widgets.count_text(7.08e9) == "7.08 B" and widgets.count_text(3.5e8) == "350 M" and widgets.count_text(1e12) == "1 T"


def test_gradient_sync_prints_the_fabrics_label_and_readable_sizes(capsys):
    fit = ab.AlphaBeta(5e-3, 0.4e9, 0.99, 0.1, "all_reduce", 4)
    ui = comm_budget.gradient_sync_widget(fit)
    params, _, fabric = ui.children[:3]
    assert params.readout and "e+" not in params.get_state()["_options_labels"][params.index]
    assert params.get_state()["_options_labels"][params.index] == "7 B"
    capsys.readouterr()
    fabric.value = "measured"
    out = capsys.readouterr().out
    assert "over this machine (measured):" in out and "over measured" not in out
    params.value = 1e12
    out = capsys.readouterr().out
    assert "e+" not in out, out
    assert out.lstrip("\x1b[2K\r").startswith("1 T parameters (2,000 GB of bf16 gradients)"), out
    plt.close("all")


def test_every_widgets_controls_share_one_label_width():
    from teraflops.compilation.batching import BatchLatency

    latency = BatchLatency((1, 2, 4, 8), (1e-3, 1.2e-3, 1.5e-3, 2e-3), label="a given latency, for the test")
    uis = [comm_budget.gradient_sync_widget(), attention.attention_memory_widget(), model_states.model_state_widget(),
           batching.batching_widget(latency)]
    for ui in uis:
        controls = [c for c in ui.children if getattr(c, "description", "")]
        assert len(controls) >= 4
        assert {c.style.description_width for c in controls} == {widgets.STYLE["description_width"]}
        assert {c.layout.width for c in controls} == {widgets.WIDTH}
    plt.close("all")


def test_every_widget_says_to_rerun_its_cell_when_it_does_not_show(monkeypatch):
    import IPython.display

    from teraflops.compilation.batching import BatchLatency

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    latency = BatchLatency((1, 2, 4, 8), (1e-3, 1.2e-3, 1.5e-3, 2e-3))
    for make in (attention.attention_memory_widget, model_states.model_state_widget, lambda: batching.batching_widget(latency),
                 comm_budget.gradient_sync_widget):
        shown.clear()
        ui = make()
        notes = [o for o in shown if isinstance(o, dict) and "run this cell" in o.get("text/plain", "")]
        assert len(notes) == 1 and "run this cell" in notes[0]["text/html"], shown
        assert shown.index(notes[0]) < shown.index(ui)
    plt.close("all")


def test_the_model_size_slider_reads_in_billions_not_exponents():
    """The Ψ slider's readout said "7.5e+9"."""
    ui = model_states.model_state_widget()
    psi = next(c for c in ui.children if c.description == "Ψ params")
    assert psi.label == "7.5 B" and psi.value == 7.5e9
    labels = [label for label, _ in psi.options]
    assert "100 M" in labels and "1 T" in labels and "175 B" in labels and not any("e+" in x for x in labels)
    assert [v for _, v in psi.options] == sorted(v for _, v in psi.options)
    plt.close("all")
