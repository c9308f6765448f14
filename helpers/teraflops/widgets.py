"""What every ipywidgets "what if" slider of the course shares: one label width, the re-run note,
and number formats that read in words.

Each widget lives beside the model function it is a thin view over, in the module that teaches it
(so the formulas have one home and one docstring with a source):
:func:`teraflops.model_definition.attention.attention_memory_widget`,
:func:`teraflops.parallelization.model_states.model_state_widget`,
:func:`teraflops.compilation.batching.batching_widget` and
:func:`teraflops.hardware.comm_budget.gradient_sync_widget`."""

from __future__ import annotations

# One label column for every control of a widget: wide enough for the longest description
# ("max wait ms", "tokens/GPU"), so none is cut off and every slider starts at the same x.
STYLE = {"description_width": "96px"}
WIDTH = "480px"


def controls(**controls):
    """The controls, each with the widget's shared label width and control width."""
    for c in controls.values():
        c.style.description_width = STYLE["description_width"]
        c.layout.width = WIDTH
    return controls


# A widget lives in the running kernel; a saved notebook keeps only a reference to it, which reopens as
# "Error displaying widget: model not found" until its cell runs again. Said beside every widget.
RERUN_NOTE = "A widget lives in the running kernel: if none shows below (after reopening the notebook), run this cell."


def show_widget(ui) -> None:
    """Show ``ui`` under a one-line note (text and HTML, so it reads in any front end) that tells the
    learner to run the cell when the widget does not show."""
    from IPython.display import display

    display({"text/plain": RERUN_NOTE,
             "text/html": f'<div class="teraflops-widget-note" style="font-size: 85%; opacity: 0.7">{RERUN_NOTE}</div>'},
            raw=True)
    display(ui)


def count_text(n: float) -> str:
    """A count with a short-scale suffix, 3 significant figures: ``"7.08 B"``, ``"350 M"``, ``"1 T"``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.3g}"


def gb_text(x: float) -> str:
    """GB (1e9 bytes) as a number, 3 significant figures, never scientific notation: ``"29,700"``, ``"0.0625"``."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def bytes_text(n: float) -> str:
    """Bytes in GB, MB or kB (powers of 1000, as the memory axis), never scientific notation:
    ``"29,700 GB"``, ``"147 kB"``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{gb_text(n / scale)} {unit}"
    return f"{n:,.0f} B"
