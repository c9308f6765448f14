"""Unit 5 §2: remedies for gradient communication, measured on real DDP runs: accumulation and compression.

One launch (:func:`run`; ``workers/remedies.py`` through :func:`~teraflops.launch.launcher.launch`:
gloo ranks on CPU, one NCCL rank per GPU with two or more GPUs) trains the same small
:class:`~teraflops.models.GPT` with PyTorch ``DistributedDataParallel`` under each setting of
:data:`SETTINGS`, from the same seed on the same micro-batches, and counts the bytes each rank
hands to ``all_reduce`` (counted in the ranks, not computed: see the worker's docstring).

* **Gradient accumulation** (``accumulate``): ``k`` micro-batches per optimizer step, the first
  ``k − 1`` inside ``DDP.no_sync()``, so gradients are all-reduced once per ``k`` micro-batches:
  bytes per sample fall ``k``-fold, bytes per step stay those of the whole gradient (PyTorch DDP
  docs, ``no_sync``; Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
  2017, on what a ``k``× larger batch does to optimisation). Design choice: every setting sees the
  same micro-batches, so at the end every setting has trained on the same samples, and
  ``accumulate`` has made ``k``× fewer, ``k``× larger updates than ``baseline`` (same learning rate):
  its loss difference is the price of the larger batch, not of a changed gradient. The control
  ``accumulate-sync`` makes the same updates without ``no_sync`` (DDP then all-reduces after every
  micro-batch): equal losses, ``k``× the bytes.
* **Compression hooks** (PyTorch DDP communication hooks, ``torch.distributed.algorithms.
  ddp_comm_hooks``; https://pytorch.org/docs/stable/ddp_comm_hooks.html): ``fp16`` / ``bf16``
  cast each bucket to 16 bits before the all-reduce (half the bytes per step; fp16 keeps 10
  mantissa bits, bf16 7 but fp32's range); ``powersgd`` replaces each gradient matrix ``M``
  (``n × m``) by a rank-``r`` product ``P Qᵀ`` found by one step of power iteration, and all-reduces
  ``P`` (``n × r``) and ``Q`` (``m × r``) instead of ``M``, with the error fed back into the next
  step (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019): ``(n + m)·r`` instead of ``n·m`` elements per matrix; vectors
  (biases, norms) and matrices not worth compressing (``(n + m)·r·2 ≥ n·m``) go uncompressed; the
  first ``start_powerSGD_iter`` steps are plain all-reduce. On gloo, PowerSGD runs with one
  bucket (its callbacks' collectives would otherwise be ordered differently on different ranks and
  hang: :data:`~teraflops.workers.remedies.ONE_BUCKET_WHY`).
* **Bucketing** overlaps the all-reduce with backward: measured in :mod:`teraflops.parallelization.ddp_sync`
  (the overlap experiment); every setting here uses DDP's buckets (``dp.bucket_mb``).

Units: bytes as counted in each rank, printed in binary multiples (KiB = 1024 B, MiB = 2**20 B;
:func:`teraflops.tables.fmt_bytes`) in tables and plots (the all-reduce payload ``S``; the ring moves ``2(n−1)/n·S``
over each rank's link, :func:`teraflops.hardware.alpha_beta.ring_allreduce_seconds`); a sample is one
sequence of the global batch (all ranks); times in ms (median over the timed optimizer steps, the
slowest rank's); losses in nats: ``eval_loss`` on held-out batches after the last step, and the
per-micro-batch training loss of the global micro-batch (mean over ranks).

What to expect on the 2-core CPU machine (4 gloo ranks, the ``cpu`` preset's 1.6 M-parameter GPT,
6.4 MB (GB = 1e9 B; 6.11 MiB) of fp32 gradients in 4 buckets; six settings × 32 micro-batches of 16 sequences; measured
~44 s with the launch): accumulation ``k = 4`` cuts bytes per sample exactly 4× (6.11 MiB per step
either way; 391 → 97.7 KiB per sample), but its 8 updates instead of 32 leave the held-out loss
~1.2 nats higher after the same samples; ``accumulate-sync`` gives the same loss with 4× the
bytes. fp16 and bf16 halve the bytes (3.05 MiB per step) and change the loss by < 1e-4 nats.
PowerSGD rank 2 sends 96.6 KiB per step (65× fewer; 13× per sample over the whole run, its two
plain steps included) but, with Adam over only 30 compressed steps, costs ~1.1 nats of held-out
loss (rank 8: 20× fewer bytes, +0.34 nats; rank 2 starting at step 16: +0.31). Communication is a
small part of a step on loopback with 2 cores, so step times gain far less than the bytes: PowerSGD's
compression arithmetic (QR, matmuls) makes its steps slower here, and the per-sample gain of
accumulation (~1.6–2.2×) is mostly the 3 all-reduces it skips, each paying gloo's ~5 ms latency.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from teraflops.parallelization.ddp_sync import (RankLaunch, TrainedRank, launch_timed, mean_over_ranks,
    slowest_median_ms)
from teraflops.errors import CourseError
from teraflops.sizing import TrainConfig, dp_config
from teraflops.launch.placement import DataParallelPlan, data_parallel_plan
from teraflops.tables import fmt_bytes, table

SETTINGS = ("baseline", "accumulate", "accumulate-sync", "fp16", "bf16", "powersgd")
WORKER = "teraflops.workers.remedies"
LABELS = {"baseline": "baseline (sync every micro-batch)", "accumulate": "accumulate k, no_sync",
          "accumulate-sync": "accumulate k, sync every micro-batch", "fp16": "fp16 compression hook",
          "bf16": "bf16 compression hook", "powersgd": "PowerSGD rank r"}
ROW_KEYS = ("setting", "k", "steps", "bytes_per_step", "bytes_per_sample", "step_ms", "eval_loss")


class RemediesError(CourseError, ValueError):
    """Bad settings or rows for the remedies experiment (one line, with a hint)."""


@dataclass(frozen=True)
class RemediesSpec:
    """What :mod:`teraflops.workers.remedies` runs: ``model`` trained on ``micro_batches``
    micro-batches per rank under each of ``settings``; ``accum``: k of the accumulation settings;
    PowerSGD's ``powersgd_rank`` and ``powersgd_start``; DDP's ``bucket_mb`` (MiB); ``timeout_s``:
    seconds a collective waits for the others. Checked on construction (:class:`RemediesError`)."""

    model: TrainConfig
    settings: tuple[str, ...]
    micro_batches: int
    accum: int
    powersgd_rank: int
    powersgd_start: int
    bucket_mb: float
    timeout_s: float = 30

    def __post_init__(self):
        _check_settings(self.settings, self.micro_batches, self.accum, self.powersgd_rank, self.powersgd_start)


@dataclass(frozen=True)
class RemedyResult:
    """One setting on one rank: ``losses`` per micro-batch (this rank's, nats); per optimizer step
    ``step_s`` (s, None untimed), ``step_bytes`` and ``step_calls`` (what ``all_reduce`` was
    handed), ``step_bucket_bytes`` and ``step_buckets`` (what DDP handed the hook); DDP's
    ``bucket_mb``; ``eval_loss`` of the held-out rows."""

    setting: str
    k: int
    losses: list[float]
    step_s: list[float | None]
    step_bytes: list[int]
    step_bucket_bytes: list[int]
    step_calls: list[int]
    step_buckets: list[int]
    bucket_mb: float
    eval_loss: float


@dataclass(frozen=True)
class RemediesResult(TrainedRank):
    """One rank's runs, one :class:`RemedyResult` per setting of the spec, in its order."""

    micro_batches: int
    powersgd_rank: int
    powersgd_start: int
    runs: tuple[RemedyResult, ...]


@dataclass(frozen=True)
class RemediesRun(RankLaunch):
    """What :func:`run` measured: the rows below, and the model and launch of
    :class:`~teraflops.parallelization.ddp_sync.RankLaunch` (``params``: fp32 gradients of ``4 * params`` bytes
    per step; ``ranks``, ``backend``, ``config`` (a :class:`~teraflops.sizing.TrainConfig`), ``load_avg``,
    ``wall_s``). ``str()`` gives :func:`remedies_table`.

    Attributes:
        rows: rows of :func:`remedy_rows`, one per setting, in the order run.
    """

    rows: list

    def __str__(self) -> str:
        return remedies_table(self.rows)


def _check_settings(settings, micro_batches: int, accum: int, powersgd_rank: int, powersgd_start: int) -> None:
    settings = tuple(settings)
    bad = [s for s in settings if s not in SETTINGS]
    if not settings or bad:
        raise RemediesError(f"unknown setting(s) {bad or 'none given'}. Hint: choose from {', '.join(SETTINGS)}")
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise RemediesError(f"accum must be an int >= 1 (micro-batches per optimizer step), got {accum!r}. "
                            "Hint: accum=4 sums 4 micro-batches' gradients before one all-reduce")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1 \
            or micro_batches % accum:
        raise RemediesError(f"micro_batches must be a positive multiple of accum = {accum}, got {micro_batches!r}. "
                            f"Hint: every setting must end on a whole optimizer step")
    if not isinstance(powersgd_rank, int) or powersgd_rank < 1 or not isinstance(powersgd_start, int) \
            or powersgd_start < 2:
        raise RemediesError(f"powersgd_rank must be >= 1 and powersgd_start >= 2, got {powersgd_rank!r}, "
                            f"{powersgd_start!r}. Hint: PowerSGD with error feedback needs start_powerSGD_iter > 1")


def remedies_spec(plan: DataParallelPlan, settings=SETTINGS, *, micro_batches: int | None = None,
                  accum: int | None = None, powersgd_rank: int | None = None, powersgd_start: int | None = None,
                  collective_timeout: float = 30) -> RemediesSpec:
    """The worker's :class:`RemediesSpec` from ``plan.preset``'s ``remedy`` sizes, its ``comm_gpt``
    model (:func:`~teraflops.sizing.dp_config`) and ``dp.bucket_mb``.

    Raises:
        RemediesError: an unknown setting, ``accum < 1``, ``micro_batches`` not a multiple of
            ``accum``, ``powersgd_rank < 1`` or ``powersgd_start < 2``.
    """
    p = plan.preset
    def pick(value, default):
        return default if value is None else value

    mb, k = pick(micro_batches, p.remedy.micro_batches), pick(accum, p.remedy.accum)
    r, start = pick(powersgd_rank, p.remedy.powersgd_rank), pick(powersgd_start, p.remedy.powersgd_start)
    _check_settings(settings, mb, k, r, start)
    return RemediesSpec(model=dp_config(p), settings=tuple(settings), micro_batches=mb, accum=k, powersgd_rank=r,
                        powersgd_start=start, bucket_mb=p.dp.bucket_mb, timeout_s=collective_timeout)


def run(settings=SETTINGS, *, micro_batches: int | None = None, accum: int | None = None,
        powersgd_rank: int | None = None, powersgd_start: int | None = None, plan: DataParallelPlan | None = None,
        timeout: float = 300, cluster=None) -> RemediesRun:
    """Train every setting in one launch and measure it.

    Args:
        settings: names from :data:`SETTINGS`; ``"baseline"`` (else the first) is the reference
            of the ratios and loss differences.
        micro_batches: micro-batches per rank per setting (default the preset's
            ``remedy.micro_batches``); a multiple of ``accum``.
        accum: ``k`` of the accumulation settings (default ``remedy.accum``, 4).
        powersgd_rank, powersgd_start: PowerSGD's ``matrix_approximation_rank`` and
            ``start_powerSGD_iter`` (defaults ``remedy_powersgd_*``: 2 and 2).
        plan: ranks and sizes (default :func:`~teraflops.launch.placement.data_parallel_plan` with the
            preset's ``remedy.ranks_cpu`` CPU ranks).
        timeout: seconds for the whole launch.
        cluster: an emulated :class:`~teraflops.nodes.cluster.Cluster` (up) to spread the ranks over its nodes.

    Raises:
        RemediesError: bad settings (see :func:`remedies_spec`), before anything is launched.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    if plan is None:
        base = data_parallel_plan()
        plan = data_parallel_plan(base.preset, ranks_cpu=base.preset.remedy.ranks_cpu)
    spec = remedies_spec(plan, settings, micro_batches=micro_batches, accum=accum, powersgd_rank=powersgd_rank,
                         powersgd_start=powersgd_start)
    results, launched = launch_timed(WORKER, plan, spec, RemediesResult, timeout=timeout,
                                     desc="remedies: " + ", ".join(settings), cluster=cluster)
    return RemediesRun(remedy_rows(results), **launched)


def remedy_rows(results: list[RemediesResult]) -> list[dict]:
    """One row per setting from the ranks' results of a launch (then :func:`add_ratios`).

    Keys: ``setting``, ``label``, ``k`` (micro-batches per optimizer step), ``steps`` (optimizer
    steps), ``samples`` (sequences trained on, all ranks), ``bytes_per_step`` (the bytes one rank
    all-reduced in the last optimizer step: the steady state, after PowerSGD's plain first steps),
    ``bucket_bytes_per_step`` (median bytes of the fp32 buckets DDP handed to the hook),
    ``calls_per_step`` (median ``all_reduce`` calls),
    ``buckets_per_step`` (median hook calls: DDP buckets, ``k`` × for ``accumulate-sync``),
    ``bytes_per_sample`` (all the bytes one rank all-reduced over the run, PowerSGD's plain first
    steps included, over ``samples``), ``step_ms``, ``samples_per_s``, ``final_loss`` (mean global
    training loss of the last ``k_max`` micro-batches), ``eval_loss``, ``losses`` (global training
    loss per micro-batch), ``samples_per_micro_batch``.

    Raises:
        RemediesError: ranks counted different bytes for one setting (they all-reduce together, so
            the counts must agree).
    """
    r0 = results[0]
    per_micro = r0.world_size * r0.config.micro_batch
    tail = max(r.k for r in r0.runs)
    rows = []
    for run0 in r0.runs:
        runs = [next((s for s in r.runs if s.setting == run0.setting), None) for r in results]
        if any(r is None or r.step_bytes != run0.step_bytes for r in runs):
            raise RemediesError(f"{run0.setting}: ranks counted different all-reduce bytes "
                                f"{[r and sum(r.step_bytes) for r in runs]}. Hint: every rank must run the same settings")
        losses = mean_over_ranks([r.losses for r in runs])
        steps, k = len(run0.step_bytes), run0.k
        samples = len(losses) * per_micro
        step_ms = slowest_median_ms([r.step_s for r in runs])
        label = LABELS[run0.setting].replace(" k", f" k={k}").replace("rank r", f"rank {r0.powersgd_rank}")
        rows.append({"setting": run0.setting, "label": label, "k": k, "steps": steps, "samples": samples,
                     "samples_per_micro_batch": per_micro,
                     "bytes_per_step": run0.step_bytes[-1],
                     "bucket_bytes_per_step": statistics.median(run0.step_bucket_bytes),
                     "calls_per_step": statistics.median(run0.step_calls),
                     "buckets_per_step": statistics.median(run0.step_buckets),
                     "bytes_per_sample": sum(run0.step_bytes) / samples, "step_ms": step_ms,
                     "samples_per_s": k * per_micro / step_ms * 1e3,
                     "final_loss": sum(losses[-tail:]) / len(losses[-tail:]), "eval_loss": run0.eval_loss,
                     "losses": losses})
    return add_ratios(rows)


def _check_rows(rows) -> None:
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, dict) for r in rows):
        raise RemediesError(f"rows must be a non-empty list of dicts, got {type(rows).__name__}. "
                            "Hint: pass remedy_rows(...) or run().rows")
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise RemediesError(f"row {r.get('setting', '?')!r} lacks {missing}. Hint: make rows with remedy_rows()")
        if not r["bytes_per_step"] > 0 or not r["bytes_per_sample"] > 0:
            raise RemediesError(f"row {r['setting']!r}: bytes must be > 0, got {r['bytes_per_step']!r} per step and "
                                f"{r['bytes_per_sample']!r} per sample. Hint: a setting that all-reduced nothing "
                                f"cannot be compared")


def add_ratios(rows: list[dict], baseline: str = "baseline") -> list[dict]:
    """Add, to every row (in place; returned), the comparison with the baseline row (the one whose
    ``setting`` is ``baseline``, else the first): ``sample_cut`` and ``step_cut`` (the baseline's
    bytes per sample / per step over this row's: 4.0 means 4× fewer bytes), ``speedup`` (time per
    micro-batch, ``step_ms / k``, of the baseline over this row's), ``eval_delta`` and
    ``final_delta`` (this row's loss minus the baseline's, nats).

    Raises:
        RemediesError: rows that are not a list of row dicts with positive byte counts.
    """
    _check_rows(rows)
    base = next((r for r in rows if r["setting"] == baseline), rows[0])
    for r in rows:
        r["sample_cut"] = base["bytes_per_sample"] / r["bytes_per_sample"]
        r["step_cut"] = base["bytes_per_step"] / r["bytes_per_step"]
        r["speedup"] = (base["step_ms"] / base["k"]) / (r["step_ms"] / r["k"])
        r["eval_delta"] = r["eval_loss"] - base["eval_loss"]
        if "final_loss" in r and "final_loss" in base:
            r["final_delta"] = r["final_loss"] - base["final_loss"]
    return rows


def _delta(d: float) -> str:
    """A loss difference: ``+0.0762``, or ``-3.8e-06`` when it would round to zero at 4 decimals."""
    return f"{d:+.4f}" if d == 0 or abs(d) >= 5e-5 else f"{d:+.1e}"


def remedies_table(rows: list[dict]) -> str:
    """The rows as a text table: bytes per step and per sample (KiB / MiB) with their cut against the baseline,
    step time, held-out loss and its difference.

    Raises:
        RemediesError: rows that are not a list of row dicts (as :func:`remedy_rows` makes them).
    """
    if not all(isinstance(r, dict) and "sample_cut" in r for r in rows or [None]):
        add_ratios(rows)
    return table([(r.get("label", r["setting"]), r["k"], r["steps"], fmt_bytes(r["bytes_per_step"]),
                   f"{r['step_cut']:.2f}×", fmt_bytes(r["bytes_per_sample"]), f"{r['sample_cut']:.2f}×",
                   r["step_ms"], f"{r['speedup']:.2f}×", r["eval_loss"], _delta(r["eval_delta"])) for r in rows],
                 ["setting", "k", "steps", "bytes/step", "cut", "bytes/sample", "cut", "step ms", "speedup/sample",
                  "eval loss", "Δ eval"], digits=4)


def plot_remedies(rows: list[dict]):
    """Training loss against samples seen, per setting (left), and bytes all-reduced per sample
    (right, a linear axis so that bar lengths keep the ratios, with the cut against the baseline);
    returns the Figure. Settings whose loss curves are identical (fp16 and bf16 compression of a
    tiny model may round the same way, accumulation with and without ``no_sync`` computes the same
    updates) share one line and one legend entry, labelled with all their names."""
    import matplotlib.pyplot as plt

    _check_rows(rows)
    if "sample_cut" not in rows[0]:
        add_ratios(rows)
    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        per = r.get("samples_per_micro_batch", 1)
        losses = tuple(float(v) for v in r.get("losses", []))
        groups.setdefault((per, losses), []).append(r)
    colors = {}
    for (per, losses), members in groups.items():
        x = [(i + 1) * per for i in range(len(losses))]
        names = [m.get("label", m["setting"]) for m in members]
        label = names[0] if len(names) == 1 else " = ".join(names) + " (identical losses)"
        line, = ax_loss.plot(x, list(losses), label=label, lw=1.3)
        for m in members:
            colors[m["setting"]] = line.get_color()
    ax_loss.set(xlabel="samples seen (sequences, all ranks)", ylabel="training loss (nats, global micro-batch)",
                title="Loss by setting (same data, same seed)")
    ax_loss.legend(fontsize="small")
    labels = [r.get("label", r["setting"]) for r in rows][::-1]
    vals = [r["bytes_per_sample"] for r in rows][::-1]
    ax_bytes.barh(labels, vals, color=[colors[r["setting"]] for r in rows][::-1])
    for y, r in enumerate(rows[::-1]):
        ax_bytes.text(r["bytes_per_sample"], y, f" {fmt_bytes(r['bytes_per_sample'])} ({r['sample_cut']:.1f}× fewer)"
                      if r["sample_cut"] != 1 else f" {fmt_bytes(r['bytes_per_sample'])}", va="center", fontsize="small")
    ax_bytes.set_xlim(0, max(vals) * 1.9)  # room for the labels right of the longest bar
    ax_bytes.set_xticks([])
    ax_bytes.set(xlabel="bytes all-reduced per sample, per rank (bar length to scale)", title="Communication per sample")
    ax_bytes.tick_params(axis="y", labelsize="small")
    fig.tight_layout()
    return fig
