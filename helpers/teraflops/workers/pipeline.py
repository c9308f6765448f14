"""Rank side of Unit 2's pipeline parallelism: one GPT stage per rank, GPipe and 1F1B, every micro-batch timed.

``python -m teraflops.workers.pipeline --spec PATH`` (a :class:`teraflops.parallelization.pipeline.PipelineSpec`),
started by :func:`teraflops.parallelization.pipeline.run`. Every rank builds the same GPT
(:func:`~teraflops.workers.common.build_model`) and keeps its stage
(:func:`~teraflops.parallelization.pipeline.stage_module`); for each schedule and micro-batch count a
fresh stage and schedule (``ScheduleGPipe`` / ``Schedule1F1B`` of ``torch.distributed.pipelining``)
train on one batch of ``m × micro_batch`` sequences. The stage's ``forward_one_chunk`` and
``backward_one_chunk`` are wrapped to record ``(kind, micro-batch, start, end)``; the schedule's
sends, receives and waits happen outside them, so their sum is the stage's busy time. A step's span
runs from the first micro-batch's start on any stage to the last one's end (:func:`schedule_span`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.parallelization.pipeline import PipelineResult, PipelineSpec, ScheduleResult, stage_module
from teraflops.workers.common import build_model, make_data, sync_device

SCHEDULE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def saved_bytes(module, x) -> int:
    """Bytes of the tensors autograd saves in one forward of ``module`` on ``x`` (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def probe_input(cfg, rank: int, x: torch.Tensor, device) -> torch.Tensor:
    """One micro-batch of what stage ``rank`` takes, on ``device``: the tokens on the first stage,
    ``(micro_batch, seq_len, d_model)`` float32 activations on the others (made on ``device``: a CUDA
    stage's weights would refuse CPU activations with a device mismatch)."""
    if rank == 0:
        return x[: cfg.micro_batch]
    return torch.randn(cfg.micro_batch, cfg.seq_len, cfg.d_model, device=device)


def timed(stage, events: list, clock: list, sync=lambda: None) -> None:
    """Wrap ``stage``'s forward_one_chunk and backward_one_chunk to append ``[kind, chunk, start, end]``
    (seconds after ``clock[0]``) to ``events``. ``sync()`` runs before the start and before the end
    are read (:func:`~teraflops.workers.common.sync_device` of the stage's device): on a GPU a chunk's
    call returns once its kernels are queued, so without it ``end − start`` would be the CPU's enqueue
    time and the bubble noise."""
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        original = getattr(stage, name)

        def wrapper(chunk, *args, _original=original, _kind=kind, **kwargs):
            sync()
            start = time.perf_counter()
            out = _original(chunk, *args, **kwargs)
            sync()
            events.append([_kind, chunk, start - clock[0], time.perf_counter() - clock[0]])
            return out

        setattr(stage, name, wrapper)


def in_flight(events: list) -> int:
    """The most micro-batches whose forward had ended and whose backward had not, over ``events``."""
    live, peak = 0, 0
    for kind, *_ in sorted(events, key=lambda e: e[3]):
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def run_one(spec: PipelineSpec, w, schedule: str, m: int, data) -> ScheduleResult:
    cfg, p = spec.model, w.world_size
    module = stage_module(build_model(cfg, w.device), w.rank, p)
    rows = m * cfg.micro_batch
    x, y = data[0][:rows].to(w.device), data[1][:rows].to(w.device)
    nbytes = saved_bytes(module, probe_input(cfg, w.rank, x, w.device))
    stage = PipelineStage(module, w.rank, p, w.device)
    try:
        sched = SCHEDULE[schedule](stage, n_microbatches=m, loss_fn=lm_loss)
    except ValueError as e:
        return ScheduleResult(schedule=schedule, micro_batches=m, refused=str(e).split("\n")[0].replace("\\", ""),
                              busy_s=[], span_s=[], events=[], peak_in_flight=0, saved_bytes=nbytes, loss_diff=None)
    opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
    events, clock, busy, span, losses = [], [0.0], [], [], []
    timed(stage, events, clock, sync=lambda: sync_device(w.device))
    for i in range(spec.warmup + spec.steps):
        events.clear()
        losses = []
        opt.zero_grad(set_to_none=True)
        sync_device(w.device)  # the previous step's optimizer kernels are not this step's
        dist.barrier()
        clock[0] = time.perf_counter()
        if w.rank == 0:
            sched.step(x)
        elif w.rank == p - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        if i >= spec.warmup:
            span.append(schedule_span(events, clock[0], w.device))
            busy.append(sum(e[3] - e[2] for e in events))
        if i == 0:
            loss_diff = reference_diff(cfg, w, x, y, losses) if w.rank == p - 1 else None
        opt.step()
    return ScheduleResult(schedule=schedule, micro_batches=m, refused=None, busy_s=busy, span_s=span,
                          events=[list(e) for e in events], peak_in_flight=in_flight(events), saved_bytes=nbytes,
                          loss_diff=loss_diff)


def schedule_span(events: list, origin: float, device) -> float:
    """Seconds from the first micro-batch's start on any stage to the last one's end on any stage
    (``time.perf_counter`` is the machine's monotonic clock, the same in every rank process here):
    the schedule's own span, without its set-up and tear-down."""
    t = torch.tensor([-(origin + min(e[2] for e in events)), origin + max(e[3] for e in events)],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[1] + t[0])


def reference_diff(cfg, w, x, y, losses) -> float:
    """|mean micro-batch loss of the pipeline − the unsplit GPT's loss on the same batch| (first step)."""
    with torch.no_grad():
        want = lm_loss(build_model(cfg, w.device)(x), y).item()
    return abs(sum(float(v) for v in losses) / len(losses) - want)


def main(argv: list[str] | None = None) -> None:
    """Run every (schedule, m) of the :class:`~teraflops.parallelization.pipeline.PipelineSpec`; write
    this rank's :class:`~teraflops.parallelization.pipeline.PipelineResult`."""
    spec = read_spec(PipelineSpec, argv)
    w = init_worker(spec.timeout_s)
    data = make_data(spec.model, 1, max(spec.micro_batches))  # enough rows for the largest m
    points = [(s, m) for s in spec.schedules for m in spec.micro_batches]
    runs = []
    for done, (schedule, m) in enumerate(points):
        runs.append(run_one(spec, w, schedule, m, data))
        report_progress(done + 1, len(points))
    write_result(PipelineResult(**w.identity(), stage=w.rank, runs=tuple(runs)))
    finish()


if __name__ == "__main__":
    main()
