"""Unit 5 across nodes: real fabrics, scaled to what one machine can carry, on emulated nodes.

A cluster's interconnect has two levels: inside a node (NVLink, here the loopback of one network
namespace) and between nodes (InfiniBand or Ethernet ports, here a tc-shaped veth link per node;
:mod:`teraflops.nodes.cluster`). This module runs the Unit 5 all-reduce sweep (nccl-tests' definitions,
:mod:`teraflops.hardware.collectives`) across links set like published fabrics divided by :data:`SCALE`,
fits the alpha-beta model, and compares the fitted bandwidth with the configured rate; then it
measures the two levels side by side (:func:`hierarchy`). The fit is :mod:`teraflops.hardware.alpha_beta`'s; the
published fabrics are in :mod:`teraflops.datasheets`.

Scaling keeps the ratios between fabrics and lets a 2-core machine drive every link to saturation:
gloo between two local processes moves 0.3-0.6 GB/s (measured: :func:`hierarchy`), far above the
scaled links. What scaling cannot
keep is latency: on the course's CPU machines the kernel has no netem qdisc, so links add no
delay (:func:`teraflops.nodes.cluster.qdiscs`) and the fitted α is the software's (gloo, TCP, the
scheduler), not a fabric's.

Measured on the 2-core CPU machine (2 nodes, one rank each): links of 50, 25 and 10 MB/s gave a
fitted busbw of 49.8, 23.6 and 9.4 MB/s (R² ≥ 0.97), α 1.6-5.8 ms.
"""

from __future__ import annotations

from teraflops.comm_cost import FABRICS, SCALE, scaled_rate  # the table's home is the shared base (Unit 2 uses it)
from teraflops.hardware.alpha_beta import fit_rows
from teraflops.hardware.collectives import BUS_FACTOR, sweep
from teraflops.nodes.cluster import Cluster
from teraflops.tables import table

SIZES = tuple(2 ** k for k in range(12, 22))  # 4 KiB - 2 MiB: the slowest scaled link moves 2 MiB in ~0.7 s
SWEEP = {"iters": 4, "min_iters": 2, "warmup": 1, "volume_bytes": 2 ** 22}  # per size: ≤ 4 timed calls, ≤ 4 MiB


def fabric_sweep(cluster, fabrics=FABRICS, sizes=SIZES, scale: float = SCALE, **sweep_kwargs) -> list[dict]:
    """All-reduce sweep between one rank per node of ``cluster``, once per fabric, every link set to it.

    Args:
        cluster: an emulated :class:`~teraflops.nodes.cluster.Cluster` that is up (2 nodes is enough).
        fabrics: :class:`~teraflops.datasheets.PublishedLink` s to emulate, each at ``bandwidth × scale``.
        sizes: message sizes (bytes, nccl-tests' ``S``).
        sweep_kwargs: to :func:`~teraflops.hardware.collectives.sweep` (iters, warmup, ...), over :data:`SWEEP`.

    Returns:
        One dict per fabric (the links are set back as they were afterwards): ``fabric``, ``published`` and ``configured`` (bytes/s per direction),
        ``fit`` (:class:`~teraflops.hardware.alpha_beta.AlphaBeta` of the all-reduce times), ``busbw_fit``
        (the fit's bandwidth × nccl-tests' all-reduce bus factor, bytes/s), ``ratio``
        (``busbw_fit / configured``), ``rows`` (the sweep's rows). A ring all-reduce moves
        ``2(n−1)/n · S`` bytes through every rank's link each way, so its busbw tends to the link rate.
    """
    out, before = [], list(cluster.links)
    try:
        for link in fabrics:
            rate = scaled_rate(link, scale)
            for i in range(cluster.nodes):
                cluster.set_link(i, rate=rate)
            rows = sweep(("all_reduce",), sizes=list(sizes), cluster=cluster, **{**SWEEP, **sweep_kwargs})
            fit = fit_rows(rows)
            busbw = fit.bandwidth * BUS_FACTOR["all_reduce"](rows[0]["ranks"])
            out.append({"fabric": link.name, "published": link.bandwidth, "configured": rate, "fit": fit,
                        "busbw_fit": busbw, "ratio": busbw / rate, "rows": rows})
    finally:  # the links as they were
        for i, link in enumerate(before):
            cluster.set_link(i, link)
    return out


def fabric_table(results: list[dict]) -> str:
    """:func:`fabric_sweep` as a table: published and configured rates, the fit, and their ratio."""
    return table([(r["fabric"], r["published"] / 1e9, r["configured"] / 1e6, r["busbw_fit"] / 1e6, r["ratio"],
                   r["fit"].alpha * 1e3, r["fit"].r2) for r in results],
                 ["fabric", "published (GB/s)", "emulated link (MB/s)", "fitted busbw (MB/s)", "fit / link",
                  "α (ms)", "R²"])


def hierarchy(cluster, sizes=SIZES[-4:], **sweep_kwargs) -> list[dict]:
    """Peak all-reduce busbw at each level of a 2-level cluster, links as they are set now.

    Three launches: 2 ranks on node 0 (intra-node: the node's loopback), 1 rank on each of 2 nodes
    (inter-node: through both links and the switch), and 2 ranks on each of 2 nodes (one ring of 4
    that crosses the links twice). A ring runs at the pace of its slowest hop, so the 4-rank ring is
    held to the inter-node rate although half of its hops are intra-node.

    Returns:
        One dict per level: ``level``, ``ranks``, ``nodes``, ``peak_busbw`` (bytes/s over ``sizes``).
    """
    if cluster.nodes != 2:
        raise ValueError(f"hierarchy() needs a cluster of 2 nodes, got {cluster.nodes}. Hint: Cluster(2)")

    def level(name: str, where, ranks: int) -> dict:
        rows = sweep(("all_reduce",), sizes=list(sizes), ranks=ranks, cluster=where, **{**SWEEP, **sweep_kwargs})
        return {"level": name, "ranks": ranks, "nodes": where.nodes, "peak_busbw": max(r["busbw"] for r in rows)}

    with Cluster(1, cluster.links[:1]) as one:
        out = [level("intra-node (loopback)", one, 2)]
    return out + [level("inter-node (links)", cluster, 2), level("2 nodes × 2 ranks (ring)", cluster, 4)]


def hierarchy_table(levels: list[dict], link_rate: float | None = None) -> str:
    """:func:`hierarchy` as a table; with ``link_rate`` (bytes/s), each level's busbw as a multiple of it."""
    head = ["level", "ranks", "nodes", "peak busbw (MB/s)"] + (["× link rate"] if link_rate else [])
    return table([(x["level"], x["ranks"], x["nodes"], x["peak_busbw"] / 1e6)
                  + ((x["peak_busbw"] / link_rate,) if link_rate else ()) for x in levels], head)
