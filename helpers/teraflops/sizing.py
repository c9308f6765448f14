"""Problem sizes chosen from the machine, so every notebook runs everywhere.

A notebook asks ``preset()`` for its sizes and never hard-codes one: on a CPU the sizes keep a
lecture under a few minutes (the Triton interpreter runs kernels with NumPy, ~10^4× slower
than a GPU); on a GPU they are large enough to show real behaviour, including naive attention
running out of memory. ``TERAFLOPS_PRESET=cpu|gpu|tiny`` overrides the choice (``tiny`` is for
smoke tests of the notebooks' code paths).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .machine import detect
from .placement import Placement, place

MiB = 2**20


@dataclass(frozen=True)
class Preset:
    """Sizes for the course's measurements (element counts unless named ``*_bytes``)."""

    name: str
    device: str
    dtype: torch.dtype  # dtype of the roofline and matmul probes
    probe_matmul_n: int
    probe_copy_bytes: int
    matmul_sizes: tuple[int, ...]  # square matmuls on the roofline
    elementwise_numel: int  # add, copy, softmax (rows × 1024 columns) on the roofline
    launch_sizes: tuple[int, ...]  # numel sweep for launch overhead
    attn_batch: int
    attn_heads: int
    attn_head_dim: int
    attn_dtype: torch.dtype  # fp32 on CPU: the Triton interpreter has no bf16
    attn_seq_lens: tuple[int, ...]
    block_d_model: int  # transformer block profiled in Unit 1
    block_heads: int
    block_seq: int
    block_batch: int
    min_run_time: float  # seconds per benchmark() call
    # Unit 2: the small GPT trained data-parallel (models.GPT) and its runs
    gpt_vocab: int = 256
    gpt_d_model: int = 128
    gpt_layers: int = 2
    gpt_heads: int = 4
    gpt_seq_len: int = 64
    dp_micro_batch: int = 4  # sequences per rank per step
    zero_steps: int = 4  # training steps per ZeRO stage (the first is warm-up, left out of timings and comms)
    dp_ranks_cpu: int = 2  # ranks on a CPU machine; with GPUs, one rank per GPU
    # Unit 2 §3-4, stale updates and overlapped all-reduce (data_parallel.py): a GPT with few tokens
    # per parameter, so that the gradient all-reduce is a visible part of a step (heads: gpt_heads,
    # sequences per rank: dp_micro_batch)
    dp_vocab: int = 64
    dp_d_model: int = 256
    dp_layers: int = 2
    dp_seq_len: int = 16
    dp_lr: float = 1e-3  # Adam
    dp_steps: int = 50  # training steps per staleness τ
    dp_overlap_steps: int = 16  # training steps per overlap mode
    dp_bucket_mb: float = 2.0  # DDP bucket_cap_mb (MiB): the CPU model's 6.4 MB of gradients make 4 buckets
    # Unit 3: synchronous data parallelism with an injected straggler (stragglers.py) and elastic
    # recovery (elastic.py), on the GPT of gpt_* sizes
    straggler_ranks_cpu: int = 4  # ranks on a CPU machine; with GPUs, one rank per GPU
    straggler_micro_batch: int = 4  # sequences per rank per step (before rebalancing)
    straggler_steps: int = 16  # timed steps per injection setting (after warm-up steps)
    straggler_delays_ms: tuple[int, ...] = (0, 50, 100, 200)  # constant delay sweep, ms per step
    straggler_lr: float = 0.3  # SGD with momentum 0.9 (local SGD at k = 1 equals synchronous DP only for SGD)
    elastic_steps: int = 30  # training steps of the elastic-recovery demo
    elastic_checkpoint_every: int = 5  # steps between (atomic) checkpoints
    elastic_kill_step: int = 17  # the step at which one rank is killed
    # Unit 4 §1-2: token-by-token decode with a static KV cache (decode.py) on a models.Llama of these
    # sizes (decode.decode_model); CPU sizes keep the lecture, a cold torch.compile (~20-25 s on two
    # cores) included, to a minute or two
    decode_vocab: int = 1024
    decode_d_model: int = 256
    decode_layers: int = 4
    decode_heads: int = 4
    decode_max_seq_len: int = 256  # KV-cache positions
    decode_prompt_len: int = 16
    decode_new_tokens: int = 64  # greedy tokens per generate() call
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # batch sweep of one decode step
    decode_fit_batch: int = 64  # the largest batch meant to fit (Unit 6's batched decode); on a GPU the sweep's
    # last batch is one past the whole memory, its out-of-memory step (gpu_fit.fit_preset)
    # Unit 5 §1: the collective bandwidth sweep (collectives.py): float32 messages of powers of two
    # from collective_min_bytes to collective_max_bytes (capped by the memory free at run time), each
    # timed over volume_bytes / size iterations, clamped to [collective_min_iters, collective_iters],
    # after collective_warmup untimed ones. CPU sizes keep the 3-collective sweep (4 gloo ranks on
    # two cores) near 30 s, the ~10 s launch included
    collective_ranks_cpu: int = 4  # ranks on a CPU machine; with GPUs, one rank per GPU
    collective_min_bytes: int = 1024
    collective_max_bytes: int = 64 * MiB
    collective_iters: int = 20  # nccl-tests' default -n 20
    collective_min_iters: int = 3
    collective_warmup: int = 2
    collective_volume_bytes: int = 256 * MiB
    # Unit 5 §2: remedies for communication (remedies.py): DDP with gradient accumulation and compression
    # hooks, on the GPT of dp_* sizes (bucket_cap_mb dp_bucket_mb); each setting trains on the same
    # remedy_micro_batches micro-batches (dp_micro_batch sequences per rank each; a multiple of remedy_accum)
    remedy_ranks_cpu: int = 4  # ranks on a CPU machine; with GPUs, one rank per GPU
    remedy_micro_batches: int = 32
    remedy_accum: int = 4  # k: micro-batches per optimizer step when accumulating
    remedy_powersgd_rank: int = 2  # PowerSGD matrix_approximation_rank
    remedy_powersgd_start: int = 2  # PowerSGD start_powerSGD_iter (plain all-reduce before; >= 2)
    # Unit 5: copy probes of the bandwidth ladder (ceilings.bandwidth_ladder) and of k streams sharing one
    # link (contention.sweep). Buffers far beyond the last-level cache (32 MiB of L3 on the course's CPU
    # machine; 50-60 MB of L2 on an H100 / H200), so that the copies measure memory and links, not caches
    # (tiny's buffers fit in that cache: they only run the code paths)
    ladder_bytes: int = 64 * MiB  # bytes per copy of each rung
    contention_bytes: int = 64 * MiB  # bytes of each stream's buffer (src + dst: 2 × per stream, 1 GiB at k = 8)
    contention_seconds: float = 0.8  # length of one round of the contention sweep, s


PRESETS = {
    "tiny": Preset("tiny", "cpu", torch.float32, 256, 16 * MiB, (32, 256), 1 << 18, (1, 1 << 10, 1 << 16),
                   1, 2, 32, torch.float32, (64, 128), 64, 2, 32, 2, 0.02, gpt_d_model=64, gpt_seq_len=32, zero_steps=3,
                   dp_d_model=64, dp_steps=6, dp_overlap_steps=4, dp_bucket_mb=0.05,
                   straggler_steps=4, straggler_delays_ms=(0, 50), elastic_steps=8, elastic_checkpoint_every=3,
                   elastic_kill_step=5, decode_vocab=256, decode_d_model=64, decode_layers=2, decode_heads=2,
                   decode_max_seq_len=32, decode_prompt_len=4, decode_new_tokens=8, decode_batches=(1, 2, 4), decode_fit_batch=4,
                   collective_ranks_cpu=2, collective_max_bytes=4 * MiB, collective_iters=5,
                   collective_min_iters=2, collective_warmup=1, remedy_micro_batches=16,
                   ladder_bytes=8 * MiB, contention_bytes=4 * MiB, contention_seconds=0.1),
    "cpu": Preset("cpu", "cpu", torch.float32, 1024, 128 * MiB, (16, 64, 256, 1024), 1 << 24,
                  (1, 1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 22), 1, 2, 32, torch.float32,
                  (128, 256, 512, 1024), 256, 4, 128, 4, 0.1),
    "gpu": Preset("gpu", "cuda", torch.bfloat16, 8192, 2048 * MiB, (64, 256, 1024, 4096, 8192), 1 << 28,
                  (1, 1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26), 4, 16, 64, torch.float16,
                  (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536), 2048, 16, 2048, 8, 0.2,
                  gpt_vocab=32768, gpt_d_model=1024, gpt_layers=8, gpt_heads=16, gpt_seq_len=1024, dp_micro_batch=8,
                  zero_steps=6, dp_vocab=4096, dp_d_model=1024, dp_layers=8, dp_seq_len=256, dp_lr=3e-4,
                  dp_steps=100, dp_overlap_steps=30, dp_bucket_mb=25.0, straggler_micro_batch=8, straggler_lr=0.05,
                  straggler_steps=30, elastic_steps=60, elastic_checkpoint_every=10, elastic_kill_step=33,
                  decode_vocab=32768, decode_d_model=2048, decode_layers=16, decode_heads=16, decode_max_seq_len=1024,
                  decode_prompt_len=128, decode_new_tokens=256, decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                  decode_fit_batch=256,
                  collective_max_bytes=8192 * MiB, collective_warmup=5, collective_volume_bytes=1 << 40,
                  remedy_micro_batches=64, ladder_bytes=256 * MiB, contention_bytes=256 * MiB,
                  contention_seconds=0.5),
}


@dataclass(frozen=True)
class TrainConfig:
    """The GPT (:class:`teraflops.models.GPT`), batch and optimizer of a training run on ranks, as a
    rank program's Spec carries it (built from a preset by :func:`dp_config` or :func:`gpt_config`;
    :mod:`teraflops.workers.common` builds the model and data from it).

    Attributes:
        vocab, d_model, layers, heads, seq_len: the GPT's sizes (tokens, channels, blocks, heads, positions).
        micro_batch: sequences per rank per step.
        lr: the optimizer's learning rate (which optimizer: the rank program's).
        seed: seed of the initial weights (the data uses ``seed + 1`` or ``seed``, per rank program).
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    seq_len: int
    micro_batch: int
    lr: float
    seed: int = 0


def dp_config(p: Preset) -> TrainConfig:
    """Unit 2 §3-4's and Unit 5 §2's GPT: the ``dp_*`` sizes, ``gpt_heads``, ``dp_micro_batch``, ``dp_lr``."""
    return TrainConfig(vocab=p.dp_vocab, d_model=p.dp_d_model, layers=p.dp_layers, heads=p.gpt_heads,
                       seq_len=p.dp_seq_len, micro_batch=p.dp_micro_batch, lr=p.dp_lr)


def gpt_config(p: Preset, micro_batch: int, lr: float) -> TrainConfig:
    """The ``gpt_*`` GPT with ``micro_batch`` sequences per rank and learning rate ``lr``."""
    return TrainConfig(vocab=p.gpt_vocab, d_model=p.gpt_d_model, layers=p.gpt_layers, heads=p.gpt_heads,
                       seq_len=p.gpt_seq_len, micro_batch=micro_batch, lr=lr)


def preset(name: str | None = None) -> Preset:
    """The preset for this machine (``"gpu"`` with CUDA, else ``"cpu"``), or the one named. The GPU
    preset is fitted to the GPU's memory and compute capability (:func:`teraflops.gpu_fit.fit_preset`).

    Raises:
        ValueError: unknown name (in the argument or ``TERAFLOPS_PRESET``).
    """
    name = name or os.environ.get("TERAFLOPS_PRESET") or ("gpu" if detect().device == "cuda" else "cpu")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[name]
    if p.device == "cuda":
        gpus = detect().gpus
        if not gpus:
            raise ValueError(f"preset {name!r} needs a CUDA GPU and none is visible")
        from .gpu_fit import fit_preset

        p = fit_preset(p, min(gpus, key=lambda g: g.memory_bytes))  # sized for the smallest GPU a rank may get
    return p



@dataclass(frozen=True)
class DataParallelPlan:
    """How a data-parallel run is laid out on this machine: a :class:`~teraflops.placement.Placement`
    (ranks, backend, each rank's device and environment) and the preset whose sizes the ranks use
    (the CPU preset's for CPU ranks on a GPU machine)."""

    placement: Placement
    preset: Preset

    @property
    def ranks(self) -> int:
        return self.placement.world_size

    @property
    def env(self) -> dict:
        """What every rank's environment gets (:attr:`Placement.env`)."""
        return self.placement.env

    @property
    def note(self) -> str:
        return self.placement.note


def data_parallel_plan(p: Preset | None = None, ranks_cpu: int | None = None, *, min_ranks: int = 2,
                       cluster=None, machine=None) -> DataParallelPlan:
    """One rank per GPU with NCCL when there are at least two GPUs (and at least ``min_ranks``);
    otherwise ``ranks_cpu`` (default the preset's ``dp_ranks_cpu``) CPU ranks with gloo, the GPUs
    hidden, and the CPU preset's sizes (:func:`teraflops.placement.place` decides; ``cluster``
    spreads the ranks over emulated nodes). A preset for the CPU asks for CPU ranks.

    Raises:
        PlacementError: the ranks cannot be placed (too few, not a multiple of the nodes).
    """
    p = p or preset()
    cpu = p if p.device == "cpu" else PRESETS["cpu"]
    where = place(None, cpu_ranks=ranks_cpu or cpu.dp_ranks_cpu, min_ranks=min_ranks, cluster=cluster,
                  gpus=p.device == "cuda", machine=machine)
    return DataParallelPlan(where, p if where.on_gpus else cpu)
