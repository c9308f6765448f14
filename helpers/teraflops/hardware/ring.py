"""Unit 5 §2: the ring all-reduce by hand, checked against ``dist.all_reduce`` and timed beside it.

**The algorithm** (Patarasuk & Yuan, *Bandwidth optimal all-reduce algorithms for clusters of
workstations*, JPDC 2009; the ring NCCL runs): split the buffer of ``S`` bytes into ``n`` chunks
(``torch.tensor_split``: sizes differ by at most one element when ``n`` does not divide it). Rank
``r`` sends to ``r + 1`` and receives from ``r − 1`` (mod ``n``).

* **Reduce-scatter**, steps ``s = 0 … n−2``: rank ``r`` sends chunk ``(r − s) mod n`` and adds the
  chunk it receives into its chunk ``(r − s − 1) mod n``. After ``n − 1`` steps rank ``r`` holds
  the full sum of chunk ``(r + 1) mod n``.
* **All-gather**, steps ``s = 0 … n−2``: rank ``r`` sends chunk ``(r + 1 − s) mod n`` and copies
  the chunk it receives into its chunk ``(r − s) mod n``.

Each rank sends ``2(n−1)`` chunks of ``S/n``: ``2(n−1)/n · S`` bytes over its link, whatever ``n``.
That is why nccl-tests' bus bandwidth is ``algbw × 2(n−1)/n`` (:func:`teraflops.hardware.collectives.busbw`):
for a ring, busbw is the bytes each link really carried per second, comparable with the link's own
bandwidth. Sends and receives of one step are posted together (``isend``/``irecv``), so no rank
waits for its neighbour to finish sending before it receives (blocking ``send`` on every rank at
once deadlocks once a message exceeds the transport's buffer).

:func:`ring_all_reduce` is the reference; :class:`RingCheckSpec`/:class:`RingCheckResult` are what
:mod:`teraflops.workers.ring_check` runs for :func:`teraflops.grading.unit05.ring_all_reduce` and for
:func:`compare`, which times a ring beside ``dist.all_reduce`` on the same ranks (busbw of both).
Units: sizes in bytes unless named elements, times in seconds, bandwidths bytes/s.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass

import torch
import torch.distributed as dist

from teraflops.errors import PLACEHOLDER_MESSAGE
from teraflops.hardware.collectives import busbw
from teraflops.launch import launcher
from teraflops.launch.placement import data_parallel_plan
from teraflops.launch.rank import RankIdentity
from teraflops.parallelization.zero import RankError

CHECK_ELEMENTS = (1, 3, 7, 64, 1000, 4099)  # fp32 elements: fewer than n, uneven, a prime
CHECK_WORLDS = (2, 3, 4)
TIMING_ELEMENTS = (2**14, 2**18, 2**20)  # 64 KiB, 1 MiB, 4 MiB of fp32


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` (any shape, any size) over the default group's ranks in place, by a ring of
    point-to-point messages: a reduce-scatter, then an all-gather, ``n − 1`` steps each."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), n))  # views: sizes differ by at most one
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):  # reduce-scatter
        send, recv = chunks[(rank - s) % n], chunks[(rank - s - 1) % n]
        buf = torch.empty_like(recv)
        ops = [dist.P2POp(dist.isend, send.contiguous(), right), dist.P2POp(dist.irecv, buf, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        recv += buf
    for s in range(n - 1):  # all-gather: rank r starts from its finished chunk (r + 1) mod n
        send, recv = chunks[(rank + 1 - s) % n], chunks[(rank - s) % n]
        buf = torch.empty_like(recv)
        ops = [dist.P2POp(dist.isend, send.contiguous(), right), dist.P2POp(dist.irecv, buf, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        recv.copy_(buf)


@dataclass(frozen=True)
class RingCheckSpec:
    """What :mod:`teraflops.workers.ring_check` runs: the learner's function block ``source``
    (function ``name``, called as ``name(tensor)``) on fp32 tensors of each of ``elements``
    (integer values, so every order of summation gives the same exact sum), compared with
    ``dist.all_reduce``; then, for each of ``timing`` (elements), ``iters`` timed calls of each
    (after one warm-up); ``timeout_s``: seconds a message waits."""

    source: str
    name: str
    elements: tuple[int, ...] = CHECK_ELEMENTS
    timing: tuple[int, ...] = ()
    iters: int = 5
    timeout_s: float = 20


@dataclass(frozen=True)
class RingCase:
    """One size on one rank: ``wrong`` elements of the result (vs ``dist.all_reduce``); ``chunks``,
    indices of the ``tensor_split`` chunks holding a wrong element; ``partial``, whether every wrong
    chunk holds a partial sum (some ranks' contributions, not all: the ring stopped early or read the
    wrong chunk); ``sent``, elements this rank handed to send/isend; ``collectives``, calls of
    collectives (all_reduce and the like) the function made."""

    elements: int
    wrong: int
    chunks: list[int]
    partial: bool
    sent: int
    collectives: int


@dataclass(frozen=True)
class RingCheckResult(RankIdentity):
    """One rank's report: ``cases`` (one :class:`RingCase` per size that ran), the first ``error``
    (None if none), and per timed size the mean seconds of one call: ``ring_s`` (the function) and
    ``torch_s`` (``dist.all_reduce``), each the slowest rank's (a collective ends when its last rank does)."""

    error: RankError | None
    cases: list[RingCase]
    timed: list[int]
    ring_s: list[float]
    torch_s: list[float]


def function_source(fn) -> str:
    """The source of the function ``fn`` (dedented) to ship to the ranks."""
    return textwrap.dedent(inspect.getsource(fn))


def run(source: str, name: str, ranks: int, *, elements=CHECK_ELEMENTS, timing=(), iters: int = 5,
        timeout: float = 120) -> list[RingCheckResult]:
    """The reports of ``ranks`` ranks running ``name`` from ``source`` (see :class:`RingCheckSpec`)."""
    plan = data_parallel_plan(ranks_cpu=ranks)
    return launcher.launch("teraflops.workers.ring_check", plan.placement,
                           spec=RingCheckSpec(source, name, tuple(elements), tuple(timing), iters),
                           result=RingCheckResult, timeout=timeout, desc=f"ring all-reduce, {ranks} ranks")


def compare(fn=ring_all_reduce, ranks: int = 4, elements=TIMING_ELEMENTS, iters: int = 5) -> list[dict]:
    """Time ``fn`` (default the reference) beside ``dist.all_reduce`` on the same ``ranks`` ranks:
    one row per size, ``{"size" (bytes), "ranks", "ring_s", "torch_s", "ring_busbw", "torch_busbw"
    (bytes/s, nccl-tests' all-reduce factor 2(n−1)/n)}``. Correctness is checked first, on the
    sizes of the check (a wrong ring's speed means nothing)."""
    source = function_source(fn)
    if PLACEHOLDER_MESSAGE in source:  # the lab's stub: say "not attempted" at once, without starting ranks
        raise NotImplementedError(PLACEHOLDER_MESSAGE)
    results = run(source, fn.__name__, ranks, timing=elements, iters=iters)
    bad = [(r.rank, c.elements) for r in results for c in r.cases if c.wrong] + [r.error for r in results if r.error]
    if bad:
        raise ValueError(f"{fn.__name__} is not an all-reduce (first problem: {bad[0]}); time it after it passes")
    r0 = results[0]
    return [{"size": 4 * e, "ranks": ranks, "ring_s": t_ring, "torch_s": t_torch,
             "ring_busbw": busbw(4 * e, t_ring, "all_reduce", ranks),
             "torch_busbw": busbw(4 * e, t_torch, "all_reduce", ranks)}
            for e, t_ring, t_torch in zip(r0.timed, r0.ring_s, r0.torch_s)]
