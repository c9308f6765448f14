"""Rank side of Unit 2's ZeRO runs: train models.GPT under DeepSpeed at each ZeRO stage in turn.

Started by :func:`teraflops.parallelization.zero.run_zero` through the DeepSpeed launcher, one process per rank:
``python -m teraflops.workers.zero_train --spec PATH`` (a :class:`teraflops.parallelization.zero.ZeroSpec`). For each stage the
same model (same seed) sees the same global batches: rank ``r`` takes rows ``r·B … (r+1)·B − 1``
of each step's ``world·B`` sequences, so the global batch, and with it the loss curve, does not
depend on the stage.

Per stage and rank it hands back a :class:`teraflops.parallelization.zero.ZeroStageResult` (through :func:`teraflops.launch.rank.write_result`):

* ``held``: elements this rank holds, read from the engine's real tensors (shared storage counted
  once): ``params`` (the module's parameters, or under stage 3 their shards ``p.ds_tensor``),
  ``grads`` (after ``backward``: full ``p.grad`` tensors, or the optimizer's reduced gradient
  partitions), ``optimizer`` (AdamW's ``exp_avg``/``exp_avg_sq`` plus the fp32 master partition
  DeepSpeed's ZeRO optimizers keep, unless it is the parameter shard itself: ``master_copy``).
* ``comms``: DeepSpeed's comms logger data as it keeps it, ``{op: {msg_size_bytes: [count,
  [latency_ms…], [algbw_Gbps…], [busbw_Gbps…]]}}``, for the steps after the first (the first step is
  warm-up), and ``logged_steps``.
* ``step_s`` (wall seconds per step) and ``losses`` (this rank's micro-batch loss per step).
* ``grads_peak``: the most gradient elements live at once during the first backward pass, sampled
  by a hook after each parameter's gradient is accumulated (stage 1 frees the full gradients only
  after the backward pass, stage 2 reduces them bucket by bucket during it).

Training runs in fp32 on every machine so that the stages can be compared to 1e-4; the DeepSpeed
config (:func:`teraflops.workers.common.zero_config`) keeps ZeRO's communication visible per
collective (no overlap, no multi-rank bucket all-reduce, stage 3 re-gathering every parameter in
the backward pass).
"""

from __future__ import annotations

import time

import torch

from teraflops.data import markov_tokens
from teraflops.launch.faults import fault_point
from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.workers.common import build_model, rank_batch, release_device_memory, zero_config
from teraflops.parallelization.zero import ZeroResult, ZeroSpec, ZeroStageResult


def _spans(tensors) -> list[tuple[int, int]]:
    """The memory each tensor covers, as merged ``[start, end)`` byte ranges."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in tensors if torch.is_tensor(t) and t.numel())
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def _elements(tensors, exclude=(), element_size: int = 4) -> int:
    """fp32 elements of memory the tensors hold, each byte counted once (views of one buffer and
    tensors sharing storage are not double-counted), leaving out bytes inside ``exclude`` spans."""
    total = 0
    for start, end in _spans(tensors):
        total += end - start
        for a, b in exclude:
            total -= max(0, min(end, b) - max(start, a))
    return total // element_size


def _params(engine, stage: int) -> list:
    params = list(engine.module.parameters())
    return [p.ds_tensor for p in params] if stage == 3 else params


def _grads(engine, stage: int) -> list:
    opt = engine.optimizer
    found = [p.grad for p in engine.module.parameters() if p.grad is not None and p.grad.numel()]
    if stage == 3 and getattr(opt, "grad_partitions_flat_buffer", None) is not None:
        found.append(opt.grad_partitions_flat_buffer)
    elif isinstance(getattr(opt, "averaged_gradients", None), dict):
        for parts in opt.averaged_gradients.values():
            found.extend(parts if isinstance(parts, list) else [parts])
    return found


def _master_partitions(engine) -> list:
    """The fp32 master copy of this rank's partition that DeepSpeed's ZeRO optimizers keep."""
    opt = engine.optimizer
    return [t for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
            for t in getattr(opt, name, [])]


def _optimizer_states(engine) -> list:
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)  # the ZeRO optimizers wrap the torch one
    states = [t for st in base.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    return states + _master_partitions(engine)


def _watch_grads_peak(engine, stage: int) -> tuple[list, list]:
    """Hooks that keep, in ``peak[0]``, the most gradient elements live after any parameter's gradient
    was accumulated; returns ``(peak, handles)`` (remove the handles when done)."""
    peak = [0]

    def sample(_param) -> None:
        peak[0] = max(peak[0], _elements(_grads(engine, stage)))

    return peak, [p.register_post_accumulate_grad_hook(sample) for p in engine.module.parameters()]


def run_stage(stage: int, spec: ZeroSpec, world: int, rank: int, step0: int) -> ZeroStageResult:
    import deepspeed
    import deepspeed.comm as ds_comm

    cfg, steps = spec.model, spec.steps
    model = build_model(cfg)
    psi = model.num_params()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=zero_config(stage, cfg.micro_batch, spec.bucket))
    data = markov_tokens(world * cfg.micro_batch * steps, cfg.seq_len, cfg.vocab, seed=cfg.seed)
    device = engine.device
    losses, step_s, held = [], [], {}
    grads_peak, hooks = _watch_grads_peak(engine, stage)
    for step in range(steps):
        fault_point(step0 + step)
        if step == 1:
            ds_comm.comms_logger.comms_dict.clear()  # the first step also holds one-off set-up traffic
        x, y = (t.to(device) for t in rank_batch(data, step, rank, world, cfg.micro_batch))
        start = time.perf_counter()
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        if step == 0:
            held["grads"] = _elements(_grads(engine, stage))
            for h in hooks:
                h.remove()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        report_progress(step0 + step + 1, len(spec.stages) * steps)
    params = _params(engine, stage)
    held["params"], param_spans = _elements(params), _spans(params)
    # a master partition that *is* the parameter shard (stage 3 in fp32) is not counted twice
    held["optimizer"] = _elements(_optimizer_states(engine), exclude=param_spans)
    master_elements = _elements(_master_partitions(engine), exclude=param_spans)
    comms = {op: {int(size): v for size, v in sizes.items()}  # DeepSpeed's raw format, see teraflops.parallelization.zero
             for op, sizes in ds_comm.comms_logger.comms_dict.items()}
    ds_comm.comms_logger.comms_dict.clear()
    result = ZeroStageResult(stage=stage, psi=psi, held=held, comms=comms, logged_steps=steps - 1, losses=losses,
                             step_s=step_s, optimizer_type=type(engine.optimizer).__name__,
                             master_copy=master_elements > 0, grads_peak=grads_peak[0],
                             master_elements=master_elements)
    engine.destroy()
    del engine, model, optimizer
    release_device_memory(device)  # four stages in one process: a T4 has no room for the last one's cached blocks
    return result


def main() -> None:
    spec = read_spec(ZeroSpec)  # the DeepSpeed launcher may append --local_rank: read_spec ignores it
    worker = init_worker(spec.timeout_s, deepspeed=True)
    runs = tuple(run_stage(s, spec, worker.world_size, worker.rank, i * spec.steps) for i, s in enumerate(spec.stages))
    write_result(ZeroResult(**worker.identity(), runs=runs))
    finish()


if __name__ == "__main__":
    main()
