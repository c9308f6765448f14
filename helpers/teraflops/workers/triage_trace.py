"""Rank side of the triage capstone: distributed workloads, each profiled on every rank.

``python -m teraflops.workers.triage_trace --spec PATH`` (a :class:`teraflops.triage.rank_traces.RankTraceSpec`),
started by :func:`teraflops.triage.rank_traces.profile_ranks` through :func:`~teraflops.launch.launcher.launch`
(``deepspeed=True`` when ``zero3`` is asked for: only then do the ranks join through
``deepspeed.init_distributed``). The workloads run one after the other in the order asked; what
each one does and which verdict it should get is in :mod:`teraflops.triage.rank_traces`.

Per workload, on every rank: the spec's ``warmup`` untimed steps, then its ``steps`` steps, each after a
barrier (so that every step starts together and no rank is late because it wrote its trace
longer) and each profiled on its own as :func:`teraflops.triage.trace.record` profiles one call
(``torch.profiler``, CPU plus CUDA with GPUs, ``record_shapes=True``). The first profiled step's
Chrome trace stays, as ``<out>/<workload>.rank<r>.json``; from every profiled step the rank keeps
its seconds inside collectives (:func:`teraflops.triage.rank_traces.collective_seconds`), which the
caller stacks into the waits ``[steps, ranks]`` of :func:`teraflops.triage.verdict.triage`. So the waits
come from the same instrument, and the same events, as the communication of the trace they go with.

Hands back (:func:`~teraflops.launch.rank.write_result`) a :class:`teraflops.triage.rank_traces.RankTraceResult`:
per workload name a :class:`~teraflops.triage.rank_traces.WorkloadResult` (``waits`` and ``step_s``,
``[steps]`` s; ``trace``, the kept trace's path; ``delayed_rank``, ``delay_s``, ``params``).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from teraflops.data import markov_tokens
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.sizing import TrainConfig
from teraflops.triage.rank_traces import RankTraceResult, RankTraceSpec, WorkloadResult, collective_seconds
from teraflops.triage.trace import record
from teraflops.workers.common import build_model, flat_grads, set_grads, sync_device, zero_config


def profile_step(step, path: Path) -> float:
    """Profile one call of ``step()`` with :func:`teraflops.triage.trace.record` (no warm-up: the caller
    warmed up), its Chrome trace to ``path``; return the seconds it spent inside collectives."""
    return collective_seconds(record(step, path, warmup=0))


def _batch(cfg: TrainConfig, rank: int, device):
    """This rank's micro-batch ``(inputs, targets)``, int64 ``[micro_batch, seq_len]`` (the same every step)."""
    b = cfg.micro_batch
    x, y = markov_tokens(b * (rank + 1), cfg.seq_len, cfg.vocab, seed=cfg.seed)
    return x[-b:].to(device), y[-b:].to(device)


def zero3(w, a):
    """One training step of the GPT under DeepSpeed ZeRO stage 3 (fp32, torch's AdamW) with Unit 2's
    :func:`teraflops.workers.common.zero_config` (every parameter partitioned, gathered before its
    forward and again before its backward: 3Ψ per step) with two changes (why: :mod:`teraflops.triage.rank_traces`):
    no comms logger (its per-call bookkeeping is Python time on every collective) and one reduce
    bucket for all gradients (one reduce-scatter, after backward). Returns ``(step, info, close)``."""
    import deepspeed

    model = build_model(a.zero, w.device)
    params = model.num_params()  # before initialize: ZeRO-3 partitions the parameters (numel() then reads 0)
    cfg = zero_config(3, a.zero.micro_batch, params)
    cfg["comms_logger"] = {"enabled": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=a.zero.lr),
                                      config=cfg)
    x, y = _batch(a.zero, w.rank, engine.device)

    def step():
        engine.backward(lm_loss(engine(x), y))
        engine.step()

    def close():
        engine.destroy()

    return step, {"params": params}, close


def straggler(w, a):
    """Synchronous data parallelism, the last rank late by a sleep of ``a.straggler_factor`` × the
    slowest rank's median step without delay (measured here, over ``a.warmup`` + 2 steps): forward,
    backward, the sleep (last rank only), one blocking all-reduce of all gradients, SGD."""
    model = build_model(a.dp, w.device)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=a.dp.lr)
    x, y = _batch(a.dp, w.rank, w.device)
    delay = [0.0]

    def step():
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        flat = flat_grads(params)
        if delay[0]:
            time.sleep(delay[0])  # the injected delay: late to the all-reduce, the others' compute undisturbed
        dist.all_reduce(flat)
        set_grads(params, flat.div_(w.world_size))
        opt.step()

    times = []
    for _ in range(a.warmup + 2):
        dist.barrier()
        start = time.perf_counter()
        step()
        sync_device(w.device)
        times.append(time.perf_counter() - start)
    base = torch.tensor([statistics.median(times[a.warmup:])], dtype=torch.float64, device=w.device)
    dist.all_reduce(base, op=dist.ReduceOp.MAX)  # one delay, the same on every rank's books
    late = w.world_size - 1
    delay_s = a.straggler_factor * base.item()
    delay[0] = delay_s if w.rank == late else 0.0
    return step, {"params": model.num_params(), "delayed_rank": late, "delay_s": delay_s}, None


def allreduce(w, a):
    """``a.allreduce_calls`` blocking all-reduces of an ``a.allreduce_bytes`` float32 message, each
    followed by one trivial op (scaling by 1/world, so the values stay put)."""
    x = torch.ones(max(1, a.allreduce_bytes // 4), device=w.device)

    def step():
        for _ in range(a.allreduce_calls):
            dist.all_reduce(x)
            x.mul_(1 / w.world_size)

    return step, {"params": 0}, None


BUILDERS = {"zero3": zero3, "straggler": straggler, "allreduce": allreduce}


def run(name: str, w, a: RankTraceSpec, tick) -> WorkloadResult:
    """Build workload ``name``, warm it up, profile ``a.steps`` steps; this rank's result for it."""
    out = Path(a.out)
    step, info, close = BUILDERS[name](w, a)
    for _ in range(a.warmup):
        step()
        tick()
    waits, step_s, kept = [], [], out / f"{name}.rank{w.rank}.json"
    for i in range(a.steps):
        path = kept if i == 0 else out / f".{name}.rank{w.rank}.step{i}.json"
        dist.barrier()
        start = time.perf_counter()
        waits.append(profile_step(step, path))
        step_s.append(time.perf_counter() - start)
        if i:
            path.unlink()
        tick()
    if close is not None:
        close()
    gc.collect()
    return WorkloadResult(waits=waits, trace=str(kept), step_s=step_s, params=info["params"],
                          delayed_rank=info.get("delayed_rank"), delay_s=info.get("delay_s", 0.0))


def main(argv: list[str] | None = None) -> None:
    """Run the workloads of the :class:`~teraflops.triage.rank_traces.RankTraceSpec`; write this rank's
    :class:`~teraflops.triage.rank_traces.RankTraceResult`."""
    a = read_spec(RankTraceSpec, argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)

    w = init_worker(a.timeout_s, deepspeed="zero3" in a.workloads)
    total, done = len(a.workloads) * (a.warmup + a.steps), 0

    def tick():
        nonlocal done
        done += 1
        report_progress(done, total)

    results = {name: run(name, w, a, tick) for name in a.workloads}
    write_result(RankTraceResult(**w.identity(), workloads=results))
    finish()


if __name__ == "__main__":
    main()
