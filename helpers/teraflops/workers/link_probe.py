"""Rank side of the pairwise link test: every pair of ranks exchanges a buffer, one pair at a time.

``python -m teraflops.workers.link_probe --spec PATH`` (a :class:`teraflops.orchestration.link_probe.LinkProbeSpec`), started by
:func:`teraflops.orchestration.link_probe.probe` through :func:`~teraflops.launch.launcher.launch` with one rank per
emulated node, so that rank ``r``'s traffic crosses its node's link and nothing else. This is how
practitioners find a bad link: a bandwidth test between two hosts at a time (``ib_write_bw``
between a pair of servers, nccl-tests' ``sendrecv_perf`` on two nodes), so that a slow result
names the pair, and the pairs a node is in name the node.

Every rank walks the same schedule, the unordered pairs ``(i, j), i < j`` in lexicographic order
(:func:`schedule`), with a barrier before each pair so that it runs alone on the switch. The two
ranks of the pair exchange a float32 buffer of ``nbytes`` bytes both ways as a *ping-pong*
(the PingPong benchmark of the Intel MPI Benchmarks): the initiator sends its
buffer and receives the peer's back (``dist.send`` then ``dist.recv``), timed on the initiator's
clock with ``time.perf_counter`` from the send to the end of the receive, so the time needs no
clock shared by two processes; a one-float token then tells the responder that the link is quiet
(:func:`round_trip`). The two take turns as initiator: after ``warmup`` untimed round
trips, ``repeats`` times i times a round trip, then j does. Each rank thus times ``repeats``
round trips with every peer: ``S`` bytes out and ``S`` back, ``t ≈ 2 S / rate`` on a link of
``rate`` bytes/s (IMB reports ``S / (t / 2)`` as the bandwidth). Ranks outside the pair wait at
the next barrier.

Why not both directions at once (``isend`` and ``irecv`` together, as ``ib_write_bw -b``)? Measured
here, gloo on CPU serialises the two directions of one pair (a bidirectional 1 MiB exchange over a
50 MB/s link took 40 ms on one rank, the time of a ping-pong, and 21 ms on the other), so the time
would depend on which rank's clock read it.

Result of each rank (:func:`~teraflops.launch.rank.write_result`): a
:class:`teraflops.orchestration.link_probe.LinkProbeResult`, ``times`` ``{peer: [seconds per round trip it
initiated, one per repeat]}``.
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.orchestration.link_probe import LinkProbeResult, LinkProbeSpec


def schedule(world: int) -> list[tuple[int, int]]:
    """The unordered pairs ``(i, j)``, ``i < j < world``, in the order every rank walks them."""
    return list(itertools.combinations(range(world), 2))


def round_trip(send: torch.Tensor, recv: torch.Tensor, token: torch.Tensor, peer: int, initiate: bool) -> float:
    """One ping-pong with ``peer``: the initiator sends ``send`` and receives into ``recv``, the other
    receives then sends back; then the initiator sends ``token`` (one float) and the other receives
    it. Returns the initiator's seconds for the round trip, token excluded (0.0 on the other).

    The token matters when the two then swap roles: ``dist.send`` returns once the buffer is in
    the socket, not delivered, so the responder's next ping would queue behind its own reply. The
    initiator sends the token only after the reply has arrived: a responder holding it knows the
    link is quiet (measured without it: round trips 1.5× longer).
    """
    if not initiate:
        dist.recv(recv, peer)
        dist.send(send, peer)
        dist.recv(token, peer)
        return 0.0
    start = time.perf_counter()
    dist.send(send, peer)
    dist.recv(recv, peer)
    elapsed = time.perf_counter() - start
    dist.send(token, peer)
    return elapsed


def main(argv: list[str] | None = None) -> None:
    a = read_spec(LinkProbeSpec, argv)
    w = init_worker(a.timeout_s)
    torch.set_num_threads(1)  # nothing to compute: the ranks share the cores
    numel = a.nbytes // 4
    send = torch.full((numel,), float(w.rank + 1))
    recv, token = torch.empty(numel), torch.zeros(1)
    pairs = schedule(w.world_size)
    times: dict[int, list[float]] = {}
    for done, (i, j) in enumerate(pairs):
        dist.barrier()  # the previous pair is finished everywhere: this one runs alone
        if w.rank in (i, j):
            peer = j if w.rank == i else i
            for _ in range(a.warmup):
                round_trip(send, recv, token, peer, initiate=w.rank == i)
            spans = []
            for _ in range(a.repeats):  # i initiates, then j: each times its own round trips
                for initiator in (i, j):
                    t = round_trip(send, recv, token, peer, initiate=w.rank == initiator)
                    if w.rank == initiator:
                        spans.append(t)
            if recv[0].item() != peer + 1:  # the peer's buffer arrived, not stale memory
                raise RuntimeError(f"rank {w.rank} received {recv[0].item()} from rank {peer}, expected {peer + 1}")
            times[peer] = spans
        report_progress(done + 1, len(pairs))
    write_result(LinkProbeResult(**w.identity(), bytes=numel * 4, repeats=a.repeats, times=times))
    finish()


if __name__ == "__main__":
    main()
