"""Data parallelism by hand, overlapped with the backward pass: what its checks ask of the ranks.

``DistributedDataParallel`` (Li et al., *PyTorch Distributed*, VLDB 2020, arXiv:2006.15704, §3-4)
does three things a learner can build in thirty lines:

1. at wrap time, **broadcast** rank 0's parameters, so every replica starts equal;
2. during ``backward()``, a hook on each parameter (``Tensor.register_post_accumulate_grad_hook``:
   it runs once the gradient has been accumulated into ``.grad``; ``register_hook`` runs before,
   when ``.grad`` is not yet set) launches an **asynchronous all-reduce** of that gradient, so
   communication overlaps the rest of the backward pass; with **buckets**, gradients are grouped
   (reverse registration order, about the order backward produces them) and a bucket's one
   all-reduce starts when its last gradient is ready: fewer, larger messages, each paying the
   latency α once (Unit 5's α-β model);
3. ``finish_gradient_synchronization()`` **waits** on every handle and divides by the world size
   (all-reduce sums; data parallelism averages) before the optimizer steps.

A weight tied in two places (embedding and output projection) is one parameter: it gets one hook
and one all-reduce. :class:`TiedLM` is the checks' model; :class:`DdpCheckSpec` what
:mod:`teraflops.workers.ddp_check` runs for :func:`teraflops.grading.unit02.ddp_overlap` and
:func:`teraflops.grading.unit02.ddp_bucketed`; :class:`DdpCheckResult` what each rank reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from teraflops.launch import launcher
from teraflops.launch.placement import data_parallel_plan
from teraflops.launch.rank import RankIdentity
from teraflops.models import GPT
from teraflops.parallelization.zero import RankError
from teraflops.sizing import TrainConfig, dp_config

DDP_TOL = 1e-6  # max |parameter difference| from DDP and from one process, fp32, after the check's steps


class TiedLM(nn.Module):
    """A one-block token model whose output projection reuses the embedding's weight (tied):
    ``logits = head(e + fc2(gelu(fc1(e))))``, ``e = emb(x)``; ``x`` int64 ``[batch, seq]``, logits
    fp32 ``[batch, seq, vocab]``. Five parameter tensors (the tied weight counted once)."""

    def __init__(self, vocab: int = 32, d: int = 16, hidden: int = 24):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter used twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        return self.head(e + self.fc2(F.gelu(self.fc1(e))))


def tied_lm(seed: int) -> TiedLM:
    """:class:`TiedLM` initialised from ``seed`` (the checks give every rank its own, so that only a
    broadcast at wrap time makes the replicas equal)."""
    torch.manual_seed(seed)
    return TiedLM()


def token_batch(step: int, rank: int, rows: int = 4, seq: int = 8, vocab: int = 32):
    """Rank ``rank``'s ``(inputs, targets)`` at ``step``: int64 ``[rows, seq]`` each, different on every rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of ``logits [b, s, V]`` against ``targets [b, s]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- the references: the solutions of exercises 8 and 9, and the baseline without overlap -------------

class DDPOverlap(nn.Module):
    """Data parallelism by hand: one asynchronous all-reduce per parameter, launched from a hook as
    soon as backward has accumulated that parameter's gradient."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        self.handles = []
        for p in module.parameters():  # unique parameters: a tied weight appears once
            dist.broadcast(p.data, src=0)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._launch)

    def _launch(self, p):
        self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self):
        for p, handle in self.handles:
            handle.wait()
            p.grad /= self.world
        self.handles.clear()


class DDPBucketed(nn.Module):
    """Data parallelism by hand with gradient buckets: parameters grouped (reverse order, about the
    order backward produces their gradients) into buckets of at most bucket_size_mb; a bucket's one
    asynchronous all-reduce starts when its last gradient is ready."""

    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        cap = bucket_size_mb * 1e6
        params = [p for p in module.parameters() if p.requires_grad]
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.buckets, current, size = [], [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap:
                self.buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(current)
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.handles = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        b = self.bucket_of[p]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):  # the bucket's last gradient: send it
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[b]])
            self.handles.append((b, flat, dist.all_reduce(flat, async_op=True)))

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self):
        for b, flat, handle in self.handles:
            handle.wait()
            flat /= self.world
            offset = 0
            for q in self.buckets[b]:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
        self.handles.clear()
        self.ready = [0] * len(self.buckets)

class DDPAfterBackward(nn.Module):
    """The baseline without overlap: nothing happens during backward; one all-reduce per parameter
    starts only in ``finish_gradient_synchronization()``, after backward has returned."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self):
        handles = [(p, dist.all_reduce(p.grad, async_op=True)) for p in self.module.parameters() if p.grad is not None]
        for p, handle in handles:
            handle.wait()
            p.grad /= self.world


WRAPPERS = {"after backward": DDPAfterBackward, "per parameter": DDPOverlap, "bucketed": DDPBucketed}


@dataclass(frozen=True)
class DdpCheckSpec:
    """What :mod:`teraflops.workers.ddp_check` runs: the learner's class block ``source`` (class
    ``name``) wrapping :class:`TiedLM`, built as ``cls(module)`` or, with ``bucket_mb``, once per
    size as ``cls(module, bucket_size_mb=size)``; ``steps`` of SGD at ``lr`` next to torch's DDP and
    one process on the global batch; ``timeout_s``: seconds a collective waits for the others."""

    source: str
    name: str
    bucket_mb: tuple[float, ...] | None = None
    steps: int = 5
    lr: float = 0.1
    timeout_s: float = 20


@dataclass(frozen=True)
class DdpRun:
    """One wrapping on one rank (``bucket_mb`` None: per parameter): ``wrapped``, the learner's
    parameters right after wrapping (flat); ``params`` after the steps; ``backward_calls`` and
    ``finish_calls``, all-reduce calls per step launched during ``backward()`` and during
    ``finish_gradient_synchronization()``; ``largest``, most elements in one call; ``unwaited``,
    asynchronous handles not waited on when ``finish_gradient_synchronization()`` returned (all
    steps); rank 0 adds ``ref`` (torch's DDP), ``single`` (one process, global batch), ``summed``
    (torch's DDP with the loss × world size: gradients summed) and ``initial`` (rank 0's model)."""

    bucket_mb: float | None
    wrapped: list[float]
    params: list[float]
    backward_calls: list[int]
    finish_calls: list[int]
    largest: int
    unwaited: int
    ref: list[float] | None = None
    single: list[float] | None = None
    summed: list[float] | None = None
    initial: list[float] | None = None


@dataclass(frozen=True)
class DdpCheckResult(RankIdentity):
    """One rank's report: a :class:`DdpRun` per wrapping that ran, ``error`` the learner's code
    raised first (None if none), ``sizes`` (elements of each unique parameter, registration order)."""

    error: RankError | None
    runs: list[DdpRun]
    sizes: list[int]


# --- the lecture's comparison: when does communication start? -----------------------------------------


@dataclass(frozen=True)
class OverlapSpec:
    """What :mod:`teraflops.workers.ddp_overlap` runs: the GPT of ``model`` wrapped in each of
    ``modes`` (keys of :data:`WRAPPERS`) in turn, ``steps`` SGD steps each (the first a warm-up, not
    reported), buckets of ``bucket_mb`` MB for ``"bucketed"``; ``timeout_s``: seconds a collective waits."""

    model: TrainConfig
    modes: tuple[str, ...]
    steps: int
    bucket_mb: float
    timeout_s: float = 60


@dataclass(frozen=True)
class OverlapRun:
    """One mode on one rank, medians over the reported steps: ``calls``, all-reduces a step;
    ``in_backward``, those launched before ``backward()`` returned; ``backward_s``, the backward
    pass; ``wait_s``, ``finish_gradient_synchronization()`` (what backward did not hide);
    ``step_s``, forward to optimizer step (s)."""

    mode: str
    calls: int
    in_backward: int
    backward_s: float
    wait_s: float
    step_s: float


@dataclass(frozen=True)
class OverlapResult(RankIdentity):
    """One rank's :class:`OverlapRun` per mode."""

    runs: list[OverlapRun]


def overlap(ranks: int | None = None, steps: int = 4, modes=tuple(WRAPPERS), buckets: int = 4) -> list[dict]:
    """The three wrappers of :data:`WRAPPERS` on the course GPT (the preset's data-parallel config),
    on ``ranks`` ranks (default the plan's): one row per mode, the slowest rank's medians
    (:class:`OverlapRun` fields; times in s). ``"bucketed"`` uses buckets of 1/``buckets`` of the
    model's fp32 gradients."""
    plan = data_parallel_plan(ranks_cpu=ranks)
    cfg = dp_config(plan.preset)
    params = sum(p.numel() for p in GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len).parameters())
    spec = OverlapSpec(cfg, tuple(modes), steps, bucket_mb=4 * params / buckets / 1e6)
    results = launcher.launch("teraflops.workers.ddp_overlap", plan.placement, spec=spec, result=OverlapResult,
                              timeout=300, desc="DDP overlap")
    rows = []
    for i, mode in enumerate(modes):
        runs = [r.runs[i] for r in results]
        rows.append({"mode": mode, "ranks": len(results), "calls": runs[0].calls, "in_backward": runs[0].in_backward,
                     **{k: max(getattr(r, k) for r in runs) for k in ("backward_s", "wait_s", "step_s")}})
    return rows
