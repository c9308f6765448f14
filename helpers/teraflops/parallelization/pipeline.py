"""Unit 2 · pipeline parallelism: GPipe and 1F1B on real ranks, the bubble measured against (p−1)/(m+p−1).

The GPT's blocks are split into ``p`` consecutive stages, one per rank (the first also holds the
embeddings, the last the final norm and the head: :func:`stage_module`); a batch is cut into ``m``
micro-batches that flow through the stages (``torch.distributed.pipelining``,
https://pytorch.org/docs/stable/distributed.pipelining.html).

* **GPipe** (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism", arXiv:1811.06965): all ``m`` forwards, then all ``m`` backwards. With equal stages
  and times ``t_f``, ``t_b`` per micro-batch the step takes ``(m + p − 1)(t_f + t_b)`` of which each
  stage is busy ``m(t_f + t_b)``: the **bubble** fraction is ``(p − 1)/(m + p − 1)``
  (:func:`bubble_fraction`; GPipe §2.3, Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473, §2.2.1). A stage keeps the
  activations of all ``m`` micro-batches until their backward.
* **1F1B** (PipeDream-Flush, Narayanan et al. 2021 §2.2.1): after ``p − s − 1`` warm-up forwards,
  stage ``s`` alternates one forward and one backward: the same bubble, but at most ``p − s``
  micro-batches in flight, so activation memory is bounded by ``p`` micro-batches, not ``m``.
  torch's ``Schedule1F1B`` refuses ``m < p`` (the run says so in its row).

Measured (``workers/pipeline.py``): per stage, the seconds inside each micro-batch's forward and
backward (``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``, timed between two
synchronisations of the stage's device: on a GPU a call returns when its kernels are queued), over the step's span
(from the first micro-batch's start on any stage to the last one's end): ``bubble = 1 − busy / span``.
What the formula leaves out is in the measurement: the stages are not equal (the first holds the
embeddings, the last the head and the loss), and each hand-over of activations or their gradients
between ranks (gloo, ~1 ms on loopback) sits on the critical path. Activation memory per
stage = the most micro-batches in flight (forward done, backward not yet; from those events) × the
bytes autograd saves for one micro-batch on that stage (counted with ``saved_tensors_hooks``, each
storage once). :func:`stage_sweep` and :func:`stage_table` put several stage counts in one table, the
bubble measured beside the formula. Units: seconds (ms in tables), bytes (MiB in tables), fractions.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import torch.nn as nn

from teraflops.errors import CourseError
from teraflops.gpu_fit import launch_timeout, rank_config, train_step_flops
from teraflops.launch import launcher
from teraflops.launch.placement import place
from teraflops.launch.rank import RankIdentity
from teraflops.sizing import PRESETS, TrainConfig, mp_config
from teraflops.parallelization.tensor_parallel import rank_flops
from teraflops.tables import fmt_bytes, table

WORKER = "teraflops.workers.pipeline"
SCHEDULES = ("gpipe", "1f1b")


class PipelineError(CourseError, ValueError):
    """A pipeline that cannot be built: more stages than blocks, unknown schedule, bad counts."""


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """``(p − 1)/(m + p − 1)``: the idle fraction of a GPipe or 1F1B step with equal stages (GPipe
    §2.3; Narayanan et al. 2021 §2.2.1).

    Raises:
        PipelineError: ``stages`` or ``micro_batches`` not a positive int.
    """
    for name, v in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"{name} must be a positive int, got {v!r}. Hint: p ranks, m micro-batches per step")
    return (stages - 1) / (micro_batches + stages - 1)


class Stage(nn.Module):
    """Stage ``index`` of ``stages`` of a :class:`~teraflops.models.GPT`: its slice of ``blocks``,
    with the embeddings on the first (input: int64 tokens ``(b, s)``) and the final norm and head on
    the last (output: logits ``(b, s, vocab)``); otherwise ``(b, s, d_model)`` activations in and out.
    The head keeps its own copy of the tied embedding weight when it is on another stage."""

    def __init__(self, gpt, index: int, stages: int):
        super().__init__()
        n = len(gpt.blocks)
        lo, hi = index * n // stages, (index + 1) * n // stages
        self.first, self.last = index == 0, index == stages - 1
        self.tok, self.pos = (gpt.tok, gpt.pos) if self.first else (None, None)
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if self.last else (None, None)

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def stage_module(gpt, index: int, stages: int) -> Stage:
    """:class:`Stage` ``index`` of ``stages``; raises :class:`PipelineError` with more stages than blocks."""
    if not 1 <= stages <= len(gpt.blocks) or not 0 <= index < stages:
        raise PipelineError(f"{stages} stages of a {len(gpt.blocks)}-block GPT (stage {index}). "
                            "Hint: at most one stage per block")
    return Stage(gpt, index, stages)


@dataclass(frozen=True)
class PipelineSpec:
    """What :mod:`teraflops.workers.pipeline` runs: ``model`` (``micro_batch``: sequences per
    micro-batch) under each schedule of ``schedules`` and micro-batch count of ``micro_batches``,
    ``steps`` timed steps after ``warmup`` untimed ones; SGD at ``model.lr``; ``timeout_s`` per collective."""

    model: TrainConfig
    schedules: tuple[str, ...]
    micro_batches: tuple[int, ...]
    steps: int
    warmup: int
    timeout_s: float = 60

    def __post_init__(self):
        if not self.schedules or set(self.schedules) - set(SCHEDULES) or not self.micro_batches \
                or min(self.micro_batches) < 1 or self.steps < 1 or self.warmup < 0:
            raise PipelineError(f"schedules {self.schedules!r} must be some of {SCHEDULES}, micro_batches "
                                f"{self.micro_batches!r} >= 1, steps >= 1. Hint: pipeline.run(cfg, 2, micro_batches=(4, 8))")


@dataclass(frozen=True)
class ScheduleResult:
    """One schedule and micro-batch count on one stage: ``refused`` (the schedule's one-line error, or
    None), ``busy_s`` and ``span_s`` per timed step, ``events`` of the last step (``[kind, micro-batch,
    start_s, end_s]``, ``kind`` ``"F"``/``"B"``, seconds from the step's start), ``peak_in_flight``
    (micro-batches), ``saved_bytes`` (activations autograd saved for one micro-batch), ``loss_diff``
    (last stage: |pipeline loss − unsplit model's| on the same batch, else None)."""

    schedule: str
    micro_batches: int
    refused: str | None
    busy_s: list[float]
    span_s: list[float]
    events: list[list]
    peak_in_flight: int
    saved_bytes: int
    loss_diff: float | None


@dataclass(frozen=True)
class PipelineResult(RankIdentity):
    """One stage's runs (``stage`` = rank), one :class:`ScheduleResult` per (schedule, m)."""

    stage: int
    runs: tuple[ScheduleResult, ...]


def run(cfg: TrainConfig, stages: int = 2, *, schedules=SCHEDULES, micro_batches=(1, 4, 8, 16), steps: int = 2,
        warmup: int = 1, timeout: float | None = None) -> list[dict]:
    """Train ``cfg``'s GPT as a ``stages``-rank pipeline under each schedule and micro-batch count
    (one launch); rows of :func:`bubble_rows`. On CPU ranks (fewer GPUs than stages) at most the CPU
    preset's sizes (:func:`teraflops.gpu_fit.rank_config`); ``timeout`` None: every step's FLOPs at
    the rank's measured FLOP/s (:func:`teraflops.gpu_fit.launch_timeout`).

    Raises:
        PipelineError: bad counts, more stages than blocks.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    placement = place(stages, cpu_ranks=stages)
    cfg = rank_config(cfg, placement.on_gpus, replace(mp_config(PRESETS["cpu"], PRESETS["cpu"].mp.pp_micro_batch),
                                                      layers=max(stages, PRESETS["cpu"].mp.pp_layers)))
    if stages < 2 or stages > cfg.layers:
        raise PipelineError(f"{stages} stages for {cfg.layers} blocks. Hint: 2 <= stages <= layers")
    spec = PipelineSpec(model=cfg, schedules=tuple(schedules), micro_batches=tuple(micro_batches), steps=steps,
                        warmup=warmup)
    if timeout is None:  # every (schedule, m) point: its steps of m micro-batches, the whole model's FLOPs on one rank's rate
        flops = sum(m * train_step_flops(cfg) for m in spec.micro_batches) * len(spec.schedules)
        timeout = launch_timeout(steps + warmup, flops, rank_flops("cuda" if placement.on_gpus else "cpu",
                                                                   1 if placement.on_gpus else stages))
    results = launcher.launch(WORKER, placement, spec=spec, result=PipelineResult,
                              timeout=timeout, desc=f"pipeline x{stages}: " + ", ".join(schedules))
    return bubble_rows(results)


def bubble_rows(results: list[PipelineResult]) -> list[dict]:
    """One row per (schedule, m): ``schedule``, ``m``, ``p``, ``refused``, ``bubble`` (mean over
    stages of the median over steps of ``1 − busy/span``), ``bubble_per_stage``, ``theory``
    (:func:`bubble_fraction`), ``step_ms`` (median span), ``peak_in_flight`` and ``activation_bytes``
    per stage (in flight × saved bytes per micro-batch), ``events`` per stage, ``loss_diff``."""
    p, rows = len(results), []
    for i, r0 in enumerate(results[0].runs):
        per = [r.runs[i] for r in results]
        row = {"schedule": r0.schedule, "m": r0.micro_batches, "p": p, "refused": r0.refused,
               "theory": bubble_fraction(p, r0.micro_batches)}
        if r0.refused is None:
            stage_bubbles = [statistics.median(1 - b / s for b, s in zip(x.busy_s, x.span_s)) for x in per]
            row.update(bubble=statistics.mean(stage_bubbles), bubble_per_stage=stage_bubbles,
                       step_ms=statistics.median(per[0].span_s) * 1e3, peak_in_flight=[x.peak_in_flight for x in per],
                       activation_bytes=[x.peak_in_flight * x.saved_bytes for x in per],
                       events=[x.events for x in per], loss_diff=per[-1].loss_diff)
        rows.append(row)
    return rows


def bubble_table(rows: list[dict]) -> str:
    """The rows as a table: measured bubble against (p−1)/(m+p−1), in-flight micro-batches and
    activation memory per stage."""
    out = []
    for r in rows:
        if r["refused"]:
            out.append((r["schedule"], r["m"], "refused", f"{r['theory']:.0%}", "", "", r["refused"][:60]))
            continue
        out.append((r["schedule"], r["m"], f"{r['bubble']:.0%}", f"{r['theory']:.0%}", r["step_ms"],
                    " / ".join(map(str, r["peak_in_flight"])), " / ".join(fmt_bytes(b) for b in r["activation_bytes"])))
    return table(out, ["schedule", "m", "bubble", "(p-1)/(m+p-1)", "step ms", "in flight per stage",
                       "activations per stage"])


def plot_timeline(row: dict):
    """One step's timeline per stage (forward and backward of each micro-batch as bars); returns the Figure."""
    import matplotlib.pyplot as plt  # lazy: plotting only in the lecture

    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * row["p"]))
    for s, events in enumerate(row["events"]):
        for kind, mb, start, end in events:
            ax.barh(s, (end - start) * 1e3, left=start * 1e3, color="tab:blue" if kind == "F" else "tab:orange",
                    edgecolor="white")
            ax.text((start + end) / 2 * 1e3, s, str(mb), ha="center", va="center", fontsize="x-small", color="white")
    ax.set(yticks=range(row["p"]), yticklabels=[f"stage {s}" for s in range(row["p"])], xlabel="ms from the step's start",
           title=f"{row['schedule']}, m = {row['m']}: bubble {row['bubble']:.0%} (theory {row['theory']:.0%}); "
                 "blue forward, orange backward")
    ax.invert_yaxis()
    fig.tight_layout()
    return fig


def stage_sweep(cfg: TrainConfig, stages=(2, 4), *, micro_batches=(1, 4, 8), known=(), **kwargs) -> list[dict]:
    """:func:`run` at each stage count in ``stages`` (one launch each) over ``micro_batches``; rows of
    :func:`bubble_rows` for every ``p``, by schedule, ``p`` and ``m``. Rows in ``known`` (an earlier
    :func:`run`'s) stand for their ``p`` if it is one of ``stages`` (those of ``micro_batches``), which is
    then not launched again. Keywords go to :func:`run` (``schedules``, ``steps``, ``warmup``, ``timeout``)."""
    rows = [r for r in known if r["m"] in micro_batches and r["p"] in stages]
    have = {r["p"] for r in rows}
    for p in stages:
        if p not in have:
            rows += run(cfg, p, micro_batches=micro_batches, **kwargs)
    order = {s: i for i, s in enumerate(SCHEDULES)}
    return sorted(rows, key=lambda r: (order.get(r["schedule"], len(order)), r["p"], r["m"]))


def stage_table(rows: list[dict]) -> str:
    """Rows of several stage counts (:func:`stage_sweep`) as one table: per schedule, ``p`` and ``m``, the
    measured bubble beside ``(p−1)/(m+p−1)`` (:func:`bubble_fraction`) and the difference in points, and
    the step's span."""
    out = []
    for r in rows:
        theory = bubble_fraction(r["p"], r["m"])
        if r["refused"]:
            out.append((r["schedule"], r["p"], r["m"], "refused", f"{theory:.0%}", "", "", r["refused"][:50]))
            continue
        out.append((r["schedule"], r["p"], r["m"], f"{r['bubble']:.0%}", f"{theory:.0%}",
                    f"{(r['bubble'] - theory) * 100:+.0f}", r["step_ms"], ""))
    return table(out, ["schedule", "p", "m", "bubble", "(p-1)/(m+p-1)", "points off", "step ms", "note"])
