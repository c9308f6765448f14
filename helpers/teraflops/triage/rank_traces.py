"""Traces of distributed steps, one per rank, for the triage capstone (:mod:`teraflops.triage.verdict`).

:func:`profile_ranks` runs, in one launch (:func:`teraflops.launch.launcher.launch`, rank side
:mod:`teraflops.workers.triage_trace`), workloads whose bottleneck is in how the ranks talk,
profiles one step of each on every rank after warm-up, and returns per workload the trace to
triage and the wait times that go with it (:class:`RankTrace`)::

    rt = profile_ranks()["straggler"]
    triage(rt.trace, waits=rt.waits)   # -> "waiting (straggler)", stragglers == (rt.straggler,)

The workloads, and the verdict each should get from rank 0's trace with its waits:

* ``"zero3"``: one training step of :class:`teraflops.models.GPT` under DeepSpeed ZeRO stage 3
  (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC 2020, §5.3; DeepSpeed's CPU path: gloo, fp32). Each parameter lives as a 1/N shard and is
  all-gathered before its module runs, and the gradients are reduce-scattered back to their
  owners. The GPT is the preset's ``comm_gpt`` (wide, few tokens: 1.6 M parameters, one sequence of
  16 tokens per rank on CPU): the bytes moved grow with the parameters, the FLOPs with parameters
  × tokens, so with few tokens the transfers outweigh the arithmetic → **communication-bound**
  (~60 % of the step on the 2-core machine, ~30 % overhead: DeepSpeed's Python hooks). Config:
  Unit 2's :func:`teraflops.workers.common.zero_config` (no overlap, no prefetch, parameters released
  after use and gathered again for backward: 3Ψ per step) with the comms logger off (its
  bookkeeping is Python time on every call) and one reduce bucket for all gradients (one
  reduce-scatter after backward; DeepSpeed's default 5e8 elements would allocate 2 GB). DeepSpeed
  waits for the backward re-gather inside its autograd node ``PreBackwardFunctionForModuleBackward``:
  triage counts such no-work time during a collective in flight as communication.
* ``"straggler"``: synchronous data parallelism (forward, backward, one all-reduce of all gradients,
  SGD) on the preset's ``gpt``, the last rank sleeping :data:`STRAGGLER_FACTOR` × the
  measured step time before the all-reduce (Unit 3's injected delay, :mod:`teraflops.orchestration.stragglers`).
  Rank 0 computes, then sits in the all-reduce until the late rank arrives; the waits show the late
  rank waiting least → **waiting (straggler)**, ``stragglers == (ranks - 1,)``, with about
  F / (F + 1) = 3/4 of rank 0's step waiting (67-80 % measured).
* ``"allreduce"``: :data:`ALLREDUCE_CALLS` all-reduces of ``collective.min_bytes`` (1 KiB) with one
  trivial op between them: each costs the collective's latency α (the Hockney model of
  :mod:`teraflops.hardware.collectives`; ~8 ms with 4 gloo ranks on 2 cores, against µs for the op),
  nothing else to do → **communication-bound** (>90 %), even waits.

Waits: per profiled step and rank, the wall seconds during which a collective ran
(:func:`collective_seconds`: the union of the events :func:`teraflops.triage.trace.is_collective`
names), ``[steps, ranks]``, read from each step's own profile. Without a straggler they are even:
no rank waits for another more than the transfer takes.

Units: seconds; paths are :class:`pathlib.Path`. The verdicts above are the CPU machine's (gloo
ranks sharing its cores); on GPUs the same workloads' shares follow NVLink's or the network's speed.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from teraflops.errors import CourseError
from teraflops.launch.launcher import launch
from teraflops.launch.placement import place
from teraflops.launch.rank import RankIdentity
from teraflops.machine import detect
from teraflops.orchestration.detection import MIN_RANKS
from teraflops.sizing import PRESETS, TrainConfig, dp_config, gpt_config, preset
from teraflops.triage.trace import COMM_CATEGORIES, is_collective, load_trace

WORKLOADS = ("zero3", "straggler", "allreduce")
EXPECTED = {"zero3": "communication-bound", "straggler": "waiting (straggler)", "allreduce": "communication-bound"}
"""The verdict each workload's rank-0 trace should get from :func:`teraflops.triage.verdict.triage` with its waits."""
WORKER = "teraflops.workers.triage_trace"
WARMUP = 2  # untimed steps per workload before the profiled ones
STEPS = 5  # profiled steps per workload (rows of the waits)
STRAGGLER_FACTOR = 3.0  # the late rank's sleep, × the slowest rank's median step without delay
ALLREDUCE_CALLS = 32  # all-reduces per step of the "allreduce" workload
ZERO_LR, STRAGGLER_LR = 1e-3, 0.1  # AdamW of the zero3 workload, SGD of the straggler workload


@dataclass(frozen=True)
class RankTraceSpec:
    """What :mod:`teraflops.workers.triage_trace` runs: ``workloads`` in this order, each warmed up
    ``warmup`` steps (:data:`WARMUP`) and profiled ``steps`` steps, traces into ``out``; ``zero``:
    the GPT of the zero3 workload, ``dp``: the straggler's, whose last rank sleeps
    ``straggler_factor`` (:data:`STRAGGLER_FACTOR`) × the slowest median step; ``allreduce_bytes``
    and ``allreduce_calls`` (:data:`ALLREDUCE_CALLS`): the allreduce workload's message (bytes) and
    calls per step; ``timeout_s``: seconds a collective waits for the others."""

    workloads: tuple[str, ...]
    out: str
    steps: int
    zero: TrainConfig
    dp: TrainConfig
    allreduce_bytes: int
    allreduce_calls: int = ALLREDUCE_CALLS
    straggler_factor: float = STRAGGLER_FACTOR
    warmup: int = WARMUP
    timeout_s: float = 60

    def __post_init__(self):
        if not self.workloads or set(self.workloads) - set(WORKLOADS) or min(self.steps, self.allreduce_calls) < 1 \
                or self.warmup < 0:
            raise ValueError(f"workloads {self.workloads} must be some of {', '.join(WORKLOADS)}, steps and "
                             "allreduce_calls >= 1, warmup >= 0")


@dataclass(frozen=True)
class WorkloadResult:
    """One workload on one rank: ``waits`` (s inside collectives per profiled step), ``step_s``
    (s per profiled step), ``trace`` (the kept Chrome trace), ``params`` of its model (0: none),
    ``delayed_rank`` and ``delay_s`` (the straggler's; None and 0 otherwise)."""

    waits: list[float]
    trace: str
    step_s: list[float]
    params: int
    delayed_rank: int | None = None
    delay_s: float = 0.0


@dataclass(frozen=True)
class RankTraceResult(RankIdentity):
    """One rank's workloads, by name."""

    workloads: dict[str, WorkloadResult]


class RankTraceError(CourseError, ValueError):
    """Arguments :func:`profile_ranks` cannot run with; one line with a hint."""


@dataclass(frozen=True)
class RankTrace:
    """One workload's traces and waits from :func:`profile_ranks`.

    Attributes:
        workload: its name, one of :data:`WORKLOADS`.
        trace: rank 0's Chrome trace of one profiled step, the one to triage (rank 0 is never the
            delayed rank, so its trace shows the waiting).
        traces: every rank's trace of that step, by rank (``traces[0] == trace``).
        waits: ``[steps, ranks]`` seconds each rank spent inside collectives in each profiled step
            (the first row is the traced step), as :func:`teraflops.triage.verdict.triage` takes them.
        straggler: the delayed rank (the last) for ``"straggler"``, else None.
        ranks: the launch's world size.
        delay_s: the straggler's injected sleep per step (s), else 0.
    """

    workload: str
    trace: Path
    traces: tuple
    waits: list
    straggler: int | None
    ranks: int
    delay_s: float = 0.0

    @property
    def expected(self) -> str:
        """The verdict this workload should get (:data:`EXPECTED`)."""
        return EXPECTED[self.workload]


def collective_seconds(trace) -> float:
    """Wall seconds during which at least one collective ran in a Chrome trace (a path or loaded
    dict, :func:`teraflops.triage.trace.load_trace`): the union of the intervals of the events that
    :func:`teraflops.triage.verdict.triage` counts as communication (``c10d::`` ops, gloo/NCCL ranges on the
    backend's threads, NCCL kernels), overlapping ones counted once."""
    events, _ = load_trace(trace)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") in COMM_CATEGORIES and is_collective(e["name"], e["cat"]))
    total, end = 0.0, float("-inf")
    for s, e in spans:
        total += max(0.0, e - max(s, end))
        end = max(end, e)
    return total * 1e-6


def default_ranks() -> int:
    """One rank per GPU with 3 GPUs or more, else the preset's ``straggler.ranks_cpu`` CPU ranks
    (:func:`teraflops.launch.placement.place` with the detector's 3 ranks at least)."""
    return _placement(None).world_size


def _placement(ranks, cluster=None):
    p = preset()
    return place(ranks, cpu_ranks=p.straggler.ranks_cpu, min_ranks=MIN_RANKS if ranks is None else 1, cluster=cluster,
                 gpus=p.device == "cuda")


def rank_trace_spec(workloads, out_dir: Path, steps: int, p, seed: int = 0) -> RankTraceSpec:
    """The worker's :class:`RankTraceSpec` for preset ``p``: ZeRO-3 on the ``comm_gpt`` (wide, few
    tokens, one sequence per rank), the straggler on the ``gpt`` (``straggler.micro_batch``
    sequences), ``collective.min_bytes`` all-reduces; ``seed`` for both models and their data."""
    zero = replace(dp_config(p), micro_batch=1, lr=ZERO_LR, seed=seed)
    dp = replace(gpt_config(p, p.straggler.micro_batch, STRAGGLER_LR), seed=seed)
    return RankTraceSpec(workloads=tuple(workloads), out=str(out_dir), steps=steps, zero=zero, dp=dp,
                         allreduce_bytes=p.collective.min_bytes)


def profile_ranks(workloads=WORKLOADS, out_dir=None, ranks: int | None = None, steps: int | None = None,
                  cluster=None, timeout: float = 300, seed: int = 0) -> dict[str, RankTrace]:
    """Run the ``workloads`` on ``ranks`` ranks in one launch; profile them; return a :class:`RankTrace` each.

    Args:
        workloads: some of :data:`WORKLOADS` (a name or a sequence), run in this order, ``"zero3"`` last.
        out_dir: folder for the traces, ``<workload>.rank<r>.json`` (created); default a fresh
            temporary folder (left for the caller: the traces are the result).
        ranks: world size; default :func:`default_ranks` (4 gloo ranks on a CPU machine; one per GPU
            with 3 or more GPUs; with fewer GPUs, CPU ranks with the GPUs hidden). ``"straggler"``
            needs at least 3 (the waits' median needs a majority), the others 2.
        steps: profiled steps per workload, the rows of ``waits`` (default :data:`STEPS`).
        cluster: an emulated :class:`~teraflops.nodes.cluster.Cluster` (up) to spread the ranks over its nodes.
        timeout: seconds for the whole launch (DeepSpeed's one-off op build is outside it).
        seed: model and data seed.

    Raises:
        RankTraceError: an unknown workload, too few ranks, steps < 1.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.
    """
    names = (workloads,) if isinstance(workloads, str) else tuple(workloads)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        what = f"unknown workload(s) {unknown}" if unknown else "no workload given"
        raise RankTraceError(f"{what}: choose from {', '.join(WORKLOADS)}. "
                             "Hint: profile_ranks(workloads=('straggler',)) runs one")
    ranks = default_ranks() if ranks is None else ranks
    least = 3 if "straggler" in names else 2
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < least:
        why = ("the straggler's waits need 3 ranks (a median needs a majority)" if least == 3
               else "one rank has no one to talk to")
        raise RankTraceError(f"ranks must be an int >= {least}, got {ranks!r}: {why}. Hint: leave ranks=None "
                             f"for {default_ranks()}")
    steps = STEPS if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise RankTraceError(f"steps must be an int >= 1 (profiled steps per workload), got {steps!r}. "
                             f"Hint: leave it None for {STEPS}")
    where = _placement(ranks, cluster)
    p = preset() if where.on_gpus or not detect().gpu_count else PRESETS["cpu"]
    out = Path(tempfile.mkdtemp(prefix="teraflops-rank-traces-") if out_dir is None else out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # ZeRO-3 last: DeepSpeed swaps torch's linear for its own in the whole process, for good
    order = sorted(names, key=lambda n: n == "zero3")
    results = launch(WORKER, where, spec=rank_trace_spec(order, out.resolve(), steps, p, seed), result=RankTraceResult,
                     timeout=timeout, desc="rank traces: " + ", ".join(order), deepspeed="zero3" in names,
                     cluster=cluster)
    found = {}
    for name in names:
        per_rank = [r.workloads[name] for r in results]
        waits = [list(row) for row in zip(*(r.waits for r in per_rank))]  # [steps, ranks]
        traces = tuple(Path(r.trace) for r in per_rank)
        found[name] = RankTrace(workload=name, trace=traces[0], traces=traces, waits=waits,
                                straggler=per_rank[0].delayed_rank, ranks=len(results), delay_s=per_rank[0].delay_s)
    return found
