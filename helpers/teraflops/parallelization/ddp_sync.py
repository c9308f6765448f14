"""Unit 2 §3-4: relaxed (stale) gradient updates, and all-reduce overlapped with backward, measured.

Both experiments train the same small :class:`~teraflops.models.GPT` data-parallel on real ranks
(``workers/ddp_sync.py`` through :func:`~teraflops.launch.launcher.launch`: gloo on CPU, NCCL with
GPUs), in one launch by :func:`run` (a launch costs several seconds of process start-up).

* **Staleness** (§3). Synchronous data parallelism waits for the all-reduce of a step's gradients
  before updating. Relaxed schemes apply a gradient τ steps late, so its all-reduce can run behind
  the next τ steps' computation: asynchronous parameter servers (Dean et al., "Large Scale
  Distributed Deep Networks", NeurIPS 2012: Downpour SGD) and bounded staleness (Ho et al., "More
  Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NeurIPS 2013: SSP,
  workers at most s clocks apart). Here the delay is exactly τ on every rank, so all ranks keep the
  same parameters: the update at step t uses the gradient of step t − τ, computed on parameters τ
  updates older; τ = 0 is synchronous. More throughput, a worse model per step.
* **Overlap** (§4). PyTorch DDP groups gradients into buckets (``bucket_cap_mb``, 25 MiB by
  default) in reverse order of the forward pass and starts a bucket's all-reduce from an autograd
  hook as soon as all its gradients are ready, while backward computes the rest (Li et al.,
  "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, §3.2.3
  and Figure 7). Against it: one all-reduce of all gradients after backward, and, as the floor,
  the same steps with no communication. Both compute the same averaged gradient, so their losses
  agree (to float rounding: DDP divides before summing).

Units: times in ms (``time.perf_counter`` per step; medians over the timed steps, the slowest
rank's), losses in nats (mean next-token cross-entropy), throughput in samples (sequences) and
tokens per second over all ranks. The runs being compared take turns inside the launch, so drift
in other processes' load hits them alike; the first steps are not timed (see the worker's
docstring). What to expect on a small CPU machine, where the ranks' computation and gloo's
communication threads share the same few cores: each gloo all-reduce pays a latency of a few ms
whatever its size, so splitting the gradient into buckets adds about as much time as overlapping
saves, and DDP gains little or nothing. A stale update can gain more: its all-reduce can spread
over whole later steps, and the ranks may drift up to τ steps apart, so a rank that is momentarily
slow (another process took its core) no longer stalls the others at every step, which is the
straggler problem SSP was designed for; on a shared 2-core machine that gain swings by tens of
percent from run to run (measured 0.8× to 1.46×). Both are results, not faults.

The launch plumbing (:class:`RankLaunch`, :func:`launch_timed`) and the
reductions over ranks (:func:`slowest_median_ms`, :func:`mean_over_ranks`) also serve the DDP
remedies of Unit 5 (:mod:`teraflops.hardware.remedies`).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

from teraflops.launch.launcher import launch
from teraflops.launch.rank import RankIdentity
from teraflops.sizing import TrainConfig, dp_config
from teraflops.launch.placement import DataParallelPlan, data_parallel_plan
from teraflops.tables import table

WORKER = "teraflops.workers.ddp_sync"
TAUS = (0, 1, 4, 16)
LAST_STEPS = 5  # final_loss averages the global loss of this many last steps
MODE_LABELS = {"bucketed": "bucketed (overlap)", "after": "all-reduce after backward",
               "local": "no all-reduce (floor)"}
OVERLAP_MODES = tuple(MODE_LABELS)
BLOCK = 10  # steps a τ run takes in one turn (at least 2τ + WARMUP_STEPS + 1)
WARMUP_STEPS = 3  # untimed steps per run: first-call allocations, DDP's bucket rebuild after its first step


@dataclass(frozen=True)
class TrainedRank(RankIdentity):
    """Who trained which model: the fields every training rank's Result starts with (the
    data-parallel, remedies and straggler rank programs; :func:`teraflops.workers.common.trained_rank`
    fills them): the :class:`~teraflops.launch.rank.RankIdentity` (``rank``, ``world_size``,
    ``backend``, ``device``, ``node``), ``params`` (the model's parameters) and ``config`` (the
    :class:`~teraflops.sizing.TrainConfig` it trained)."""

    params: int
    config: TrainConfig


@dataclass(frozen=True)
class DataParallelSpec:
    """What :mod:`teraflops.workers.ddp_sync` runs: ``model`` trained ``steps`` steps per τ of
    ``taus`` (in turns of ``block`` steps) and ``overlap_steps`` per mode of ``modes``, for each of
    ``experiments`` (``"staleness"``, ``"overlap"``); ``bucket_mb``: DDP's bucket_cap_mb (MiB);
    ``warmup_steps``: untimed steps at the start of each run; ``timeout_s``: seconds a collective
    waits for the others."""

    model: TrainConfig
    experiments: tuple[str, ...]
    taus: tuple[int, ...]
    steps: int
    overlap_steps: int
    bucket_mb: float
    modes: tuple[str, ...] = OVERLAP_MODES
    block: int = BLOCK
    warmup_steps: int = WARMUP_STEPS
    timeout_s: float = 30

    def __post_init__(self):
        bad = set(self.experiments) - {"staleness", "overlap"} or set(self.modes) - set(OVERLAP_MODES)
        if bad or min(self.steps, self.block, self.overlap_steps) < 1 or min(self.taus, default=0) < 0 \
                or self.warmup_steps < 0:
            raise ValueError(f"unknown experiment or mode {sorted(bad)}, steps < 1 or a negative τ or warm-up in {self}")


@dataclass(frozen=True)
class StaleResult:
    """One τ on one rank: ``losses`` (nats) and ``step_s`` (s, None untimed) per step, ``updates``
    made during the steps, ``eval_loss`` of the held-out rows once the queue is drained."""

    tau: int
    losses: list[float]
    step_s: list[float | None]
    updates: int
    eval_loss: float


@dataclass(frozen=True)
class ModeResult:
    """One overlap mode on one rank: per step ``losses`` and the seconds of the step and its parts
    (None untimed); ``buckets``: all-reduces per step."""

    mode: str
    losses: list[float]
    step_s: list[float | None]
    forward_s: list[float | None]
    backward_s: list[float | None]
    comm_s: list[float | None]
    buckets: int


@dataclass(frozen=True)
class DataParallelResult(TrainedRank):
    """One rank's runs: one :class:`StaleResult` per τ and one :class:`ModeResult` per mode, in the
    spec's order; ``params`` of the model; ``config`` it trained."""

    staleness: tuple[StaleResult, ...]
    overlap: tuple[ModeResult, ...]


@dataclass(frozen=True, kw_only=True)
class RankLaunch:
    """What every data-parallel launch reports besides its rows (:func:`launch_timed` fills it in).

    The experiments' results (:class:`DataParallelRun`, :class:`teraflops.hardware.remedies.RemediesRun`)
    add their rows to these fields, which are keyword-only.

    Attributes:
        params: parameters of the model (its gradient is ``4 * params`` bytes, fp32).
        ranks, backend: data-parallel ranks and their torch.distributed backend.
        config: the model, batch and optimizer settings the ranks trained (:class:`~teraflops.sizing.TrainConfig`).
        load_avg: the machine's 1-minute load average before and after the launch (other
            processes' load makes timings noisy).
        wall_s: seconds the launch took, process start-up included.
    """

    params: int
    ranks: int
    backend: str
    config: TrainConfig
    load_avg: tuple
    wall_s: float


@dataclass(frozen=True)
class DataParallelRun(RankLaunch):
    """What :func:`run` measured: the rows below, and the model and launch of :class:`RankLaunch`
    (``params``, ``ranks``, ``backend``, ``config``, ``load_avg``, ``wall_s``).

    Attributes:
        staleness: rows of :func:`staleness_rows`, one per τ.
        overlap: rows of :func:`overlap_rows`, one per mode.
    """

    staleness: list
    overlap: list


def launch_timed(worker: str, plan: DataParallelPlan, spec, result, *, timeout: float,
                 desc: str, cluster=None) -> tuple[list, dict]:
    """Launch ``worker`` with ``spec`` on ``plan.placement`` (:func:`~teraflops.launch.launcher.launch`),
    its ranks' results read as ``result`` (a dataclass with ``params``, ``world_size``, ``backend``
    and ``config``), and time the launch; with ``cluster`` (an emulated
    :class:`~teraflops.nodes.cluster.Cluster`), the ranks are spread over its nodes
    (:func:`~teraflops.launch.placement.across`).

    Returns:
        The ranks' results (rank 0 first) and the keyword arguments of :class:`RankLaunch`:
        ``params``, ``ranks`` (``world_size``), ``backend`` and ``config`` from rank 0's result,
        ``load_avg`` (1-minute load average before and after) and ``wall_s``.

    Raises:
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    before, start = os.getloadavg()[0], time.perf_counter()
    results = launch(worker, plan.placement, spec=spec, result=result, timeout=timeout, desc=desc, cluster=cluster)
    r0 = results[0]
    return results, {"params": r0.params, "ranks": r0.world_size, "backend": r0.backend, "config": r0.config,
                     "load_avg": (before, os.getloadavg()[0]), "wall_s": time.perf_counter() - start}


def dp_spec(plan: DataParallelPlan, *, taus=TAUS, steps=None, overlap_steps=None,
            experiments=("staleness", "overlap"), collective_timeout: float = 30) -> DataParallelSpec:
    """The worker's :class:`DataParallelSpec` from ``plan.preset``: its ``comm_gpt``
    (:func:`~teraflops.sizing.dp_config`), ``dp.steps``, ``dp.overlap_steps``, ``dp.bucket_mb``."""
    p = plan.preset
    return DataParallelSpec(model=dp_config(p), experiments=tuple(experiments), taus=tuple(int(t) for t in taus),
                            steps=steps or p.dp.steps, overlap_steps=overlap_steps or p.dp.overlap_steps,
                            bucket_mb=p.dp.bucket_mb, timeout_s=collective_timeout)


def run(taus=TAUS, steps: int | None = None, overlap_steps: int | None = None, plan: DataParallelPlan | None = None,
        experiments=("staleness", "overlap"), timeout: float = 300) -> DataParallelRun:
    """Run the staleness sweep and the overlap comparison in one launch.

    Args:
        taus: staleness values (steps a gradient is applied late); 0 is synchronous. The first
            is the baseline of ``speedup`` and the loss deltas.
        steps, overlap_steps: training steps per τ and per overlap mode (default: the preset's
            ``dp.steps``, ``dp.overlap_steps``).
        plan: ranks and sizes (default :func:`~teraflops.launch.placement.data_parallel_plan`).
        experiments: ``"staleness"``, ``"overlap"`` or both.
        timeout: seconds for the whole launch.

    Raises:
        ValueError: a negative τ.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    if any(int(t) < 0 for t in taus):
        raise ValueError(f"taus must be >= 0 (steps a gradient is applied late), got {tuple(taus)}")
    plan = plan or data_parallel_plan()
    spec = dp_spec(plan, taus=taus, steps=steps, overlap_steps=overlap_steps, experiments=experiments)
    results, launched = launch_timed(WORKER, plan, spec, DataParallelResult, timeout=timeout,
                                     desc="data parallel: " + " and ".join(experiments))
    return DataParallelRun(staleness_rows(results), overlap_rows(results), **launched)


def run_overlap(steps: int | None = None, plan: DataParallelPlan | None = None) -> list[dict]:
    """Only the overlap comparison (one launch): :func:`overlap_rows`."""
    return run(overlap_steps=steps, plan=plan, experiments=("overlap",)).overlap


def slowest_median_ms(per_rank_seconds: list[list]) -> float:
    """The slowest rank's median step time, in ms.

    Args:
        per_rank_seconds: per rank, its step times in seconds; ``None`` marks an untimed step
            (warm-up).

    Returns:
        ``1e3 ×`` the largest of the ranks' medians over their timed steps (a synchronous step ends
        when its slowest rank does); NaN if some rank has no timed step.
    """
    timed = [[t for t in s if t is not None] for s in per_rank_seconds]
    return 1e3 * max(statistics.median(t) for t in timed) if all(timed) else float("nan")


def mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """Per step, the mean over ranks of their values (one list per rank, steps aligned; the
    result is as long as the shortest). With equal micro-batches on every rank, the mean of the
    ranks' losses is the loss of the global batch (nats)."""
    return [sum(v) / len(v) for v in zip(*per_rank)]


def staleness_rows(results: list[DataParallelResult]) -> list[dict]:
    """One row per τ from the ranks' results of a launch.

    Keys: ``tau``; ``step_ms`` (median step time); ``samples_per_s``, ``tokens_per_s`` (all ranks);
    ``speedup`` (step time of the first row, τ = 0 by default, over this one's); ``final_loss``
    (mean global loss of the last :data:`LAST_STEPS` steps) and ``loss_delta`` (minus the first
    row's); ``eval_loss`` (held-out batches, after the last gradient was applied, so every τ
    has made the same number of updates) and ``eval_delta``; ``updates`` (optimizer steps made
    during training: ``max(0, steps - tau)``); ``losses`` (global loss per step).
    """
    cfg, world = results[0].config, results[0].world_size
    samples = world * cfg.micro_batch
    rows = []
    for run0 in results[0].staleness:
        runs = [next(s for s in r.staleness if s.tau == run0.tau) for r in results]
        losses = mean_over_ranks([r.losses for r in runs])
        step_ms = slowest_median_ms([r.step_s for r in runs])
        tail = losses[-LAST_STEPS:]
        rows.append({"tau": run0.tau, "step_ms": step_ms, "samples_per_s": samples / step_ms * 1e3,
                     "tokens_per_s": samples * cfg.seq_len / step_ms * 1e3,
                     "final_loss": sum(tail) / len(tail), "eval_loss": run0.eval_loss,
                     "updates": run0.updates, "losses": losses})
    for row in rows:
        row["speedup"] = rows[0]["step_ms"] / row["step_ms"]
        row["loss_delta"] = row["final_loss"] - rows[0]["final_loss"]
        row["eval_delta"] = row["eval_loss"] - rows[0]["eval_loss"]
    return rows


def overlap_rows(results: list[DataParallelResult]) -> list[dict]:
    """One row per mode from the ranks' results of a launch.

    Keys: ``mode`` (label), ``step_ms``, ``forward_ms``, ``backward_ms`` (DDP's includes waiting
    for its last buckets' all-reduces, which finish inside ``backward()``), ``comm_ms`` (waiting
    for the all-reduce after backward returned: 0 for DDP), ``exposed_ms`` (step time minus the
    no-communication floor's: the communication not hidden; None without the floor), ``buckets``
    (all-reduces per step), ``max_loss_diff`` (largest per-step difference of the global loss from
    the after-backward mode; None for the floor, whose ranks train apart), ``losses``.
    """
    rows = []
    for run0 in results[0].overlap:
        runs = [next(m for m in r.overlap if m.mode == run0.mode) for r in results]
        row = {"mode": MODE_LABELS[run0.mode], "key": run0.mode}
        for name in ("step", "forward", "backward", "comm"):
            row[f"{name}_ms"] = slowest_median_ms([getattr(r, f"{name}_s") for r in runs])
        row.update(buckets=run0.buckets, losses=mean_over_ranks([r.losses for r in runs]))
        rows.append(row)
    floor = next((r for r in rows if r["key"] == "local"), None)
    after = next((r for r in rows if r["key"] == "after"), None)
    for row in rows:
        row["exposed_ms"] = row["step_ms"] - floor["step_ms"] if floor and row is not floor else None
        row["max_loss_diff"] = (None if row["key"] == "local" or after is None else
                                max(abs(a - b) for a, b in zip(row["losses"], after["losses"])))
    return rows


def staleness_table(rows: list[dict]) -> str:
    """The staleness rows as a text table."""
    return table([(r["tau"], r["step_ms"], r["tokens_per_s"], f"{r['speedup']:.2f}×", r["final_loss"],
                   f"{r['loss_delta']:+.3f}", r["eval_loss"], f"{r['eval_delta']:+.3f}") for r in rows],
                 ["τ", "step ms", "tokens/s", "speedup", "final loss", "Δ loss", "eval loss", "Δ eval"])


def overlap_table(rows: list[dict]) -> str:
    """The overlap rows as a text table."""
    return table([(r["mode"], r["step_ms"], r["forward_ms"], r["backward_ms"], r["comm_ms"],
                   "-" if r["exposed_ms"] is None else r["exposed_ms"], r["buckets"],
                   "-" if r["max_loss_diff"] is None else f"{r['max_loss_diff']:.1e}") for r in rows],
                 ["mode", "step ms", "forward ms", "backward ms", "comm after bwd ms", "exposed comm ms", "buckets",
                  "max |Δ loss|"])


def plot_staleness(rows: list[dict]):
    """Loss curves by τ (left) and throughput against final loss (right); returns the Figure."""
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_trade) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        line, = ax_loss.plot(range(len(r["losses"])), r["losses"], label=f"τ = {r['tau']}")
        ax_trade.scatter(r["final_loss"], r["tokens_per_s"], color=line.get_color(), s=50, zorder=3)
        ax_trade.annotate(f"τ = {r['tau']}  ({r['speedup']:.2f}×)", (r["final_loss"], r["tokens_per_s"]),
                          textcoords="offset points", xytext=(6, 4), fontsize="small")
    ax_loss.set(xlabel="step", ylabel="training loss (nats, global batch)", title="Loss by staleness τ")
    ax_loss.legend()
    ax_trade.set(xlabel=f"final loss (nats, mean of the last {LAST_STEPS} steps)", ylabel="tokens/s (all ranks)",
                 title="Throughput against loss")
    ax_trade.grid(alpha=0.3)
    ax_trade.margins(x=0.25, y=0.15)
    fig.tight_layout()
    return fig


def plot_overlap(rows: list[dict]):
    """Median step time per mode, split into forward, backward, communication after backward and
    the rest (optimizer step); returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.9 * len(rows) + 1.6))
    labels = [r["mode"] for r in rows][::-1]
    left = [0.0] * len(rows)
    parts = [("forward_ms", "forward"), ("backward_ms", "backward (DDP: with its all-reduces)"),
             ("comm_ms", "all-reduce after backward")]
    for key, name in parts:
        vals = [r[key] for r in rows][::-1]
        ax.barh(labels, vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    rest = [max(0.0, r["step_ms"] - x) for r, x in zip(rows[::-1], left)]
    ax.barh(labels, rest, left=left, label="optimizer and rest", color="lightgrey")
    for y, r in enumerate(rows[::-1]):
        ax.text(max(r["step_ms"], left[y] + rest[y]), y, f"  {r['step_ms']:.1f} ms", va="center")
    ax.set(xlabel="median time per step (ms)", title="DDP bucketing (overlap) vs all-reduce after backward")
    ax.set_xlim(0, 1.25 * max(r["step_ms"] for r in rows))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize="small", frameon=False)
    fig.tight_layout()
    return fig
