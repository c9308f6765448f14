"""ipywidgets "what if" sliders. Each widget is a thin view over a model function that lives
in the module that teaches it (so the formulas have one home and one docstring with a source)."""

from __future__ import annotations

# One label column for every control of a widget: wide enough for the longest description
# ("max wait ms", "tokens/GPU"), so none is cut off and every slider starts at the same x.
_STYLE = {"description_width": "96px"}
_WIDTH = "480px"


def _controls(**controls):
    """The controls, each with the widget's shared label width and control width."""
    for c in controls.values():
        c.style.description_width = _STYLE["description_width"]
        c.layout.width = _WIDTH
    return controls


# A widget lives in the running kernel; a saved notebook keeps only a reference to it, which reopens as
# "Error displaying widget: model not found" until its cell runs again. Said beside every widget.
RERUN_NOTE = "A widget lives in the running kernel: if none shows below (after reopening the notebook), run this cell."


def _display(ui) -> None:
    """Show ``ui`` under a one-line note (text and HTML, so it reads in any front end) that tells the
    learner to run the cell when the widget does not show."""
    from IPython.display import display

    display({"text/plain": RERUN_NOTE,
             "text/html": f'<div class="teraflops-widget-note" style="font-size: 85%; opacity: 0.7">{RERUN_NOTE}</div>'},
            raw=True)
    display(ui)


def _count(n: float) -> str:
    """A count with a short-scale suffix, 3 significant figures: ``"7.08 B"``, ``"350 M"``, ``"1 T"``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.3g}"


def _gb(x: float) -> str:
    """GB (1e9 bytes) as a number, 3 significant figures, never scientific notation: ``"29,700"``, ``"0.0625"``."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _bytes(n: float) -> str:
    """Bytes in GB, MB or kB (powers of 1000, as the memory axis), never scientific notation:
    ``"29,700 GB"``, ``"147 kB"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{_gb(n / scale)} {unit}"
    return f"{n:,.0f} B"


def attention_memory_figure(log2_seq_len: int, head_dim: int, heads: int, batch: int, element_size: int):
    """The figure of :func:`attention_memory_widget`: naive vs flash attention's extra memory in GB
    (1e9 bytes) as horizontal bars on a log axis, against the 80 GB of an H100 and the 141 GB of an
    H200 (NVIDIA's datasheets), each capacity's label on its own side of its line and inside the frame.
    Returns ``(fig, ax)``."""
    import math

    import matplotlib.pyplot as plt

    from .attention import flash_peak_bytes, naive_peak_bytes

    n = 2**log2_seq_len
    naive = naive_peak_bytes(batch, heads, n, head_dim, element_size) / 1e9
    flash = flash_peak_bytes(batch, heads, n, head_dim, element_size) / 1e9
    fig, ax = plt.subplots(figsize=(6, 2.6))
    ax.barh(["flash", "naive"], [flash, naive], height=0.5, color=["tab:green", "tab:red"])
    ax.set_xscale("log")
    # room for the labels: a fifth of the axis either side of the data and the two capacities
    lo, hi = min(flash, 80), max(naive, 141)
    margin = 10 ** max(1.0, math.log10(hi / lo) / 3)
    ax.set_xlim(lo / margin, hi * margin)
    for gb, name, side in ((80, "H100 80 GB ", "right"), (141, " H200 141 GB", "left")):
        ax.axvline(gb, color="grey", ls=":")
        # between the two bars, in axes coordinates for y: H100's label left of its line, H200's right
        ax.text(gb, 0.5, name, fontsize=8, ha=side, va="center", transform=ax.get_xaxis_transform())
    ax.set_xlabel("extra memory for one attention call (GB = 1e9 bytes)")
    ax.set_title(f"N = {n:,}: naive {_bytes(naive * 1e9)} vs flash {_bytes(flash * 1e9)} ({naive / flash:,.0f}×)", fontsize=10)
    fig.tight_layout()
    return fig, ax


def attention_memory_widget():
    """Sliders for sequence length, head dim, heads, batch and dtype → predicted extra memory of
    naive vs flash attention (:func:`teraflops.attention.naive_peak_bytes` / ``flash_peak_bytes``),
    drawn against the 80 GB and 141 GB (GB = 1e9) of an H100 and an H200."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    sizes = {"fp32": 4, "bf16 / fp16": 2, "fp8": 1}

    def show(log2_seq_len, head_dim, heads, batch, dtype):
        attention_memory_figure(log2_seq_len, head_dim, heads, batch, sizes[dtype])
        plt.show()

    ui = W.interactive(show, **_controls(
        log2_seq_len=W.IntSlider(value=13, min=8, max=18, description="log2 N"),
        head_dim=W.Dropdown(options=[32, 64, 128, 256], value=64, description="head dim"),
        heads=W.IntSlider(value=32, min=1, max=128, description="heads"),
        batch=W.IntSlider(value=1, min=1, max=64, description="batch"),
        dtype=W.Dropdown(options=list(sizes), value="bf16 / fp16", description="dtype"),
    ))
    _display(ui)
    return ui


# Ψ on the model-state slider: a 1-1.5-2-3-5-7.5 grid from 100 M to 1 T, with the ZeRO paper's 7.5 B
# and common open-model sizes (7, 13, 70, 175, 405 B), read as "7.5 B", not "7.5e+9"
PSI_OPTIONS = tuple(sorted({float(round(m * 10**e)) for e in range(8, 12) for m in (1, 1.5, 2, 3, 5, 7.5)}
                           | {7e9, 13e9, 70e9, 175e9, 405e9, 1e12}))


def model_state_widget():
    """Sliders for parameters Ψ, data-parallel devices Nd, ZeRO stage and optimizer precision →
    stacked bars of parameters, gradients and optimizer states per device for stages 0-3
    (:func:`teraflops.model_states.model_states`, ZeRO §5), the chosen stage highlighted, drawn
    against the 80 GB and 141 GB (GB = 1e9) of an H100 and an H200.

    Returns the ``ipywidgets.interactive``; its ``result`` is the chosen stage's
    :class:`~teraflops.model_states.ModelStates`."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    from .model_states import (FP32_ADAM, FP32_ADAM_MASTER, GB, MIXED_ADAM, figure1, format_gb, memory_capacities,
                               plot_model_states)
    from .tables import fmt_count

    def show(psi, nd, stage, precision):
        rows = figure1(psi, nd, precision)
        chosen = rows[stage]
        fig, ax = plt.subplots(figsize=(8, 4))
        plot_model_states(rows, ax=ax, highlight=stage)
        fits = [label for label, gb in memory_capacities() if chosen.total_bytes / GB <= gb]
        verdict = f"fits {fits[0]} (model states only)" if fits else "fits on neither GPU"
        ax.set_title(f"stage {stage} ({chosen.name}, {chosen.formula}): {format_gb(chosen.total_bytes)} GB per device, "
                     f"{verdict}\nΨ = {psi / 1e9:.3g} billion, Nd = {nd}, {precision.name}", fontsize=9)
        fig.tight_layout()
        plt.show()
        return chosen

    ui = W.interactive(show, **_controls(
        psi=W.SelectionSlider(options=[(fmt_count(v), v) for v in PSI_OPTIONS], value=7.5e9, description="Ψ params"),
        nd=W.SelectionSlider(options=[2**k for k in range(11)], value=64, description="Nd devices"),
        stage=W.IntSlider(value=3, min=0, max=3, description="ZeRO stage"),
        precision=W.Dropdown(options=[(p.name, p) for p in (MIXED_ADAM, FP32_ADAM, FP32_ADAM_MASTER)],
                             value=MIXED_ADAM, description="optimizer"),
    ))
    _display(ui)
    return ui


def batching_widget(latency, tokens_per_request: int = 1, price_per_hour: float = 2.0):
    """Sliders for offered load (× what batch-1 serving sustains), ``max_batch``, ``max_wait`` and
    the GPU's price per hour → the simulated dynamic-batching server
    (:func:`teraflops.batching.simulate_server`, driven by the measured ``latency``, a
    :class:`~teraflops.batching.BatchLatency`): served requests/s, p50/p99 latency (ms), mean batch,
    busy fraction, and the cost per million tokens (:func:`teraflops.batching.cost_per_million_tokens`).

    Returns the ``ipywidgets.interactive``; its ``result`` is the :class:`~teraflops.batching.ServerResult`."""
    import ipywidgets as W

    from .batching import cost_per_million_tokens, simulate_server

    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= latency.max_batch]

    def show(load, max_batch, max_wait_ms, price):
        rate = load / latency(1)
        r = simulate_server(latency, rate, max_batch, max_wait_ms / 1e3, duration=min(5.0, 5000 / rate),
                            tokens_per_request=tokens_per_request)
        print(f"offered {rate:,.0f} req/s → served {r.throughput_rps:,.0f} req/s ({r.tokens_per_s:,.0f} tokens/s); "
              f"p50 {r.p50_s * 1e3:.2f} ms, p99 {r.p99_s * 1e3:.2f} ms; mean batch {r.mean_batch:.1f}, "
              f"busy {r.utilisation:.0%}; ${cost_per_million_tokens(r.tokens_per_s, price):.4f} per million tokens "
              f"at ${price:g}/h")
        return r

    ui = W.interactive(show, **_controls(
        load=W.FloatSlider(value=1.5, min=0.1, max=4.0, step=0.1, description="load ×"),
        max_batch=W.SelectionSlider(options=batches, value=batches[min(3, len(batches) - 1)], description="max batch"),
        max_wait_ms=W.FloatSlider(value=2.0, min=0.0, max=20.0, step=0.5, description="max wait ms"),
        price=W.FloatSlider(value=price_per_hour, min=0.5, max=10.0, step=0.25, description="$ per hour"),
    ))
    _display(ui)
    return ui


def gradient_sync_widget(fit=None):
    """Sliders for model size (parameters), number of GPUs, fabric, tokens per GPU per step and MFU →
    the predicted ring all-reduce time of bf16 gradients per step
    (:func:`teraflops.alpha_beta.ring_allreduce_seconds`, α = 0 on a datasheet link), the step's
    math time (6·params·tokens at MFU × the H100 SXM's 989.5 TFLOP/s), communication's share with no
    overlap, and the accumulation steps that bring it under 10%
    (:func:`teraflops.comm_budget.accumulation_for_fraction`). Fabrics: the published links and a node
    with 8 InfiniBand NDR ports (:func:`teraflops.datasheets.cross_node_link`). With ``fit`` (an all-reduce
    :class:`~teraflops.alpha_beta.AlphaBeta` from this machine's sweep) "this machine (measured)" is
    a fabric too, its busbw and per-step latency scaled to the chosen GPU count.

    Returns the ``ipywidgets.interactive``; its ``result`` is the row of
    :func:`teraflops.comm_budget.gradient_sync_rows` for the chosen fabric."""
    import ipywidgets as W

    from .comm_budget import accumulation_for_fraction, gradient_sync_rows
    from .datasheets import PUBLISHED_LINKS, cross_node_link
    from .tables import fmt_seconds

    links = PUBLISHED_LINKS + (cross_node_link(8),)
    gradient_sync_rows((1e9,), 2, 2, links, fit)  # a fit of the wrong kind fails here, in one line
    fabrics = [(l.name, l.name) for l in links] + ([("this machine (measured)", "measured")] if fit else [])
    fabric_label = {value: label for label, value in fabrics}
    # model sizes people train (7B, 13B, 70B, 175B, 405B ...), read in words: "7 B", not "7e+9"
    sizes = sorted({m * 10**k for k in range(8, 12) for m in (1, 1.3, 1.75, 2, 3, 4.05, 5, 7)} | {1e12})

    def show(params, gpus, fabric, tokens_per_gpu, mfu):
        row = gradient_sync_rows((params,), gpus, 2, links, fit, tokens_per_gpu=tokens_per_gpu, mfu=mfu)[0]
        sync, compute, frac = row[fabric], row["compute"], row[f"{fabric} fraction"]
        k = accumulation_for_fraction(sync, compute, 0.1)
        verdict = "communication-bound" if frac > 0.5 else "compute-bound"
        print(f"{_count(params)} parameters ({_gb(2 * params / 1e9)} GB of bf16 gradients) on {gpus} GPUs over {fabric_label[fabric]}:\n"
              f"  all-reduce {fmt_seconds(sync)} per step, math {fmt_seconds(compute)} → {frac:.0%} of the step "
              f"in communication ({verdict}, no overlap)\n"
              f"  accumulate {k} micro-batch{'es' if k > 1 else ''} of {tokens_per_gpu:,} tokens per sync "
              "to keep it under 10%")
        if fabric == PUBLISHED_LINKS[0].name and gpus > 8:
            print("  note: NVLink 4 connects the 8 GPUs of an HGX H100 node; a ring of more GPUs crosses nodes, "
                  "and the fabric between them sets its speed")
        return row

    ui = W.interactive(show, **_controls(
        params=W.SelectionSlider(options=[(_count(n), n) for n in sizes], value=7e9, description="params"),
        gpus=W.SelectionSlider(options=[2**k for k in range(1, 14)], value=8, description="GPUs"),
        fabric=W.Dropdown(options=fabrics, value=PUBLISHED_LINKS[-1].name, description="fabric"),
        tokens_per_gpu=W.SelectionSlider(options=[2**k for k in range(8, 21)], value=8192, description="tokens/GPU"),
        mfu=W.FloatSlider(value=0.4, min=0.05, max=0.8, step=0.05, description="MFU"),
    ))
    _display(ui)
    return ui
