"""Triage a workload from its profile: compute-, memory-, overhead- or communication-bound, or waiting?

The course's diagnosis in one call. :func:`triage` reads a Chrome trace written by
``torch.profiler.profile(record_shapes=True).export_chrome_trace(path)`` (:func:`teraflops.triage.trace.record`
writes one; :mod:`teraflops.triage.trace` reads it)
and splits the step's wall time into five categories:

* **compute** / **memory** / **overhead**: each operator's self time goes to the verdict of
  :func:`teraflops.model_definition.profiling.classify` for one call of it: its roofline ideal time
  ``max(FLOPs / peak, bytes / bandwidth)`` against the launch floor (Williams, Waterman & Patterson,
  "Roofline", CACM 52(4), 2009). Time in which no operator runs (Python, dispatcher, a GPU waiting
  for launches) is **overhead** too.
* **communication**: time in collectives (gloo/NCCL ranges, ``c10d::`` ops, ``record_param_comms``,
  NCCL kernels) while no other operator does work, i.e. *exposed* communication; overlapped
  communication costs nothing. An operator with no work of its own (a module hook, an autograd
  node: DeepSpeed ZeRO-3 waits for its parameter all-gathers inside one) that runs while a
  collective is in flight is waiting for it, so that time is communication too; operators that
  gloo's worker threads run inside a collective's range are part of it.
* **waiting**: with per-rank wait times, the part of that collective time spent waiting for a
  straggler. The straggler is the rank that waits *least* (it arrives last, everyone else waits for
  it), found with the modified z-score of :mod:`teraflops.orchestration.detection` (Iglewicz & Hoaglin 1993).
  The waits split the traced rank's own collective time: profile one step of a rank other than the
  straggler (the trace's ``distributedInfo`` names the rank that wrote it).

The verdict is the category with the largest share; ``act_on`` names the units that fix it.

Self time: on one thread, operator events nest by time containment; an event's self time is the
time when it is the innermost event running, so ``aten::matmul`` and its ``aten::mm`` are not
counted twice. FLOPs and bytes per call come from :func:`teraflops.triage.trace.op_cost`, "self" in the same way: an operator's
own estimate minus its children's (floored at 0), so a wrapper that delegates its work has none.

On a GPU trace (events with ``cat == "kernel"``) the device timeline is used instead: each kernel's
time goes to the operator that launched it (its ``External id``), idle device time is overhead
except inside a host-side collective (``gloo:``/``c10d::`` ranges, ``record_param_comms``), where it
is communication as on the CPU (the device waits for the collective), or under a host operator with
no work of its own while a collective is in flight, from its launch to the end of its NCCL kernel
(DeepSpeed ZeRO-3's module hooks fetching parameters: the CPU rule on the device's timeline), and
kernels of no operator, or of one with no FLOP/byte estimate (a torch.compile'd or custom kernel), are
classified by name (``gemm``/``flash``/… compute, NCCL communication,
others memory). Units: seconds, FLOP, bytes (GB = 1e9).

:func:`triage` runs five steps, one function each: the step's **intervals**, each with a
:class:`Label` (:func:`_intervals`) → the wall time **attributed** to them (:func:`_attribute`) →
**shares** per category (:func:`_shares`; waits move part of communication to waiting,
:func:`_straggler_split`) → the **evidence** per operator (:func:`_evidence`) → the **verdict**
(:func:`_verdict`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from teraflops.ceilings import Ceilings, measure_ceilings
from teraflops.machine import detect
from teraflops.model_definition.launch_overhead import launch_floor, op_time_vs_size
from teraflops.model_definition.profiling import classify
from teraflops.orchestration.detection import THRESHOLD, as_matrix, modified_z
from teraflops.triage import trace
from teraflops.triage.trace import COMM_CATEGORIES, GEMM_KERNEL, TriageError, is_collective, load_trace, op_cost

# the trace reader's, importable from here too: a learner's notebook calls verdict.record / verdict.load_trace
record = trace.record
from teraflops.sizing import PRESETS
from teraflops.tables import fmt_seconds, table

CATEGORIES = ("compute", "memory", "overhead", "communication", "waiting")
VERDICTS = {"compute": "compute-bound", "memory": "memory-bound", "overhead": "overhead-bound",
            "communication": "communication-bound", "waiting": "waiting (straggler)"}
ACT_ON = {"compute": "Unit 1 (model definition: kernels, precision) and Unit 4 (quantization)",
          "memory": "Unit 1 (FlashAttention/fusion) and Unit 4 (torch.compile fusion)",
          "overhead": "Unit 4 (torch.compile, CUDA graphs, batching)",
          "communication": "Unit 5 (communicate less, less often) and Unit 2 (ZeRO stage)",
          "waiting": "Unit 3 (stragglers)"}
_FROM_CLASSIFY = {"math": "compute", "memory": "memory", "framework overhead": "overhead"}
# Chrome-trace dtype names (c10's type names as the profiler prints them) -> bytes per element
def measured_ceilings(device: str | None = None) -> Ceilings:
    """This machine's ceilings on ``device`` (``"cpu"`` or ``"cuda"``; default the machine's),
    :func:`teraflops.ceilings.measure_ceilings` at the preset's probe sizes (the ``cpu`` preset's
    for the CPU of a GPU machine; a few seconds), measured once per process and device."""
    return _ceilings_on(device or detect().device)


@functools.lru_cache(maxsize=None)
def _ceilings_on(device: str) -> Ceilings:
    import torch

    if device == detect().device:
        return measure_ceilings(device=device)
    p = PRESETS["cpu"]
    return measure_ceilings(p.probe.matmul_n, p.probe.copy_bytes, torch.float32, device)


def measured_launch_floor(device: str | None = None) -> float:
    """This machine's launch floor in seconds on ``device`` (default the machine's), measured once per
    process: the median time of a 1-element ``torch.add`` (the smallest point of Unit 1's
    :func:`teraflops.model_definition.launch_overhead.op_time_vs_size` sweep). Measured rather than read from the trace: a
    trace's shortest events are dispatcher-only ops (a view, ~0.1 µs), far below what an op that
    launches work costs."""
    return _floor_on(device or detect().device)


@functools.lru_cache(maxsize=None)
def _floor_on(device: str) -> float:
    return launch_floor(op_time_vs_size([1], device, min_run_time=0.05))


@dataclass(frozen=True)
class Evidence:
    """One contributor: an operator name and category, over all its calls in the trace.

    ``seconds``: its attributed time; ``share``: of the step; ``flops``, ``nbytes``: self FLOPs and
    bytes of all calls; ``intensity``: FLOP/byte; ``of_roof``: roofline ideal time / measured time,
    i.e. achieved FLOP/s / peak (compute) or bytes/s / bandwidth (memory); NaN for collectives and idle.
    """

    name: str
    category: str
    calls: int
    seconds: float
    share: float
    flops: float
    nbytes: float
    intensity: float
    of_roof: float


@dataclass(frozen=True)
class Triage:
    """What :func:`triage` found. ``shares``: fraction of the step per category of :data:`CATEGORIES`
    (sum 1); ``step_s``: the step's wall time (s); ``stragglers``: ranks flagged from the waits."""

    verdict: str
    shares: dict
    evidence: tuple
    act_on: str
    step_s: float
    ceilings: Ceilings
    launch_floor: float
    stragglers: tuple = ()
    note: str = ""

    def summary(self) -> str:
        """One paragraph: verdict, shares, top contributor and where to act."""
        parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(self.shares.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        c, top = self.ceilings, self.evidence[0] if self.evidence else None
        lead = (f" Top contributor: {top.name} ({top.category}), {top.share:.0%} of the step"
                + (f", {top.intensity:.3g} FLOP/byte at {top.of_roof:.0%} of its roof." if top.of_roof == top.of_roof
                   else ".")) if top else ""
        return (f"Verdict: {self.verdict} ({parts}) over a {fmt_seconds(self.step_s)} step, against peak "
                f"{c.peak_flops / 1e9:.3g} GFLOP/s, bandwidth {c.bandwidth / 1e9:.3g} GB/s (ridge "
                f"{c.ridge_point:.3g} FLOP/byte), launch floor {fmt_seconds(self.launch_floor)}.{lead}"
                f"{' ' + self.note if self.note else ''} Act on: {self.act_on}.")

    def table(self) -> str:
        """The evidence as a table (``teraflops.tables.table``)."""
        return table([(e.name, e.category, e.calls, fmt_seconds(e.seconds), f"{e.share:.0%}", e.flops / 1e9,
                       e.nbytes / 1e6, e.intensity, "-" if e.of_roof != e.of_roof else f"{e.of_roof:.0%}")
                      for e in self.evidence],
                     ["operator", "category", "calls", "time", "share", "GFLOP", "MB", "FLOP/byte", "of roof"])


def _waits(waits) -> np.ndarray:
    """Wait times as float64 ``[steps, ranks]`` seconds from a list per rank, a list of such lists
    (one per step), a dict rank -> seconds (or -> list per step), or a JSON file of one of these."""
    hint = "Hint: seconds each rank spent inside the collective, e.g. [0.21, 0.2, 0.01, 0.22] for 4 ranks"
    try:
        if isinstance(waits, (str, Path)):
            waits = json.loads(Path(waits).read_text())
        if isinstance(waits, dict):
            waits = np.asarray([waits[k] for k in sorted(waits, key=int)], dtype=np.float64).T
        w = np.asarray(waits, dtype=np.float64)
    except (OSError, ValueError, TypeError) as e:
        raise TriageError(f"cannot read the waits ({' '.join(str(e).split())[:80]}). {hint}") from None
    try:
        w = as_matrix(w, "waits")
    except ValueError as e:
        raise TriageError(f"{str(e).split(' Hint:')[0].rstrip('.')}. {hint}") from None
    return w


def _pieces(events: list[dict]) -> tuple[list, dict]:
    """Innermost-event pieces per thread, ``(start, end, event index)`` in µs (children clipped to
    their parent), and each event's parent index (``None`` at top level)."""
    threads: dict = {}
    for i, e in enumerate(events):
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    pieces, parent = [], {}
    for idx in threads.values():
        idx.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        stack, cursor = [], 0.0  # (index, end); cursor: where the running piece began
        for i in idx + [None]:
            t = math.inf if i is None else events[i]["ts"]
            while stack and stack[-1][1] <= t:
                j, end = stack.pop()
                pieces.append((cursor, end, j))
                cursor = end
            if i is None:
                break
            if stack:
                pieces.append((cursor, t, stack[-1][0]))
            parent[i] = stack[-1][0] if stack else None
            stack.append((i, min(t + events[i]["dur"], stack[-1][1] if stack else math.inf)))
            cursor = t
    return [p for p in pieces if p[1] > p[0]], parent


def _seconds(intervals, seg, weight, mask) -> np.ndarray:
    """Seconds of each ``(start, end, key)`` interval (µs) over the segments between the sorted
    boundaries ``seg`` where ``mask`` holds, a segment shared equally by the ``weight`` intervals in it."""
    per = np.where(mask, np.diff(seg) / np.maximum(weight, 1), 0.0)
    cum = np.concatenate([[0.0], np.cumsum(per)])
    ends = np.searchsorted(seg, [[s, e] for s, e, _ in intervals]).reshape(-1, 2)
    return (cum[ends[:, 1]] - cum[ends[:, 0]]) * 1e-6


def _count(intervals, seg) -> np.ndarray:
    """How many intervals run in each segment between the boundaries ``seg``."""
    d = np.zeros(len(seg))
    ends = np.searchsorted(seg, [[s, e] for s, e, _ in intervals]).reshape(-1, 2)
    np.add.at(d, ends[:, 0], 1)
    np.add.at(d, ends[:, 1], -1)
    return np.cumsum(d)[:-1]


@dataclass(frozen=True)
class Label:
    """What one timed interval of the step belongs to: an operator, a GPU kernel or a collective
    (``name``), its category (one of :data:`CATEGORIES`) and the self FLOPs and bytes of that call
    (0 for collectives and for kernels classified by name)."""

    name: str
    category: str
    flops: float = 0.0
    nbytes: float = 0.0

    @property
    def has_work(self) -> bool:
        """Whether it has FLOPs or bytes of its own (a module hook or an autograd node has neither)."""
        return self.flops > 0 or self.nbytes > 0


def _labels(ops, parent, c: Ceilings, floor: float) -> dict[int, Label]:
    """Op index -> its :class:`Label`: self FLOPs and bytes, category from one call's roofline."""
    cost = {}
    for i, e in enumerate(ops):
        try:
            cost[i] = op_cost(e["name"], e.get("args") or {})
        except (ValueError, TypeError, AssertionError, IndexError) as err:
            raise TriageError(f"{e['name']} has Input Dims that do not fit it ({' '.join(str(err).split())[:60]}). "
                              "Hint: a trace from torch.profiler with record_shapes=True, unedited") from None
    own = {i: list(x) for i, x in cost.items()}
    for i, p in parent.items():
        if p is not None:
            own[p] = [own[p][0] - cost[i][0], own[p][1] - cost[i][1]]
    out = {}
    for i, e in enumerate(ops):
        f, b = max(own[i][0], 0.0), max(own[i][1], 0.0)
        out[i] = Label(e["name"], _FROM_CLASSIFY[classify(f, b, c.peak_flops, c.bandwidth, floor)], f, b)
    return out


# ---- step 1: the step's intervals, each labelled -------------------------------------------------


@dataclass(frozen=True)
class Intervals:
    """The step's timed intervals, ``(start, end, key)`` in µs, by role; ``labels[key]`` says what each is.

    ``work``: operators doing work (on a GPU trace, kernels, keyed by the operator that launched
    them); ``light``: operators with no work of their own outside any collective (a CPU trace's
    hooks, autograd nodes, Python); ``comm``: collectives (on a GPU trace, NCCL kernels); ``host``:
    a GPU trace's host-side collective ranges; ``bounds``: every operator's start and end (µs), so
    that the step spans them all.
    """

    work: tuple
    light: tuple
    comm: tuple
    host: tuple
    labels: dict
    bounds: tuple

    @property
    def all(self) -> tuple:
        """Every interval, in the order :class:`Attribution` gives their seconds."""
        return self.work + self.light + self.comm + self.host


def _kernel_work(events, ops, labels: dict) -> tuple[list, dict]:
    """A GPU trace's kernels as work intervals: a kernel's time is the time of the operator that
    launched it (its ``External id``). A kernel of no operator, or of one with no FLOP/byte estimate
    (a torch.compile'd or custom kernel), gets a label of its own from its name: busy device time
    is never launch overhead. Returns the intervals and those kernels' labels."""
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and not is_collective(e["name"], e["cat"])]
    by_ext = {e["args"]["External id"]: i for i, e in enumerate(ops) if isinstance((e.get("args") or {}).get("External id"), int)}
    work, own = [], {}
    for k, e in enumerate(kernels):
        ext = (e.get("args") or {}).get("External id")
        key = by_ext.get(ext) if isinstance(ext, int) else None
        if key is None or not labels[key].has_work:
            key = ("k", k)
            own[key] = Label(e["name"], "compute" if GEMM_KERNEL.search(e["name"]) else "memory")
        work.append((e["ts"], e["ts"] + e["dur"], key))
    return work, own


def _operator_work(events, ops, pieces, parent, labels: dict) -> tuple[list, list]:
    """A CPU trace's operator self-time pieces outside collectives, as ``(work, light)``: those with
    work of their own and those without. A piece inside a collective (the collective op, an op it
    calls, or an op that gloo's worker thread runs inside a collective's range) is the collective's,
    already in :attr:`Intervals.comm`, and is left out."""
    spans: dict = {}  # thread -> collective ranges that are no operator (gloo's worker threads)
    for e in events:
        if e.get("cat") == "user_annotation" and is_collective(e["name"], e["cat"]):
            spans.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e["dur"]))
    in_comm: dict = {}
    for i in sorted(parent, key=lambda i: (ops[i]["ts"], -ops[i]["dur"])):  # parents first
        e = ops[i]
        in_comm[i] = (is_collective(e["name"]) or (parent[i] is not None and in_comm[parent[i]])
                      or any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans.get((e.get("pid"), e.get("tid")), ())))
    work, light = [], []
    for p in pieces:
        if not in_comm[p[2]]:
            (work if labels[p[2]].has_work else light).append(p)
    return work, light


def _in_flight(events) -> list[tuple[float, float]]:
    """A GPU trace's collectives in flight, ``(start, end)`` µs: from a host-side collective's start
    (the launch: ``record_param_comms``, ``c10d::``, ``nccl:`` ranges) to the end of the NCCL kernel
    it launched (same ``External id``; else the first NCCL kernel that starts after it), or of its
    range if that ends later. NCCL runs asynchronously: the host range covers the launch only."""
    nccl = sorted((e for e in events if e.get("cat") == "kernel" and is_collective(e["name"], "kernel")),
                  key=lambda e: e["ts"])
    out = []
    for e in events:
        if e.get("cat") not in ("cpu_op", "user_annotation") or not is_collective(e["name"], e["cat"]):
            continue
        ext = (e.get("args") or {}).get("External id")
        mine = [k for k in nccl if isinstance(ext, int) and (k.get("args") or {}).get("External id") == ext]
        later = mine or [k for k in nccl if k["ts"] >= e["ts"]][:1]
        end = max([e["ts"] + e["dur"]] + [k["ts"] + k["dur"] for k in later])
        out.append((e["ts"], end))
    return out


def _waiting_on_device(events, ops, pieces, labels: dict) -> list:
    """A GPU trace's host operators with no work of their own (a module hook, an autograd node:
    DeepSpeed ZeRO-3 fetches each module's parameters inside one and waits for the all-gather) while
    a collective is in flight (:func:`_in_flight`): the CPU rule on the device's timeline. Their
    self-time pieces, clipped to the windows, as ``(start, end, ("w", op index))`` host intervals:
    device idle time under them is the collective's, not launch overhead."""
    windows = _in_flight(events)
    out = []
    for a, b, i in pieces:
        if labels[i].has_work or is_collective(ops[i]["name"]):
            continue
        for lo, hi in windows:
            if min(b, hi) > max(a, lo):
                out.append((max(a, lo), min(b, hi), ("w", i)))
    return out


def _intervals(events, on_device: bool, ceilings: Ceilings, launch_floor: float) -> Intervals:
    """Step 1: the trace's events as labelled intervals (CPU operators' self time, or on a GPU trace
    the device's kernels; collectives)."""
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    pieces, parent = _pieces(ops)
    labels = _labels(ops, parent, ceilings, launch_floor)
    comm = [(e["ts"], e["ts"] + e["dur"], ("c", j)) for j, e in enumerate(events)
            if e.get("cat") in (("kernel",) if on_device else COMM_CATEGORIES) and is_collective(e["name"], e["cat"])]
    # On a GPU trace, a host-side collective (gloo's or c10d's range, DeepSpeed's record_param_comms)
    # during which the device runs nothing is communication too, as on the CPU: the device is idle
    # because the step waits for the collective, not for Python or launches.
    host = [(e["ts"], e["ts"] + e["dur"], ("h", j)) for j, e in enumerate(events)
            if on_device and e.get("cat") in ("cpu_op", "user_annotation") and is_collective(e["name"], e["cat"])]
    labels.update({key: Label(events[key[1]]["name"], "communication") for _, _, key in comm + host})
    if on_device:
        work, kernels = _kernel_work(events, ops, labels)
        labels.update(kernels)
        waited = _waiting_on_device(events, ops, pieces, labels)
        host += waited
        labels.update({key: Label(ops[key[1]]["name"], "communication") for _, _, key in waited})
        light = []
    else:
        work, light = _operator_work(events, ops, pieces, parent, labels)
    bounds = tuple(t for e in ops for t in (e["ts"], e["ts"] + e["dur"]))
    return Intervals(tuple(work), tuple(light), tuple(comm), tuple(host), labels, bounds)


# ---- step 2: the step's time attributed to them ---------------------------------------------------


@dataclass(frozen=True)
class Attribution:
    """``seconds``: of each interval of :attr:`Intervals.all`, in that order; ``idle``: seconds in
    which none runs; ``step``: the step's wall time (s), from the first boundary to the last."""

    seconds: np.ndarray
    idle: float
    step: float


def _attribute(iv: Intervals) -> Attribution:
    """Step 2: each moment of the step goes to what runs then, in this order of precedence: work
    (shared equally by the intervals running), else collectives, else operators with no work of
    their own, else a GPU trace's host-side collectives, else nothing (idle). An operator with no work
    of its own (a module hook, an autograd node, Python) that runs while a collective is in flight is
    waiting for it: such time goes to the collective, as idle time does."""
    seg = np.unique([t for s, e, _ in iv.all for t in (s, e)] + list(iv.bounds))
    step = float(seg[-1] - seg[0]) * 1e-6
    if step <= 0:
        raise TriageError("the trace's operators span 0 s. Hint: profile a call that does some work")
    busy, talk = _count(iv.work, seg), _count(iv.comm, seg)
    waiting, hosted = _count(iv.light, seg), _count(iv.host, seg)
    secs = np.concatenate([_seconds(iv.work, seg, busy, busy > 0),
                           _seconds(iv.light, seg, waiting, (busy == 0) & (talk == 0) & (waiting > 0)),
                           _seconds(iv.comm, seg, talk, (busy == 0) & (talk > 0)),
                           _seconds(iv.host, seg, hosted, (busy == 0) & (talk == 0) & (waiting == 0) & (hosted > 0))])
    idle = float(np.diff(seg)[(busy == 0) & (talk == 0) & (waiting == 0) & (hosted == 0)].sum()) * 1e-6
    return Attribution(secs, idle, step)


# ---- step 3: shares per category ------------------------------------------------------------------


def _shares(iv: Intervals, att: Attribution) -> dict:
    """Step 3: the fraction of the step per category of :data:`CATEGORIES` (idle time is overhead);
    waits then move part of communication to waiting (:func:`_straggler_split`)."""
    shares = dict.fromkeys(CATEGORIES, 0.0)
    shares["overhead"] = att.idle / att.step
    for (_, _, key), s in zip(iv.all, att.seconds):
        shares[iv.labels[key].category] += s / att.step
    return shares


def _straggler_split(waits, shares: dict, rank: int | None) -> tuple[tuple, str, float]:
    """Move the waited part of the communication share to ``"waiting"`` when some rank waits least
    (modified z of the ranks' mean waits, low side, over :data:`teraflops.orchestration.detection.THRESHOLD`).

    Per step the last rank to arrive waits only for the transfer, ``min`` over ranks; the rest of a
    rank's wait is waiting for it. The fraction moved is the traced rank's (``rank``, from the
    trace's ``distributedInfo``), or the mean over ranks when the trace does not say. Returns the
    flagged ranks, a note, and that fraction."""
    w = _waits(waits)
    if shares["communication"] == 0:
        raise TriageError("waits were given but the trace has no exposed time in collectives. Hint: profile a "
                          "step that includes its all-reduce (e.g. a whole DDP step)")
    low_z = -modified_z(w.mean(axis=0))  # positive: the rank waits less than the median rank
    flagged = tuple(int(r) for r in np.flatnonzero(low_z > THRESHOLD))
    if not flagged:
        return (), f"No rank stands out in the waits (largest modified z {low_z.max():.1f} <= {THRESHOLD:g}).", 0.0
    known = isinstance(rank, int) and 0 <= rank < w.shape[1]
    cols, who = ([rank], f"rank {rank}'s") if known else (slice(None), "the ranks'")
    excess = w - w.min(axis=1, keepdims=True)
    waited = float(excess[:, cols].mean() / max(w[:, cols].mean(), 1e-12))
    shares["waiting"] = shares["communication"] * waited
    shares["communication"] -= shares["waiting"]
    own = (f" This trace is rank {rank}'s, the straggler itself: its breakdown shows why it is late; profile "
           "another rank to see the waiting.") if rank in flagged else ""
    return flagged, (f"Rank(s) {', '.join(map(str, flagged))} wait least (modified z {low_z.max():.1f} > "
                     f"{THRESHOLD:g}): they arrive last, and {waited:.0%} of {who} time in collectives is "
                     f"waiting for them.{own}"), waited


# ---- step 4: the evidence, per operator -----------------------------------------------------------


def _evidence(iv: Intervals, att: Attribution, ceilings: Ceilings, waited: float) -> list[Evidence]:
    """Step 4: one :class:`Evidence` per operator name and category (its calls' seconds, FLOPs and
    bytes summed), a collective's time split into waiting and communication as the shares were, and
    the idle time; largest first."""
    rows: dict = {}  # (name, category) -> [keys, seconds]
    for (_, _, key), s in zip(iv.all, att.seconds):
        label = iv.labels[key]
        row = rows.setdefault((label.name, label.category), [set(), 0.0])
        row[0].add(key)
        row[1] += float(s)
    step, evidence = att.step, []
    for (name, cat), (keys, s) in rows.items():
        f, b = sum(iv.labels[k].flops for k in keys), sum(iv.labels[k].nbytes for k in keys)
        roof = max(f / ceilings.peak_flops, b / ceilings.bandwidth) / s if (f or b) and s > 0 else math.nan
        if cat == "communication" and waited > 0:  # a collective's time splits as the shares did
            evidence.append(Evidence(name, "waiting", len(keys), s * waited, s * waited / step, 0.0, 0.0,
                                     math.nan, math.nan))
            s *= 1 - waited
        evidence.append(Evidence(name, cat, len(keys), s, s / step, f, b, f / b if b else math.nan, roof))
    if att.idle > 0:
        evidence.append(Evidence("(idle: no operator running)", "overhead", 0, att.idle, att.idle / step, 0.0, 0.0,
                                 math.nan, math.nan))
    evidence.sort(key=lambda e: -e.seconds)
    return evidence


# ---- step 5: the verdict ----------------------------------------------------------------------------


def _verdict(shares: dict, rank: int | None, stragglers: tuple) -> tuple[str, str]:
    """Step 5: ``(verdict, act_on)``: the category with the largest share, and the units that fix it."""
    best = max(CATEGORIES, key=lambda k: shares[k])
    act_on = ACT_ON[best]
    if rank in stragglers:  # the late rank's own time says why it is late, but the fix is Unit 3's first
        act_on = f"{ACT_ON['waiting']}: this rank is the late one; its {best} time above is why ({ACT_ON[best]})"
    return VERDICTS[best], act_on


def ceilings_note(c: Ceilings) -> str:
    """What a verdict placed on ceilings ``c`` must say about them (``""`` when they are trusted and
    were not put in place of a doubtful probe): ``"inconclusive: machine busy (load 6.2): ..."`` or
    ``"inconclusive: the probe's repeats disagree ..."`` when not :attr:`~teraflops.ceilings.Ceilings.trusted`
    (no quiet figures to use instead), or, on quiet figures used in place of a probe that was not
    trusted (:attr:`~teraflops.ceilings.Ceilings.doubt`), that the step's own timings may be off too."""
    if c.reason:
        return f"inconclusive: {c.reason}: the ceilings are not trusted, so the compute/memory split may be off."
    if c.doubt:
        return (f"The ceilings are this machine's quiet figures: the probe measured now was not trusted ({c.doubt}), "
                "so a step timed now may be off too.")
    return ""


def triage(trace, waits=None, ceilings: Ceilings | None = None, launch_floor: float | None = None,
           top: int = 6) -> Triage:
    """Attribute a profiled step's time; return the verdict, the evidence and where to act.

    Args:
        trace: a Chrome trace of ``torch.profiler`` with ``record_shapes=True``: a path (``.json``,
            ``.json.gz``) or the loaded dict (:func:`load_trace`).
        waits: optional seconds each rank spent inside the step's collectives: ``[ranks]`` or
            ``[steps, ranks]`` (at least 3 ranks), a dict rank -> seconds, or a JSON file of these.
        ceilings: peak FLOP/s and bandwidth (bytes/s); default this machine's (:func:`measured_ceilings`)
            on the device the trace ran on: its GPU when the trace has GPU kernels, else its CPU (e.g.
            gloo ranks on a machine with too few GPUs for NCCL).
        launch_floor: seconds of the cheapest op; default this machine's on that device
            (:func:`measured_launch_floor`).
            Pass both for a trace recorded on another machine.
        top: evidence rows kept, largest time first.

    Raises:
        TriageError: an unreadable or empty trace, bad waits, or waits with no collective in the trace.
    """
    events, rank = load_trace(trace)
    on_device = any(e.get("cat") == "kernel" for e in events)  # a GPU trace: the device's timeline is the step's
    on = "cuda" if on_device else "cpu"  # where the trace's work ran
    ceilings = measured_ceilings(on) if ceilings is None else ceilings
    launch_floor = measured_launch_floor(on) if launch_floor is None else launch_floor
    iv = _intervals(events, on_device, ceilings, launch_floor)
    att = _attribute(iv)
    shares = _shares(iv, att)
    stragglers, note, waited = _straggler_split(waits, shares, rank) if waits is not None else ((), "", 0.0)
    shares = {k: float(v) for k, v in shares.items()}
    evidence = _evidence(iv, att, ceilings, waited)
    verdict, act_on = _verdict(shares, rank, stragglers)
    note = " ".join(x for x in (note, ceilings_note(ceilings)) if x)
    return Triage(verdict, shares, tuple(evidence[:top]), act_on, att.step, ceilings, launch_floor, stragglers, note)
