"""Find the slow link of a cluster: pairwise bandwidth tests between its nodes, then the Unit 3 detector.

A straggler caused by a slow link looks, from inside one job, like every rank waiting longer in the
all-reduce (:func:`teraflops.orchestration.detection.attribute` tells it from a slow-compute straggler), but the
job cannot say *whose* link it is: a ring all-reduce moves at the pace of its slowest link, and
all ranks slow down together. Practitioners localise it by testing the nodes in pairs
(``ib_write_bw`` between two hosts, nccl-tests' ``sendrecv_perf`` on two nodes): :func:`probe`
runs ``workers/link_probe.py`` with one rank per node of an emulated
:class:`~teraflops.nodes.cluster.Cluster`; each pair of nodes, alone on the switch, plays ping-pong
with a float32 buffer of ``nbytes`` (the PingPong of the Intel MPI Benchmarks: out and back, timed
on one clock), each node timing ``repeats`` round trips it starts.

Why the minimum over peers is the node's own link: a message from node i to node j leaves through
i's link and arrives through j's (two shaped queues: i's ``eth0`` and j's switch port, see
:mod:`teraflops.nodes.cluster`), so it moves at the slower of the two rates: a round trip of ``S`` bytes
each way takes ``t_ij ≈ 2 S / min(r_i, r_j)``. No pair can beat node i's own link, and a pair with a
peer at least as fast as i reaches it: ``min_j t_ij = 2 S / r_i`` as long as one such peer exists.
A healthy node therefore reads healthy through another healthy node, and a slow node reads slow
through every peer. That needs at least two healthy nodes, hence at least 3 nodes (with 2, the
one pair's time belongs to both nodes: nothing says which link is slow), and for the detector's
median to be a healthy node, fewer than half of the nodes slow.

:func:`flag_slow_links` then applies the Unit 3 straggler detector
(:func:`teraflops.orchestration.detection.flag_stragglers`: the modified z-score of Iglewicz & Hoaglin, 1993,
with its MAD floor, so a node must be ~26 % slower than the median node) to the
``[repeats, nodes]`` matrix of per-node link times.

Units: seconds in arrays, ms and MB/s (1e6 bytes/s; GB = 1e9) in tables.

Measured here (2-core CPU machine under load, 3 nodes, 1 MiB each way, 3 repeats): with every link
at 50 MB/s, each node 41.8 ms per round trip, 50.2 MB/s, modified z within ±0.6, nothing flagged;
with node 1 at 5 MB/s, node 1 425 ms and 4.93 MB/s (z ≈ 120, flagged), nodes 0 and 2 unchanged
(41.8-41.9 ms, 50 MB/s, reading each other). A launch takes ~17 s (start-up), ~23 s with the
slow link.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from teraflops.orchestration.detection import detect, flag_stragglers
from teraflops.launch.launcher import launch
from teraflops.errors import CourseError
from teraflops.launch.placement import place
from teraflops.launch.rank import RankIdentity
from teraflops.tables import table

WORKER = "teraflops.workers.link_probe"
NBYTES = 1 << 20  # bytes each way per round trip: 42 ms at 50 MB/s; 10x the tbf bucket at 50 MB/s (100 kB)
REPEATS = 5  # timed round trips per node and peer
MIN_NODES = 3


class LinkProbeError(CourseError, ValueError):
    """A link test cannot run or its input is unusable; one line with a hint."""


@dataclass(frozen=True)
class LinkProbeSpec:
    """What :mod:`teraflops.workers.link_probe` runs: per pair, ``warmup`` untimed round trips, then
    ``repeats`` timed ones each way, ``nbytes`` (whole float32) out and back; ``timeout_s``:
    seconds a collective or exchange waits."""

    nbytes: int
    repeats: int
    warmup: int = 1
    timeout_s: float = 60

    def __post_init__(self):
        if self.nbytes < 4 or self.repeats < 1 or self.warmup < 0:
            raise LinkProbeError(f"need nbytes >= 4 (one float32), repeats >= 1 and warmup >= 0, got {self.nbytes}, "
                                 f"{self.repeats}, {self.warmup}. Hint: nbytes is bytes each way per round trip")


@dataclass(frozen=True)
class LinkProbeResult(RankIdentity):
    """One rank's round trips: ``times[peer]``, seconds of each round trip it initiated with
    ``peer`` (one per repeat); ``bytes`` each way; ``node`` (:class:`~teraflops.launch.rank.RankIdentity`):
    its emulated node."""

    bytes: int
    repeats: int
    times: dict[int, list[float]]


@dataclass(frozen=True, eq=False)
class LinkProbe:
    """Times of a pairwise link test, and what they say about each node's link.

    Attributes:
        nbytes: bytes sent each way per round trip.
        pair_s: float64 ``[repeats, nodes, nodes]``, seconds of the ``k``-th round trip node ``i``
            started with node ``j`` (``nbytes`` out, ``nbytes`` back, on ``i``'s clock); NaN on
            the diagonal. ``pair_s[:, j, i]`` are ``j``'s round trips over the same two links.
    """

    nbytes: int
    pair_s: np.ndarray

    def __post_init__(self):
        t = np.asarray(self.pair_s, dtype=np.float64)
        if t.ndim != 3 or t.shape[1] != t.shape[2] or t.shape[1] < MIN_NODES or t.shape[0] < 1:
            raise LinkProbeError(f"pair_s must be [repeats, nodes, nodes] seconds with at least {MIN_NODES} nodes, "
                                 f"got shape {t.shape}. Hint: with 2 nodes one link cannot be told from the other.")
        off = t[:, ~np.eye(t.shape[1], dtype=bool)]
        if not np.isfinite(off).all() or (off <= 0).any() or self.nbytes <= 0:
            raise LinkProbeError("pair_s must hold positive, finite times off the diagonal and nbytes > 0. "
                                 "Hint: each node needs a time with every other node.")
        object.__setattr__(self, "pair_s", t)

    @property
    def nodes(self) -> int:
        return self.pair_s.shape[1]

    @property
    def pair_median_s(self) -> np.ndarray:
        """``[nodes, nodes]`` median over repeats of each round-trip time (s); NaN on the diagonal."""
        return np.median(self.pair_s, axis=0)

    @property
    def best_peer(self) -> np.ndarray:
        """int ``[nodes]``: for each node, the peer with which its median round trip was fastest."""
        m = self.pair_median_s.copy()
        np.fill_diagonal(m, np.inf)
        return m.argmin(axis=1)

    @property
    def link_s(self) -> np.ndarray:
        """``[repeats, nodes]`` seconds: each node's round trips with its best peer (module docstring)."""
        return self.pair_s[:, np.arange(self.nodes), self.best_peer]

    @property
    def link_median_s(self) -> np.ndarray:
        """``[nodes]`` seconds: min over peers of the median pair time, the node's own link's time."""
        return np.median(self.link_s, axis=0)

    @property
    def bandwidth(self) -> np.ndarray:
        """``[nodes]`` bytes/s achieved over the node's link: ``2 nbytes / link_median_s`` (bytes out
        and back per second of round trip, IMB PingPong's ``S / (t / 2)``; one direction at a time)."""
        return 2 * self.nbytes / self.link_median_s


def from_results(results: list[LinkProbeResult]) -> LinkProbe:
    """A :class:`LinkProbe` from the ranks' results of ``workers/link_probe.py`` (each with its ``node``).

    Raises:
        LinkProbeError: two ranks on one node, or a pair missing (via :class:`LinkProbe`).
    """
    node = [r.rank if r.node is None else r.node for r in results]
    if sorted(node) != list(range(len(results))):
        raise LinkProbeError(f"the link test needs one rank per node, got ranks on nodes {node}. "
                             "Hint: launch it with nproc=1 and cluster=...")
    repeats = results[0].repeats
    t = np.full((repeats, len(results), len(results)), np.nan)
    for r in results:
        for peer, spans in r.times.items():
            t[:, node[r.rank], node[peer]] = spans
    return LinkProbe(results[0].bytes, t)


def probe(cluster, nbytes: int | None = None, repeats: int | None = None, timeout: float = 180) -> LinkProbe:
    """Test every pair of ``cluster``'s nodes, one pair at a time, with one rank per node.

    Args:
        cluster: an emulated :class:`~teraflops.nodes.cluster.Cluster` that is up, with at least 3 nodes.
        nbytes: bytes sent each way per round trip (default :data:`NBYTES`, 1 MiB; rounded down to
            whole float32). Keep it well above the link's burst (max(64 KiB, 2 ms of traffic)) so that the rate, not the
            bucket, sets the time: at ``r`` bytes/s a round trip takes about ``2 nbytes / r`` s.
        repeats: timed round trips per node and peer (default :data:`REPEATS`).
        timeout: seconds for the whole launch (start-up ~10 s on CPU, then ``nodes (nodes - 1) / 2``
            pairs of ``2 repeats + 1`` round trips each).

    Raises:
        LinkProbeError: fewer than 3 nodes, or bad sizes.
        LaunchFailed: a rank crashed or the launch took over ``timeout`` s.
    """
    nodes = getattr(cluster, "nodes", None)
    if not isinstance(nodes, numbers.Integral) or nodes < MIN_NODES:
        raise LinkProbeError(f"localising a slow link needs at least {MIN_NODES} nodes, got {nodes!r}: with 2, "
                             "the one pair's time belongs to both links. Hint: Cluster(3, Link(rate=50e6)).")
    nbytes, repeats = NBYTES if nbytes is None else nbytes, REPEATS if repeats is None else repeats
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in (nbytes, repeats)) \
            or nbytes < 4 or repeats < 1:
        raise LinkProbeError(f"need integers nbytes >= 4 and repeats >= 1, got {nbytes!r} and {repeats!r}. "
                             "Hint: nbytes is bytes each way per round trip, e.g. 1 << 20.")
    spec = LinkProbeSpec(nbytes=int(nbytes), repeats=int(repeats), timeout_s=timeout)
    # gloo CPU ranks, one per node: the probe measures the emulated (TCP) links, not the GPUs
    where = place(int(nodes), cluster=cluster, gpus=False)
    return from_results(launch(WORKER, where, spec=spec, result=LinkProbeResult, timeout=timeout, cluster=cluster,
                               desc=f"link test, {nodes * (nodes - 1) // 2} pairs"))


def flag_slow_links(result: LinkProbe) -> list[int]:
    """Nodes whose link time stands out on the slow side (the Unit 3 detector on ``result.link_s``).

    Returns:
        Sorted node indices (empty when every link reads alike).
    """
    if not isinstance(result, LinkProbe):
        raise LinkProbeError(f"flag_slow_links takes the LinkProbe that probe() returns, "
                             f"got {type(result).__name__}. Hint: flag_slow_links(probe(cl)).")
    return flag_stragglers(result.link_s)


def probe_table(result: LinkProbe) -> str:
    """One row per node: best peer, median link time (ms), achieved MB/s, modified z-score, flagged."""
    z, flagged = detect(result.link_s).run_z, set(flag_slow_links(result))
    return table([(i, int(result.best_peer[i]), 1e3 * result.link_median_s[i], result.bandwidth[i] / 1e6,
                   float(z[i]), i in flagged) for i in range(result.nodes)],
                 ["node", "best peer", "link ms", "MB/s", "modified z", "slow link"])
