"""Rank side of the ring all-reduce check (Unit 5, exercise 5) and of :func:`teraflops.hardware.ring.compare`.

``python -m teraflops.workers.ring_check --spec PATH`` (a :class:`teraflops.hardware.ring.RingCheckSpec`).

For each size of the spec, every rank fills an fp32 tensor with small integers of its own (exact
in fp32 whatever the order of the additions), runs the learner's function on one copy and
``dist.all_reduce`` on another, and reports how the results differ: wrong elements, the
``tensor_split`` chunks they fall in, whether those hold partial sums (a subset of the ranks'
contributions), elements handed to ``send``/``isend``, and collectives called. Then, for each timed
size, one warm-up and ``iters`` timed calls of each, between barriers; every rank reports the
slowest rank's mean (an all-reduce of the times with MAX).
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from teraflops.hardware.ring import RingCase, RingCheckResult, RingCheckSpec
from teraflops.launch.rank import init_worker, read_spec, report_progress, write_result
from teraflops.workers.common import sync_device
from teraflops.workers.learner_code import CommLog, LearnerCalls, define, rank_error, run_and_exit

_P2P = ("send", "isend", "batch_isend_irecv")
_COLLECTIVE = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_gather_single",
               "all_gather_into_tensor", "all_gather", "broadcast", "reduce", "all_to_all_single")


def data(elements: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s fp32 input of ``elements``: integers in [−50, 50], seeded by size and rank."""
    g = torch.Generator().manual_seed(7919 * elements + rank)
    return torch.randint(-50, 51, (elements,), generator=g).float()


def _partial(got: torch.Tensor, inputs: list[torch.Tensor], idx: torch.Tensor) -> bool:
    """Whether each wrong element equals the sum of some non-empty proper subset of the ranks' inputs."""
    n = len(inputs)
    sums = [sum(inputs[r][idx] for r in subset) for k in range(1, n) for subset in itertools.combinations(range(n), k)]
    return bool(all(any(torch.equal(got[i], s[j]) for s in sums) for j, i in enumerate(idx.tolist()[:50])))


def main(argv: list[str] | None = None) -> None:
    a = read_spec(RingCheckSpec, argv)
    w = init_worker(a.timeout_s)
    n = w.world_size
    comm = CommLog()
    learner, cases = LearnerCalls(comm), []

    fn = learner("function definition", define, a.source, a.name)
    for elements in a.elements:
        if learner.error:
            break
        mine, want = data(elements, w.rank).to(w.device), data(elements, w.rank).to(w.device)
        before = len(comm.log)
        out = learner(f"{a.name}(tensor of {elements} elements)", fn, mine)
        if learner.error:
            break
        got = (out if isinstance(out, torch.Tensor) and out.shape == mine.shape else mine).cpu()
        dist.all_reduce(want)
        want = want.cpu()
        wrong = (got != want).nonzero().view(-1)
        bounds = torch.tensor([c.numel() for c in torch.tensor_split(torch.empty(elements), n)]).cumsum(0)
        chunks = sorted({int(torch.searchsorted(bounds, i, right=True)) for i in wrong.tolist()})
        inputs = [data(elements, r) for r in range(n)]
        calls = comm.log[before:]
        cases.append(RingCase(elements=elements, wrong=len(wrong), chunks=chunks,
                              partial=len(wrong) > 0 and _partial(got, inputs, wrong),
                              sent=sum(size for name, size in calls if name in _P2P),
                              collectives=sum(name in _COLLECTIVE for name, _ in calls)))
    timed, ring_s, torch_s = [], [], []
    ready = False
    if not learner.error:  # time only a ring right on every rank (the decision must be the same on all of them)
        try:
            flag = torch.tensor([float(sum(c.wrong for c in cases))], device=w.device)
            dist.all_reduce(flag)
            ready = flag.item() == 0
        except Exception as e:  # noqa: BLE001 - another rank's learner code failed and left the group
            learner.error = rank_error("the timing", e, secondary=True)
    if ready:
        for elements in a.timing:
            x = torch.ones(elements, device=w.device)
            seconds = []
            for call in (lambda: fn(x), lambda: dist.all_reduce(x)):
                call()  # warm-up
                dist.barrier()
                start = time.perf_counter()
                for _ in range(a.iters):
                    call()
                sync_device(w.device)  # a GPU's queued work counts in the time
                seconds.append((time.perf_counter() - start) / a.iters)
            slowest = torch.tensor(seconds, dtype=torch.float64, device=w.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            timed.append(elements)
            ring_s.append(float(slowest[0]))
            torch_s.append(float(slowest[1]))
            report_progress(len(timed), len(a.timing))
    write_result(RingCheckResult(**w.identity(), error=learner.error, cases=cases, timed=timed, ring_s=ring_s,
                                 torch_s=torch_s))
    learner.leave_group()


if __name__ == "__main__":
    run_and_exit(main)
