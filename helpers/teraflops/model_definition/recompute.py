"""Unit 1 · activation recomputation: trade one extra forward for the activations, measured on the course GPT.

Training keeps every activation the backward needs until the backward reaches it: memory ``O(L)`` in
the layers and linear in the batch. **Recomputation** (gradient checkpointing; Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174) keeps only each block's input
and runs the block's forward again during the backward (``torch.utils.checkpoint``,
https://pytorch.org/docs/stable/checkpoint.html, ``use_reentrant=False``): per block, the saved
activations shrink to one ``(b, s, h)`` tensor, at the price of one more forward of the blocks. A
forward is ~1/3 of a training step's FLOPs (backward ≈ 2× forward; Kaplan et al. 2020 §2.1), so
recomputing every block costs up to ``(1 + 2 + 1)/(1 + 2) = 4/3`` of the FLOPs (less: embeddings
and head are not recomputed). Checkpointing every ``√L`` blocks instead gives ``O(√L)`` memory for
the same one extra forward (Chen et al. §3); here each block is one segment.

Measured, one process (:func:`measure`): the peak memory of a training step above what was
allocated before it, from the allocator (CUDA: ``torch.cuda.max_memory_allocated``) or, on the CPU,
from ``torch.profiler``'s memory events (each operator's own allocations and frees, added up in time
order: :func:`profiler_peak`); the FLOPs (``torch.utils.flop_counter.FlopCounterMode``); the step
time (fastest of ``repeats``, interleaved). The process's RSS would hide the saving: glibc keeps freed memory
unless told otherwise (``MALLOC_MMAP_THRESHOLD_``). Units: bytes (MiB in tables), FLOPs, seconds.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from teraflops.errors import CourseError
from teraflops.models import GPT, lm_loss
from teraflops.tables import fmt_bytes, table


class RecomputeError(CourseError, ValueError):
    """Bad input to the recomputation measurement (a batch or budget that is not positive, too few rows)."""


class Checkpointed(nn.Module):
    """``block`` whose forward runs under ``torch.utils.checkpoint`` while training: its activations
    are recomputed in the backward instead of kept (``(b, s, h)`` in, the same out)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.block(x, *args, **kwargs)
        return checkpoint(self.block, x, *args, use_reentrant=False, **kwargs)


def with_recompute(model: GPT) -> GPT:
    """``model`` with every block wrapped in :class:`Checkpointed`, in place (same weights, same
    outputs and gradients); returns it."""
    model.blocks = nn.ModuleList(b if isinstance(b, Checkpointed) else Checkpointed(b) for b in model.blocks)
    return model


def profiler_peak(prof) -> int:
    """Peak bytes above the start of a ``torch.profiler.profile(profile_memory=True)`` run: every
    operator's own allocations and frees (``self_cpu_memory_usage``; CUDA's on a GPU) and the frees
    outside operators (``[memory]`` events), summed in time order."""
    cuda = any(e.self_device_memory_usage for e in prof.events())
    own = "self_device_memory_usage" if cuda else "self_cpu_memory_usage"
    changes = [(e.time_range.start, getattr(e, own)) for e in prof.events() if getattr(e, own)]
    level = peak = 0
    for _, delta in sorted(changes):
        level += delta
        peak = max(peak, level)
    return peak


def train_step(model: GPT, tokens: torch.Tensor) -> float:
    """One forward and backward (next-token loss on ``tokens``, int64 ``(b, s)``); the loss (nats)."""
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.item()


def peak_bytes(model: GPT, tokens: torch.Tensor) -> int:
    """Peak memory of one :func:`train_step` above what was allocated before it (bytes): CUDA's
    allocator on a GPU, ``torch.profiler``'s memory events on the CPU (:func:`profiler_peak`)."""
    if tokens.device.type == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(tokens.device)
        base = torch.cuda.memory_allocated(tokens.device)
        torch.cuda.reset_peak_memory_stats(tokens.device)
        train_step(model, tokens)
        return torch.cuda.max_memory_allocated(tokens.device) - base
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(model, tokens)
    return profiler_peak(prof)


def measure(cfg, batches=(4, 8, 16, 32), repeats: int = 5, device="cpu") -> list[dict]:
    """With and without recomputation, for each batch (sequences of ``cfg.seq_len`` tokens) of
    ``cfg``'s GPT (a :class:`~teraflops.sizing.TrainConfig`; same seed, same data): one row each.

    ``device``: where this one process runs the sweep: a data-parallel plan's ``local_device``
    (:class:`~teraflops.launch.placement.DataParallelPlan`), the GPU wherever there is one. Not
    ``plan.preset.device``: on one GPU the ranks are CPU ranks, so the plan's preset is the CPU's.

    Returns:
        Rows ``batch``, ``recompute`` (bool), ``oom`` (bool), ``peak_bytes`` (:func:`peak_bytes`), ``flops``
        (one step, ``FlopCounterMode``), ``step_s`` (the fastest of ``repeats`` steps, the two settings
        taking turns: the least disturbed by other processes), ``loss``. A setting whose step runs out
        of memory (``torch.OutOfMemoryError``: 2×T4 at batch 32 needs ~18 GB of activations without
        recomputation) is a row too (:func:`out_of_memory_row`), and the sweep goes on: that recomputation
        still fits there is the lesson.

    Raises:
        RecomputeError: a batch that is not a positive int.
    """
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise RecomputeError(f"batches must be positive ints, got {batches!r}. Hint: sequences per step, e.g. (4, 8)")
    torch.manual_seed(cfg.seed)
    plain = GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len).to(device)
    torch.manual_seed(cfg.seed)
    recomputed = with_recompute(GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len).to(device))
    g = torch.Generator().manual_seed(cfg.seed + 1)
    rows = []
    for batch in batches:
        tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=g).to(device)
        pair, got = ((False, plain), (True, recomputed)), {}
        for flag, model in pair:
            try:
                train_step(model, tokens)  # warm-up: first-call allocations
                peak = peak_bytes(model, tokens)
                with FlopCounterMode(display=False) as flops:
                    loss = train_step(model, tokens)
            except torch.OutOfMemoryError as e:  # the memory ceiling is a point of the sweep, not its end
                got[flag] = out_of_memory_row(batch, flag, e)
                model.zero_grad(set_to_none=True)
                _release(tokens.device)
                continue
            got[flag] = {"batch": batch, "recompute": flag, "oom": False, "peak_bytes": peak,
                         "flops": flops.get_total_flops(), "loss": loss, "times": []}
        ran = [(flag, model) for flag, model in pair if not got[flag]["oom"]]
        for _ in range(repeats):  # interleaved, against drift in the machine's load
            for flag, model in ran:
                start = time.perf_counter()
                train_step(model, tokens)
                if tokens.device.type == "cuda":
                    torch.cuda.synchronize(tokens.device)
                got[flag]["times"].append(time.perf_counter() - start)
        for flag, _ in pair:
            row = got[flag]
            if not row["oom"]:
                row["step_s"] = min(row.pop("times"))
            rows.append(row)
    return rows


def out_of_memory_row(batch: int, recompute: bool, error: BaseException) -> dict:
    """The row of a batch whose step ran out of memory: ``oom`` True, its first line as ``error``, no
    measurements (``peak_bytes``, ``flops``, ``step_s``, ``loss`` None)."""
    return {"batch": batch, "recompute": recompute, "oom": True, "error": str(error).split("\n")[0][:200],
            "peak_bytes": None, "flops": None, "step_s": None, "loss": None}


def _release(device) -> None:
    """Hand what the failed step held back to the device (the next batch starts from a clean allocator)."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def recompute_table(rows: list[dict]) -> str:
    """Rows of :func:`measure` as a table, each batch's with-recomputation row beside its ratios
    (``out of memory`` where a step ran out of it; no ratio against such a row)."""
    base = {r["batch"]: r for r in rows if not r["recompute"]}

    def ratio(r, key):
        b = base.get(r["batch"])
        return "" if r.get("oom") or b is None or b.get("oom") else f"{r[key] / b[key]:.2f}×"

    return table([(r["batch"], "yes" if r["recompute"] else "no", "out of memory", "", "", "", "", "")
                  if r.get("oom") else
                  (r["batch"], "yes" if r["recompute"] else "no", fmt_bytes(r["peak_bytes"]), ratio(r, "peak_bytes"),
                   r["flops"] / 1e9, ratio(r, "flops"), r["step_s"] * 1e3, ratio(r, "step_s")) for r in rows],
                 ["batch", "recompute", "peak memory", "× plain", "GFLOP", "× plain", "step ms", "× plain"])


def largest_batch(rows: list[dict], budget_bytes: float, recompute: bool) -> int:
    """The largest batch whose peak fits ``budget_bytes``, from the line ``peak = a + b·batch`` fitted
    (least squares) to the measured rows with ``recompute`` (out-of-memory rows have no peak: left out);
    0 if not even one sequence fits.

    Raises:
        RecomputeError: fewer than two measured batches, or a budget that is not > 0.
    """
    pts = [(r["batch"], r["peak_bytes"]) for r in rows if r["recompute"] == recompute and not r.get("oom")]
    if len({b for b, _ in pts}) < 2 or not budget_bytes > 0:
        raise RecomputeError(f"need two or more measured batches and a budget > 0 bytes, got {len(pts)} rows and "
                             f"{budget_bytes!r}. Hint: measure(cfg, batches=(4, 8, 16))")
    n = len(pts)
    mx, my = sum(b for b, _ in pts) / n, sum(p for _, p in pts) / n
    slope = sum((b - mx) * (p - my) for b, p in pts) / sum((b - mx) ** 2 for b, _ in pts)
    intercept = my - slope * mx
    return max(0, int((budget_bytes - intercept) // slope)) if slope > 0 else 0
