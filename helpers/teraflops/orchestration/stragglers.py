"""Unit 3 §1 and §4: one slow rank in synchronous data parallelism, injected and measured.

In synchronous data parallelism every step ends with an all-reduce of the gradients, which no rank
can leave before the last rank has joined it. A rank that is late (a straggler: a throttled or
slower GPU, a noisy neighbour, a garbage-collection pause, a slow data loader) makes every other
rank wait. :func:`run` trains the same small :class:`~teraflops.models.GPT` on real ranks
(``workers/straggler.py`` through :func:`~teraflops.launch.launcher.launch`: gloo on CPU, NCCL with
GPUs), makes one rank late on purpose (:class:`Injection`) and records, per step and rank, where
the time went (:class:`Timeline`): compute (forward and backward), the injected delay, waiting
inside the all-reduce, and the optimizer update.

The model behind the measurements (§1): a synchronous step lasts as long as its slowest rank's
busy time plus the transfer ``c`` of the all-reduce (what the last rank to arrive spends in it: it
waits for nobody). A delay ``d`` on one rank makes it the last, so a step takes
``T(d) = max(T0, busy0 + d + c)``, with ``T0``, ``busy0`` and ``c`` from the run without delay,
while a healthy rank still works only ``busy0``; the rest of its step it sits in the all-reduce.
Healthy idle fraction: ``1 - busy0 / T(d)`` (:func:`predicted_idle`). ("Idle" counts all of the
time inside the collective, the transfer included: with no straggler at all it is ``c / T0``.)
With ``d`` per step on average (an intermittent or random delay), ``d`` is the mean delay: the
fraction is a ratio of sums over steps.

Mitigations measured here (§4):

* (a) **Rebalancing** (:func:`rebalance`): give each rank a micro-batch proportional to its
  measured speed, so all arrive together. It helps when the slowness is proportional to the work
  (a slower device); it cannot help against a fixed pause. Each rank's loss is weighted by
  ``b_r / B`` and gradients are summed, so the update is the same global-batch mean gradient.
* (c) **Relaxed synchronisation, local SGD**: each rank steps on its own gradient and the ranks
  average their parameters only every ``k`` steps (Stich, "Local SGD Converges Fast and
  Communicates Little", ICLR 2019; Lin et al., "Don't Use Large Mini-Batches, Use Local SGD",
  ICLR 2020). Against independent jitter on every rank it waits less: synchronous DP pays, every
  step, the largest delay of any rank, ``Σ_t max_r δ_rt`` over k steps, while local SGD pays once
  per k steps the largest *sum*, ``max_r Σ_t δ_rt``, which is never larger (between averages each
  rank keeps its own pace, so one rank's delay at one step and another's at the next no longer
  add up; with 4 ranks each late with p = 0.25, a synchronous step is delayed with probability
  1 − 0.75⁴ ≈ 0.68, a rank only with 0.25). Against a persistent straggler the
  two are equal (the same rank is the maximum every step), so local SGD only saves communication
  (``1/k`` of the bytes), at a cost in loss from the ranks drifting apart between averages.

Units: times in seconds in :class:`Timeline` arrays, ms in rows and tables; losses in nats. Timings
are noisy on a shared machine; compare runs of one launch, which take turns within it. What to
expect on a 2-core CPU machine, where 4 gloo ranks share the cores (a step ~70-100 ms without
delay, 20-40 of them inside the all-reduce: the transfer, and waiting for ranks the scheduler ran
later): the healthy ranks' idle fraction within ~0.05 of the prediction, a little below it (see
:func:`predicted_idle`); a rank at a third of the speed rebalanced 1.1-1.4× faster (ranks share
cores and a pass has fixed costs, so the slow rank's time shrinks less than its micro-batch);
local SGD with k = 4 about 1.3-1.6× faster per step with a quarter of the bytes, for a held-out
loss ~0.03 nats higher after the same steps.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from teraflops.orchestration.detection import MIN_RANKS
from teraflops.launch.launcher import launch
from teraflops.parallelization.ddp_sync import TrainedRank
from teraflops.sizing import Preset, TrainConfig, gpt_config, preset
from teraflops.launch.placement import DataParallelPlan, data_parallel_plan
from teraflops.tables import table

WORKER = "teraflops.workers.straggler"
EXPERIMENTS = ("sweep", "kinds", "rebalance", "localsgd")
KINDS = ("none", "constant", "intermittent", "random", "compute")
KIND_DELAY_MS = 200  # the intermittent and random kinds: 50 ms per step on average, well above the detector's floor
FACTOR = 3.0  # the compute kind and rebalance: the straggler computes at a third of the speed
JITTER_MS, JITTER_PROB = 50, 0.25  # local SGD: every rank independently late by 50 ms with p = 0.25
LOCAL_K = 4  # local SGD: steps between parameter averages
WARMUP = 2  # untimed steps at the start of each setting (dropped from the records)
MOMENTUM = 0.9  # SGD's momentum in every setting


@dataclass(frozen=True)
class Injection:
    """How a rank is made late. Shared by the host and the ranks (in :class:`StragglerSpec` and its results).

    Args:
        kind: ``"none"``; ``"constant"`` (``delay_ms`` every step); ``"intermittent"`` (every
            ``every``-th step); ``"random"`` (with probability ``prob`` per step, drawn from
            ``seed`` and the rank, so runs repeat); ``"compute"`` (real extra work: the rank
            goes on computing until its forward and backward have taken ``factor``× as long, like a
            device at 1/factor speed: the extra time is proportional to its micro-batch). Delays
            are ``time.sleep`` after backward, before the all-reduce: the rank is late, the
            others' compute is undisturbed.
        delay_ms: the delay (ms) when one is injected.
        rank: the injected rank(s): None for the last rank, an int, a tuple of ints, or ``"all"``.

    Raises:
        ValueError: unknown kind, negative delay, ``every < 1``, ``prob`` outside [0, 1], ``factor < 1``.
    """

    kind: str = "none"
    delay_ms: float = 0.0
    rank: int | str | tuple | None = None
    every: int = 4
    prob: float = 0.25
    factor: float = FACTOR
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown injection kind {self.kind!r}; choose one of {KINDS}")
        if not (0 <= self.delay_ms < math.inf and self.every >= 1 and 0 <= self.prob <= 1 and 1 <= self.factor < math.inf):
            raise ValueError(f"{self}: needs delay_ms >= 0, every >= 1, 0 <= prob <= 1 and factor >= 1")

    def ranks(self, world: int) -> tuple[int, ...]:
        """The injected ranks of a ``world``-rank run (none for kind ``"none"`` or a zero delay).

        Raises:
            ValueError: a rank outside ``0 .. world - 1``.
        """
        if self.kind == "none" or (self.kind != "compute" and self.delay_ms == 0):
            return ()
        chosen = ((world - 1,) if self.rank is None else tuple(range(world)) if self.rank == "all"
                  else tuple(int(r) for r in np.atleast_1d(self.rank)))
        if not all(0 <= r < world for r in chosen):
            raise ValueError(f"injection rank {self.rank!r} is not a rank of 0-{world - 1}")
        return chosen

    def delays_s(self, steps: int, rank: int, world: int) -> np.ndarray:
        """The delay (s, float64 ``[steps]``) ``rank`` sleeps at each step (zeros for ``"compute"``)."""
        if rank not in self.ranks(world) or self.kind == "compute":
            return np.zeros(steps)
        on = {"constant": np.ones(steps, bool), "intermittent": np.arange(steps) % self.every == self.every - 1,
              "random": np.random.default_rng([self.seed, rank]).random(steps) < self.prob}[self.kind]
        return on * self.delay_ms / 1e3

    @property
    def label(self) -> str:
        """A short description, e.g. ``"random 100 ms, p = 0.25"``."""
        return {"none": "none", "constant": f"constant {self.delay_ms:g} ms",
                "intermittent": f"{self.delay_ms:g} ms every {self.every} steps",
                "random": f"random {self.delay_ms:g} ms, p = {self.prob:g}",
                "compute": f"compute ×{self.factor:g}"}[self.kind]


def timeline_title(timeline) -> str:
    """A timeline plot's title: the setting's name and its injection, said once (a name such as
    ``"200 ms"`` that the injection's label ``"constant 200 ms"`` already holds is not repeated)."""
    name, label = str(timeline.name).strip(), timeline.injection.label
    if not name or name in label or name == timeline.injection.kind:
        return f"injected: {label}"
    return f"{name}: {label}"


@dataclass(frozen=True, eq=False)
class Timeline:
    """One training setting of a launch, per timed step and rank (arrays ``[steps, ranks]``).

    Attributes:
        name: the setting, e.g. ``"100 ms"``. injection: its :class:`Injection`.
        start: step start (s) from the setting's earliest start; compute, delay, wait, update, step:
            durations (s, float64): forward + backward, the injected sleep, time inside the
            collective (all-reduce: waiting for the last rank, then the transfer), optimizer step,
            and their sum.
        batch: micro-batch size (sequences, int64). loss: the global batch's loss per step (nats,
            ``[steps]``; local SGD: the mean of the ranks' own losses).
        local_k: 0 for synchronous DP, else steps between parameter averages (local SGD).
        eval_loss: held-out loss after training (nats), where measured, else None.
    """

    name: str
    injection: Injection
    start: np.ndarray
    compute: np.ndarray
    delay: np.ndarray
    wait: np.ndarray
    update: np.ndarray
    step: np.ndarray
    batch: np.ndarray
    loss: np.ndarray
    local_k: int = 0
    eval_loss: float | None = None

    @property
    def busy(self) -> np.ndarray:
        """Seconds each rank works per step, ``step - wait`` (an injected delay counts as busy)."""
        return self.step - self.wait

    @property
    def injected_ranks(self) -> list[int]:
        return list(self.injection.ranks(self.step.shape[1]))

    @property
    def healthy_ranks(self) -> list[int]:
        return [r for r in range(self.step.shape[1]) if r not in self.injected_ranks]


@dataclass(frozen=True)
class StragglerSpec:
    """What :mod:`teraflops.workers.straggler` runs: ``model`` (SGD at ``model.lr`` with ``momentum``)
    under each setting of ``experiments``, each after ``warmup`` untimed steps; ``delays_ms``: the sweep's constant delays; ``steps``:
    timed steps per setting; ``local_ks``: local SGD's steps between averages; ``kind_delay_ms``:
    the intermittent and random kinds' delay; ``factor``: compute slow-down of the compute kind and
    rebalance; ``jitter_ms``, ``jitter_prob``: local SGD's random delay on every rank and its
    probability per step; ``timeout_s``: seconds a collective waits for the others; ``interleave``:
    the settings of an experiment take turns step by step, all built at once (on CPU ranks, whose
    load drifts with other processes'), or run one after another, one setting's model, momentum and
    gradients alive at a time (on GPUs: seven GPT settings of the GPU preset do not fit a 16 GB
    GPU; :func:`straggler_spec` decides)."""

    model: TrainConfig
    experiments: tuple[str, ...]
    delays_ms: tuple[float, ...]
    steps: int
    local_ks: tuple[int, ...] = (LOCAL_K,)
    kind_delay_ms: float = KIND_DELAY_MS
    factor: float = FACTOR
    jitter_ms: float = JITTER_MS
    jitter_prob: float = JITTER_PROB
    momentum: float = MOMENTUM
    warmup: int = WARMUP
    timeout_s: float = 30
    interleave: bool = True

    def __post_init__(self):
        if set(self.experiments) - set(EXPERIMENTS) or not self.experiments:
            raise ValueError(f"experiments must be some of {EXPERIMENTS}, got {self.experiments}")
        if self.steps < 1 or min(self.local_ks, default=1) < 1 or min(self.delays_ms, default=0) < 0 or self.warmup < 0:
            raise ValueError(f"steps ({self.steps}) and every k of {self.local_ks} must be >= 1, delays >= 0 ms, "
                             f"warmup ({self.warmup}) >= 0")


@dataclass(frozen=True)
class SettingRecords:
    """One setting's timed steps on one rank, a value per step each: ``start`` (``time.time()`` s),
    ``compute``, ``delay``, ``wait``, ``update``, ``step`` (s), ``batch`` (sequences), ``loss``
    (the micro-batch's mean loss, nats)."""

    start: list[float]
    compute: list[float]
    delay: list[float]
    wait: list[float]
    update: list[float]
    step: list[float]
    batch: list[int]
    loss: list[float]


@dataclass(frozen=True)
class SettingResult:
    """One setting on one rank: its ``name``, ``injection``, ``local_k`` (0: synchronous), every
    rank's micro-batch ``sizes``, ``records`` and ``eval_loss`` (held-out, nats; None unmeasured)."""

    name: str
    injection: Injection
    local_k: int
    sizes: list[int]
    records: SettingRecords
    eval_loss: float | None = None


@dataclass(frozen=True)
class StragglerResult(TrainedRank):
    """One rank's settings, per experiment in the spec's order (none for an experiment not run);
    ``calibration_speeds``: every rank's samples/s in rebalance's calibration run (None without it)."""

    sweep: tuple[SettingResult, ...] = ()
    kinds: tuple[SettingResult, ...] = ()
    rebalance: tuple[SettingResult, ...] = ()
    localsgd: tuple[SettingResult, ...] = ()
    calibration_speeds: list[float] | None = None


@dataclass(frozen=True)
class StragglerRun:
    """What :func:`run` measured.

    Attributes:
        sweep: a :class:`Timeline` per constant delay (``delays_ms``), in order.
        kinds: Timelines of the intermittent, random and compute injections.
        rebalance: rows of :func:`rebalance_rows` (equal split, then rebalanced).
        local_sgd: rows of :func:`local_sgd_rows` (synchronous, then local SGD per k).
        world_size, backend: ranks and their torch.distributed backend. params: model parameters.
        config: model, batch and optimizer settings. load_avg: 1-minute load average before and
        after. wall_s: seconds the launch took, start-up included.
    """

    sweep: list
    kinds: list
    rebalance: list
    local_sgd: list
    world_size: int
    backend: str
    params: int
    config: TrainConfig
    load_avg: tuple
    wall_s: float


# ---- the model and the references of the lab -----------------------------------------------------


def idle_fraction(step_s, wait_s) -> np.ndarray:
    """Per rank, the fraction of its time spent waiting: ``Σ_t wait / Σ_t step``.

    Args:
        step_s, wait_s: step and wait times (s), arrays of the same shape ``[steps, ranks]``.

    Returns:
        float64 ``[ranks]``.

    Raises:
        ValueError: shapes differ or are not 2-D, a negative time, or a wait longer than its step.
    """
    step, wait = np.asarray(step_s, np.float64), np.asarray(wait_s, np.float64)
    if step.shape != wait.shape or step.ndim != 2:
        raise ValueError(f"step_s and wait_s must have the same [steps, ranks] shape, got {step.shape} and "
                         f"{wait.shape}. Hint: pass timeline.step and timeline.wait")
    if (step < 0).any() or (wait < 0).any() or (wait > step + 1e-9).any():
        raise ValueError("times must be >= 0 and each wait at most its step. Hint: wait_s is part of step_s")
    return wait.sum(0) / np.maximum(step.sum(0), 1e-300)


def predicted_idle(baseline: Timeline, mean_delay_s: float) -> float:
    """Healthy ranks' idle fraction predicted for a straggler late by ``mean_delay_s`` (s) per step.

    A step lasts the slowest rank's busy time plus the all-reduce's transfer, so with the straggler
    last, ``T(d) = max(T0, busy0 + d + c)`` (:func:`predicted_step_s`); a healthy rank works
    ``busy0`` of it and waits the rest: idle fraction ``1 - busy0 / T(d)``. ``T0``, ``busy0`` and
    ``c`` come from ``baseline``, the same run without delay (:func:`baseline_means`).

    Raises:
        ValueError: a negative delay.
    """
    if mean_delay_s < 0:
        raise ValueError(f"mean_delay_s must be >= 0 (seconds), got {mean_delay_s}")
    return float(1 - baseline_means(baseline)[1] / predicted_step_s(baseline, mean_delay_s))


def predicted_step_s(baseline: Timeline, mean_delay_s: float) -> float:
    """``T(d) = max(T0, busy0 + d + c)`` (s): the step time with one rank late by ``d`` (module docstring)."""
    t0, busy0, c = baseline_means(baseline)
    return max(t0, busy0 + mean_delay_s + c)


def baseline_means(baseline: Timeline) -> tuple[float, float, float]:
    """``(T0, busy0, c)`` (s) of a run without delay: mean step and busy time of its healthy ranks
    (all, if none was injected), and the transfer ``c``: per step, the wait of the rank that waited
    least (the last to arrive, which waits for nobody), averaged over steps."""
    ranks = baseline.healthy_ranks or list(range(baseline.step.shape[1]))
    return (float(baseline.step[:, ranks].mean()), float(baseline.busy[:, ranks].mean()),
            float(baseline.wait.min(axis=1).mean()))


def rebalance(speeds, global_batch: int) -> list[int]:
    """Micro-batch sizes proportional to the ranks' speeds: each rank then needs the same time.

    Rank r gets the quota ``B · s_r / Σ s``, rounded down; the samples left go to the largest
    remainders (Hamilton's largest-remainder method), so the sizes sum to ``B`` exactly; a rank
    whose quota rounds to 0 still gets 1, taken from the largest.

    Args:
        speeds: samples/s of each rank (positive), e.g. micro-batch / median compute time.
        global_batch: B, sequences per step over all ranks (at least one per rank).

    Returns:
        int sizes, one per rank, summing to ``global_batch``.

    Raises:
        ValueError: a speed that is not positive and finite, or ``global_batch < len(speeds)``.
    """
    s = np.asarray(speeds, np.float64)
    if s.ndim != 1 or not len(s) or not np.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"speeds must be positive samples/s, one per rank, got {speeds!r}")
    if int(global_batch) != global_batch or global_batch < len(s):
        raise ValueError(f"global_batch must be an integer >= {len(s)} (one sample per rank), got {global_batch}")
    quota = global_batch * s / s.sum()
    sizes = np.floor(quota).astype(int)
    sizes[np.argsort(sizes - quota, kind="stable")[:int(global_batch) - sizes.sum()]] += 1
    while (sizes < 1).any():
        sizes[np.argmax(sizes)] -= 1
        sizes[np.argmin(sizes)] += 1
    return sizes.tolist()


# ---- the launch ------------------------------------------------------------------------------------


def straggler_spec(plan: DataParallelPlan, *, delays_ms=None, steps=None, experiments=EXPERIMENTS,
                   local_ks=(LOCAL_K,), collective_timeout: float = 30) -> StragglerSpec:
    """The worker's :class:`StragglerSpec` from ``plan.preset``'s ``gpt`` (``straggler.micro_batch``
    sequences per rank, ``straggler.lr``) and ``straggler`` sizes; the settings take turns on CPU
    ranks and run one at a time on GPUs (``StragglerSpec.interleave``)."""
    p = plan.preset
    delays = p.straggler.delays_ms if delays_ms is None else delays_ms
    return StragglerSpec(model=gpt_config(p, p.straggler.micro_batch, p.straggler.lr),
                         experiments=tuple(experiments), delays_ms=tuple(float(d) for d in delays),
                         steps=steps or p.straggler.steps, local_ks=tuple(int(k) for k in local_ks),
                         timeout_s=collective_timeout, interleave=not plan.placement.on_gpus)


def default_plan(p: Preset | None = None, cluster=None) -> DataParallelPlan:
    """Unit 3's ranks and sizes: one NCCL rank per GPU with at least :data:`~teraflops.orchestration.detection.MIN_RANKS`
    GPUs (the detector's median needs three), else the preset's ``straggler.ranks_cpu`` CPU ranks."""
    p = p or preset()
    return data_parallel_plan(p, ranks_cpu=p.straggler.ranks_cpu, min_ranks=MIN_RANKS, cluster=cluster)


def run(plan: DataParallelPlan | None = None, delays_ms=None, steps: int | None = None, experiments=EXPERIMENTS,
        *, local_ks=(LOCAL_K,), timeout: float = 300, cluster=None) -> StragglerRun:
    """Run the chosen experiments in one launch (each launch costs ~10 s of start-up on CPU).

    Args:
        plan: ranks and sizes (default: :func:`~teraflops.launch.placement.data_parallel_plan` with the
            preset's ``straggler.ranks_cpu`` CPU ranks, or one rank per GPU).
        delays_ms: constant delays of the sweep (ms; default ``straggler.delays_ms``); include 0,
            the baseline of :func:`predicted_idle`.
        steps: timed steps per setting (default ``straggler.steps``), after :data:`WARMUP` untimed.
        experiments: any of ``"sweep"``, ``"kinds"``, ``"rebalance"``, ``"localsgd"``.
        local_ks: the k values of local SGD (steps between parameter averages).
        timeout: seconds for the whole launch.
        cluster: an emulated :class:`~teraflops.nodes.cluster.Cluster` (up) to spread the ranks over its nodes.

    Raises:
        ValueError: an unknown experiment, a negative delay, steps or k below 1.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    experiments = (experiments,) if isinstance(experiments, str) else tuple(experiments)
    if set(experiments) - set(EXPERIMENTS) or not experiments:
        raise ValueError(f"experiments must be some of {EXPERIMENTS}, got {tuple(experiments)}")
    bad_delays = delays_ms is not None and (len(delays_ms) == 0 or min(delays_ms) < 0)
    if bad_delays or (steps is not None and steps < 1) or min(local_ks, default=1) < 1:
        raise ValueError("delays_ms must be one or more delays >= 0 ms, steps >= 1 and every k >= 1. "
                         "Hint: include 0 ms, the baseline of the prediction")
    if plan is None:
        plan = default_plan()
    before, start = os.getloadavg()[0], time.perf_counter()
    spec = straggler_spec(plan, delays_ms=delays_ms, steps=steps, experiments=experiments, local_ks=local_ks)
    results = launch(WORKER, plan.placement, spec=spec, result=StragglerResult, timeout=timeout,
                     desc="stragglers: " + ", ".join(experiments), cluster=cluster)
    r0, tl = results[0], {key: timelines(results, key) for key in EXPERIMENTS}
    return StragglerRun(sweep=tl["sweep"], kinds=tl["kinds"],
                        rebalance=rebalance_rows(tl["rebalance"], r0.calibration_speeds),
                        local_sgd=local_sgd_rows(tl["localsgd"], r0.params), world_size=r0.world_size,
                        backend=r0.backend, params=r0.params, config=r0.config,
                        load_avg=(before, os.getloadavg()[0]), wall_s=time.perf_counter() - start)


def timelines(results: list[StragglerResult], key: str) -> list[Timeline]:
    """The :class:`Timeline` of each setting of experiment ``key`` (a :class:`StragglerResult`
    field) from the ranks' results, each rank's setting found by its name."""
    out = []
    for s0 in getattr(results[0], key):
        recs = [next(s for s in getattr(r, key) if s.name == s0.name).records for r in results]

        def arr(name, dtype=np.float64):
            return np.array([getattr(rec, name) for rec in recs], dtype).T  # [steps, ranks]

        start, batch, losses = arr("start"), arr("batch", np.int64), arr("loss")
        out.append(Timeline(name=s0.name, injection=s0.injection, start=start - start.min(), compute=arr("compute"),
                            delay=arr("delay"), wait=arr("wait"), update=arr("update"), step=arr("step"),
                            batch=batch, loss=(losses * batch).sum(1) / batch.sum(1), local_k=s0.local_k,
                            eval_loss=s0.eval_loss))
    return out


# ---- rows and tables ----------------------------------------------------------------------------


def late_s(tl: Timeline) -> float:
    """How late the injected rank(s) arrive per step on average, measured (s): the mean injected
    delay, plus, for the ``compute`` kind, the extra compute time over the healthy ranks'."""
    inj, ok = tl.injected_ranks, tl.healthy_ranks
    if not inj:
        return 0.0
    extra = tl.compute[:, inj].mean() - tl.compute[:, ok].mean() if tl.injection.kind == "compute" else 0.0
    return float(tl.delay[:, inj].mean() + extra)


def _idle_row(tl: Timeline, baseline: Timeline | None) -> dict:
    late, idle = late_s(tl), idle_fraction(tl.step, tl.wait)
    healthy = float(idle[tl.healthy_ranks].mean())
    predicted = None if baseline is None else predicted_idle(baseline, max(late, 0.0))
    return {"name": tl.name, "injection": tl.injection.label, "delay_ms": tl.injection.delay_ms,
            "late_ms": 1e3 * late, "step_ms": 1e3 * tl.step.mean(),
            "predicted_step_ms": None if baseline is None else 1e3 * predicted_step_s(baseline, max(late, 0.0)),
            "healthy_idle": healthy, "predicted_idle": predicted,
            "abs_diff": None if predicted is None else abs(healthy - predicted),
            "straggler_idle": float(idle[tl.injected_ranks].mean()) if tl.injected_ranks else None, "idle": idle}


def _baseline(run: StragglerRun) -> Timeline | None:
    return next((t for t in run.sweep if t.injection.delay_ms == 0), None)


def sweep_rows(run: StragglerRun) -> list[dict]:
    """One row per constant delay of ``run.sweep``.

    Keys: ``delay_ms`` (configured), ``late_ms`` (:func:`late_s`: the straggler's measured mean
    delay per step), ``step_ms`` (mean over steps and ranks), ``predicted_step_ms`` (``T(d)``, :func:`predicted_step_s`
    with ``d = late_ms``), ``healthy_idle`` (mean :func:`idle_fraction` of the healthy ranks),
    ``predicted_idle`` (:func:`predicted_idle` with the 0-ms setting as baseline; None without
    one), ``abs_diff``, ``straggler_idle``, ``idle`` (per rank), ``name``, ``injection``.
    """
    return [_idle_row(tl, _baseline(run)) for tl in run.sweep]


def kinds_rows(run: StragglerRun) -> list[dict]:
    """One row per injection kind of ``run.kinds``; keys as :func:`sweep_rows` (``late_ms`` is
    the mean delay per step, for ``compute`` the extra compute time)."""
    return [_idle_row(tl, _baseline(run)) for tl in run.kinds]


def sweep_table(rows: list[dict]) -> str:
    """The sweep rows as a text table."""
    return table([(r["delay_ms"], r["step_ms"], r["predicted_step_ms"], r["healthy_idle"], r["predicted_idle"],
                   r["abs_diff"], r["straggler_idle"]) for r in rows],
                 ["delay ms", "step ms", "predicted T(d) ms", "healthy idle", "predicted", "|diff|", "straggler idle"])


def kinds_table(rows: list[dict]) -> str:
    """The kinds rows as a text table."""
    return table([(r["injection"], r["late_ms"], r["step_ms"], r["healthy_idle"], r["predicted_idle"], r["abs_diff"],
                   r["straggler_idle"]) for r in rows],
                 ["injection", "late ms/step", "step ms", "healthy idle", "predicted", "|diff|", "straggler idle"])


def rebalance_rows(tls: list[Timeline], calibration_speeds=None) -> list[dict]:
    """One row per phase of the rebalance experiment (equal split, then rebalanced, taking turns).

    Keys: ``phase``, ``sizes`` (micro-batch per rank), ``speeds`` (samples/s per rank: micro-batch
    over median compute time), ``calibration_speeds`` (those of a first equal-split run alone,
    which gave the rebalanced sizes: ``rebalance(calibration_speeds, B)``), ``step_ms`` (mean),
    ``idle`` (:func:`idle_fraction` per rank), ``speedup`` (the first phase's step time over this
    one's), ``max_loss_diff`` (largest per-step difference of the global loss from the first phase:
    both train from the same initialisation on the same global batches, so it is float rounding),
    ``timeline``.
    """
    rows = [{"phase": tl.name, "sizes": tl.batch[0].tolist(),
             "speeds": (tl.batch[0] / np.median(tl.compute, 0)).tolist(), "calibration_speeds": calibration_speeds,
             "step_ms": 1e3 * tl.step.mean(), "idle": idle_fraction(tl.step, tl.wait), "timeline": tl} for tl in tls]
    for row in rows:
        row["speedup"] = rows[0]["step_ms"] / row["step_ms"]
        row["max_loss_diff"] = float(np.abs(row["timeline"].loss - rows[0]["timeline"].loss).max())
    return rows


def rebalance_table(rows: list[dict]) -> str:
    """The rebalance rows as a text table, and the calibration speeds that sized the micro-batches."""
    def join(values, spec="d"):
        return " ".join(f"{v:{spec}}" for v in values)

    speeds = rows[0]["calibration_speeds"] if rows else None
    text = table([(r["phase"], join(r["sizes"]), join(r["speeds"], ".0f"), r["step_ms"], join(r["idle"], ".2f"),
                   f"{r['speedup']:.2f}×", f"{r['max_loss_diff']:.1e}") for r in rows],
                 ["phase", "micro-batches", "samples/s", "step ms", "idle per rank", "speed-up", "max |Δ loss|"])
    return text + ("" if speeds is None else f"\nsizes from the calibration run's samples/s: {join(speeds, '.0f')}")


def jitter_cost_s(delay_s: float, prob: float, ranks: int, k: int = 1) -> float:
    """Expected time per step (s) that independent jitter adds to a job that synchronises every
    ``k`` steps: each of ``ranks`` ranks is late by ``delay_s`` with probability ``prob`` per step.

    Every ``k`` steps the job waits for the rank with the most late steps, so per step it pays
    ``delay_s × E[max_r B_r] / k`` with ``B_r ~ Binomial(k, prob)`` independent, and
    ``E[max] = Σ_{j=1..k} (1 - F(j - 1)^ranks)`` (F: the binomial CDF; the maximum of independent
    draws has CDF F^n). ``k = 1`` (synchronous) gives ``delay_s (1 - (1 - prob)^ranks)``.
    """
    if not 0 <= prob <= 1 or ranks < 1 or k < 1:
        raise ValueError(f"need 0 <= prob <= 1, ranks >= 1 and k >= 1, got prob={prob}, ranks={ranks}, k={k}")
    cdf = np.cumsum([math.comb(k, j) * prob ** j * (1 - prob) ** (k - j) for j in range(k + 1)])
    return delay_s * float(sum(1 - cdf[j - 1] ** ranks for j in range(1, k + 1))) / k


def local_sgd_rows(tls: list[Timeline], params: int) -> list[dict]:
    """One row per run of the local-SGD experiment (synchronous first).

    Keys: ``mode``, ``k``, ``step_ms`` (wall: from the first step's start to the last step's end,
    over all ranks, per step), ``wait_ms`` and ``delay_ms`` (per step, mean over ranks),
    ``bytes_per_step`` (fp32 buffer each rank all-reduces per step: gradients ``4Ψ`` every step, or
    parameters ``4Ψ`` every k steps), ``eval_loss`` (held-out, after the final average),
    ``eval_delta`` (minus the synchronous run's), ``speedup``, ``jitter_ms`` (:func:`jitter_cost_s`,
    the jitter's predicted cost per step), ``timeline``.
    """
    rows = [{"mode": tl.name, "k": tl.local_k, "step_ms": 1e3 * (tl.start[-1] + tl.step[-1]).max() / len(tl.step),
             "jitter_ms": 1e3 * jitter_cost_s(tl.injection.delay_ms / 1e3, tl.injection.prob, tl.step.shape[1],
                                              max(tl.local_k, 1)),
             "wait_ms": 1e3 * tl.wait.mean(), "delay_ms": 1e3 * tl.delay.mean(), "eval_loss": tl.eval_loss,
             "bytes_per_step": 4 * params / max(tl.local_k, 1), "timeline": tl} for tl in tls]
    for row in rows:
        row["speedup"] = rows[0]["step_ms"] / row["step_ms"]
        row["eval_delta"] = row["eval_loss"] - rows[0]["eval_loss"]
    return rows


def local_sgd_table(rows: list[dict]) -> str:
    """The local-SGD rows as a text table."""
    return table([(r["mode"], r["step_ms"], r["delay_ms"], r["jitter_ms"], r["wait_ms"], r["bytes_per_step"] / 1e6,
                   f"{r['speedup']:.2f}×", r["eval_loss"], f"{r['eval_delta']:+.3f}") for r in rows],
                 ["mode", "ms/step (wall)", "delay ms/step", "jitter cost ms/step (predicted)", "wait ms/step", "MB all-reduced/step", "speed-up",
                  "eval loss", "Δ eval"])


# ---- plots -------------------------------------------------------------------------------------

PHASES = (("compute", "compute (fwd + bwd)", "tab:blue", None), ("delay", "injected delay", "tab:red", None),
          ("wait", "waiting in all-reduce", "white", "///"), ("update", "optimizer update", "tab:green", None))


def plot_timeline(timeline: Timeline, steps: int = 6, first: int = 0, ax=None):
    """Per-rank Gantt chart of ``steps`` timed steps from ``first``: compute, injected delay, waiting
    in the all-reduce (idle, hatched) and update, in ms. Steps are drawn back to back, each rank
    at its own start within the step (settings of a launch take turns, so the real starts have
    gaps). Returns the Figure. (Local SGD updates before it averages: read compute, delay, update, wait.)"""
    import matplotlib.pyplot as plt

    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(11, 0.55 * timeline.step.shape[1] + 1.6))
    start, step = timeline.start[first:first + steps], timeline.step[first:first + steps]
    span = (start + step).max(1) - start.min(1)
    origin = start - start.min(1, keepdims=True) + np.concatenate([[0], np.cumsum(span)[:-1]])[:, None]
    sl = slice(first, first + steps)
    for r in range(timeline.step.shape[1]):
        left = origin[:, r] * 1e3
        for key, label, color, hatch in PHASES:
            width = getattr(timeline, key)[sl, r] * 1e3
            ax.broken_barh(list(zip(left, width)), (r - 0.35, 0.7), facecolors=color, edgecolor="grey",
                           hatch=hatch, linewidth=0.5, label=label if r == 0 else None)
            left = left + width
    ax.set_yticks(range(timeline.step.shape[1]),
                  [f"rank {r}" + (" (injected)" if r in timeline.injected_ranks else "")
                   for r in range(timeline.step.shape[1])])
    ax.invert_yaxis()
    ax.set(xlabel="time (ms)", title=timeline_title(timeline))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize="small", frameon=False)
    fig.tight_layout()
    return fig


def plot_idle_vs_delay(rows: list[dict]):
    """Healthy ranks' measured idle fraction (points) and the prediction (line) against the delay,
    with the straggler's own; ``rows`` from :func:`sweep_rows`. Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    d = [r["delay_ms"] for r in rows]
    predicted = [np.nan if r["predicted_idle"] is None else r["predicted_idle"] for r in rows]
    ax.plot(d, predicted, "-", color="grey", label="predicted: 1 − busy₀ / max(T₀, busy₀ + d + c)")
    ax.plot(d, [r["healthy_idle"] for r in rows], "o", label="healthy ranks, measured")
    ax.plot(d, [np.nan if r["straggler_idle"] is None else r["straggler_idle"] for r in rows], "s",
            label="straggler, measured")
    ax.set(xlabel="injected delay per step (ms)", ylabel="idle fraction (waiting in all-reduce)", ylim=(0, 1),
           title="Everyone waits for the slowest rank")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_rebalance(rows: list[dict]):
    """Mean time per step of each rank, split into phases, before and after rebalancing; ``rows``
    from :func:`rebalance_rows`. Returns the Figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.4), sharex=True, squeeze=False)
    for ax, row in zip(axes[0], rows):
        tl, left = row["timeline"], 0
        names = [f"rank {r} (b = {b})" for r, b in enumerate(row["sizes"])]
        for key, label, color, hatch in PHASES:
            width = 1e3 * getattr(tl, key).mean(0)
            ax.barh(names, width, left=left, color=color, edgecolor="grey", hatch=hatch, label=label)
            left = left + width
        ax.invert_yaxis()
        ax.set(xlabel="mean ms per step", title=f"{row['phase']}: {row['step_ms']:.0f} ms/step")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
