"""ipywidgets "what if" sliders. Each widget is a thin view over a model function that lives
in the module that teaches it (so the formulas have one home and one docstring with a source)."""

from __future__ import annotations


def attention_memory_widget():
    """Sliders for sequence length, head dim, heads, batch and dtype → predicted extra memory of
    naive vs flash attention (:func:`teraflops.attention.naive_peak_bytes` / ``flash_peak_bytes``),
    drawn against the 80 GB and 141 GB (GB = 1e9) of an H100 and an H200."""
    import ipywidgets as W
    import matplotlib.pyplot as plt
    from IPython.display import display

    from .attention import flash_peak_bytes, naive_peak_bytes

    sizes = {"fp32": 4, "bf16 / fp16": 2, "fp8": 1}

    def show(log2_seq_len, head_dim, heads, batch, dtype):
        n, s = 2**log2_seq_len, sizes[dtype]
        naive = naive_peak_bytes(batch, heads, n, head_dim, s) / 1e9
        flash = flash_peak_bytes(batch, heads, n, head_dim, s) / 1e9
        fig, ax = plt.subplots(figsize=(6, 2.6))
        ax.barh(["flash", "naive"], [flash, naive], color=["tab:green", "tab:red"])
        for gb, name in ((80, "H100 80 GB"), (141, "H200 141 GB")):
            ax.axvline(gb, color="grey", ls=":")
            ax.text(gb, 1.45, name, fontsize=8, ha="center")
        ax.set_xscale("log")
        ax.set_xlabel("extra memory for one attention call (GB = 1e9 bytes)")
        ax.set_title(f"N = {n:,}: naive {naive:.3g} GB vs flash {flash:.3g} GB ({naive / flash:,.0f}×)")
        plt.show()

    ui = W.interactive(
        show,
        log2_seq_len=W.IntSlider(value=13, min=8, max=18, description="log2 N"),
        head_dim=W.Dropdown(options=[32, 64, 128, 256], value=64, description="head dim"),
        heads=W.IntSlider(value=32, min=1, max=128, description="heads"),
        batch=W.IntSlider(value=1, min=1, max=64, description="batch"),
        dtype=W.Dropdown(options=list(sizes), value="bf16 / fp16", description="dtype"),
    )
    display(ui)
    return ui
