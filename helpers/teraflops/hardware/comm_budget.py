"""Unit 5 §3: the communication budget of a training step, the gradient all-reduce against the math.

Data parallelism all-reduces every gradient once per optimizer step. With no overlap the step
takes ``compute + sync``, and communication's share of it is ``sync / (compute + sync)``
(:func:`comm_fraction`). Both sides come from cited formulas:

* **sync**: a ring all-reduce of ``Ψ · b`` bytes (``Ψ`` parameters, ``b`` bytes per gradient) on
  ``n`` ranks, :func:`teraflops.hardware.alpha_beta.ring_allreduce_seconds` (Patarasuk & Yuan 2009), at a
  published link's per-direction bandwidth (:mod:`teraflops.datasheets`, α = 0: a ceiling) or at
  this machine's fitted one (:func:`teraflops.hardware.alpha_beta.fit_rows`);
* **compute**: ``6 · Ψ · T`` FLOPs for ``T`` tokens per GPU (:func:`train_flops`; Kaplan et al.
  2020) at a fraction ``mfu`` of a GPU's dense 16-bit peak (the H100 SXM's datasheet by default).

Setting the two equal, the model size cancels: a job is communication-bound below
:func:`comm_bound_tokens` tokens per GPU per step, whatever its size. Gradient accumulation raises
the tokens between syncs (:func:`accumulation_for_fraction`: the fewest micro-batches for a target
share). Units: parameters and tokens are counts; bytes; seconds; bandwidths in bytes/s per direction
(GB = 1e9 bytes); FLOP/s.
"""

from __future__ import annotations

import math

import numpy as np

from teraflops.hardware.alpha_beta import AlphaBeta, ring_allreduce_seconds
from teraflops.hardware.collectives import CollectiveInputError, check_positive, check_ranks
from teraflops import widgets
from teraflops.datasheets import PUBLISHED_LINKS, cross_node_link, published_peak
from teraflops.tables import GB, fmt, fmt_seconds, table


def train_flops(params, tokens):
    """FLOPs of one training step: ``6 · params · tokens`` (2 for the forward multiply-adds, 4 for the
    backward; Kaplan et al., "Scaling Laws for Neural Language Models", arXiv:2001.08361, §2.1, which
    leaves out the attention term, small while the context is short against 12 · d_model).

    Raises:
        CollectiveInputError: a count not > 0.
    """
    p, t = check_positive("params", params), check_positive("tokens", tokens)
    out = 6.0 * p * t
    return float(out) if out.ndim == 0 else out


def comm_fraction(sync_seconds, compute_seconds):
    """The share of a step spent in communication when none of it overlaps compute:
    ``sync / (compute + sync)`` (dimensionless, 0–1). Overlap (DDP's buckets) can only lower it.

    Raises:
        CollectiveInputError: a sync time < 0 or a compute time not > 0.
    """
    k = check_positive("compute_seconds", compute_seconds)
    c = np.asarray(sync_seconds, dtype=np.float64) if not isinstance(sync_seconds, (bool, str)) else None
    if c is None or c.size == 0 or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise CollectiveInputError(f"sync_seconds must be finite times >= 0, got {sync_seconds!r}. "
                                   "Hint: seconds of one all-reduce of the gradients")
    out = 1.0 / (1.0 + k / c) if np.all(c > 0) else np.where(c > 0, c / (k + np.where(c > 0, c, 1.0)), 0.0)
    return float(out) if out.ndim == 0 else out


def accumulation_for_fraction(sync_seconds: float, micro_batch_seconds: float, target: float) -> int:
    """The fewest micro-batches ``k >= 1`` per all-reduce (gradient accumulation) for which the
    gradient sync takes at most ``target`` of the step: ``sync / (k · micro + sync) <= target``, i.e.
    ``k = max(1, ceil(sync · (1 − target) / (target · micro)))``. No overlap is assumed, so this is
    the safe side. Lab 5, exercise 4, writes it.

    Args:
        sync_seconds: one all-reduce of the gradients (s, > 0). micro_batch_seconds: forward + backward
            of one micro-batch (s, > 0). target: the largest acceptable communication fraction (0–1).

    Raises:
        CollectiveInputError: a time not > 0 or ``target`` not strictly between 0 and 1.
    """
    sync = float(check_positive("sync_seconds", sync_seconds))
    micro = float(check_positive("micro_batch_seconds", micro_batch_seconds))
    if isinstance(target, bool) or not isinstance(target, (int, float, np.floating)) or not 0 < target < 1:
        raise CollectiveInputError(f"target must be a fraction strictly between 0 and 1, got {target!r}. "
                                   "Hint: 0.1 asks that communication take at most 10% of the step")
    x = sync * (1 - target) / (target * micro)
    if not math.isfinite(x):
        raise CollectiveInputError(f"sync {sync!r} s over micro-batch {micro!r} s is out of range. "
                                   "Hint: both in seconds, of the same order of magnitude as a real step")
    k = max(1, math.ceil(x))
    while k > 1 and sync / ((k - 1) * micro + sync) <= target:  # x rounded up past an exact integer
        k -= 1
    while sync / (k * micro + sync) > target:  # x rounded down below the true k
        k += 1
    return k


def _h100_peak() -> float:
    """Dense bf16 FLOP/s of an H100 SXM (989.5 TFLOP/s, :func:`teraflops.datasheets.published_peak`)."""
    return published_peak()[0]


def _check_fraction(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating)) or not 0 < x <= 1:
        raise CollectiveInputError(f"{name} must be a fraction in (0, 1], got {x!r}. "
                                   "Hint: MFU 0.4 means 40% of the peak FLOP/s goes into the model's math")
    return float(x)


def gradient_sync_rows(params=(1e9, 7e9, 13e9, 70e9), n: int = 8, bytes_per_grad: float = 2,
                       links=PUBLISHED_LINKS, fit: AlphaBeta | None = None, *, tokens_per_gpu: float | None = None,
                       peak_flops: float | None = None, mfu: float = 0.4) -> list[dict]:
    """Predicted ring all-reduce time (s) of one step's gradients, per model size and link, and the
    share of the step it takes.

    Each row: ``params``, ``bytes`` (``params × bytes_per_grad``: 2 for bf16 gradients) and, per link,
    :func:`~teraflops.hardware.alpha_beta.ring_allreduce_seconds` at the link's per-direction bandwidth with
    α = 0 (a ceiling: the best any implementation can do). The link is the ring's slowest hop for
    every rank: NVLink 4 only while all ``n`` GPUs share one NVLink domain (8 in an HGX H100); the
    bare InfiniBand row is a ring whose nodes each have one port; for nodes with several ports use
    :func:`~teraflops.datasheets.cross_node_link`. With ``fit`` (an all-reduce fit from
    :func:`~teraflops.hardware.alpha_beta.fit_rows`, measured on ``fit.ranks`` ranks) a ``"measured"`` column: the ring formula with ``B`` = the fit's busbw
    asymptote and ``α`` = fitted latency / ``2(fit.ranks − 1)`` per step, scaled to ``n`` ranks.

    With ``tokens_per_gpu`` (tokens each GPU processes per optimizer step: micro-batch × sequence
    length × accumulation steps) also ``compute``, the step's math time ``6 · params · tokens_per_gpu /
    (peak_flops · mfu)`` (:func:`train_flops`; ``peak_flops`` default the H100 SXM's dense bf16
    989.5 TFLOP/s, the datasheet in :data:`teraflops.datasheets.PUBLISHED`), and per column
    ``"<name> fraction"``: :func:`comm_fraction` with no overlap.

    Raises:
        CollectiveInputError: ``n < 2``, parameters, bytes, tokens or peak not > 0, ``mfu`` not in
            (0, 1], a fit of another collective or without its rank count.
    """
    check_ranks(n)
    counts = np.atleast_1d(check_positive("params", params))
    if np.ndim(bytes_per_grad) != 0:
        raise CollectiveInputError(f"bytes_per_grad must be one number, got {bytes_per_grad!r}. "
                                   "Hint: 2 for bf16 gradients, 4 for fp32")
    check_positive("bytes_per_grad", bytes_per_grad)
    if fit is not None and (fit.collective != "all_reduce" or fit.ranks is None):
        raise CollectiveInputError("fit must be an all-reduce fit that knows its rank count. "
                                   "Hint: fit_rows(rows, 'all_reduce') on a sweep's rows")
    peak = _h100_peak() if peak_flops is None else float(check_positive("peak_flops", peak_flops))
    _check_fraction("mfu", mfu)
    if tokens_per_gpu is not None:
        check_positive("tokens_per_gpu", tokens_per_gpu)
    names = [link.name for link in links] + (["measured"] if fit is not None else [])
    rows = []
    for p in counts:
        size = float(p) * bytes_per_grad
        row = {"params": float(p), "bytes": size}
        for link in links:
            row[link.name] = ring_allreduce_seconds(size, n, link.bandwidth)
        if fit is not None:
            row["measured"] = ring_allreduce_seconds(size, n, fit.bus_bandwidth, fit.alpha / (2 * (fit.ranks - 1)))
        if tokens_per_gpu is not None:
            row["compute"] = train_flops(float(p), tokens_per_gpu) / (peak * mfu)
            for k in names:
                row[f"{k} fraction"] = comm_fraction(row[k], row["compute"])
        rows.append(row)
    return rows


def gradient_sync_table(params=(1e9, 7e9, 13e9, 70e9), n: int = 8, bytes_per_grad: float = 2,
                        links=PUBLISHED_LINKS, fit: AlphaBeta | None = None, **compute) -> str:
    """:func:`gradient_sync_rows` as a table: one row per model, seconds per link; with
    ``tokens_per_gpu`` (and ``peak_flops``, ``mfu``) the compute time and each link's share of the step."""
    rows = gradient_sync_rows(params, n, bytes_per_grad, links, fit, **compute)
    names = [l.name for l in links] + (["measured"] if fit is not None else [])
    head = (f"# ring all-reduce of the gradients ({bytes_per_grad:g} bytes each) on n = {n} ranks: seconds per step "
            f"(links: α = 0, per-direction datasheet bandwidth"
            + (f"; measured: this machine's fit, busbw {fit.bus_bandwidth / GB:.3g} GB/s)" if fit else ")"))
    if "compute" in rows[0]:
        head += (f"\n# compute: 6·params·{compute['tokens_per_gpu']:g} tokens per GPU at MFU {compute.get('mfu', 0.4):g}"
                 " of the peak; (x%) = communication's share of the step with no overlap")
        cells = [[f"{r['params'] / 1e9:g}B", r["bytes"] / GB, r["compute"]]
                 + [f"{fmt(r[k])} ({r[k + ' fraction']:.0%})" for k in names] for r in rows]
        return head + "\n" + table(cells, ["model", "gradients (GB)", "compute (s)"] + [f"{k} (s)" for k in names])
    body = table([[f"{r['params'] / 1e9:g}B", r["bytes"] / GB] + [r[k] for k in names] for r in rows],
                 ["model", "gradients (GB)"] + [f"{k} (s)" for k in names])
    return head + "\n" + body


def comm_bound_tokens(n: int, bandwidth: float, bytes_per_grad: float = 2, peak_flops: float | None = None,
                      mfu: float = 0.4) -> float:
    """Tokens per GPU per step below which the gradient all-reduce takes longer than the math: the
    step is communication-bound. Setting the ring's ``2(n−1)/n · Ψ·b / B`` equal to ``6·Ψ·T /
    (peak · mfu)`` gives ``T* = 2(n−1)/n · b · peak · mfu / (6 · B)``: the model size ``Ψ`` cancels
    (both grow with it), so whether a job is communication-bound is decided by the tokens each GPU
    processes between syncs and the link, not by the model (α = 0; with latency small messages do
    worse). Sources as :func:`~teraflops.hardware.alpha_beta.ring_allreduce_seconds` and :func:`train_flops`.

    Args:
        n: ranks (>= 2). bandwidth: bytes/s per direction of each rank's link. bytes_per_grad: 2 for
            bf16. peak_flops: FLOP/s (default H100 SXM dense bf16). mfu: achieved fraction of the peak.

    Raises:
        CollectiveInputError: a value out of range.
    """
    check_ranks(n)
    b = float(check_positive("bandwidth", bandwidth))
    per = float(check_positive("bytes_per_grad", bytes_per_grad))
    peak = _h100_peak() if peak_flops is None else float(check_positive("peak_flops", peak_flops))
    return 2 * (n - 1) / n * per * peak * _check_fraction("mfu", mfu) / (6 * b)


def plot_comm_fraction(n: int = 8, links=PUBLISHED_LINKS, fit: AlphaBeta | None = None, params: float = 7e9,
                       peak_flops: float | None = None, mfu: float = 0.4, ax=None):
    """Communication's share of a step (no overlap) against tokens per GPU per step, one line per
    link (and the measured fit, scaled to ``n`` ranks, if given) for a ``params`` model on ``n``
    ranks, with the communication-bound half drawn: where each line crosses 50% is
    :func:`comm_bound_tokens`. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    tokens = np.logspace(4, 22, 73, base=2)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4))
    for i, t in enumerate(tokens):
        rows = gradient_sync_rows((params,), n, 2, links, fit, tokens_per_gpu=float(t), peak_flops=peak_flops, mfu=mfu)
        if i == 0:
            names = [k for k in rows[0] if k.endswith(" fraction")]
            series = {k: [] for k in names}
        for k in names:
            series[k].append(rows[0][k])
    for k, ys in series.items():
        ax.plot(tokens, ys, label=k.removesuffix(" fraction"), lw=2.5 if k.startswith("measured") else 1.5)
    ax.axhspan(0.5, 1.0, color="0.92", zorder=0)
    ax.text(tokens[-1], 0.97, "communication-bound", ha="right", va="top", fontsize="small", color="0.35")
    ax.set(xscale="log", xlabel="tokens per GPU per optimizer step (micro-batch × sequence × accumulation)",
           ylabel="share of the step in all-reduce", ylim=(0, 1),
           title=f"gradient all-reduce vs math: {params / 1e9:g}B parameters, n = {n}, MFU {mfu:g} (no overlap)")
    # below the axes, off the curves and the communication-bound band's label, at any figure scale
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, frameon=False)
    return ax


def gradient_sync_widget(fit=None):
    """Sliders for model size (parameters), number of GPUs, fabric, tokens per GPU per step and MFU →
    the predicted ring all-reduce time of bf16 gradients per step
    (:func:`teraflops.hardware.alpha_beta.ring_allreduce_seconds`, α = 0 on a datasheet link), the step's
    math time (6·params·tokens at MFU × the H100 SXM's 989.5 TFLOP/s), communication's share with no
    overlap, and the accumulation steps that bring it under 10%
    (:func:`teraflops.hardware.comm_budget.accumulation_for_fraction`). Fabrics: the published links and a node
    with 8 InfiniBand NDR ports (:func:`teraflops.datasheets.cross_node_link`). With ``fit`` (an all-reduce
    :class:`~teraflops.hardware.alpha_beta.AlphaBeta` from this machine's sweep) "this machine (measured)" is
    a fabric too, its busbw and per-step latency scaled to the chosen GPU count.

    Returns the ``ipywidgets.interactive``; its ``result`` is the row of
    :func:`teraflops.hardware.comm_budget.gradient_sync_rows` for the chosen fabric."""
    import ipywidgets as W

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
        print(f"{widgets.count_text(params)} parameters ({widgets.gb_text(2 * params / 1e9)} GB of bf16 gradients) on {gpus} GPUs over {fabric_label[fabric]}:\n"
              f"  all-reduce {fmt_seconds(sync)} per step, math {fmt_seconds(compute)} → {frac:.0%} of the step "
              f"in communication ({verdict}, no overlap)\n"
              f"  accumulate {k} micro-batch{'es' if k > 1 else ''} of {tokens_per_gpu:,} tokens per sync "
              "to keep it under 10%")
        if fabric == PUBLISHED_LINKS[0].name and gpus > 8:
            print("  note: NVLink 4 connects the 8 GPUs of an HGX H100 node; a ring of more GPUs crosses nodes, "
                  "and the fabric between them sets its speed")
        return row

    ui = W.interactive(show, **widgets.controls(
        params=W.SelectionSlider(options=[(widgets.count_text(n), n) for n in sizes], value=7e9, description="params"),
        gpus=W.SelectionSlider(options=[2**k for k in range(1, 14)], value=8, description="GPUs"),
        fabric=W.Dropdown(options=fabrics, value=PUBLISHED_LINKS[-1].name, description="fabric"),
        tokens_per_gpu=W.SelectionSlider(options=[2**k for k in range(8, 21)], value=8192, description="tokens/GPU"),
        mfu=W.FloatSlider(value=0.4, min=0.05, max=0.8, step=0.05, description="MFU"),
    ))
    widgets.show_widget(ui)
    return ui
