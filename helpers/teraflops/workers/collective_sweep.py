"""Rank side of Unit 5 §1: time all-reduce, all-gather and reduce-scatter over message sizes.

``python -m teraflops.workers.collective_sweep --spec PATH`` (a :class:`teraflops.hardware.collectives.SweepSpec`),
started by :func:`teraflops.hardware.collectives.sweep` through :func:`~teraflops.launch.launcher.launch`
(gloo on CPU, NCCL with one rank per GPU); each rank hands back a
:class:`~teraflops.hardware.collectives.SweepResult`. Buffers are float32; a size is the bytes of the
*whole* buffer, as in nccl-tests (https://github.com/NVIDIA/nccl-tests, ``doc/PERFORMANCE.md``):
all-reduce reduces ``size`` bytes on every rank; all-gather gathers ``n`` chunks of ``size / n``
bytes into a ``size``-byte buffer; reduce-scatter reduces a ``size``-byte buffer into ``n`` chunks
of ``size / n``. A chunk is rounded down to a multiple of 8 elements (the check pattern's period)
and the size reported is the one moved: ``8·⌊count / 8n⌋ · n · 4`` bytes.

Per collective and size, following nccl-tests' ``BenchTime`` (``src/common.cu``): ``warmup``
untimed calls; a barrier; ``iters`` calls back to back timed as one span with
``time.perf_counter`` (on CUDA ended by ``torch.cuda.synchronize()``, as nccl-tests waits for its
streams); the span divided by ``iters`` is the rank's time, and the reported time is its **average
over ranks** (nccl-tests: ``Allreduce(args, &deltaSec, average)``); the maximum over ranks is kept
too. Then, untimed, one call on fresh data whose result is known exactly: every element that
differs counts as wrong (nccl-tests' ``#wrong``), summed over ranks (as ``CheckData`` then
``Allreduce(..., sum)`` do in nccl-tests). Rank ``r`` contributes
``r + 1 + 8·q + (i mod 8)`` at element ``i`` of the whole buffer, ``q`` the chunk that holds ``i``
(small integers: float32 sums of them are exact), so a chunk delivered to the wrong rank, or
gathered into the wrong place, counts as wrong (:func:`check_input`, :func:`expected`).

Sizes above what fits in device memory (GPU: 4× the size must be free) are skipped and listed.
Every size, count and timeout comes from the spec.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from teraflops.hardware.collectives import SweepResult, SweepRow, SweepSpec
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.workers.common import sync_device

PERIOD = 8  # the check pattern repeats every 8 elements
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def counts(collective: str, size: int, world: int) -> tuple[int, int]:
    """(elements of the whole buffer, elements per rank's chunk) for a ``size``-byte message; 0 if too small."""
    total = size // 4
    if collective == "all_reduce":
        return total, total
    chunk = total // world // PERIOD * PERIOD
    return chunk * world, chunk


def pattern(numel: int, device) -> torch.Tensor:
    """``i mod 8`` for ``i < numel`` (float32, ``[numel]``), built without an int64 index."""
    reps = -(-numel // PERIOD)
    return torch.arange(PERIOD, dtype=torch.float32, device=device).repeat(reps)[:numel]


def _blocks(numel: int, chunk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i mod 8)`` as ``[numel // chunk, chunk]`` and the chunk index ``q`` as ``[numel // chunk, 1]`` (float32)."""
    blocks = max(numel // chunk, 1)
    return (pattern(chunk, device).repeat(blocks).view(blocks, chunk),
            torch.arange(blocks, dtype=torch.float32, device=device)[:, None])


def check_input(collective: str, numel: int, chunk: int, rank: int, device) -> torch.Tensor:
    """Rank ``rank``'s check data, ``[numel]``: ``rank + 1 + 8·q + (i mod 8)`` with ``q`` the chunk of the
    whole buffer that holds element ``i`` (all-gather: this rank's input is chunk ``rank``)."""
    pat, q = _blocks(numel, chunk, device)
    first = rank if collective == "all_gather" else 0
    return (pat + 8 * (q + first) + (rank + 1)).view(-1)


def expected(collective: str, numel: int, chunk: int, rank: int, world: int, device) -> torch.Tensor:
    """The exact output ``[numel]`` of ``collective`` on rank ``rank`` of ``world`` after every rank
    passed :func:`check_input`: the sum over ranks (all-reduce: whole buffer; reduce-scatter: chunk
    ``rank``), or every rank's chunk in rank order (all-gather)."""
    pat, q = _blocks(numel, chunk, device)
    n = world
    if collective == "all_gather":  # chunk q holds rank q's input: q + 1 + 8q + (i mod 8)
        return (pat + 9 * q + 1).view(-1)
    first = rank if collective == "reduce_scatter" else 0  # this rank's chunk of the whole buffer
    return (n * pat + 8 * n * (q + first) + n * (n + 1) / 2).view(-1)


def count_wrong(collective: str, out: torch.Tensor, chunk: int, rank: int, world: int) -> int:
    """Elements of ``out`` that differ from :func:`expected` (nccl-tests' ``#wrong`` on one rank)."""
    want = expected(collective, out.numel(), chunk, rank, world, out.device)
    return int((out != want).sum())


class Buffers:
    """The input and output of one collective at one size; ``run()`` calls it once."""

    def __init__(self, collective: str, total: int, chunk: int, rank: int, world: int, device):
        self.collective, self.rank, self.world, self.chunk = collective, rank, world, chunk
        if collective == "all_reduce":
            self.inp = self.out = torch.zeros(total, device=device)  # in place, as torch's all_reduce is
        elif collective == "all_gather":
            self.inp, self.out = torch.zeros(chunk, device=device), torch.zeros(total, device=device)
        else:
            self.inp, self.out = torch.zeros(total, device=device), torch.zeros(chunk, device=device)

    def run(self) -> None:
        if self.collective == "all_reduce":
            dist.all_reduce(self.out)
        elif self.collective == "all_gather":
            _gather(self.out, self.inp)
        else:
            _scatter(self.out, self.inp)

    def wrong(self) -> int:
        """Run once on the check data; the number of this rank's output elements that are wrong."""
        self.inp.copy_(check_input(self.collective, self.inp.numel(), self.chunk, self.rank, self.inp.device))
        if self.collective == "all_gather":
            self.out.fill_(-1.0)
        self.run()
        return count_wrong(self.collective, self.out, self.chunk, self.rank, self.world)


def fits(size: int, device: torch.device) -> bool:
    """Whether a ``size``-byte sweep point fits: on a GPU, 4× ``size`` free (input, output, check temporaries)."""
    return device.type != "cuda" or 4 * size <= torch.cuda.mem_get_info(device)[0]


def iterations(size: int, spec: SweepSpec) -> tuple[int, int]:
    """(warm-up, timed) calls at ``size`` bytes: ``volume / size`` timed, clamped to [min_iters, iters]."""
    timed = max(spec.min_iters, min(spec.iters, spec.volume_bytes // max(size, 1)))
    return max(1, min(spec.warmup, timed)), timed


def main(argv: list[str] | None = None) -> None:
    """Time every point of the :class:`~teraflops.hardware.collectives.SweepSpec`; write this rank's
    :class:`~teraflops.hardware.collectives.SweepResult`."""
    spec = read_spec(SweepSpec, argv)
    w = init_worker(spec.timeout_s)
    if w.device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the cores; a collective's reduction needs no thread pool
    points = [(c, s) for c in spec.collectives for s in spec.sizes]
    measured, skipped, times = [], [], []
    for done, (collective, size) in enumerate(points):
        total, chunk = counts(collective, size, w.world_size)
        ok = torch.tensor([fits(size, w.device) and chunk > 0], dtype=torch.int32, device=w.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips the same points
        if not ok.item():
            skipped.append((collective, size))
            continue
        buf = Buffers(collective, total, chunk, w.rank, w.world_size, w.device)
        warmup, iters = iterations(size, spec)
        for _ in range(warmup):
            buf.run()
        sync_device(w.device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            buf.run()
        sync_device(w.device)
        times.append((time.perf_counter() - start) / iters)
        measured.append((collective, total, iters, warmup, buf.wrong()))
        del buf
        report_progress(done + 1, len(points))
    # the ranks' times, their average (nccl-tests) and maximum, and the wrong elements summed over ranks
    t = torch.tensor(times, dtype=torch.float64, device=w.device)
    t_max, wrong = t.clone(), torch.tensor([m[-1] for m in measured], dtype=torch.int64, device=w.device)
    dist.all_reduce(t)
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
    dist.all_reduce(wrong)
    rows = tuple(SweepRow(collective=c, size=total * 4, count=total, type="float", iters=iters, warmup=warmup,
                          seconds=mean, seconds_max=top, wrong=int(bad))
                 for (c, total, iters, warmup, _), mean, top, bad
                 in zip(measured, (t / w.world_size).tolist(), t_max.tolist(), wrong.tolist()))
    write_result(SweepResult(**w.identity(), rows=rows, skipped=tuple(skipped)))
    finish()


if __name__ == "__main__":
    main()
