"""Rank side of Unit 2's tensor parallelism: Megatron TP (and data parallelism) of the course GPT, counted and timed.

``python -m teraflops.workers.tensor_parallel --spec PATH`` (a
:class:`teraflops.parallelization.tensor_parallel.TensorParallelSpec`), started by
:func:`teraflops.parallelization.tensor_parallel.run`. Every rank builds the same GPT
(:func:`~teraflops.workers.common.build_model`, same seed) and the same global batch
(:func:`~teraflops.workers.common.make_data`).

* ``"tp"``: a copy sharded over all ranks (:func:`~teraflops.parallelization.tensor_parallel.shard_gpt`);
  first its logits and loss on the global batch against the unsharded model's (the single-process
  reference, computed on every rank), then one forward + backward under :class:`CountingCommMode`,
  a ``CommDebugMode`` that also records each collective's input bytes, its module and its phase
  (forward or backward, from the mode's module tracker), then the timed steps.
* ``"dp"``: an unsharded copy trained on this rank's ``1/n`` of the global batch; after the backward
  every gradient is all-reduced in one flat buffer (:func:`~teraflops.workers.common.flat_grads`)
  and averaged: one collective of ``4Ψ`` bytes per step, timed alone (no overlap with the backward).

**Timing**: each step (forward, backward, SGD step) with ``time.perf_counter``, the modes taking
turns step by step against drift in the load. Its communication is measured by **replay**
(:func:`replay`): after the steps, the ranks all-reduce buffers of exactly the sizes the counted step
handed to its collectives, in its order, as many times as there were timed steps, each repeat after
an untimed barrier. So a rank's wait for a slower one (the load of a shared machine, not the link)
is not counted as communication, and nothing depends on when an asynchronous collective is waited
for. Compute is the step time minus that. Last, :func:`small_allreduces` times all-reduces of one
float: the latency of the ranks and link, the ``α`` of the alpha-beta prediction. TP has no communication to overlap (each all-reduce's
result is the next layer's input), so the split is the one a step really has; DP's all-reduce here
follows the backward (DDP's bucket overlap could hide part of it; not used).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops  # what it counts

from teraflops.launch.rank import finish, init_worker, read_spec, report_progress, write_result
from teraflops.models import lm_loss
from teraflops.parallelization.tensor_parallel import (ModeResult, TensorParallelResult, TensorParallelSpec,
    shard_gpt)
from teraflops.workers.common import build_model, flat_grads, make_data, rank_batch, set_grads, sync_device

# the collectives CommDebugMode counts: functional (native and Python) and c10d ops
COLLECTIVES = set(NATIVE_TO_PY_MAPPING) | set(NATIVE_TO_PY_MAPPING.values()) | set(c10d_collective_ops)


class CountingCommMode(CommDebugMode):
    """``CommDebugMode`` that also keeps, per collective it sees, ``(name, phase, module, bytes)`` in
    ``records`` (bytes: its first tensor argument's ``numel × element_size``; phase and module from
    the mode's own module tracker)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if packet in COLLECTIVES and not any(t == DTensor for t in types):
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            tracker = self.advanced_module_tracker
            self.records.append((packet.__name__, "backward" if tracker.is_bw else "forward", tracker.name,
                                 t.numel() * t.element_size()))
        return out


def block_of(module: str) -> int | None:
    """The block index of a module name such as ``"GPT.blocks.1.fc2"`` (None outside the blocks)."""
    parts = module.split(".")
    return int(parts[parts.index("blocks") + 1]) if "blocks" in parts and parts.index("blocks") + 1 < len(parts) \
        and parts[parts.index("blocks") + 1].isdigit() else None


def per_block(records: list, layers: int) -> tuple[list[dict], list[dict], int]:
    """``records`` of one counted step as per-block calls and bytes (``"forward/all_reduce"`` keys)
    and the number of collectives outside every block."""
    calls, nbytes, other = [{} for _ in range(layers)], [{} for _ in range(layers)], 0
    for name, phase, module, size in records:
        i = block_of(module)
        if i is None:
            other += 1
            continue
        key = f"{phase}/{name.removesuffix('_')}"
        calls[i][key] = calls[i].get(key, 0) + 1
        nbytes[i][key] = nbytes[i].get(key, 0) + size
    return calls, nbytes, other


def replay(sizes: list[int], repeats: int, device) -> list[float]:
    """Seconds per repeat to all-reduce float32 buffers of ``sizes`` bytes one after the other (the
    collectives a counted step made, in its order), after an untimed barrier, ``repeats`` times."""
    bufs = [torch.zeros(max(1, n // 4), device=device) for n in sizes]
    out = []
    for _ in range(repeats):
        dist.barrier()  # the time a rank waits for a slower one (load, not the link) is not counted
        start = time.perf_counter()
        for buf in bufs:
            dist.all_reduce(buf)
        sync_device(device)
        out.append(time.perf_counter() - start)
    return out


def small_allreduces(repeats: int, device) -> list[float]:
    """Seconds of each of ``repeats`` all-reduces of one float, each after an untimed barrier: the
    latency a collective pays on these ranks and this link whatever its size (the ``α`` side of the
    alpha-beta model; its 4 bytes take microseconds at any rate the course's links have)."""
    buf, out = torch.zeros(1, device=device), []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        sync_device(device)
        out.append(time.perf_counter() - start)
    return out


def sgd(params, lr: float) -> torch.optim.SGD:
    """SGD over the sharded model's parameters, one at a time (``foreach=False``).

    The list mixes DTensor shards (``qkv``/``proj``/``fc1``/``fc2``) with plain replicated tensors
    (embeddings, norms, the tied head). torch counts DTensor among the types its multi-tensor path
    accepts (``torch.distributed.tensor`` adds it to ``torch.optim.optimizer._foreach_supported_types``),
    so on CUDA, a ``foreach`` device, SGD's default is ``foreach=True`` and its one
    ``_foreach_add_`` over both kinds raises "got mixed torch.Tensor and DTensor" at the first step.
    The CPU is not a ``foreach`` device, which is why gloo ranks never took that path."""
    return torch.optim.SGD(params, lr=lr, foreach=False)


def one_rank_steps(cfg, device, steps: int, optimizer=sgd) -> dict:
    """The TP rank's training step in this process, as a 1-rank mesh (gloo on the CPU, NCCL on CUDA;
    a ``FileStore`` in a temporary folder, no port, no other process): the sharded GPT's parameters
    are the same mix of DTensor and plain tensors as on ``tp`` ranks, so the optimizer meets what it
    meets there. ``optimizer(params, lr)`` builds it (:func:`sgd`; pass another to show the failure).

    Returns:
        ``{"losses": [nats per step, steps + 1 of them], "dtensor_params", "plain_params": counts}``.

    Raises:
        RuntimeError: a process group is initialised in this process already, or the optimizer's.
    """
    import tempfile
    from pathlib import Path

    device = torch.device(device)
    if dist.is_initialized():
        raise RuntimeError("a process group is initialised in this process already: the 1-rank TP step needs its own")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.FileStore(str(Path(tmp) / "store"), 1),
                                **({"device_id": device} if device.type == "cuda" else {}))
        try:
            mesh = init_device_mesh(device.type, (1,))
            model = shard_gpt(build_model(cfg, device), mesh)
            params = list(model.parameters())
            opt = optimizer(params, cfg.lr)
            x, y = [t.to(device) for t in rank_batch(make_data(cfg, 1, 1), 0, 0, 1, cfg.micro_batch)]
            losses = []
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            with torch.no_grad():
                losses.append(float(lm_loss(model(x), y)))
            kinds = [isinstance(q, DTensor) for q in params]
            return {"losses": losses, "dtensor_params": sum(kinds), "plain_params": len(kinds) - sum(kinds)}
        finally:
            dist.destroy_process_group()


class TPRun:
    """The sharded model on this rank, its optimizer, counts and times."""

    def __init__(self, spec: TensorParallelSpec, w, mesh, data):
        self.spec, self.w, self.data = spec, w, data
        self.model = shard_gpt(build_model(spec.model, w.device), mesh)
        self.opt = sgd(self.model.parameters(), spec.model.lr)
        self.step_s = []
        self.batch = [t.to(w.device) for t in rank_batch(data, 0, 0, 1, spec.model.micro_batch)]

    def check(self, reference) -> tuple[float, float]:
        """(max |logits − reference logits|, |loss − reference loss|) on the global batch."""
        x, y = self.batch
        with torch.no_grad():
            want, got = reference(x), self.model(x)
        return float((got - want).abs().max()), abs(float(lm_loss(got, y) - lm_loss(want, y)))

    def step(self, timed: bool, count: bool = False):
        mode = CountingCommMode() if count else nullcontext()
        x, y = self.batch
        sync_device(self.w.device)
        start = time.perf_counter()
        with mode:
            self.opt.zero_grad(set_to_none=True)
            lm_loss(self.model(x), y).backward()
        self.opt.step()
        sync_device(self.w.device)
        if timed:
            self.step_s.append(time.perf_counter() - start)
        return mode

    def result(self, counted: CountingCommMode) -> ModeResult:
        sizes = [r[3] for r in counted.records]
        return ModeResult(mode="tp", step_s=self.step_s, comm_s=replay(sizes, len(self.step_s), self.w.device),
                          bytes_per_step=sum(sizes), calls_per_step=len(sizes))


class DPRun:
    """The unsharded model trained on this rank's share of the global batch; one flat gradient all-reduce."""

    def __init__(self, spec: TensorParallelSpec, w, data):
        self.spec, self.w = spec, w
        self.model = build_model(spec.model, w.device)
        self.params = [p for p in self.model.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=spec.model.lr)
        share = spec.model.micro_batch // w.world_size
        self.batch = [t.to(w.device) for t in rank_batch(data, 0, w.rank, w.world_size, share)]
        self.step_s, self.bytes, self.calls = [], 0, 0

    def step(self, timed: bool) -> None:
        x, y = self.batch
        sync_device(self.w.device)
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        lm_loss(self.model(x), y).backward()
        grads = flat_grads(self.params)
        dist.all_reduce(grads)
        set_grads(self.params, grads.div_(self.w.world_size))
        self.opt.step()
        sync_device(self.w.device)
        self.bytes, self.calls = grads.numel() * grads.element_size(), 1
        if timed:
            self.step_s.append(time.perf_counter() - start)

    def result(self) -> ModeResult:
        return ModeResult(mode="dp", step_s=self.step_s, comm_s=replay([self.bytes], len(self.step_s), self.w.device),
                          bytes_per_step=self.bytes,
                          calls_per_step=self.calls)


def main(argv: list[str] | None = None) -> None:
    """Run the :class:`~teraflops.parallelization.tensor_parallel.TensorParallelSpec`; write this
    rank's :class:`~teraflops.parallelization.tensor_parallel.TensorParallelResult`."""
    spec = read_spec(TensorParallelSpec, argv)
    cfg = spec.model
    w = init_worker(spec.timeout_s)
    data = make_data(cfg, 1, 1)  # one global batch of micro_batch sequences (the same on every rank)
    runs, tp, counted, diff, loss_diff = {}, None, None, None, None
    if "tp" in spec.modes:
        mesh = init_device_mesh(w.device.type, (w.world_size,))
        tp = runs["tp"] = TPRun(spec, w, mesh, data)
        diff, loss_diff = tp.check(build_model(cfg, w.device))
        counted = tp.step(timed=False, count=True)
    if "dp" in spec.modes:
        runs["dp"] = DPRun(spec, w, data)
    total = (spec.warmup + spec.steps) * len(runs)
    for i in range(spec.warmup + spec.steps):
        for j, mode in enumerate(spec.modes):
            runs[mode].step(timed=i >= spec.warmup)
            report_progress(i * len(runs) + j + 1, total)
    calls, nbytes, other = per_block(counted.records, cfg.layers) if counted else ([], [], 0)
    results = tuple(tp.result(counted) if m == "tp" else runs[m].result() for m in spec.modes)
    small = small_allreduces(spec.latency_repeats, w.device) if w.world_size > 1 else []
    write_result(TensorParallelResult(**w.identity(), params=build_model(cfg).num_params(), config=cfg,
                                      runs=results, max_abs_diff=diff, loss_diff=loss_diff, layer_calls=calls,
                                      layer_bytes=nbytes, other_calls=other, small_allreduce_s=small))
    finish()


if __name__ == "__main__":
    main()
