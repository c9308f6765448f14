"""Unit 5 §1: the bandwidth of collectives, measured as nccl-tests measures it, modelled, and compared.

**Definitions** (NVIDIA nccl-tests, ``doc/PERFORMANCE.md``,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), so that a learner who later
runs ``all_reduce_perf`` reads the same columns:

* ``S`` is the size in bytes of the *whole* buffer: for all-reduce the buffer every rank reduces;
  for all-gather and reduce-scatter the full gathered (or scattered) buffer, ``n`` × the per-rank
  chunk (NCCL's ``sendcount`` / ``recvcount`` are per rank).
* **algbw** = ``S / t``: divide a size by it to get a time.
* **busbw** = ``algbw × factor``, the factor (:data:`BUS_FACTOR`) chosen so that busbw can be compared
  with the bandwidth of one rank's link whatever the number of ranks ``n``: all-reduce
  ``2(n−1)/n`` (each element needs ``n − 1`` additions and ``n`` assignments, ``2(n−1)`` transfers
  spread over ``n`` links); reduce-scatter and all-gather ``(n−1)/n`` (one half of that);
  broadcast and reduce ``1`` (all data passes the root's link); all-to-all ``(n−1)/n``.

**Timing** (nccl-tests ``src/common.cu``, ``BenchTime``): warm-up calls, a barrier, ``iters`` calls
back to back timed as one span, the span / ``iters`` averaged over ranks; then one call on known data
whose wrong elements are counted (``#wrong``). Two deviations, both for a 2-core CPU machine: the
number of timed calls falls with the size (``volume / size``, within [min, max] iterations; nccl-tests
uses a fixed ``-n 20``), and one form per collective is timed (all-reduce in place, torch's only form;
all-gather and reduce-scatter out of place), where nccl-tests times both.

The alpha-beta model fitted to these times is :mod:`teraflops.hardware.alpha_beta`; the links they are
compared with, :mod:`teraflops.datasheets`; what the gradient all-reduce costs a training step,
:mod:`teraflops.hardware.comm_budget`.

Units: sizes in bytes, times in seconds (µs in tables), bandwidths in bytes/s (GB/s in tables,
GB = 1e9 bytes; Gb/s = 1e9 bits/s); message sizes in prose and on plots are binary, KiB = 1024 B and
MiB = 2**20 B, as nccl-tests' ``-b 1K -e 64M`` counts them.

What to expect on the 2-core CPU machine with 4 gloo ranks (they share the cores and talk over
loopback TCP): the sweep of three collectives over 1 KiB – 64 MiB takes ~35 s, the launch included;
a message of up to ~1 MiB costs the same 5–8 ms (on 2 ranks ~2 ms: roughly 1 ms per ring step, and a
ring all-reduce takes 2(n−1) steps); peak busbw ~0.6–0.7 GB/s (all-reduce), ~0.4–0.6 (all-gather),
~0.2 (reduce-scatter): some 700× below NVLink 4's 450 GB/s per direction.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from teraflops import machine
# nccl-tests' bus factors and the input checks live in the shared base (Unit 2's cost model uses them too);
# Unit 5 teaches them here, under these names.
from teraflops.comm_cost import BUS_FACTOR as BUS_FACTOR, check_collective as check_collective
from teraflops.comm_cost import CollectiveInputError, bus_factor, check_positive, check_ranks
from teraflops.launch import launcher
from teraflops.launch.placement import place
from teraflops.launch.rank import RankIdentity
from teraflops.sizing import PRESETS, preset
from teraflops.tables import GB, fmt, fmt_bytes, table

WORKER = "teraflops.workers.collective_sweep"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what sweep() measures


def algbw(size_bytes, seconds):
    """Algorithm bandwidth ``S / t`` in bytes/s (``S``: bytes of the whole buffer, see the module doc).

    Works on scalars and arrays. Raises:
        CollectiveInputError: a size or time that is not > 0.
    """
    s, t = check_positive("size_bytes", size_bytes), check_positive("seconds", seconds)
    out = s / t
    return float(out) if out.ndim == 0 else out


def busbw(size_bytes, seconds, collective: str, n: int):
    """Bus bandwidth ``algbw × bus_factor(collective, n)`` in bytes/s (nccl-tests doc/PERFORMANCE.md).

    Raises:
        CollectiveInputError: unknown collective, ``n < 2``, a size or time not > 0.
    """
    return algbw(size_bytes, seconds) * bus_factor(collective, n)


# ---- the measurement -------------------------------------------------------------------------------


def default_sizes(p=None, ranks: int | None = None) -> list[int]:
    """Powers of two from the preset's ``collective.min_bytes`` to ``collective.max_bytes`` (bytes); on
    a CPU, capped so that every rank's buffers (~3× the size) fit in a quarter of the available memory."""
    p = p or preset()
    top = p.collective.max_bytes
    if p.device == "cpu":
        import psutil

        top = min(top, psutil.virtual_memory().available // (4 * 3 * (p.collective.ranks_cpu if ranks is None else ranks)))
    sizes, s = [], p.collective.min_bytes
    while s <= top:
        sizes.append(s)
        s *= 2
    return sizes


@dataclass(frozen=True)
class SweepSpec:
    """What :mod:`teraflops.workers.collective_sweep` runs: each of ``collectives`` at each of
    ``sizes`` (bytes of the whole buffer, nccl-tests' ``S``), ``volume_bytes / size`` timed calls
    clamped to ``[min_iters, iters]`` after ``min(warmup, timed)`` untimed ones (at least 1);
    ``timeout_s``: seconds a collective waits for the others. Checked on construction
    (:class:`CollectiveInputError`); :func:`sweep_spec` builds it from a preset."""

    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    iters: int
    min_iters: int
    warmup: int
    volume_bytes: int
    timeout_s: float = 60

    def __post_init__(self):
        if not self.collectives or set(self.collectives) - set(COLLECTIVES):
            raise CollectiveInputError(f"collectives must be some of {COLLECTIVES}, got {self.collectives!r}. "
                                       "Hint: pass a tuple such as ('all_reduce',)")
        counts = (self.iters, self.min_iters, self.warmup, self.volume_bytes)
        if not self.sizes or min((*self.sizes, *counts)) < 1 or self.min_iters > self.iters:
            raise CollectiveInputError(f"sizes {self.sizes!r} and iters {self.iters}, min_iters {self.min_iters}, "
                                       f"warmup {self.warmup}, volume_bytes {self.volume_bytes} must be >= 1, "
                                       "min_iters <= iters. Hint: build it with sweep_spec()")


@dataclass(frozen=True)
class SweepRow:
    """One collective at one size, as the ranks measured it: ``size`` (bytes moved, after rounding
    each rank's chunk to 8 elements), ``count`` (float32 elements), ``type`` (``"float"``),
    ``iters`` timed and ``warmup`` untimed calls, ``seconds`` (mean per call, averaged over ranks),
    ``seconds_max`` (the slowest rank's), ``wrong`` (elements, summed over ranks)."""

    collective: str
    size: int
    count: int
    type: str
    iters: int
    warmup: int
    seconds: float
    seconds_max: float
    wrong: int


@dataclass(frozen=True)
class SweepResult(RankIdentity):
    """One rank's sweep: ``rows`` (reduced over the ranks, so the same on every rank), one per point
    run, and ``skipped``, the ``(collective, size)`` points no rank ran (they did not fit in device
    memory, or left a chunk of 0 elements)."""

    rows: tuple[SweepRow, ...]
    skipped: tuple[tuple[str, int], ...] = ()


def _sweep_placement(ranks, cluster):
    """The placement of a sweep and the preset that sizes it (the CPU preset for CPU ranks)."""
    if ranks is not None:
        check_ranks(ranks)
    p, gpus = preset(), machine.detect().gpu_count
    if cluster is not None and ranks is None:
        ranks = cluster.nodes
    if cluster is None and gpus >= 2 and ranks is not None and ranks > gpus:
        raise CollectiveInputError(f"ranks={ranks} but this machine has {gpus} GPUs (one NCCL rank per GPU). "
                                   f"Hint: ranks <= {gpus}, or ranks=None for one rank per GPU")
    cpu = p if p.device == "cpu" else PRESETS["cpu"]
    # emulated nodes shape TCP traffic: gloo CPU ranks there, so that the collective crosses the links
    where = place(None if ranks is None else int(ranks), cpu_ranks=cpu.collective.ranks_cpu, min_ranks=2, cluster=cluster,
                  gpus=cluster is None and p.device == "cuda")
    if not where.on_gpus:
        where = where.with_env(OMP_NUM_THREADS=1)  # one torch thread per gloo rank
    check_ranks(where.world_size)
    return where, (p if where.on_gpus else cpu)


def _sweep_collectives(collectives) -> tuple[str, ...]:
    collectives = (collectives,) if isinstance(collectives, str) else tuple(collectives)
    for c in collectives or ("",):
        if c not in COLLECTIVES:
            raise CollectiveInputError(f"sweep measures some of {COLLECTIVES}, got {c!r}. "
                                       "Hint: pass a tuple such as ('all_reduce',)")
    return collectives


def _sweep_sizes(sizes, ranks: int) -> tuple[int, ...]:
    def whole(s) -> bool:
        return isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 32 * ranks

    if not sizes or not all(whole(s) for s in sizes):
        raise CollectiveInputError(f"sizes must be integers of at least 32·ranks = {32 * ranks} bytes, got {sizes!r}. "
                                   "Hint: each rank's chunk holds a multiple of 8 float32 elements")
    return tuple(int(s) for s in sizes)


def _sweep_count(p, name: str, value) -> int:
    """``value``, or the preset's ``collective.<name>`` if None; an integer >= 1."""
    v = getattr(p.collective, name) if value is None else value
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise CollectiveInputError(f"{name} must be an integer >= 1, got {v!r}. "
                                   f"Hint: leave it None for the preset's {getattr(p.collective, name)}")
    return int(v)


def sweep_spec(p, ranks: int, collectives=COLLECTIVES, sizes=None, *, iters: int | None = None,
               min_iters: int | None = None, warmup: int | None = None, volume_bytes: int | None = None,
               collective_timeout: float = 60) -> SweepSpec:
    """The worker's :class:`SweepSpec` for ``ranks`` ranks sized by preset ``p``: ``sizes`` (default
    :func:`default_sizes`) and every count that is None from ``p.collective``; ``min_iters`` at most ``iters``.

    Raises:
        CollectiveInputError: a collective not in :data:`COLLECTIVES`, a size that is not an integer
            >= 32·ranks bytes, a count that is not an integer >= 1.
    """
    collectives = _sweep_collectives(collectives)
    sizes = _sweep_sizes(default_sizes(p, ranks) if sizes is None else list(sizes), ranks)
    most = _sweep_count(p, "iters", iters)
    return SweepSpec(collectives, sizes, most, min(_sweep_count(p, "min_iters", min_iters), most),
                     _sweep_count(p, "warmup", warmup), _sweep_count(p, "volume_bytes", volume_bytes),
                     timeout_s=collective_timeout)


def sweep_rows(result: SweepResult, wall_s: float) -> list[dict]:
    """The rows of :func:`sweep` from one rank's :class:`SweepResult`: each :class:`SweepRow`'s fields,
    then ``ranks`` and ``backend`` (the result's), ``wall_s`` (the whole launch, s), ``algbw`` and
    ``busbw`` (bytes/s, :func:`algbw`, :func:`busbw`)."""
    n = result.world_size
    return [{**asdict(row), "ranks": n, "backend": result.backend, "wall_s": wall_s,
             "algbw": algbw(row.size, row.seconds), "busbw": busbw(row.size, row.seconds, row.collective, n)}
            for row in result.rows]


def sweep(collectives=COLLECTIVES, sizes=None, ranks: int | None = None, iters: int | None = None, *,
          warmup: int | None = None, min_iters: int | None = None, volume_bytes: int | None = None,
          timeout: float = 300, verbose: bool = False, cluster=None) -> list[dict]:
    """Measure ``collectives`` over message ``sizes`` on real ranks, in one launch; rows for :func:`bandwidth_table`.

    With ``cluster`` (an emulated :class:`~teraflops.nodes.cluster.Cluster` that is up) the ranks are gloo
    CPU ranks spread evenly over its nodes (default one per node), so the collective crosses the
    shaped links.

    Ranks: one per GPU with NCCL when there are at least 2 GPUs (``ranks``, if given, at most that
    many: asking for more raises), else ``ranks`` (default the preset's ``collective.ranks_cpu``) CPU ranks with gloo and one
    torch thread each, the GPU (if one) hidden. Each rank runs ``workers/collective_sweep.py`` on a
    :class:`SweepSpec` (:func:`sweep_spec`) and hands back a :class:`SweepResult`.

    Args:
        collectives: some of :data:`COLLECTIVES`. sizes: bytes of the whole buffer (nccl-tests'
            ``S``; default :func:`default_sizes`). iters: the most timed calls per size (default the
            preset's ``collective.iters``); ``min_iters``, ``volume_bytes`` (timed calls per size =
            volume / size, clamped), ``warmup``: the preset's ``collective`` sizes by default.
        timeout: seconds for the whole launch.

    Returns:
        One dict per collective and size (:func:`sweep_rows`): ``collective``, ``size`` (bytes moved,
        after rounding each rank's chunk to 8 elements), ``count`` (float32 elements), ``type``,
        ``iters``, ``warmup``, ``seconds`` (mean over iterations, averaged over ranks),
        ``seconds_max`` (the slowest rank's), ``wrong`` (elements, summed over ranks), ``ranks``,
        ``backend``, ``wall_s`` (the whole launch), ``algbw`` and ``busbw`` (bytes/s).

    Raises:
        CollectiveInputError: an unknown collective, a size that is not an integer >= 32·ranks bytes,
            ranks < 2 (or more ranks than GPUs on a machine with 2 or more), iteration counts < 1.
        LaunchFailed: a rank crashed, hung or the launch took over ``timeout`` s.

    Warns (``UserWarning``) naming the sizes the ranks skipped because they did not fit in GPU memory.
    """
    where, q = _sweep_placement(ranks, cluster)
    spec = sweep_spec(q, where.world_size, collectives, sizes, iters=iters, min_iters=min_iters, warmup=warmup,
                      volume_bytes=volume_bytes)
    start = time.perf_counter()
    results = launcher.launch(WORKER, where, spec=spec, result=SweepResult, timeout=timeout, verbose=verbose, cluster=cluster,
                     desc=f"{', '.join(spec.collectives)} on {where.world_size} ranks")
    wall, r0 = time.perf_counter() - start, results[0]
    if r0.skipped:
        warnings.warn(f"sweep skipped {len(r0.skipped)} point(s) that did not fit in device memory: "
                      + ", ".join(f"{c} {fmt_bytes(size)}" for c, size in r0.skipped), stacklevel=2)
    return sweep_rows(r0, wall)


# ---- showing it --------------------------------------------------------------------------------------


def bandwidth_table(rows: list[dict]) -> str:
    """nccl-tests' table, one block per collective: size (B), count (elements), type, time (µs),
    algbw and busbw (GB/s, GB = 1e9 bytes), #wrong; a footer with the average busbw over the sizes."""
    blocks = []
    for c in dict.fromkeys(r["collective"] for r in rows):
        mine = [r for r in rows if r["collective"] == c]
        head = (f"# {c}: {mine[0].get('ranks', '?')} ranks, {mine[0].get('backend', '?')}; time = mean of back-to-back "
                "calls, averaged over ranks (nccl-tests); size = the whole buffer")
        body = table([(r["size"], r["count"], r["type"], r["seconds"] * 1e6, r["algbw"] / GB, r["busbw"] / GB,
                       r["wrong"]) for r in mine],
                     ["size (B)", "count (elements)", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"])
        wrong = sum(r["wrong"] for r in mine)
        foot = (f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'WRONG'}\n"
                f"# Avg bus bandwidth    : {fmt(float(np.mean([r['busbw'] for r in mine])) / GB)} GB/s")
        blocks.append("\n".join([head, body, foot]))
    return "\n\n".join(blocks)
