"""Problem sizes chosen from the machine, so every notebook runs everywhere.

A notebook asks ``preset()`` for its sizes and never hard-codes one: on a CPU the sizes keep a
lecture under a few minutes (the Triton interpreter runs kernels with NumPy, ~10^4× slower
than a GPU); on a GPU they are large enough to show real behaviour, including naive attention
running out of memory. ``TERAFLOPS_PRESET=cpu|gpu|tiny`` overrides the choice.

``tiny`` is for smoke tests of the notebooks' code paths, not for reading numbers: its problems are so
small that timings are dominated by launch overhead and noise (on a busy machine they can contradict a
lecture's story). It shortens Units 0, 1, 4 and 6 to under a minute each but not Units 2, 3 and 5, whose
time is mostly process launches, emulated nodes and Slurm (~2.5 min each at ``tiny`` on the course's
2-core CPU machine, measured under load). For one failure mode at a size that tells the story, use
``teraflops demo`` (:mod:`teraflops.course.demo`).

Each unit's sizes are one frozen, keyword-only record (:class:`ZeroSizes`, :class:`DecodeSizes`, ...);
a :class:`Preset` composes them by name (``p.zero.steps``, ``p.gpt.d_model``). The CPU preset spells
every value; ``tiny`` and ``gpu`` are the CPU preset with some units replaced (``dataclasses.replace``).
They live here rather than beside each unit's module because those modules import this one.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from teraflops.errors import CourseError
from teraflops.gpu_fit import fit_preset, gpu_share
from teraflops.machine import detect

MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class ProbeSizes:
    """Unit 0's ceiling probes (:func:`teraflops.ceilings.measure_ceilings`).

    Attributes:
        matmul_n: side of the square matmul timed for the peak FLOP/s (elements).
        copy_bytes: bytes of the tensor copied for the memory bandwidth, far beyond the last-level cache.
    """

    matmul_n: int
    copy_bytes: int


@dataclass(frozen=True, kw_only=True)
class RooflineSizes:
    """Unit 1's roofline (:func:`teraflops.model_definition.roofline.measure_roofline`) and launch-overhead sweeps
    (:mod:`teraflops.model_definition.launch_overhead`).

    Attributes:
        matmul_sizes: sides of the square matmuls on the roofline (elements).
        elementwise_numel: elements of add, copy and softmax (rows × 1024 columns) on the roofline.
        launch_sizes: the numel sweep of the launch-overhead measurement (elements).
    """

    matmul_sizes: tuple[int, ...]
    elementwise_numel: int
    launch_sizes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AttentionSizes:
    """Unit 1's attention sweep (:func:`teraflops.model_definition.attention.attention_sweep`): q, k, v of shape
    ``(batch, heads, N, head_dim)`` for each ``N`` of ``seq_lens``.

    Attributes:
        batch, heads, head_dim: the first, second and last dimensions of q, k, v.
        dtype: their dtype (fp32 on CPU: the Triton interpreter has no bf16).
        seq_lens: the sequence lengths ``N`` of the sweep (positions).
    """

    batch: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    seq_lens: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """The transformer block profiled in Unit 1 (:class:`teraflops.models.TransformerBlock`), input
    ``(batch, seq, d_model)``.

    Attributes:
        d_model: channels.
        heads: attention heads.
        seq: positions per sequence.
        batch: sequences.
    """

    d_model: int
    heads: int
    seq: int
    batch: int


@dataclass(frozen=True, kw_only=True)
class GPTSizes:
    """A :class:`teraflops.models.GPT` (its constructor's arguments, in its order).

    Attributes:
        vocab: tokens in the vocabulary.
        d_model: channels.
        layers: transformer blocks.
        heads: attention heads per block.
        seq_len: positions per sequence.
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    seq_len: int


@dataclass(frozen=True, kw_only=True)
class DataParallelSizes:
    """Unit 2's data-parallel runs: the ranks and batch shared by ZeRO (:mod:`teraflops.parallelization.zero`), stale
    updates and overlapped all-reduce (:mod:`teraflops.parallelization.ddp_sync`) and Unit 5's remedies
    (:mod:`teraflops.hardware.remedies`), and the staleness and overlap experiments' own sizes.

    Attributes:
        ranks_cpu: ranks on a CPU machine (with GPUs, one rank per GPU).
        micro_batch: sequences per rank per step.
        lr: Adam's learning rate (staleness, overlap, remedies, elastic recovery).
        steps: training steps per staleness τ.
        overlap_steps: training steps per overlap mode.
        bucket_mb: DDP's ``bucket_cap_mb`` (MiB) of the overlap and remedies runs.
    """

    ranks_cpu: int
    micro_batch: int
    lr: float
    steps: int
    overlap_steps: int
    bucket_mb: float


@dataclass(frozen=True, kw_only=True)
class ZeroSizes:
    """Unit 2's ZeRO stages (:mod:`teraflops.parallelization.zero`), on :attr:`Preset.gpt` with
    :attr:`DataParallelSizes.micro_batch` sequences per rank.

    Attributes:
        steps: training steps per ZeRO stage (the first is warm-up, left out of timings and comms).
    """

    steps: int


@dataclass(frozen=True, kw_only=True)
class StragglerSizes:
    """Unit 3's synchronous data parallelism with an injected straggler (:mod:`teraflops.orchestration.stragglers`),
    on :attr:`Preset.gpt`; its ranks and micro-batch are also the elastic demo's and the rank traces'.

    Attributes:
        ranks_cpu: ranks on a CPU machine (with GPUs, one rank per GPU).
        micro_batch: sequences per rank per step (before rebalancing).
        steps: timed steps per injection setting (after warm-up steps).
        delays_ms: the constant-delay sweep (ms per step).
        lr: SGD's learning rate, momentum 0.9 (local SGD at k = 1 equals synchronous DP only for SGD).
    """

    ranks_cpu: int
    micro_batch: int
    steps: int
    delays_ms: tuple[int, ...]
    lr: float


@dataclass(frozen=True, kw_only=True)
class ElasticSizes:
    """Unit 3's elastic recovery (:mod:`teraflops.orchestration.elastic`), on :attr:`Preset.gpt` with
    :attr:`StragglerSizes.micro_batch` sequences per rank and :attr:`DataParallelSizes.lr`.

    Attributes:
        steps: training steps of the demo.
        checkpoint_every: steps between (atomic) checkpoints.
        kill_step: the step at which one rank is killed.
    """

    steps: int
    checkpoint_every: int
    kill_step: int


@dataclass(frozen=True, kw_only=True)
class DecodeSizes:
    """Unit 4's token-by-token decode with a static KV cache (:mod:`teraflops.compilation.decode`) on a
    :class:`teraflops.models.Llama` of these sizes (:func:`teraflops.compilation.decode.decode_model`).

    Attributes:
        vocab, d_model, layers, heads: the Llama's tokens, channels, blocks and attention heads.
        max_seq_len: KV-cache positions.
        prompt_len: prompt tokens.
        new_tokens: greedy tokens per ``generate()`` call.
        batches: the batch sweep of one decode step (sequences).
        fit_batch: the largest batch meant to fit (Unit 6's batched decode); on a GPU the sweep's last
            batch is one past the whole memory, its out-of-memory step (:func:`teraflops.gpu_fit.fit_preset`).
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    max_seq_len: int
    prompt_len: int
    new_tokens: int
    batches: tuple[int, ...]
    fit_batch: int


@dataclass(frozen=True, kw_only=True)
class CollectiveSizes:
    """Unit 5 §1's collective bandwidth sweep (:mod:`teraflops.hardware.collectives`): float32 messages of
    powers of two from ``min_bytes`` to ``max_bytes`` (capped by the memory free at run time), each
    timed over ``volume_bytes / size`` iterations clamped to ``[min_iters, iters]``, after ``warmup``
    untimed ones.

    Attributes:
        ranks_cpu: ranks on a CPU machine (with GPUs, one rank per GPU).
        min_bytes, max_bytes: the smallest and largest message (bytes).
        iters, min_iters: the most and fewest timed iterations per size.
        warmup: untimed iterations per size.
        volume_bytes: bytes timed per size (sets the iterations between the two bounds).
    """

    ranks_cpu: int
    min_bytes: int
    max_bytes: int
    iters: int
    min_iters: int
    warmup: int
    volume_bytes: int


@dataclass(frozen=True, kw_only=True)
class RemedySizes:
    """Unit 5 §2's remedies for communication (:mod:`teraflops.hardware.remedies`): DDP with gradient
    accumulation and compression hooks, on :attr:`Preset.comm_gpt` (``bucket_cap_mb``
    :attr:`DataParallelSizes.bucket_mb`); each setting trains on the same ``micro_batches``
    micro-batches of :attr:`DataParallelSizes.micro_batch` sequences per rank.

    Attributes:
        ranks_cpu: ranks on a CPU machine (with GPUs, one rank per GPU).
        micro_batches: micro-batches per setting (a multiple of ``accum``).
        accum: k, micro-batches per optimizer step when accumulating.
        powersgd_rank: PowerSGD's ``matrix_approximation_rank``.
        powersgd_start: PowerSGD's ``start_powerSGD_iter`` (plain all-reduce before it; >= 2).
    """

    ranks_cpu: int
    micro_batches: int
    accum: int
    powersgd_rank: int
    powersgd_start: int


@dataclass(frozen=True, kw_only=True)
class CopySizes:
    """Unit 5's copy probes: the bandwidth ladder (:func:`teraflops.ceilings.bandwidth_ladder`) and k
    streams sharing one link (:func:`teraflops.hardware.contention.sweep`). Buffers far beyond the last-level
    cache (32 MiB of L3 on the course's CPU machine; 50-60 MB of L2 on an H100 / H200), so that the
    copies measure memory and links, not caches (tiny's buffers fit in that cache: they only run the
    code paths).

    Attributes:
        ladder_bytes: bytes per copy of each rung of the ladder.
        contention_bytes: bytes of each stream's buffer (src + dst: 2 × per stream, 1 GiB at k = 8 on a GPU).
        contention_seconds: length of one round of the contention sweep (s).
    """

    ladder_bytes: int
    contention_bytes: int
    contention_seconds: float


@dataclass(frozen=True, kw_only=True)
class ModelParallelSizes:
    """Unit 2's model parallelism (:mod:`teraflops.parallelization.tensor_parallel`,
    :mod:`teraflops.parallelization.pipeline`) and recomputation (:mod:`teraflops.model_definition.recompute`).

    Attributes:
        gpt: the GPT split over ranks. Activation-heavy on purpose (``batch · seq_len`` tokens ≫
            ``3 · d_model``): TP's bytes per step grow with the tokens, DP's with the parameters.
        batch: global batch of the TP runs (sequences; every TP rank sees all of them).
        tp_degrees: TP degrees of the sweep (each divides ``gpt.heads``).
        steps, warmup: timed and untimed steps per mode.
        pp_stages: pipeline ranks; ``pp_layers``: blocks of the pipeline's GPT (``gpt`` otherwise);
            ``pp_micro_batches``: the micro-batch counts of the bubble sweep; ``pp_micro_batch``:
            sequences per micro-batch; ``pp_stage_sweep``: the stage counts of the bubble's sweep over
            depth (each at most ``pp_layers``: one block per stage at the most).
        recompute_batches: batches (sequences) of the recomputation sweep on ``gpt``.
    """

    gpt: GPTSizes
    batch: int
    tp_degrees: tuple[int, ...]
    steps: int
    warmup: int
    pp_stages: int
    pp_layers: int
    pp_micro_batches: tuple[int, ...]
    pp_micro_batch: int
    recompute_batches: tuple[int, ...]
    pp_stage_sweep: tuple[int, ...] = (2, 4)


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Sizes for the course's measurements, one sizes record per unit (element counts unless named
    ``*_bytes``): ``p.zero.steps``, ``p.gpt.d_model``, ...

    Attributes:
        name: the preset's name (a key of :data:`PRESETS`).
        device: ``"cpu"`` or ``"cuda"``.
        dtype: dtype of the roofline and matmul probes.
        min_run_time: seconds per ``benchmark()`` call of Unit 1's sweeps.
        gpt: Unit 2's small GPT (ZeRO), also Unit 3's (stragglers, elastic recovery, rank traces).
        comm_gpt: a GPT with few tokens per parameter, so that the gradient all-reduce is a visible part
            of a step: Unit 2 §3-4 (stale updates, overlapped all-reduce) and Unit 5 §2 (remedies).
    """

    name: str
    device: str
    dtype: torch.dtype
    min_run_time: float
    probe: ProbeSizes
    roofline: RooflineSizes
    attention: AttentionSizes
    block: BlockSizes
    gpt: GPTSizes
    comm_gpt: GPTSizes
    dp: DataParallelSizes
    zero: ZeroSizes
    straggler: StragglerSizes
    elastic: ElasticSizes
    decode: DecodeSizes
    collective: CollectiveSizes
    remedy: RemedySizes
    copies: CopySizes
    mp: ModelParallelSizes


# The CPU preset keeps a lecture under a few minutes on the course's two-core CPU machine; tiny and
# gpu replace the sizes they change.
_CPU = Preset(
    name="cpu", device="cpu", dtype=torch.float32, min_run_time=0.1,
    probe=ProbeSizes(matmul_n=1024, copy_bytes=128 * MiB),
    roofline=RooflineSizes(matmul_sizes=(16, 64, 256, 1024), elementwise_numel=1 << 24,
                           launch_sizes=(1, 1 << 8, 1 << 12, 1 << 16, 1 << 20, 1 << 22)),
    attention=AttentionSizes(batch=1, heads=2, head_dim=32, dtype=torch.float32, seq_lens=(128, 256, 512, 1024)),
    block=BlockSizes(d_model=256, heads=4, seq=128, batch=4),
    gpt=GPTSizes(vocab=256, d_model=128, layers=2, heads=4, seq_len=64),
    comm_gpt=GPTSizes(vocab=64, d_model=256, layers=2, heads=4, seq_len=16),  # heads: gpt's in every preset
    # bucket_mb: the CPU comm_gpt's 6.4 MB of gradients make 4 buckets
    dp=DataParallelSizes(ranks_cpu=2, micro_batch=4, lr=1e-3, steps=50, overlap_steps=16, bucket_mb=2.0),
    zero=ZeroSizes(steps=4),
    straggler=StragglerSizes(ranks_cpu=4, micro_batch=4, steps=16, delays_ms=(0, 50, 100, 200), lr=0.3),
    elastic=ElasticSizes(steps=30, checkpoint_every=5, kill_step=17),
    # a minute or two of decode lecture on two cores, a cold torch.compile (~20-25 s) included
    decode=DecodeSizes(vocab=1024, d_model=256, layers=4, heads=4, max_seq_len=256, prompt_len=16, new_tokens=64,
                       batches=(1, 2, 4, 8, 16, 32, 64), fit_batch=64),
    # the 3-collective sweep (4 gloo ranks on two cores) near 30 s, the ~10 s launch included;
    # iters: nccl-tests' default -n 20
    collective=CollectiveSizes(ranks_cpu=4, min_bytes=1024, max_bytes=64 * MiB, iters=20, min_iters=3, warmup=2,
                               volume_bytes=256 * MiB),
    remedy=RemedySizes(ranks_cpu=4, micro_batches=32, accum=4, powersgd_rank=2, powersgd_start=2),
    copies=CopySizes(ladder_bytes=64 * MiB, contention_bytes=64 * MiB, contention_seconds=0.8),
    # 64 × 128 tokens, width 64: TP hands 16 MiB per step to all-reduce, DP 0.44 MB
    mp=ModelParallelSizes(gpt=GPTSizes(vocab=64, d_model=64, layers=2, heads=4, seq_len=128), batch=64,
                          tp_degrees=(1, 2, 4), steps=3, warmup=1, pp_stages=2, pp_layers=4,
                          pp_micro_batches=(1, 4, 8, 16), pp_micro_batch=16, recompute_batches=(4, 8, 16)),
)

PRESETS = {
    # smoke tests of the notebooks' code paths
    "tiny": replace(
        _CPU, name="tiny", min_run_time=0.02,
        probe=ProbeSizes(matmul_n=256, copy_bytes=16 * MiB),
        roofline=RooflineSizes(matmul_sizes=(32, 256), elementwise_numel=1 << 18, launch_sizes=(1, 1 << 10, 1 << 16)),
        attention=replace(_CPU.attention, seq_lens=(64, 128)),
        block=BlockSizes(d_model=64, heads=2, seq=32, batch=2),
        gpt=replace(_CPU.gpt, d_model=64, seq_len=32),
        comm_gpt=replace(_CPU.comm_gpt, d_model=64),
        dp=replace(_CPU.dp, steps=6, overlap_steps=4, bucket_mb=0.05),
        zero=ZeroSizes(steps=3),
        straggler=replace(_CPU.straggler, steps=4, delays_ms=(0, 50)),
        elastic=ElasticSizes(steps=8, checkpoint_every=3, kill_step=5),
        decode=replace(_CPU.decode, vocab=256, d_model=64, layers=2, heads=2, max_seq_len=32, prompt_len=4,
                       new_tokens=8, batches=(1, 2, 4), fit_batch=4),
        collective=replace(_CPU.collective, ranks_cpu=2, max_bytes=4 * MiB, iters=5, min_iters=2, warmup=1),
        remedy=replace(_CPU.remedy, micro_batches=16),
        copies=CopySizes(ladder_bytes=8 * MiB, contention_bytes=4 * MiB, contention_seconds=0.1),
        mp=replace(_CPU.mp, batch=16, tp_degrees=(1, 2), steps=2, pp_micro_batches=(1, 4, 8),
                   recompute_batches=(2, 4)),
    ),
    "cpu": _CPU,
    # written for an 80 GB H100; preset() fits it to the GPU found (teraflops.gpu_fit.fit_preset)
    "gpu": replace(
        _CPU, name="gpu", device="cuda", dtype=torch.bfloat16, min_run_time=0.2,
        probe=ProbeSizes(matmul_n=8192, copy_bytes=2048 * MiB),
        roofline=RooflineSizes(matmul_sizes=(64, 256, 1024, 4096, 8192), elementwise_numel=1 << 28,
                               launch_sizes=(1, 1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)),
        attention=AttentionSizes(batch=4, heads=16, head_dim=64, dtype=torch.float16,
                                 seq_lens=(512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)),
        block=BlockSizes(d_model=2048, heads=16, seq=2048, batch=8),
        gpt=GPTSizes(vocab=32768, d_model=1024, layers=8, heads=16, seq_len=1024),
        comm_gpt=GPTSizes(vocab=4096, d_model=1024, layers=8, heads=16, seq_len=256),
        dp=replace(_CPU.dp, micro_batch=8, lr=3e-4, steps=100, overlap_steps=30, bucket_mb=25.0),
        zero=ZeroSizes(steps=6),
        straggler=replace(_CPU.straggler, micro_batch=8, steps=30, lr=0.05),
        elastic=ElasticSizes(steps=60, checkpoint_every=10, kill_step=33),
        decode=DecodeSizes(vocab=32768, d_model=2048, layers=16, heads=16, max_seq_len=1024, prompt_len=128,
                           new_tokens=256, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), fit_batch=256),
        collective=replace(_CPU.collective, max_bytes=8192 * MiB, warmup=5, volume_bytes=1 << 40),
        remedy=replace(_CPU.remedy, micro_batches=64),
        copies=CopySizes(ladder_bytes=256 * MiB, contention_bytes=256 * MiB, contention_seconds=0.5),
        mp=ModelParallelSizes(gpt=GPTSizes(vocab=4096, d_model=1024, layers=8, heads=16, seq_len=1024), batch=16,
                              tp_degrees=(1, 2, 4, 8), steps=10, warmup=3, pp_stages=4, pp_layers=8,
                              pp_micro_batches=(1, 4, 8, 16), pp_micro_batch=4, recompute_batches=(4, 8, 16, 32)),
    ),
}


class PresetError(CourseError, ValueError):
    """An unknown preset name (argument or ``TERAFLOPS_PRESET``); the message lists the presets."""


def preset_name() -> str:
    """The name of the preset in force: ``TERAFLOPS_PRESET`` if set, else the machine's (``"gpu"`` with
    CUDA, else ``"cpu"``). Raises :class:`PresetError` for an unknown ``TERAFLOPS_PRESET``."""
    env = os.environ.get("TERAFLOPS_PRESET")
    return _checked(env, "TERAFLOPS_PRESET") if env else ("gpu" if detect().device == "cuda" else "cpu")


def _checked(name: str, where: str = "preset") -> str:
    if name not in PRESETS:
        raise PresetError(f"unknown {where} {name!r}; the presets are {', '.join(PRESETS)}. "
                          "Hint: unset TERAFLOPS_PRESET to size for this machine, or set it to one of them")
    return name


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
        eval_batches: global batches held out after the trained ones, for an eval loss
            (:func:`teraflops.workers.common.held_out`).
    """

    vocab: int
    d_model: int
    layers: int
    heads: int
    seq_len: int
    micro_batch: int
    lr: float
    seed: int = 0
    eval_batches: int = 8


def dp_config(p: Preset) -> TrainConfig:
    """Unit 2 §3-4's and Unit 5 §2's GPT: ``p.comm_gpt``, ``p.dp.micro_batch`` sequences per rank, ``p.dp.lr``."""
    return TrainConfig(**asdict(p.comm_gpt), micro_batch=p.dp.micro_batch, lr=p.dp.lr)


def gpt_config(p: Preset, micro_batch: int, lr: float) -> TrainConfig:
    """``p.gpt`` with ``micro_batch`` sequences per rank and learning rate ``lr``."""
    return TrainConfig(**asdict(p.gpt), micro_batch=micro_batch, lr=lr)


def mp_config(p: Preset, batch: int | None = None) -> TrainConfig:
    """Unit 2's model-parallel GPT: ``p.mp.gpt`` with ``batch`` (default ``p.mp.batch``) sequences, SGD lr 0.01."""
    return TrainConfig(**asdict(p.mp.gpt), micro_batch=batch or p.mp.batch, lr=0.01)


def pp_config(p: Preset) -> TrainConfig:
    """Unit 2's pipeline GPT: :func:`mp_config` with ``p.mp.pp_layers`` blocks, ``p.mp.pp_micro_batch``
    sequences per micro-batch."""
    return replace(mp_config(p, p.mp.pp_micro_batch), layers=p.mp.pp_layers)


def preset(name: str | None = None) -> Preset:
    """The preset for this machine (``"gpu"`` with CUDA, else ``"cpu"``), or the one named. The GPU
    preset is fitted to the GPU's memory and compute capability (:func:`teraflops.gpu_fit.fit_preset`).

    Raises:
        PresetError: unknown name (in the argument or ``TERAFLOPS_PRESET``), one line listing the presets.
        ValueError: the GPU preset without a CUDA GPU.
    """
    name = _checked(name) if name else preset_name()
    p = PRESETS[name]
    if p.device == "cuda":
        gpus = detect().gpus
        if not gpus:
            raise ValueError(f"preset {name!r} needs a CUDA GPU and none is visible")

        smallest = min(gpus, key=lambda g: min(g.free_bytes or g.memory_bytes, g.memory_bytes))
        # sized for the smallest GPU a rank may get, one rank per GPU, this learner's share of it
        p = fit_preset(p, smallest, world=len(gpus), share=gpu_share())
    return p
