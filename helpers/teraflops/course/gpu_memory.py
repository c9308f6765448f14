"""Every GPU-preset workload's memory per rank, measured without a GPU, against :mod:`teraflops.gpu_fit`'s model.

For each GPU class of :data:`GPUS` (a 16 GB T4, a 24 GB card, an 80 GB H100, a 141 GB H200) and
each world size of :data:`WORLDS` (1, 2 and 8 GPUs, one rank per GPU), the GPU preset is fitted
(:func:`teraflops.gpu_fit.fit_preset`) and what a rank of each workload holds at once is built and
run under :func:`teraflops.memory.fake_memory` (FakeTensorMode: shapes, no data): the models, optimizer
states and buffers the worker builds, as it builds them (the same :mod:`teraflops.workers.common`
helpers), two training steps (the second one's optimizer states live) and the evaluation. The peak of
live bytes is compared with the model's bytes and with the budget (:func:`teraflops.gpu_fit.budget_bytes`:
80 % of the memory, less the CUDA context and NCCL reserve). Collectives are in-place on buffers the
rank holds (NCCL's own buffers are in the reserve), so an all-reduce adds nothing the fake run could see.

Measured here: the workloads whose memory is a model's (:data:`MEASURED`); the buffer-only ones (probes,
roofline, attention, copies) and DeepSpeed's ZeRO stages (DeepSpeed cannot run under FakeTensorMode) keep
their model only, and :func:`table` says so. ``docs/gpu_memory.md`` is :func:`markdown`'s output
(``python -m teraflops.course.gpu_memory > docs/gpu_memory.md``; ``tests/test_gpu_memory.py`` checks it
is current and that every measured peak fits its model and its budget). GB = 1e9.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from teraflops import gpu_fit
from teraflops.machine import GPU
from teraflops.memory import fake_memory
from teraflops.models import Llama, lm_loss
from teraflops.sizing import PRESETS, dp_config, gpt_config
from teraflops.workers.common import build_model, flat_grads, held_out_loss, set_grads

GiB = 2**30
# total memory as torch reports it, compute capability (tests/test_gpu_fit.py's classes)
GPUS = {"T4 16 GB": GPU(0, "Tesla T4", int(14.75 * GiB), (7, 5)),
        "L4 24 GB": GPU(0, "NVIDIA L4", int(22.5 * GiB), (8, 9)),
        "H100 80 GB": GPU(0, "NVIDIA H100 80GB HBM3", int(79.1 * GiB), (9, 0)),
        "H200 141 GB": GPU(0, "NVIDIA H200", int(139.8 * GiB), (9, 0))}
WORLDS = (1, 2, 8)
MEASURED = ("stragglers (one setting, rebalanced, evaluation)", "elastic (GPT, Adam)", "stale gradients (τ sweep)",
            "remedies (DDP, every setting)", "decode at the largest batch that fits", "collectives (largest message)")


def _tokens(rows: int, seq: int) -> torch.Tensor:
    return torch.zeros(rows, seq, dtype=torch.int64)


def _train_steps(model, opt, x, steps: int = 2, flat: bool = False) -> None:
    params = list(model.parameters())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), x).backward()
        if flat:  # the straggler worker: one flat buffer for the all-reduce, the grads viewing it
            set_grads(params, flat_grads(params))
        opt.step()


@lru_cache(maxsize=None)
def _straggler(gpt: tuple, micro_batch: int, eval_micro_batch: int, world: int, momentum: float = 0.9) -> int:
    cfg = gpt_config(PRESETS["gpu"], eval_micro_batch, 0.05)
    cfg = type(cfg)(*gpt, micro_batch=eval_micro_batch, lr=0.05)
    with fake_memory() as mem:
        model = build_model(cfg)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=momentum)
        _train_steps(model, opt, _tokens(micro_batch, cfg.seq_len), flat=True)
        rows = (2 + cfg.eval_batches) * world * cfg.micro_batch
        held_out_loss(model, (_tokens(rows, cfg.seq_len), _tokens(rows, cfg.seq_len)), cfg, 2, world, "cpu")
        return mem.peak


@lru_cache(maxsize=None)
def _adam(gpt: tuple, micro_batch: int, models: int = 1, in_flight: int = 0, bucket: bool = False) -> int:
    """``models`` GPTs with Adam built at once (the workers' settings), ``in_flight`` flat gradients more,
    DDP's bucket per model if ``bucket``; two training steps of each."""
    cfg = type(dp_config(PRESETS["gpu"]))(*gpt, micro_batch=micro_batch, lr=1e-3)
    with fake_memory() as mem:
        runs = []
        for _ in range(models):
            model = build_model(cfg)
            buckets = torch.empty(model.num_params()) if bucket else None  # DDP's gradient buckets
            runs.append((model, torch.optim.Adam(model.parameters(), lr=cfg.lr), buckets))
        queue = [torch.empty(runs[0][0].num_params()) for _ in range(in_flight)]  # stale gradients in flight
        for model, opt, _ in runs:
            _train_steps(model, opt, _tokens(micro_batch, cfg.seq_len))
        del queue
        return mem.peak


@lru_cache(maxsize=None)
def _decode(vocab: int, d_model: int, layers: int, heads: int, positions: int, prompt: int, batch: int) -> int:
    with fake_memory() as mem:
        model = Llama(vocab, d_model, layers, heads, positions)  # fp32, as notebook 04 builds it
        cache = model.new_cache(batch)
        with torch.no_grad():
            model(_tokens(batch, prompt))  # the prefill's logits
        del cache
        return mem.peak


def _collectives(max_bytes: int) -> int:
    with fake_memory() as mem:
        bufs = [torch.empty(max_bytes // 4) for _ in range(3)]  # send, receive, reference
        del bufs
        return mem.peak


def _gpt(s) -> tuple:
    return (s.vocab, s.d_model, s.layers, s.heads, s.seq_len)


def measure(p, world: int) -> dict[str, int]:
    """Peak live bytes per rank of each workload of :data:`MEASURED` at the fitted preset ``p`` with ``world`` ranks."""
    d = p.decode
    return {
        MEASURED[0]: _straggler(_gpt(p.gpt), gpu_fit.rebalanced_micro_batch(p.straggler.micro_batch, world),
                                p.straggler.micro_batch, world),
        MEASURED[1]: _adam(_gpt(p.gpt), p.straggler.micro_batch),
        MEASURED[2]: _adam(_gpt(p.comm_gpt), p.dp.micro_batch, models=4, in_flight=sum(t + 1 for t in (0, 1, 4, 16))),
        MEASURED[3]: _adam(_gpt(p.comm_gpt), p.dp.micro_batch, models=gpu_fit.REMEDY_SETTINGS, bucket=True),
        MEASURED[4]: _decode(d.vocab, d.d_model, d.layers, d.heads, d.max_seq_len, d.prompt_len, d.fit_batch),
        MEASURED[5]: _collectives(p.collective.max_bytes),
    }


@dataclass(frozen=True)
class Row:
    """One workload on one GPU class and world size: bytes measured (None: model only), modelled, budget."""

    gpu: str
    world: int
    workload: str
    measured: int | None
    model: int
    budget: int

    @property
    def fits(self) -> bool:
        return (self.measured is None or self.measured <= self.model) and self.model <= self.budget


def table() -> list[Row]:
    """Every workload × :data:`GPUS` × :data:`WORLDS` (a few seconds per distinct size; cached)."""
    rows = []
    for name, gpu in GPUS.items():
        for world in WORLDS:
            p = gpu_fit.fit_preset(PRESETS["gpu"], gpu, world=world)
            model, measured = gpu_fit.workload_bytes(p, world), measure(p, world)
            budget = gpu_fit.budget_bytes(gpu, world)
            rows += [Row(name, world, w, measured.get(w), b, budget) for w, b in model.items()]
    return rows


def markdown(rows: list[Row] | None = None) -> str:
    """The table as Markdown (``docs/gpu_memory.md``)."""
    rows = table() if rows is None else rows
    out = ["# GPU memory per rank at the GPU preset, measured without a GPU", "",
           "Generated by `python -m teraflops.course.gpu_memory > docs/gpu_memory.md` (module docstring:",
           "FakeTensorMode, no memory allocated); `tests/test_gpu_memory.py` checks that it is current and that",
           "every measured peak is within its model and every model within the budget (80 % of the memory, less",
           "1 GiB for the CUDA context and, with several ranks, 256 MiB of NCCL buffers). GB = 1e9; `model only`:",
           "not measured (buffers only, or DeepSpeed).", "",
           "| GPU | GPUs | workload | measured GB | model GB | budget GB | fits |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        m = "model only" if r.measured is None else f"{r.measured / 1e9:.2f}"
        out.append(f"| {r.gpu} | {r.world} | {r.workload} | {m} | {r.model / 1e9:.2f} | {r.budget / 1e9:.1f} | "
                   f"{'yes' if r.fits else 'NO'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
