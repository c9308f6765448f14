"""Rank side of Unit 2 §3-4: stale (relaxed) gradient updates, and all-reduce overlapped with backward.

``python -m teraflops.workers.ddp_sync --spec PATH`` (a :class:`teraflops.parallelization.ddp_sync.DataParallelSpec`),
started by :func:`teraflops.parallelization.ddp_sync.run` through :func:`~teraflops.launch.launcher.launch`. Every
run builds the same :class:`~teraflops.models.GPT` (:func:`~teraflops.workers.common.build_model`) and feeds it the same Markov
token stream (:func:`~teraflops.workers.common.make_data`): at step ``t`` rank ``r`` trains on sequences
``(t * world + r) * B ... + B`` of it, so the global batch of step ``t`` is the same in every run.
Optimizer: Adam.

* **staleness**, for each τ: each rank computes the gradient of its micro-batch, copies it into one
  flat buffer and starts ``dist.all_reduce(buffer, async_op=True)``; the (work, buffer) pairs wait
  in a FIFO queue (:class:`DelayedGradients`). Once the queue holds more than τ of them, the oldest
  is waited for, divided by the world size and applied. So the update made at step ``t`` uses the
  gradient of step ``t - τ`` (computed on parameters τ updates old), the first τ steps make no
  update, and the all-reduce of a step may run while the next τ steps compute. τ = 0 is plain
  synchronous data parallelism. After the last step the queue is drained (untimed) and the loss of
  held-out batches is measured, so every τ is compared after the same number of updates.
* **overlap**: ``DistributedDataParallel`` with ``bucket_mb`` buckets, whose hooks start the
  all-reduce of a bucket as soon as its gradients are ready, while backward goes on (``bucketed``),
  against the same model without DDP and one all-reduce of all gradients after backward
  (``after``), and, as the floor, the same steps with no communication at all (``local``, whose
  losses are each rank's own). ``bucketed`` and ``after`` compute the same averaged gradient.

Interleaving, against the drift of other processes' load on a shared machine: the overlap modes
take turns step by step (each finishes its communication within its step); the τ runs take turns
in blocks of ``block`` steps (at least 2τ + ``warmup_steps`` + 1, so that most timed steps of a
stale run are in the steady state, each waiting for the all-reduce of τ steps ago), and between
blocks the paused run's in-flight all-reduces are
waited for, untimed, which leaves its arithmetic unchanged. Times are ``time.perf_counter``
seconds per step, the step ending when its optimizer step is done on the device (CUDA: the current
stream, not the whole device, so all-reduces left in flight by a stale run are not waited for).
Not timed (``None`` in ``step_s``): the spec's first ``warmup_steps`` steps of a run and the first
step of each later block (its all-reduces had been drained, so it would look faster).
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from teraflops.launch.faults import fault_point
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.parallelization.ddp_sync import DataParallelResult, DataParallelSpec, ModeResult, StaleResult
from teraflops.sizing import TrainConfig
from teraflops.workers.common import (
    build_model,
    flat_grads,
    held_out_loss,
    make_data,
    rank_batch,
    set_grads,
    sync_device,
    trained_rank,
)


class DelayedGradients:
    """FIFO of in-flight gradient all-reduces, released ``tau`` pushes late.

    :meth:`push` a ``(work, buffer)`` pair (``work`` is what ``dist.all_reduce(..., async_op=True)``
    returns, or None for a finished reduction); it returns the buffers now due, oldest first, each
    waited for: none while the queue holds ``tau`` or fewer, else the oldest. :meth:`drain` returns
    (waited) all that are left; :meth:`wait_all` waits for all without releasing any.
    """

    def __init__(self, tau: int):
        if tau < 0:
            raise ValueError(f"tau must be >= 0 (steps a gradient is applied late), got {tau}")
        self.tau, self._queue = tau, deque()

    def __len__(self) -> int:
        return len(self._queue)

    def _pop(self):
        work, buf = self._queue.popleft()
        if work is not None:
            work.wait()
        return buf

    def push(self, work, buffer) -> list:
        self._queue.append((work, buffer))
        return [self._pop() for _ in range(len(self._queue) - self.tau)]

    def drain(self) -> list:
        return [self._pop() for _ in range(len(self._queue))]

    def wait_all(self) -> None:
        for i, (work, buf) in enumerate(self._queue):
            if work is not None:
                work.wait()
            self._queue[i] = (None, buf)


def train_reference(cfg: TrainConfig, steps: int, world: int, tau: int) -> list[float]:
    """Single-process training on the whole global batch of each step, each step's gradient applied
    ``tau`` steps late: the losses that data parallelism with staleness τ must reproduce (the mean
    of the ranks' micro-batch losses), as floats."""
    model, data = build_model(cfg), make_data(cfg, steps, world)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=cfg.lr)
    losses, queue = [], []
    for step in range(steps):
        parts = [rank_batch(data, step, r, world, cfg.micro_batch) for r in range(world)]
        opt.zero_grad(set_to_none=True)
        loss = sum(lm_loss(model(x), y) for x, y in parts) / world
        loss.backward()
        queue.append([p.grad.clone() for p in params])
        if len(queue) > tau:
            for p, g in zip(params, queue.pop(0)):
                p.grad = g
            opt.step()
        losses.append(loss.item())
    return losses


class _Run:
    """One training run on this rank: model, optimizer, per-step losses and times."""

    def __init__(self, cfg: TrainConfig, data, w, warmup_steps: int):
        self.cfg, self.data, self.w, self.warmup_steps = cfg, data, w, warmup_steps
        self.model = build_model(cfg, w.device)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.Adam(self.params, lr=cfg.lr)
        self.losses, self.step_s, self.timed_next = [], [], False

    def batch(self, step: int):
        w = self.w
        return (t.to(w.device) for t in rank_batch(self.data, step, w.rank, w.world_size, self.cfg.micro_batch))

    def record(self, loss: torch.Tensor, seconds: float) -> None:
        self.losses.append(loss.item())
        self.step_s.append(seconds if self.timed_next and len(self.step_s) >= self.warmup_steps else None)
        self.timed_next = True


class StaleRun(_Run):
    """Data parallelism with every gradient applied ``tau`` steps late (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, tau: int, data, w, warmup_steps: int):
        super().__init__(cfg, data, w, warmup_steps)
        self.tau, self.queue, self.updates = tau, DelayedGradients(tau), 0

    def _apply(self, flat: torch.Tensor) -> None:
        set_grads(self.params, flat.div_(self.w.world_size))
        self.opt.step()
        self.updates += 1

    def step(self, step: int) -> None:
        x, y = self.batch(step)
        sync_device(self.w.device)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.model(x), y)
        loss.backward()
        flat = flat_grads(self.params)
        for due in self.queue.push(dist.all_reduce(flat, async_op=True), flat):
            self._apply(due)
        loss = loss.detach()
        sync_device(self.w.device)
        self.record(loss, time.perf_counter() - t0)

    def pause(self) -> None:
        """Let this run's in-flight all-reduces finish (untimed) before another run takes a turn."""
        self.queue.wait_all()
        if self.w.device.type == "cuda":
            torch.cuda.synchronize(self.w.device)
        self.timed_next = False

    def result(self, eval_step: int) -> StaleResult:
        """This τ's :class:`~teraflops.parallelization.ddp_sync.StaleResult`: ``updates`` made during the steps;
        then the queue is drained and ``eval_loss`` is the loss of the held-out rows after the first
        ``eval_step`` global batches."""
        made = self.updates
        for due in self.queue.drain():
            self._apply(due)
        eval_loss = held_out_loss(self.model, self.data, self.cfg, eval_step, self.w.world_size, self.w.device).item()
        return StaleResult(tau=self.tau, losses=self.losses, step_s=self.step_s, updates=made, eval_loss=eval_loss)


class ModeRun(_Run):
    """One overlap mode: ``bucketed`` (DDP), ``after`` (one all-reduce after backward) or ``local``."""

    def __init__(self, cfg: TrainConfig, mode: str, bucket_mb: float, data, w, warmup_steps: int):
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(cfg, data, w, warmup_steps)
        self.mode, self.net = mode, self.model
        if mode == "bucketed":
            ids = [w.device] if w.device.type == "cuda" else None
            self.net = DDP(self.model, device_ids=ids, bucket_cap_mb=bucket_mb)
        self.parts = {"forward_s": [], "backward_s": [], "comm_s": []}

    def step(self, step: int) -> None:
        x, y = self.batch(step)
        dev = self.w.device
        sync_device(dev)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.net(x), y)
        sync_device(dev)
        t1 = time.perf_counter()
        loss.backward()  # DDP: returns once every bucket's all-reduce is done
        sync_device(dev)
        t2 = time.perf_counter()
        if self.mode == "after":
            flat = flat_grads(self.params)
            dist.all_reduce(flat)
            set_grads(self.params, flat.div_(self.w.world_size))
            sync_device(dev)
        t3 = time.perf_counter()
        self.opt.step()
        loss = loss.detach()
        sync_device(dev)
        self.record(loss, time.perf_counter() - t0)
        timed = self.step_s[-1] is not None
        for key, dt in (("forward_s", t1 - t0), ("backward_s", t2 - t1), ("comm_s", t3 - t2)):
            self.parts[key].append(dt if timed else None)

    def result(self) -> ModeResult:
        """This mode's :class:`~teraflops.parallelization.ddp_sync.ModeResult`; ``buckets``: all-reduces per
        step (DDP's after its rebuild on the first step)."""
        buckets = {"after": 1, "local": 0}.get(self.mode)
        if buckets is None:
            info = self.net._get_ddp_logging_data()
            sizes = str(info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes") or "")
            buckets = len([s for s in sizes.split(",") if s.strip()])
        return ModeResult(mode=self.mode, losses=self.losses, step_s=self.step_s, **self.parts, buckets=buckets)


def main(argv: list[str] | None = None) -> None:
    """Run the experiments of the :class:`~teraflops.parallelization.ddp_sync.DataParallelSpec`; write this
    rank's :class:`~teraflops.parallelization.ddp_sync.DataParallelResult`. Fault points (``TERAFLOPS_FAULT``)
    count every training step of the launch, in the order they run."""
    spec = read_spec(DataParallelSpec, argv)
    cfg = spec.model
    taus = spec.taus if "staleness" in spec.experiments else ()
    modes = spec.modes if "overlap" in spec.experiments else ()

    w = init_worker(spec.timeout_s)
    data = make_data(cfg, max(spec.steps if taus else 0, spec.overlap_steps if modes else 0), w.world_size)
    total, done = len(taus) * spec.steps + len(modes) * spec.overlap_steps, 0

    def step(run, i):
        nonlocal done
        fault_point(done)
        run.step(i)
        done += 1
        report_progress(done, total)

    stale = [StaleRun(cfg, tau, data, w, spec.warmup_steps) for tau in taus]
    # A block must be well over τ long: the first τ steps after a pause start all-reduces and wait for
    # none, so with short blocks the timed steps of a large τ would never wait at all.
    block = max(spec.block, 2 * max(taus, default=0) + spec.warmup_steps + 1)
    for start in range(0, spec.steps if stale else 0, block):
        for run in stale:
            for i in range(start, min(start + block, spec.steps)):
                step(run, i)
            run.pause()
    staleness = tuple(run.result(eval_step=spec.steps) for run in stale)
    del stale
    runs = [ModeRun(cfg, mode, spec.bucket_mb, data, w, spec.warmup_steps) for mode in modes]
    for i in range(spec.overlap_steps if runs else 0):
        for run in runs:
            step(run, i)
    write_result(DataParallelResult(**trained_rank(w, cfg), staleness=staleness,
                                    overlap=tuple(run.result() for run in runs)))
    finish()


if __name__ == "__main__":
    main()
