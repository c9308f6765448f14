"""Naive attention against FlashAttention: time, peak memory and HBM traffic over sequence length.

Three implementations of ``softmax(Q Kᵀ / √d) V`` for ``(batch, heads, seq_len, head_dim)`` inputs:

* ``naive``: :func:`naive_attention` materialises the ``seq_len × seq_len`` scores and
  probabilities in memory (Vaswani et al. 2017, "Attention Is All You Need", eq. 1);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, which picks a fused backend
  (flash, memory-efficient, cuDNN or math); :func:`sdpa_backend` reports which one actually ran;
* ``triton``: the course's own FlashAttention forward kernel (:mod:`teraflops.model_definition.flash_triton`).

:func:`training_sweep` times forward *and* backward (what training pays) for naive attention, the
course's FlashAttention-2 autograd Functions (tiled PyTorch, :mod:`teraflops.model_definition.flash_pytorch`,
and Triton) and SDPA: autograd saves naive attention's ``N × N`` probabilities for the backward
pass and builds two more ``N × N`` gradients there; FlashAttention-2 saves one log-sum-exp per row.

Models shown next to the measurements (Dao et al. 2022, "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", arXiv:2205.14135):

* HBM traffic of standard attention (their Algorithm 0): read Q, K, write S; read S, write P;
  read P, V, write O = ``4·N·d + 4·N²`` elements per head, Θ(Nd + N²) (Theorem 2).
* HBM traffic of FlashAttention with on-chip memory of M bytes: Θ(N²d²/M) (Theorem 2). We count
  our kernel's loop order (FlashAttention-2, Dao 2023, arXiv:2307.08691: Q tile outer, K/V
  inner): Q read and O written once, K and V read once per Q tile of ``Br`` rows, with
  ``Br = M / (4·d·bytes)`` rows so that the Q, K, V and O tiles fit: ``2Nd + 2Nd·⌈N/Br⌉`` elements.
* Peak memory: naive holds at least two ``N × N`` matrices (scores and probabilities) plus the
  output; flash holds the output and one fp32 log-sum-exp per row.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from teraflops import widgets
from teraflops.errors import DTypeError, ShapeError
from teraflops.machine import triton_mode
from teraflops.memory import peak_memory
from teraflops.model_definition.flash_pytorch import FlashAttentionPytorch
from teraflops.model_definition.flash_triton import FlashAttentionTriton, flash_attention
from teraflops.tables import table
from teraflops.timing import benchmark, format_seconds

IMPLEMENTATIONS = ("naive", "sdpa", "triton")

# aten kernel that ran → readable backend name (torch/nn/attention/__init__.py lists the backends).
SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU kernel)",
    "_scaled_dot_product_flash_attention": "flash (FlashAttention-2)",
    "_scaled_dot_product_efficient_attention": "memory-efficient (xFormers)",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_attention_math": "math (unfused)",
}


def check_qkv(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a one-line :class:`ShapeError`/:class:`DTypeError` unless q, k, v are 4-D
    ``(batch, heads, seq_len, head_dim)`` floating tensors of the same shape and dtype."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name}: {n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name}: {n} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise DTypeError(f"{name}: {n} must be a floating-point tensor, got {t.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ShapeError(f"{name}: q, k, v must have the same shape, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(f"{name}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """``softmax(q kᵀ / √d) v``, materialising the ``(B, H, N, N)`` scores.

    Args: q, k, v of shape ``(B, H, N, d)``, one floating dtype. Returns ``(B, H, N, d)``.
    Raises: :class:`ShapeError`, :class:`DTypeError` (one line).
    """
    check_qkv("naive_attention", q, k, v)
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa(q, k, v, causal: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (PyTorch picks the backend)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def sdpa_backend(q, k, v, causal: bool = False) -> str:
    """Which SDPA backend ran for these inputs, read from the aten kernel in a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sdpa(q, k, v, causal)
    names = {e.name.removeprefix("aten::") for e in prof.events()}
    found = [label for kernel, label in SDPA_KERNELS.items() if kernel in names]
    return found[0] if found else "unknown"


def triton_attention(q, k, v, causal: bool = False) -> torch.Tensor:
    """The course's Triton FlashAttention forward (see :mod:`teraflops.model_definition.flash_triton`)."""
    return flash_attention(q, k, v, causal=causal)


IMPL_FUNCS = {"naive": naive_attention, "sdpa": sdpa, "triton": triton_attention}


# --- models ----------------------------------------------------------------------------------

def standard_attention_hbm_bytes(seq_len: int, head_dim: int, elem_bytes: int) -> int:
    """HBM bytes per (batch, head) of standard attention: ``(4·N·d + 4·N²)·bytes`` (Dao et al. 2022, Alg. 0)."""
    return (4 * seq_len * head_dim + 4 * seq_len**2) * elem_bytes


def flash_attention_hbm_bytes(seq_len: int, head_dim: int, elem_bytes: int, sram_bytes: int) -> int:
    """HBM bytes per (batch, head) of a FlashAttention-2-ordered forward with ``sram_bytes`` of on-chip
    memory: ``(2Nd + 2Nd·⌈N/Br⌉)·bytes`` with ``Br = sram_bytes / (4·d·bytes)`` (Θ(N²d²/M), Dao et al. 2022, Thm. 2)."""
    rows = max(1, sram_bytes // (4 * head_dim * elem_bytes))
    return (2 * seq_len * head_dim + 2 * seq_len * head_dim * math.ceil(seq_len / rows)) * elem_bytes


def naive_peak_bytes(batch: int, heads: int, seq_len: int, head_dim: int, elem_bytes: int) -> int:
    """Model of naive attention's extra memory: scores and probabilities (two N×N per head) plus the output."""
    return batch * heads * (2 * seq_len**2 + seq_len * head_dim) * elem_bytes


def flash_peak_bytes(batch: int, heads: int, seq_len: int, head_dim: int, elem_bytes: int) -> int:
    """Model of FlashAttention's extra memory: the output plus one fp32 log-sum-exp per row."""
    return batch * heads * seq_len * (head_dim * elem_bytes + 4)


# --- the sweep -------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionResult:
    """One implementation at one sequence length. seconds per call, peak_bytes above inputs;
    both None when the run ran out of memory (``oom``)."""

    impl: str
    seq_len: int
    seconds: float | None
    peak_bytes: int | None
    max_error: float | None  # max |out - sdpa| in the input dtype
    oom: bool = False

    def tflops(self, batch: int, heads: int, head_dim: int) -> float | None:
        """Achieved TFLOP/s with the forward count ``4·B·H·N²·d`` (two matmuls)."""
        if self.seconds is None:
            return None
        return 4 * batch * heads * self.seq_len**2 * head_dim / self.seconds / 1e12


def is_oom(e: BaseException) -> bool:
    """True if ``e`` is an out-of-memory error: CUDA's ``OutOfMemoryError`` or a message saying so (the CPU
    allocator's, the Triton launcher's), so that an OOM becomes a data point instead of a crash."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def release_cached_memory(device) -> None:
    """After an out-of-memory error: collect garbage and, on a GPU, hand the caching allocator's
    free blocks back (``torch.cuda.empty_cache``). Call it *after* the ``except`` block, never
    inside: while an exception is being handled its traceback keeps the failed call's frames,
    and so their tensors, alive, and ``empty_cache`` cannot free what is still referenced."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def measured_or_oom(measure, impl: str, n: int, device: str) -> "AttentionResult":
    """``measure()``'s :class:`AttentionResult`, or, when it ran out of memory, an ``oom=True`` data point
    for ``impl`` at ``n`` (the sweep goes on). Any other error re-raises."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - only OOM is a data point; everything else re-raises
        if not is_oom(e):
            raise
    # outside the except: the traceback no longer holds the failed call's tensors, so they can be freed
    release_cached_memory(device)
    return AttentionResult(impl, n, None, None, None, oom=True)


def attention_sweep(seq_lens, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: str,
                    impls=IMPLEMENTATIONS, min_run_time: float = 0.1, progress: bool = True) -> list[AttentionResult]:
    """Time and peak memory of each implementation at each sequence length.

    An out-of-memory error (GPU) is caught and recorded as a data point (``oom=True``); the sweep
    goes on. Under the Triton interpreter the Triton kernel is timed with as few calls as possible.
    """
    from tqdm.auto import tqdm

    results = []
    bar = tqdm(total=len(seq_lens) * len(impls), desc="attention sweep", disable=not progress)
    for n in seq_lens:
        g = torch.Generator(device=device).manual_seed(n)
        q, k, v = (torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype, generator=g) for _ in range(3))
        ref = sdpa(q, k, v)
        for impl in impls:
            fn = IMPL_FUNCS[impl]
            bar.set_postfix(N=n, impl=impl)

            def measure(fn=fn, impl=impl):
                fn(q, k, v)  # warm-up: first calls compile/autotune (and may allocate for that)
                peak, out = peak_memory(lambda: fn(q, k, v), device)
                err = (out.float() - ref.float()).abs().max().item()
                del out
                slow = impl == "triton" and triton_mode() == "interpreter"
                t = benchmark(lambda: fn(q, k, v), min_run_time=0.0 if slow else min_run_time, warmup=0)
                return AttentionResult(impl, n, t.median, peak, err)

            results.append(measured_or_oom(measure, impl, n, device))
            bar.update()
        del q, k, v, ref
        if device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()  # hand cached blocks back: the next N needs larger ones
    bar.close()
    return results


# --- forward + backward ------------------------------------------------------------------------

TRAINING_IMPLS = ("naive", "flash2-pytorch", "flash2-triton", "sdpa")
TRAINING_FUNCS = {
    "naive": naive_attention,
    "flash2-pytorch": lambda q, k, v, causal=False: FlashAttentionPytorch.apply(q, k, v, causal),
    "flash2-triton": lambda q, k, v, causal=False: FlashAttentionTriton.apply(q, k, v, causal),
    "sdpa": sdpa,
}


def training_flops(batch: int, heads: int, seq_len: int, head_dim: int) -> float:
    """FLOPs of attention's forward plus backward: the forward's two matmuls (4·B·H·N²·d) and the
    backward's five (dV, dP, dQ, dK and the recomputed S: 10·B·H·N²·d), the FlashAttention-2 paper's
    convention (Dao 2023, §4.1: backward counted as 2.5× the forward)."""
    return 3.5 * 4 * batch * heads * seq_len**2 * head_dim


def training_sweep(seq_lens, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: str,
                   impls=TRAINING_IMPLS, min_run_time: float = 0.1, causal: bool = False,
                   progress: bool = True, tiled_pytorch_max_n: int = 4096) -> list[AttentionResult]:
    """Time and peak memory of one forward + backward step (``out.backward(dO)``) of each
    implementation at each sequence length.

    Returns :class:`AttentionResult` per (impl, N): ``seconds`` per step, ``peak_bytes`` above the
    inputs during the step (the saved activations, the backward's temporaries and the three
    gradients), ``max_error`` the largest |dQ, dK, dV − SDPA's| in the input dtype. An out-of-memory
    error is a data point, as in :func:`attention_sweep`. Under the Triton interpreter the Triton
    step is run twice only (memory, then time): one call takes seconds there. ``flash2-pytorch`` is
    left out above ``tiled_pytorch_max_n``: its Python loop visits (N/64)² tile pairs, a million at
    N = 65,536.
    """
    from tqdm.auto import tqdm

    results = []
    bar = tqdm(total=len(seq_lens) * len(impls), desc="forward+backward sweep", disable=not progress)
    for n in seq_lens:
        g = torch.Generator(device=device).manual_seed(n)
        q, k, v, do = (torch.randn(batch, heads, n, head_dim, device=device, dtype=dtype, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step(fn):
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v, causal).backward(do)
            return [t.grad for t in (q, k, v)]

        ref = [t.detach().clone() for t in step(sdpa)]
        for impl in impls:
            if impl == "flash2-pytorch" and n > tiled_pytorch_max_n:
                bar.update()
                continue
            fn = TRAINING_FUNCS[impl]
            bar.set_postfix(N=n, impl=impl)

            def measure(fn=fn, impl=impl):
                slow = impl == "flash2-triton" and triton_mode() == "interpreter"
                if not slow:
                    step(fn)  # warm-up: compiling, autotuning, the allocator's first blocks
                peak, grads = peak_memory(lambda: step(fn), device)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, ref))
                del grads
                t = benchmark(lambda: step(fn), min_run_time=0.0 if slow else min_run_time, warmup=0)
                return AttentionResult(impl, n, t.median, peak, err)

            results.append(measured_or_oom(measure, impl, n, device))
            bar.update()
        del q, k, v, do, ref
        if device == "cuda":
            release_cached_memory(device)
    bar.close()
    return results


def training_table(results: list[AttentionResult], batch: int, heads: int, head_dim: int) -> str:
    """Per N and implementation: forward+backward time, TFLOP/s (:func:`training_flops`), measured peak
    MiB and the max gradient error against SDPA."""
    rows = []
    for r in results:
        if r.oom:
            rows.append((r.seq_len, r.impl, "OOM", "-", "OOM", "-"))
        else:
            rows.append((r.seq_len, r.impl, format_seconds(r.seconds),
                         training_flops(batch, heads, r.seq_len, head_dim) / r.seconds / 1e12,
                         r.peak_bytes / 2**20, f"{r.max_error:.1e}"))
    return table(rows, ["N", "impl", "fwd+bwd time", "TFLOP/s", "peak MiB", "max grad err"])


def sweep_table(results: list[AttentionResult], batch: int, heads: int, head_dim: int, elem_bytes: int) -> str:
    """Per N and implementation: time, TFLOP/s, measured peak MiB, modelled peak MiB, max error."""
    rows = []
    for r in results:
        model = (naive_peak_bytes if r.impl == "naive" else flash_peak_bytes)(batch, heads, r.seq_len, head_dim, elem_bytes)
        if r.oom:
            rows.append((r.seq_len, r.impl, "OOM", "-", "OOM", model / 2**20, "-"))
        else:
            rows.append((r.seq_len, r.impl, format_seconds(r.seconds), r.tflops(batch, heads, head_dim),
                         r.peak_bytes / 2**20, model / 2**20, f"{r.max_error:.1e}"))
    return table(rows, ["N", "impl", "time", "TFLOP/s", "peak MiB", "model MiB", "max err"])


def memory_ratio(results: list[AttentionResult], seq_len: int, flash_impl: str = "triton") -> float | None:
    """Peak memory of naive / ``flash_impl`` at ``seq_len`` (None if either is missing or OOM)."""
    by = {(r.impl, r.seq_len): r for r in results}
    a, b = by.get(("naive", seq_len)), by.get((flash_impl, seq_len))
    if not a or not b or a.oom or b.oom or not b.peak_bytes:
        return None
    return a.peak_bytes / b.peak_bytes


def plot_sweep(results: list[AttentionResult], batch: int, heads: int, head_dim: int, elem_bytes: int,
               models: bool = True):
    """Two panels against N: time per call and peak memory (OOM drawn as ×), with the forward's memory
    models unless ``models`` is False (a forward+backward sweep has no model drawn)."""
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in dict.fromkeys(r.impl for r in results):
        rs = [r for r in results if r.impl == impl]
        ok = [r for r in rs if not r.oom]
        line = ax_t.loglog([r.seq_len for r in ok], [r.seconds for r in ok], "o-", label=impl)[0]
        ax_m.loglog([r.seq_len for r in ok], [r.peak_bytes / 2**20 for r in ok], "o-", color=line.get_color(), label=impl)
        for r in rs:
            if r.oom:
                ax_m.plot([r.seq_len], [max(x.peak_bytes for x in ok) / 2**20 if ok else 1], "x",
                          color=line.get_color(), ms=12, mew=3, label=f"{impl}: out of memory")
    ns = sorted({r.seq_len for r in results})
    if models:
        ax_m.loglog(ns, [naive_peak_bytes(batch, heads, n, head_dim, elem_bytes) / 2**20 for n in ns], "k:",
                    label="model: naive (2 N² + Nd)")
        ax_m.loglog(ns, [flash_peak_bytes(batch, heads, n, head_dim, elem_bytes) / 2**20 for n in ns], "k--",
                    label="model: flash (Nd + N)")
    for ax in (ax_t, ax_m):
        ax.set_xticks(ns, [f"{n:,}" for n in ns])
        ax.minorticks_off()
    ax_t.set(xlabel="sequence length N", ylabel="seconds per call", title="Time")
    ax_m.set(xlabel="sequence length N", ylabel="peak MiB above inputs", title="Peak memory")
    ax_t.legend(fontsize="small")
    ax_m.legend(fontsize="small")
    fig.tight_layout()
    return fig


def attention_memory_figure(log2_seq_len: int, head_dim: int, heads: int, batch: int, element_size: int):
    """The figure of :func:`attention_memory_widget`: naive vs flash attention's extra memory in GB
    (1e9 bytes) as horizontal bars on a log axis, against the 80 GB of an H100 and the 141 GB of an
    H200 (NVIDIA's datasheets), each capacity's label on its own side of its line and inside the frame.
    Returns ``(fig, ax)``."""
    import math

    import matplotlib.pyplot as plt

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
        ax.text(gb, 0.5, name, fontsize="small", ha=side, va="center", transform=ax.get_xaxis_transform())
    ax.set_xlabel("extra memory for one attention call (GB = 1e9 bytes)")
    ax.set_title(f"N = {n:,}: naive {widgets.bytes_text(naive * 1e9)} vs flash {widgets.bytes_text(flash * 1e9)} ({naive / flash:,.0f}×)", fontsize="medium")
    fig.tight_layout()
    return fig, ax


def attention_memory_widget():
    """Sliders for sequence length, head dim, heads, batch and dtype → predicted extra memory of
    naive vs flash attention (:func:`teraflops.model_definition.attention.naive_peak_bytes` / ``flash_peak_bytes``),
    drawn against the 80 GB and 141 GB (GB = 1e9) of an H100 and an H200."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    sizes = {"fp32": 4, "bf16 / fp16": 2, "fp8": 1}

    def show(log2_seq_len, head_dim, heads, batch, dtype):
        attention_memory_figure(log2_seq_len, head_dim, heads, batch, sizes[dtype])
        plt.show()

    ui = W.interactive(show, **widgets.controls(
        log2_seq_len=W.IntSlider(value=13, min=8, max=18, description="log2 N"),
        head_dim=W.Dropdown(options=[32, 64, 128, 256], value=64, description="head dim"),
        heads=W.IntSlider(value=32, min=1, max=128, description="heads"),
        batch=W.IntSlider(value=1, min=1, max=64, description="batch"),
        dtype=W.Dropdown(options=list(sizes), value="bf16 / fp16", description="dtype"),
    ))
    widgets.show_widget(ui)
    return ui
