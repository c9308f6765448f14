"""A GPU cluster's queue as a discrete-event simulation: FIFO, EASY backfill and fair share.

GPUs sit idle not only because of stragglers but because of the queue. Under strict FIFO a head
job that does not fit blocks every job behind it; free GPUs scattered over nodes cannot host a
job that needs a whole node (fragmentation). Backfill starts later jobs in the holes as long as
the head job does not start later; fair share reorders the queue by how much each user has used.

The model (all times in hours, sizes in GPUs):

* A cluster of ``nodes`` × ``gpus_per_node`` GPUs (default 8 × 8 = 64). A job of at most
  ``gpus_per_node`` GPUs runs inside one node, placed by **best fit** (the node with the fewest
  free GPUs that still fits it; ties go to the lowest node index). A bigger job takes whole free
  nodes, so its size must be a multiple of ``gpus_per_node``. Jobs are not preempted and run
  exactly ``duration`` hours.
* A **policy** is a function ``policy(queue, cluster, now) -> list[Job]``: the jobs to start now,
  in order. ``queue`` holds the waiting jobs in submission order; ``cluster`` is a read-only
  :class:`ClusterView`. The simulator asks whenever a job arrives or ends, gathering all that
  happen at one instant into one decision, and skips asking while no GPU is free.
* Schedulers know only the runtime the user declared (``estimate``, Slurm's ``--time``), so
  reservations use estimated ends. Here the estimate defaults to the true duration: backfill then
  plans exactly, and its zero head delays are a property of the algorithm rather than of luck.
* **Head protection is measured, not assumed.** At each decision the *head* is the oldest job the
  policy left waiting. The simulator computes the head's earliest start given only the started
  jobs submitted before it, then adds the younger started jobs one by one in the policy's order;
  any that make the head's earliest start later is recorded as a :class:`HeadDelay`.

SimPy (https://simpy.readthedocs.io) keeps the clock and the events; placement, policies and
statistics are the course's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import groupby
from typing import Callable, Iterable, Sequence

import numpy as np
import simpy

from teraflops.errors import CourseError
from teraflops.tables import table


class SchedulingError(CourseError, ValueError):
    """A bad trace or a policy's invalid decision, explained in one line with a hint."""


@dataclass(frozen=True)
class Job:
    """One job: ``gpus`` GPUs for ``duration`` hours, submitted at ``submit`` hours.

    ``estimate`` (hours) is the runtime the user declared; schedulers see only this (backfill
    trusts it). It defaults to ``duration``: a perfect estimate.
    """

    id: int
    user: str
    gpus: int
    submit: float
    duration: float
    estimate: float | None = None

    def __post_init__(self):
        if self.estimate is None:
            object.__setattr__(self, "estimate", self.duration)

    def __str__(self) -> str:
        return f"job {self.id} ({self.gpus} GPU{'' if self.gpus == 1 else 's'}, {self.estimate:.1f} h)"


Alloc = tuple  # ((node, gpus), ...)
Policy = Callable[[list, "ClusterView", float], list]


def _place(free: Sequence[int], gpus: int, gpn: int) -> Alloc | None:
    """Where a job of ``gpus`` GPUs goes, given free GPUs per node; None if it does not fit."""
    if gpus <= gpn:
        best = min(((f, n) for n, f in enumerate(free) if f >= gpus), default=None)
        return None if best is None else ((best[1], gpus),)
    whole = [n for n, f in enumerate(free) if f == gpn][:gpus // gpn]
    return tuple((n, gpn) for n in whole) if len(whole) * gpn == gpus else None


def _take(free: list[int], alloc: Alloc, sign: int = -1) -> None:
    for n, g in alloc:
        free[n] += sign * g


class ClusterView:
    """A read-only snapshot of the cluster that a policy sees at time ``now`` (hours).

    ``free``: free GPUs per node. ``running``: ``(job, estimated end in hours)`` pairs, the end
    being ``start + estimate`` (never earlier than ``now``). Build one by hand for experiments:
    ``ClusterView(free=(7,) * 8)``; ``running`` items are then ``(job, end, ((node, gpus), ...))``.
    """

    def __init__(self, free: Sequence[int], gpus_per_node: int = 8, now: float = 0.0,
                 running: Iterable[tuple] = (), usage: dict[str, float] | None = None):
        self.free = tuple(free)
        self.gpus_per_node = gpus_per_node
        self.now = now
        self._running = sorted(((max(end, now), job, alloc) for job, end, alloc in running), key=lambda r: r[0])
        self.running = tuple((job, end) for end, job, _ in self._running)
        self._usage = dict(usage or {})

    @property
    def total_free(self) -> int:
        """Free GPUs over all nodes."""
        return sum(self.free)

    def usage(self, user: str) -> float:
        """GPU-hours ``user`` has consumed so far (finished jobs plus the elapsed part of running ones)."""
        return self._usage.get(user, 0.0)

    def _assume(self, assuming: Iterable[Job]) -> tuple[list[int], list[tuple]]:
        free, ends = list(self.free), []
        for a in assuming:
            alloc = _place(free, a.gpus, self.gpus_per_node)
            if alloc is None:
                raise SchedulingError(f"cannot assume {a} starts now: it does not fit beside the jobs before it "
                                      f"(free per node {tuple(free)}). Hint: assume only jobs checked with fits()")
            _take(free, alloc)
            ends.append((self.now + a.estimate, a, alloc))
        return free, ends

    def fits(self, job: Job, assuming: Iterable[Job] = ()) -> bool:
        """Whether ``job`` can start now (on one node, or on whole free nodes), if the jobs in
        ``assuming`` start first, in order. Raises :class:`SchedulingError` if they do not fit."""
        free, _ = self._assume(assuming)
        return _place(free, job.gpus, self.gpus_per_node) is not None

    def earliest_start(self, job: Job, assuming: Iterable[Job] = ()) -> float:
        """Hours: the earliest time ``job`` could start if running jobs end at their estimated ends,
        the jobs in ``assuming`` start now (ending after their estimates) and nothing else starts.
        ``math.inf`` if it never fits. Raises :class:`SchedulingError` if ``assuming`` does not fit now."""
        free, ends = self._assume(assuming)
        gpn = self.gpus_per_node
        if _place(free, job.gpus, gpn) is not None:
            return self.now
        for end, _, alloc in sorted(self._running + ends, key=lambda r: r[0]):
            _take(free, alloc, +1)
            if _place(free, job.gpus, gpn) is not None:
                return end
        return math.inf


# --------------------------------------------------------------------------- reference policies

def fifo(queue: list[Job], cluster: ClusterView, now: float) -> list[Job]:
    """Strict first-in first-out: start jobs in submission order until the first that does not
    fit, and never skip it."""
    chosen = []
    for job in queue:
        if not cluster.fits(job, assuming=chosen):
            break
        chosen.append(job)
    return chosen


def greedy(queue: list[Job], cluster: ClusterView, now: float) -> list[Job]:
    """Start every job that fits, in submission order. Fills holes, but a stream of small jobs
    can delay a big head job again and again (starvation): a foil for :func:`backfill`."""
    chosen = []
    for job in queue:
        if cluster.fits(job, assuming=chosen):
            chosen.append(job)
    return chosen


def easy_order(order: list[Job], cluster: ClusterView) -> list[Job]:
    """EASY backfill's pick from a queue already in priority ``order``: the jobs that start now in
    order while they fit, then any later job that fits now and leaves the head's reservation (its
    earliest start, :meth:`ClusterView.earliest_start`) where it was. :func:`backfill` uses it in
    submission order, :func:`fair_share` in fair-share order."""
    chosen = fifo(order, cluster, cluster.now)
    if len(chosen) == len(order):
        return chosen
    head = order[len(chosen)]
    shadow = cluster.earliest_start(head, assuming=chosen)  # the head's reservation
    for job in order[len(chosen) + 1:]:
        if cluster.fits(job, assuming=chosen) and cluster.earliest_start(head, assuming=chosen + [job]) <= shadow:
            chosen.append(job)
    return chosen


def backfill(queue: list[Job], cluster: ClusterView, now: float) -> list[Job]:
    """EASY backfill (Lifka, "The ANL/IBM SP scheduling system", JSSPP 1995; analysed by Mu'alem &
    Feitelson, "Utilization, predictability, workloads, and user runtime estimates in scheduling
    the IBM SP2 with backfilling", IEEE TPDS 12(6), 2001).

    Start jobs in order while they fit; the first that does not fit (the head) gets a reservation
    at its earliest start. A later job may start now only if it fits now and does not push the
    head's earliest start later: it ends before the reservation, or uses GPUs the head will not
    need. Only the head is protected; the jobs behind it may be overtaken."""
    return easy_order(list(queue), cluster)


def fair_share(queue: list[Job], cluster: ClusterView, now: float, shares: dict[str, float] | None = None) -> list[Job]:
    """Order the queue by each user's GPU-hours used so far divided by their share (default 1 each;
    ties in submission order), then EASY backfill behind that priority head.

    The idea is classic fair-share scheduling (Kay & Lauder, "A fair share scheduler", CACM 31(1),
    1988) as in Slurm's fair-share factor (https://slurm.schedmd.com/fair_tree.html). Slurm
    decays usage with a half-life and mixes in other factors; here usage never decays, a
    simplification. The oldest job is no longer protected: a heavy user's old job can be
    overtaken by light users' new ones, which shows up in ``head_delays``.
    """
    shares = shares or {}
    if any(not v > 0 for v in shares.values()):
        raise SchedulingError(f"fair-share shares must be > 0, got {shares}. Hint: a user with no share gets a small one")
    return easy_order(sorted(queue, key=lambda j: cluster.usage(j.user) / shares.get(j.user, 1.0)), cluster)


# --------------------------------------------------------------------------- the simulator

@dataclass(frozen=True)
class JobRun:
    """Where and when a job ran: ``start``/``end`` in hours, ``gpus_held`` as global GPU indices
    (``node * gpus_per_node + local index``)."""

    job: Job
    start: float
    end: float
    nodes: tuple[int, ...]
    gpus_held: tuple[int, ...]

    @property
    def wait(self) -> float:
        """Hours from submission to start."""
        return self.start - self.job.submit


@dataclass(frozen=True)
class HeadDelay:
    """At ``time`` (hours) the policy started ``job``, which moved the head job's earliest start
    from ``before`` to ``after`` (hours); or (``job`` None) it left the head waiting although the
    head fitted next to the jobs it started."""

    time: float
    job: Job | None
    head: Job
    before: float
    after: float

    def __str__(self) -> str:
        if self.job is None:
            return (f"your policy left the head job {self.head.id} ({self.head.gpus} GPUs) waiting at t={self.time:.1f} h "
                    "although it fitted next to the jobs it started")
        return (f"your policy started {self.job} at t={self.time:.1f} h, which pushed the head job {self.head.id} "
                f"from t={self.before:.1f} h to t={self.after:.1f} h")


@dataclass
class SimResult:
    """What :func:`simulate` measured. Times in hours, sizes in GPUs.

    The window is from the first submission to the last job's end (``makespan_h`` long).
    ``utilisation``: busy GPU-hours / (GPUs × makespan). Waits are start − submit; ``p95_wait_h``
    uses numpy's default (linear) percentile. ``stranded_gpus``: time-averaged free
    GPUs while the head job (the oldest waiting) would fit by count but not by placement —
    fragmentation; ``stranded_fraction`` is that over all GPUs. ``idle_with_queue``: time-averaged
    free GPUs while any job waits. ``users``: per user, jobs, GPU-hours and waits.
    ``timeline``: ``(t, busy GPUs, queued jobs)`` after each decision.
    """

    policy: str
    nodes: int
    gpus_per_node: int
    runs: list[JobRun]
    head_delays: list[HeadDelay]
    timeline: list[tuple[float, int, int]]
    makespan_h: float
    utilisation: float
    mean_wait_h: float
    p95_wait_h: float
    max_wait_h: float
    stranded_gpus: float
    stranded_fraction: float
    idle_with_queue: float
    users: dict[str, dict] = field(default_factory=dict)

    def run(self, job_id: int) -> JobRun:
        """The :class:`JobRun` of job ``job_id``."""
        return next(r for r in self.runs if r.job.id == job_id)


def check_trace(trace: Sequence[Job], nodes: int = 8, gpus_per_node: int = 8) -> None:
    """Raise :class:`SchedulingError` unless every job can ever run on the cluster and ids are unique."""
    seen = set()
    for j in trace:
        hint = None
        if j.id in seen:
            hint = "ids must be unique"
        elif not (isinstance(j.gpus, int) and 1 <= j.gpus <= nodes * gpus_per_node):
            hint = f"gpus must be an integer from 1 to {nodes * gpus_per_node}"
        elif j.gpus > gpus_per_node and j.gpus % gpus_per_node:
            hint = f"a job bigger than one node takes whole nodes: use a multiple of {gpus_per_node} GPUs"
        elif not (0 < j.duration < math.inf and 0 < j.estimate < math.inf and 0 <= j.submit < math.inf):
            hint = "duration and estimate must be finite and > 0 h, submit finite and >= 0 h"
        if hint:
            raise SchedulingError(f"{j} of user {j.user!r} cannot run on {nodes}×{gpus_per_node} GPUs. Hint: {hint}")
        seen.add(j.id)


class _Sim:
    def __init__(self, trace, policy, nodes, gpn):
        self.policy, self.gpn = policy, gpn
        self.env = simpy.Environment()
        self.free = [gpn] * nodes
        self.slots = [list(range(gpn)) for _ in range(nodes)]  # free local GPU indices (for the plot)
        self.queue: list[Job] = []
        self.running: dict[int, tuple] = {}  # id -> (job, start, alloc)
        self.used: dict[str, float] = {}  # GPU-hours of finished jobs
        self.runs: dict[int, JobRun] = {}
        self.delays: list[HeadDelay] = []
        self.wake = self.env.event()
        self.env.process(self._arrivals(sorted(trace, key=lambda j: j.submit)))
        self.env.process(self._scheduler())

    def _kick(self):
        if not self.wake.triggered:
            self.wake.succeed()

    def _arrivals(self, trace):
        for t, group in groupby(trace, key=lambda j: j.submit):
            yield self.env.timeout(t - self.env.now)
            self.queue.extend(group)
            self._kick()

    def _scheduler(self):
        while True:
            yield self.wake
            yield self.env.timeout(0)  # let every arrival and end at this instant land first
            self.wake = self.env.event()
            self._decide()

    def _run(self, job, alloc, held):
        yield self.env.timeout(job.duration)
        _take(self.free, alloc, +1)
        for g in held:
            self.slots[g // self.gpn].append(g % self.gpn)
        del self.running[job.id]
        self.used[job.user] = self.used.get(job.user, 0.0) + job.gpus * job.duration
        self._kick()

    def view(self) -> ClusterView:
        now = self.env.now
        usage = dict(self.used)
        for job, start, _ in self.running.values():
            usage[job.user] = usage.get(job.user, 0.0) + job.gpus * (now - start)
        running = [(job, start + job.estimate, alloc) for job, start, alloc in self.running.values()]
        return ClusterView(self.free, self.gpn, now, running, usage)

    def _decide(self):
        now, view = self.env.now, self.view()
        chosen = []
        if self.queue and view.total_free:
            chosen = self._validate(self.policy(list(self.queue), view, now), view)
            self._measure_head(chosen, view)
            for job in chosen:
                alloc = _place(self.free, job.gpus, self.gpn)
                _take(self.free, alloc)
                held = []
                for n, g in alloc:
                    self.slots[n].sort()
                    held += [n * self.gpn + s for s in self.slots[n][:g]]
                    del self.slots[n][:g]
                self.running[job.id] = (job, now, alloc)
                self.runs[job.id] = JobRun(job, now, now + job.duration, tuple(n for n, _ in alloc), tuple(held))
                self.env.process(self._run(job, alloc, held))
            ids = {j.id for j in chosen}
            self.queue = [j for j in self.queue if j.id not in ids]

    def _validate(self, chosen, view: ClusterView) -> list[Job]:
        if not isinstance(chosen, (list, tuple)):
            raise SchedulingError(f"your policy returned a {type(chosen).__name__}, not a list of jobs. "
                                  "Hint: return [] to start nothing now")
        waiting, free, seen = {j.id: j for j in self.queue}, list(view.free), set()
        for job in chosen:
            if not isinstance(job, Job) or waiting.get(job.id) != job or job.id in seen:
                what = "twice" if isinstance(job, Job) and job.id in seen else "but it is not in the queue"
                raise SchedulingError(f"your policy returned {job} at t={view.now:.1f} h {what}. "
                                      "Hint: return each job of the `queue` argument at most once")
            alloc = _place(free, job.gpus, self.gpn)
            if alloc is None:
                raise SchedulingError(f"your policy started {job} at t={view.now:.1f} h, but it does not fit: "
                                      f"free GPUs per node {tuple(free)} after the jobs before it. "
                                      "Hint: check cluster.fits(job, assuming=chosen) before choosing it")
            _take(free, alloc)
            seen.add(job.id)
        return list(chosen)

    def _measure_head(self, chosen, view: ClusterView):
        ids = {j.id for j in chosen}
        head = next((j for j in self.queue if j.id not in ids), None)
        if head is None:
            return
        order = {j.id: i for i, j in enumerate(self.queue)}
        before_head = [j for j in chosen if order[j.id] < order[head.id]]
        assumed = sorted(before_head, key=lambda j: order[j.id])
        before = view.earliest_start(head, assuming=assumed)
        for job in chosen:
            if job in before_head:
                continue
            assumed.append(job)
            after = view.earliest_start(head, assuming=assumed)
            if after > before + 1e-9:
                self.delays.append(HeadDelay(view.now, job, head, before, after))
            before = after
        if view.fits(head, assuming=chosen):  # it could have started now, and was held back
            self.delays.append(HeadDelay(view.now, None, head, view.now, math.inf))

    def result(self, name: str) -> SimResult:
        if self.queue:
            j = self.queue[0]
            raise SchedulingError(f"your policy left {len(self.queue)} jobs waiting forever, e.g. {j} submitted at "
                                  f"t={j.submit:.1f} h. Hint: start the head job whenever it fits; the simulator asks "
                                  "again only when a job arrives or ends")
        return measure(list(self.runs.values()), len(self.free), self.gpn, name, self.delays)


def measure(runs: Sequence[JobRun], nodes: int, gpus_per_node: int, name: str,
            head_delays: Sequence[HeadDelay] = ()) -> SimResult:
    """The :class:`SimResult` of jobs that ran as ``runs`` (simulated, or read back from a real
    scheduler by :mod:`teraflops.orchestration.slurm_queue`): every statistic from the runs alone.

    The timeline is rebuilt at every submission, start and end (after all events of an instant):
    busy GPUs (from ``gpus_held``), queued jobs (submitted, not started) and stranded GPUs (the
    oldest waiting job fits the free GPUs by count but not by placement). Busy GPU-time counts
    ``end - start``. Times are in the runs' unit (hours when simulated; seconds on Slurm).
    """
    runs = sorted(runs, key=lambda r: r.job.id)
    gpus = nodes * gpus_per_node
    t0, t1 = min(r.job.submit for r in runs), max(r.end for r in runs)
    span = t1 - t0
    order = sorted(runs, key=lambda r: (r.job.submit, r.job.id))  # the queue's order: submission
    tl = []
    for t in sorted({x for r in runs for x in (r.job.submit, r.start, r.end)}):
        free = [gpus_per_node] * nodes
        for r in runs:
            if r.start <= t < r.end:
                for g in r.gpus_held:
                    free[g // gpus_per_node] -= 1
        queued = [r.job for r in order if r.job.submit <= t < r.start]
        total = sum(free)
        head = queued[0] if queued else None
        stranded = total if head and head.gpus <= total and _place(free, head.gpus, gpus_per_node) is None else 0
        tl.append((t, gpus - total, len(queued), stranded))
    dts = np.diff([t for t, *_ in tl] + [t1])

    def avg(values):
        return float(np.dot(values, dts) / span) if span > 0 else 0.0

    busy = sum(r.job.gpus * (r.end - r.start) for r in runs)
    waits = np.array([r.wait for r in runs])
    users = {}
    for u in sorted({r.job.user for r in runs}):
        mine = [r for r in runs if r.job.user == u]
        w = [r.wait for r in mine]
        users[u] = dict(jobs=len(mine), gpu_hours=sum(r.job.gpus * (r.end - r.start) for r in mine),
                        mean_wait_h=float(np.mean(w)), max_wait_h=float(np.max(w)))
    stranded = avg([s for *_, s in tl])
    return SimResult(
        policy=name, nodes=nodes, gpus_per_node=gpus_per_node, runs=runs, head_delays=list(head_delays),
        timeline=[(t, b, q) for t, b, q, _ in tl], makespan_h=span,
        utilisation=busy / (gpus * span) if span > 0 else 0.0,
        mean_wait_h=float(waits.mean()), p95_wait_h=float(np.percentile(waits, 95)), max_wait_h=float(waits.max()),
        stranded_gpus=stranded, stranded_fraction=stranded / gpus,
        idle_with_queue=avg([gpus - b if q else 0 for _, b, q, _ in tl]), users=users)


def simulate(trace: Sequence[Job], policy: Policy, nodes: int = 8, gpus_per_node: int = 8,
             name: str | None = None) -> SimResult:
    """Run ``trace`` through ``policy`` on ``nodes`` × ``gpus_per_node`` GPUs; returns a :class:`SimResult`
    labelled ``name`` (default: the policy's ``__name__``).

    Raises :class:`SchedulingError` for a job that can never run (see :func:`check_trace`), for a
    policy decision that starts a job not in the queue, twice, or one that does not fit, and for a
    policy that leaves jobs waiting forever. A 300-job trace takes a fraction of a second.
    """
    if not trace:
        raise SchedulingError("the trace is empty. Hint: make one with make_trace()")
    check_trace(trace, nodes, gpus_per_node)
    sim = _Sim(trace, policy, nodes, gpus_per_node)
    sim.env.run()
    return sim.result(name or getattr(policy, "__name__", repr(policy)))


# --------------------------------------------------------------------------- the course trace

USERS = ("alice", "bob", "chen", "llm-team")
SMALL_SIZES = {1: 0.45, 2: 0.15, 4: 0.15, 8: 0.2, 16: 0.05}
LARGE_SIZES = {8: 0.2, 16: 0.3, 32: 0.3, 64: 0.2}


def make_trace(num_jobs: int = 300, seed: int = 0, *, load: float = 1.1, users: Sequence[str] = USERS,
               big_fraction: float = 0.15, median_h: float = 1.0, sigma: float = 1.2, max_h: float = 24.0,
               estimate_factor: float = 1.0, nodes: int = 8, gpus_per_node: int = 8) -> list[Job]:
    """A seeded synthetic trace of ``num_jobs`` jobs, ids in submission order.

    Its shape imitates published traces of shared GPU clusters (Jeon et al., "Analysis of
    Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads", USENIX ATC 2019, Microsoft
    Philly; Hu et al., "Characterization and Prediction of Deep Learning Workloads in Large-Scale
    GPU Datacenters", SC 2021, SenseTime Helios): most jobs take one or a few GPUs, a few take
    many, and runtimes are heavy-tailed. Every number below is the course's choice, not a fit.

    * Users: the last of ``users`` (``"llm-team"``) submits a ``big_fraction`` of the jobs with
      sizes from ``LARGE_SIZES`` (8–64 GPUs); the others share the rest evenly with sizes from
      ``SMALL_SIZES`` (1–16 GPUs, mostly 1). Sizes are powers of two.
    * Durations (hours): log-normal with median ``median_h`` and log-std ``sigma``, clipped to
      [0.05, ``max_h``]. Estimates: ``estimate_factor`` × duration (1 = users know their runtimes).
    * Arrivals: a Poisson process whose rate makes the offered load (GPU-hours submitted per hour)
      ``load`` × the cluster's GPUs; above 1 a queue forms.
    """
    if num_jobs < 1 or load <= 0 or not 0 <= big_fraction <= 1 or len(users) < 2:
        raise SchedulingError("make_trace needs num_jobs >= 1, load > 0, 0 <= big_fraction <= 1 and two users or more. "
                              "Hint: the defaults make the course trace")
    rng = np.random.default_rng(seed)
    capacity = nodes * gpus_per_node
    big = rng.random(num_jobs) < big_fraction
    small_users = list(users[:-1])

    def sizes(table_, n):
        s = [k for k in table_ if k <= capacity]
        p = np.array([table_[k] for k in s])
        return rng.choice(s, size=n, p=p / p.sum())

    gpus = np.where(big, sizes(LARGE_SIZES, num_jobs), sizes(SMALL_SIZES, num_jobs))
    who = np.where(big, users[-1], rng.choice(small_users, size=num_jobs))
    dur = np.clip(rng.lognormal(math.log(median_h), sigma, num_jobs), 0.05, max_h).round(3)
    rate = load * capacity / float(np.mean(gpus * dur))  # jobs per hour
    submit = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, num_jobs - 1))]).round(3)
    return [Job(i, str(who[i]), int(gpus[i]), float(submit[i]), float(dur[i]), float(dur[i] * estimate_factor))
            for i in range(num_jobs)]


# --------------------------------------------------------------------------- comparing and showing

DEFAULT_POLICIES = {"FIFO": fifo, "backfill": backfill, "fair share": fair_share}


def compare(trace: Sequence[Job], policies: dict[str, Policy] | None = None, nodes: int = 8,
            gpus_per_node: int = 8) -> list[dict]:
    """Simulate ``trace`` under each policy (default FIFO, backfill, fair share); one row per policy
    with the headline numbers and the full :class:`SimResult` under ``"result"``."""
    rows = []
    for name, policy in (policies or DEFAULT_POLICIES).items():
        r = simulate(trace, policy, nodes, gpus_per_node, name=name)
        rows.append(dict(policy=name, utilisation=r.utilisation, mean_wait_h=r.mean_wait_h, p95_wait_h=r.p95_wait_h,
                         stranded_gpus=r.stranded_gpus, idle_with_queue=r.idle_with_queue,
                         head_delays=len(r.head_delays), result=r))
    return rows


def policy_table(rows: list[dict]) -> str:
    """The :func:`compare` rows as a text table."""
    return table([(r["policy"], 100 * r["utilisation"], r["mean_wait_h"], r["p95_wait_h"], r["stranded_gpus"],
                   r["idle_with_queue"], r["head_delays"]) for r in rows],
                 ["policy", "utilisation %", "mean wait h", "p95 wait h", "stranded GPUs", "idle GPUs w/ queue",
                  "head delays"])


def user_table(result: SimResult) -> str:
    """Per user: jobs, GPU-hours and their share of all, mean and max wait (hours)."""
    total = sum(u["gpu_hours"] for u in result.users.values())
    return table([(name, u["jobs"], u["gpu_hours"], 100 * u["gpu_hours"] / total, u["mean_wait_h"], u["max_wait_h"])
                  for name, u in result.users.items()],
                 ["user", "jobs", "GPU-hours", "share %", "mean wait h", "max wait h"])


def plot_timeline(result: SimResult):
    """One row per GPU with each job as a bar coloured by user (top), busy GPUs and queue length
    over time (bottom); returns the Figure."""
    import matplotlib.pyplot as plt

    gpn, gpus = result.gpus_per_node, result.nodes * result.gpus_per_node
    fig, (ax, ax_busy) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw=dict(height_ratios=[3, 1]))
    colours = {u: plt.cm.tab10(i % 10) for i, u in enumerate(result.users)}
    for user, colour in colours.items():
        bars = [(r, g) for r in result.runs if r.job.user == user for g in r.gpus_held]
        ax.barh([g for _, g in bars], [r.end - r.start for r, _ in bars], left=[r.start for r, _ in bars], height=1,
                color=colour, edgecolor="white", linewidth=0.3, label=user)
    for n in range(1, result.nodes):
        ax.axhline(n * gpn - 0.5, color="black", linewidth=0.6)
    ax.set_yticks([n * gpn + (gpn - 1) / 2 for n in range(result.nodes)], [f"node {n}" for n in range(result.nodes)])
    ax.set_ylim(gpus - 0.5, -0.5)
    ax.set(title=f"{result.policy}: utilisation {100 * result.utilisation:.1f}%, mean wait {result.mean_wait_h:.1f} h")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    t = [p[0] for p in result.timeline]
    ax_busy.step(t, [p[1] for p in result.timeline], where="post", label="busy GPUs")
    ax_busy.axhline(gpus, color="grey", linestyle="--", linewidth=0.8)
    ax_busy.set(xlabel="time (hours)", ylabel="busy GPUs", ylim=(0, gpus * 1.05))
    ax_q = ax_busy.twinx()
    ax_q.step(t, [p[2] for p in result.timeline], where="post", color="tab:red", label="queued jobs")
    ax_q.set_ylabel("queued jobs", color="tab:red")
    fig.tight_layout()
    return fig
