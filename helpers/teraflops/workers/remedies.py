"""Rank side of Unit 5's communication remedies: gradient accumulation and gradient compression under DDP.

``python -m teraflops.workers.remedies --spec PATH`` (a :class:`teraflops.hardware.remedies.RemediesSpec`),
started by :func:`teraflops.hardware.remedies.run` through :func:`~teraflops.launch.launcher.launch`. Every
setting trains its own ``DistributedDataParallel`` copy of the same :class:`~teraflops.models.GPT`
(:func:`~teraflops.workers.common.build_model`, same seed) on the same micro-batches in the
same order: micro-batch ``i`` of rank ``r`` is :func:`~teraflops.workers.common.rank_batch`
``(data, i, r, world, micro_batch)``. Optimizer: Adam, the same learning rate everywhere.

Settings (:data:`teraflops.hardware.remedies.SETTINGS`; ``k`` micro-batches per optimizer step, the loss of each scaled by
``1/k`` so the step's gradient is the mean over its global batch of ``k × world × micro_batch``
sequences):

* ``baseline``: ``k = 1``, DDP's plain all-reduce (``allreduce_hook``) after every micro-batch.
* ``accumulate``: ``k = accum``; the first ``k − 1`` micro-batches run forward and backward inside
  ``ddp.no_sync()`` (no all-reduce; gradients add up locally), the last one syncs the sum.
* ``accumulate-sync``: the same ``k`` and updates, without ``no_sync``: DDP all-reduces after every
  micro-batch anyway. Same losses as ``accumulate`` (to float rounding), ``k``× its bytes: it is
  ``no_sync``, not accumulating, that saves the bytes.
* ``fp16``, ``bf16``: ``k = 1``, ``fp16_compress_hook`` / ``bf16_compress_hook`` (cast the bucket to
  16 bits, all-reduce, cast back).
* ``powersgd``: ``k = 1``, ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank =
  powersgd_rank, start_powerSGD_iter = powersgd_start)`` (error feedback and warm start on, the
  defaults; plain all-reduce for the first ``start`` steps). On gloo with all gradients in one
  bucket (:data:`ONE_BUCKET_WHY`).

**Bytes are counted, not computed.** Every setting's hook is wrapped (:func:`counting_hook`): the
wrapper adds ``bucket.buffer()``'s bytes (the fp32 gradients DDP hands over) to ``bucket_bytes``,
then calls the real hook. The bytes actually all-reduced are counted by :class:`AllReduceBytes`,
which, for the whole rank process, replaces ``torch.distributed.all_reduce`` with a wrapper that adds
``tensor.numel() × tensor.element_size()`` of each call before calling the original. The hooks
look ``dist.all_reduce`` up at call time (``torch/distributed/algorithms/ddp_comm_hooks/
default_hooks.py`` ``_allreduce_fut`` and ``_compress_hook``; ``powerSGD_hook.py``: one all-reduce
of the uncompressed vectors (biases, norms), then one of all ``P`` matrices and one of all ``Q``
matrices, the last two launched from future callbacks after the hook has returned), so every byte
a hook sends is seen, PowerSGD's ``P`` and ``Q`` included. DDP waits for every bucket's future
before ``backward()`` returns, so the bytes counted between the start and the end of a step are
that step's. These are the bytes each rank puts into all-reduce (the payload ``S``); a ring moves
``2(n−1)/n · S`` over each rank's link (:mod:`teraflops.hardware.collectives`).

Interleaving, against drift in the machine's load: the settings take turns in rounds of
``max(k)`` micro-batches (each finishes its communication within its turn). Times are
``time.perf_counter`` seconds per optimizer step; the steps of the first round are not timed
(``None``: first-call allocations, DDP's bucket rebuild after its first step).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from teraflops.hardware.remedies import RemediesResult, RemediesSpec, RemedyResult
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.workers.common import build_model, held_out_loss, make_data, rank_batch, sync_device, trained_rank

ONE_BUCKET_WHY = (
    "on gloo, PowerSGD runs with all gradients in one DDP bucket: it launches its P and Q all-reduces from "
    "future callbacks, so with several buckets their order depends on which bucket's all-reduce finishes "
    "first, which can differ between ranks; gloo pairs collectives by their order, and the ranks then wait "
    "on different ones (observed with torch 2.13: a hang at the first compressed step with 2 buckets)")


class AllReduceBytes:
    """Counts the bytes and calls of every ``torch.distributed.all_reduce`` while installed.

    ``with AllReduceBytes() as c:`` replaces ``torch.distributed.all_reduce`` (the module attribute,
    which the DDP comm hooks look up at each call) by a wrapper that adds
    ``tensor.numel() * tensor.element_size()`` to ``c.bytes`` and 1 to ``c.calls`` (under a lock:
    PowerSGD launches its ``P``/``Q`` all-reduces from future callbacks, on another thread), then
    calls the original; the original is put back on exit.
    """

    def __init__(self):
        self.bytes, self.calls, self._lock, self._original = 0, 0, threading.Lock(), None

    def __enter__(self):
        original = self._original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            with self._lock:
                self.bytes += tensor.numel() * tensor.element_size()
                self.calls += 1
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original
        return False


def comm_hook(setting: str, powersgd_rank: int, powersgd_start: int):
    """``(state, hook)`` for ``DDP.register_comm_hook`` of ``setting`` (state None: the default group);
    PowerSGD's rank and start step come from the spec (:class:`~teraflops.hardware.remedies.RemediesSpec`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if setting == "powersgd":
        return psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                  start_powerSGD_iter=powersgd_start), psgd.powerSGD_hook
    return None, {"fp16": default.fp16_compress_hook, "bf16": default.bf16_compress_hook}.get(
        setting, default.allreduce_hook)


def counting_hook(hook, tally: dict):
    """``hook`` that first adds ``bucket.buffer()``'s bytes to ``tally["bucket_bytes"]`` (and 1 to
    ``tally["buckets"]``): the gradient bytes DDP hands to the hook, before any compression."""

    def counted(state, bucket):
        buf = bucket.buffer()
        tally["bucket_bytes"] += buf.numel() * buf.element_size()
        tally["buckets"] += 1
        return hook(state, bucket)

    return counted


class RemedyRun:
    """One setting on this rank: its DDP model, optimizer, losses, step times and bytes."""

    def __init__(self, setting: str, k: int, cfg, data, w, counter: AllReduceBytes, *, bucket_mb: float,
                 powersgd_rank: int, powersgd_start: int, untimed_micro_batches: int):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.setting, self.k, self.cfg, self.data, self.w, self.counter = setting, k, cfg, data, w, counter
        self.no_sync = setting == "accumulate"
        self.model = build_model(cfg, w.device)
        if setting == "powersgd" and w.backend == "gloo":  # one bucket: see ONE_BUCKET_WHY
            grad_mib = sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2**20
            bucket_mb = max(bucket_mb, 2 * grad_mib + 1)
        self.bucket_mb = bucket_mb
        self.ddp = DDP(self.model, device_ids=[w.device] if w.device.type == "cuda" else None,
                       bucket_cap_mb=bucket_mb)
        self.tally = {"bucket_bytes": 0, "buckets": 0}
        state, hook = comm_hook(setting, powersgd_rank, powersgd_start)
        self.ddp.register_comm_hook(state, counting_hook(hook, self.tally))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.untimed = untimed_micro_batches
        self.losses, self.step_s, self.step_bytes, self.step_bucket_bytes, self.step_calls = [], [], [], [], []
        self.step_buckets = []

    def micro_batch(self, i: int) -> None:
        """Forward and backward of micro-batch ``i``; the optimizer step after every ``k``-th."""
        w, first, last = self.w, i % self.k == 0, i % self.k == self.k - 1
        x, y = (t.to(w.device) for t in rank_batch(self.data, i, w.rank, w.world_size, self.cfg.micro_batch))
        if first:
            sync_device(w.device)
            self._t0 = time.perf_counter()
            self._start = (self.counter.bytes, self.counter.calls, self.tally["bucket_bytes"], self.tally["buckets"])
            self.opt.zero_grad(set_to_none=True)
        with self.ddp.no_sync() if self.no_sync and not last else nullcontext():
            loss = lm_loss(self.ddp(x), y)
            (loss / self.k).backward()  # DDP: returns once this micro-batch's all-reduces are done
        self.losses.append(loss.item())
        if last:
            self.opt.step()
            sync_device(w.device)
            self.step_s.append(time.perf_counter() - self._t0 if i >= self.untimed else None)
            self.step_bytes.append(self.counter.bytes - self._start[0])
            self.step_calls.append(self.counter.calls - self._start[1])
            self.step_bucket_bytes.append(self.tally["bucket_bytes"] - self._start[2])
            self.step_buckets.append(self.tally["buckets"] - self._start[3])

    def result(self, trained: int) -> RemedyResult:
        """This setting's :class:`~teraflops.hardware.remedies.RemedyResult`; ``eval_loss``: the loss of the
        held-out rows after the first ``trained`` micro-batches."""
        eval_loss = held_out_loss(self.model, self.data, self.cfg, trained, self.w.world_size, self.w.device).item()
        return RemedyResult(setting=self.setting, k=self.k, losses=self.losses, step_s=self.step_s,
                            step_bytes=self.step_bytes, step_bucket_bytes=self.step_bucket_bytes,
                            step_calls=self.step_calls, step_buckets=self.step_buckets, bucket_mb=self.bucket_mb,
                            eval_loss=eval_loss)


def main(argv: list[str] | None = None) -> None:
    """Train every setting of the :class:`~teraflops.hardware.remedies.RemediesSpec`; write this rank's
    :class:`~teraflops.hardware.remedies.RemediesResult`."""
    spec = read_spec(RemediesSpec, argv)  # its settings were checked where it was built, and again here
    cfg = spec.model
    w = init_worker(spec.timeout_s)
    data = make_data(cfg, spec.micro_batches, w.world_size)
    ks = {s: spec.accum if s.startswith("accumulate") else 1 for s in spec.settings}
    turn = max(ks.values())
    with AllReduceBytes() as counter:
        runs = [RemedyRun(s, ks[s], cfg, data, w, counter, bucket_mb=spec.bucket_mb, powersgd_rank=spec.powersgd_rank,
                          powersgd_start=spec.powersgd_start, untimed_micro_batches=turn) for s in spec.settings]
        total, done = len(runs) * spec.micro_batches, 0
        for start in range(0, spec.micro_batches, turn):
            for run in runs:
                for i in range(start, start + turn):
                    run.micro_batch(i)
                done += turn
                report_progress(done, total)
    write_result(RemediesResult(**trained_rank(w, cfg), micro_batches=spec.micro_batches,
                                powersgd_rank=spec.powersgd_rank, powersgd_start=spec.powersgd_start,
                                runs=tuple(run.result(spec.micro_batches) for run in runs)))
    finish()


if __name__ == "__main__":
    main()
