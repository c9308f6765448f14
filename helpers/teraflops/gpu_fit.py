"""The GPU preset fitted to the GPU found: memory models of every GPU-preset workload, and sizes
chosen so that each fits the device's memory with headroom.

:data:`teraflops.sizing.PRESETS` ``["gpu"]`` is written for an 80 GB H100. :func:`fit_preset` keeps its
sizes where they fit and shrinks the ones that do not, for the GPU it is given (a
:class:`teraflops.machine.GPU`: total memory in bytes, compute capability), so nothing runs out of
memory by accident on a 16 GB T4, 24 GB L4 / A10 / RTX 4090, 40 or 80 GB A100, 80 GB H100 or
141 GB H200. The two out-of-memory points the course *wants* stay: naive attention's N² scores in
the attention sweep, and one batch beyond what fits in the decode batch sweep (Unit 4's memory
ceiling).

The dtype: bf16 only where the GPU has bf16 tensor cores (sm80, Ampere, and newer: the
``bfloat16`` rows of the CUDA C Programming Guide's "Arithmetic Instructions" table; on sm75 torch
emulates it, so a bf16 roofline would measure an emulated peak); fp16 otherwise.

Memory models (bytes on one GPU, the largest point of each workload; GB = 1e9, GiB = 2**30):

* **Training a GPT** in fp32 with Adam: model states 16 B per parameter (weights 4, gradients 4,
  Adam's two moments 8; Rajbhandari et al. 2019, "ZeRO", §3.1, for fp32 training), plus activations
  ``68 · s · b · h`` bytes per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation
  in Large Transformer Models", eq. 1: ``s·b·h·34`` bytes in 16-bit without the ``5·a·s/h`` score
  term, which fused attention does not store; twice that in fp32), plus the logits and their
  gradient (``3 · b · s · V · 4`` bytes: logits, softmax and its gradient).
* **Stale gradients** (``workers/ddp_sync.py``): every τ of the sweep keeps its own model and
  Adam states (16 B/parameter each) and up to ``τ + 1`` flat fp32 gradients in flight.
* **Decode** (``decode.py``): the weights (``2`` B/parameter in 16-bit) and the static KV cache,
  ``2 · layers · batch · positions · d_model`` elements (keys and values, every head), plus the
  prefill's logits ``batch · prompt · vocab`` in fp32.
* **Collectives**: send, receive and a reference buffer of the message size (``3 · S``).
* **Remedies** (``workers/remedies.py``): all :data:`REMEDY_SETTINGS` settings are built at once, each a DDP
  model with Adam (16 B/parameter) and DDP's gradient buckets (4 B/parameter), and one setting's activations.
* **Stragglers** (``workers/straggler.py``): on GPUs one setting at a time (SGD with momentum, the
  flat gradient buffer: within 16 B/parameter), at the largest micro-batch rebalancing can give a rank
  (:func:`rebalanced_micro_batch`); the held-out evaluation runs one micro-batch at a time.
* **Decode** is built in fp32 by notebook 04 (eager and compiled tokens compare exactly): weights and
  cache at :data:`DECODE_ELEM` bytes.

The budget (:func:`budget_bytes`) is ``HEADROOM`` of the memory a learner has, less a reserve: the
GPU's free memory (not its total: another process may hold some) times its share
(``TERAFLOPS_GPU_SHARE``, e.g. ``0.25`` for four learners of a hub on one GPU), minus
:data:`CONTEXT_BYTES` for the CUDA context and cuBLAS workspaces (outside torch's allocator: a few
hundred MB per process on recent GPUs, CUDA C Programming Guide, "Lazy Loading") and, with several
ranks, NCCL's buffers (:func:`nccl_bytes`: ``NCCL_BUFFSIZE`` = 4 MiB per protocol buffer, per channel,
to each ring neighbour, up to 32 channels; NCCL's environment-variable docs).
:mod:`teraflops.course.gpu_memory` measures each workload without a GPU and checks it against the model.
* **Probes**: the matmul probe's three ``n × n`` matrices, the copy probe's source and destination.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from functools import lru_cache

from teraflops.models import GPT

HEADROOM = 0.8  # fraction of the GPU's memory a workload may plan to use
MiB = 2**20
GiB = 2**30
CONTEXT_BYTES = 1 * GiB  # CUDA context + cuBLAS workspaces per process (module docstring)
NCCL_BUFFSIZE = 4 * MiB  # NCCL's default per-protocol buffer
NCCL_CHANNELS = 32  # the most channels NCCL opens (MAXCHANNELS)
REMEDY_SETTINGS = 6  # teraflops.hardware.remedies.SETTINGS, built at once (tests/test_gpu_memory.py checks)
DECODE_ELEM = 4  # notebook 04 builds the decode model in fp32
STRAGGLER_FACTOR = 3.0  # teraflops.orchestration.stragglers.FACTOR (tests/test_gpu_memory.py checks)
SHARE_ENV = "TERAFLOPS_GPU_SHARE"


def nccl_bytes(world: int) -> int:
    """NCCL's buffers per rank: ``2 neighbours × NCCL_CHANNELS × NCCL_BUFFSIZE`` with several ranks, 0 alone."""
    return 0 if world < 2 else 2 * NCCL_CHANNELS * NCCL_BUFFSIZE


def gpu_share(environ=None) -> float:
    """The share of one GPU a learner plans for: ``TERAFLOPS_GPU_SHARE`` (0 < share <= 1), default 1.

    Raises:
        ValueError: a share that is not a number in (0, 1].
    """
    import os

    raw = (os.environ if environ is None else environ).get(SHARE_ENV, "1")
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(f"{SHARE_ENV}={raw!r} must be a fraction in (0, 1], e.g. 0.25 for four learners on one GPU")
    return share


def budget_bytes(gpu, world: int = 1, share: float = 1.0) -> int:
    """Bytes a workload may plan to use on ``gpu``: ``HEADROOM × share × free`` minus the context's
    and NCCL's reserve (module docstring); ``free`` is ``gpu.free_bytes`` where known, else the total."""
    free = getattr(gpu, "free_bytes", None) or gpu.memory_bytes
    return int(HEADROOM * share * min(free, gpu.memory_bytes)) - CONTEXT_BYTES - nccl_bytes(world)


def rebalanced_micro_batch(micro_batch: int, world: int, factor: float = STRAGGLER_FACTOR) -> int:
    """The largest micro-batch Unit 3's rebalancing gives a rank when one of ``world`` computes at
    ``1/factor`` of the speed: its quota of ``world × micro_batch`` rounded up (largest remainders)."""
    if world < 2:
        return micro_batch
    import math

    return math.ceil(world * micro_batch / (world - 1 + 1 / factor))


@lru_cache(maxsize=64)
def gpt_params(vocab: int, d_model: int, layers: int, heads: int, seq_len: int) -> int:
    """Parameter elements of :class:`teraflops.models.GPT` of these sizes (built on the meta
    device: the real module's count, no memory)."""
    import torch

    with torch.device("meta"):
        return GPT(vocab, d_model, layers, heads, seq_len).num_params()


def llama_params(vocab: int, d_model: int, layers: int) -> int:
    """Parameter elements of :class:`teraflops.models.Llama`: embedding and head (untied), per layer
    four ``d × d`` attention projections, SwiGLU's three ``d × 4d`` matrices and two RMSNorm weights,
    and the final norm (``tests/test_gpu_fit.py`` checks it against a built model)."""
    return 2 * vocab * d_model + layers * (4 * d_model ** 2 + 3 * d_model * 4 * d_model + 2 * d_model) + d_model


def training_bytes(params: int, *, layers: int, d_model: int, seq_len: int, micro_batch: int, vocab: int) -> int:
    """One rank training a GPT in fp32 with Adam (module docstring): ``16·Ψ + 68·s·b·h·L + 12·b·s·V``."""
    return 16 * params + 68 * seq_len * micro_batch * d_model * layers + 12 * micro_batch * seq_len * vocab


def _activation_sizes(gpt) -> dict[str, int]:
    """The sizes :func:`training_bytes` reads from a :class:`teraflops.sizing.GPTSizes`."""
    return dict(layers=gpt.layers, d_model=gpt.d_model, seq_len=gpt.seq_len, vocab=gpt.vocab)


def staleness_bytes(p, taus=(0, 1, 4, 16)) -> int:
    """The stale-gradient sweep on one rank: a model and Adam per τ, ``Σ (τ + 1)`` gradients in flight."""
    psi = gpt_params(**asdict(p.comm_gpt))
    act = training_bytes(0, micro_batch=p.dp.micro_batch, **_activation_sizes(p.comm_gpt))
    return len(taus) * 16 * psi + sum(t + 1 for t in taus) * 4 * psi + act


def remedies_bytes(p) -> int:
    """Unit 5's remedies on one rank: :data:`REMEDY_SETTINGS` DDP models with Adam and gradient
    buckets (20 B/parameter each) and one setting's activations (module docstring)."""
    psi = gpt_params(**asdict(p.comm_gpt))
    return REMEDY_SETTINGS * 20 * psi + training_bytes(0, micro_batch=p.dp.micro_batch, **_activation_sizes(p.comm_gpt))


def decode_bytes(p, batch: int) -> int:
    """Unit 4's decode model at ``batch``: weights and the static KV cache at :data:`DECODE_ELEM` bytes,
    the prefill's fp32 logits and one block's SwiGLU intermediates (``3 · 4·d_model`` per token)."""
    weights = DECODE_ELEM * llama_params(p.decode.vocab, p.decode.d_model, p.decode.layers)
    cache = DECODE_ELEM * 2 * p.decode.layers * batch * p.decode.max_seq_len * p.decode.d_model
    prefill = 4 * batch * p.decode.prompt_len * (p.decode.vocab + 12 * p.decode.d_model)  # logits, SwiGLU's 3 × 4d
    return weights + cache + prefill


def decode_sweep_bytes(p, batch: int) -> int:
    """What the decode batch sweep allocates at ``batch`` (``decode.batch_sweep``: weights and the
    cache, one token per step, no prefill), at :data:`DECODE_ELEM` bytes per element (the sweep runs
    the model notebook 04 builds, in fp32): the bound its out-of-memory step must pass."""
    return DECODE_ELEM * llama_params(p.decode.vocab, p.decode.d_model, p.decode.layers) + \
        DECODE_ELEM * 2 * p.decode.layers * batch * p.decode.max_seq_len * p.decode.d_model


def workload_bytes(p, world: int = 1) -> dict[str, int]:
    """The memory model (bytes on one GPU) of each GPU-preset workload at its largest planned point
    that is meant to fit (the intended OOM points excluded: naive attention, the decode sweep's last),
    with ``world`` ranks (one per GPU)."""
    elem = 2  # the probes' and attention's 16-bit elements
    gpt, gpt_psi = _activation_sizes(p.gpt), gpt_params(**asdict(p.gpt))
    n_max = max(p.attention.seq_lens)
    return {
        "ceilings probes": max(3 * p.probe.matmul_n ** 2 * elem, 2 * p.probe.copy_bytes),
        "roofline": max(3 * max(p.roofline.matmul_sizes) ** 2 * elem, 3 * p.roofline.elementwise_numel * 4),
        "flash attention at the largest N": 4 * p.attention.batch * p.attention.heads * n_max * p.attention.head_dim * elem,
        "transformer block (fwd + bwd)": training_bytes(12 * p.block.d_model ** 2, layers=1, d_model=p.block.d_model,
                                                       seq_len=p.block.seq, micro_batch=p.block.batch, vocab=0),
        "ZeRO stage 0 (GPT)": training_bytes(gpt_psi, micro_batch=p.dp.micro_batch, **gpt),
        "stragglers (one setting, rebalanced, evaluation)": training_bytes(
            gpt_psi, micro_batch=rebalanced_micro_batch(p.straggler.micro_batch, world), **gpt),
        "elastic (GPT, Adam)": training_bytes(gpt_psi, micro_batch=p.straggler.micro_batch, **gpt),
        "stale gradients (τ sweep)": staleness_bytes(p),
        "remedies (DDP, every setting)": remedies_bytes(p),
        "decode at the largest batch that fits": decode_bytes(p, p.decode.fit_batch),
        "collectives (largest message)": 3 * p.collective.max_bytes,
        "contention (8 streams)": 2 * 8 * p.copies.contention_bytes,
        "bandwidth ladder": 2 * p.copies.ladder_bytes,
    }


def supports_bf16(capability: tuple[int, int]) -> bool:
    """bf16 tensor cores: sm80 (Ampere) and newer (module docstring)."""
    return tuple(capability) >= (8, 0)


def fit_preset(base, gpu, world: int = 1, share: float = 1.0):
    """``base`` (the GPU preset) with sizes and dtype fitted to ``gpu`` (memory, capability).

    Shrinks, in this order and only where a workload's model exceeds ``HEADROOM`` of the memory:
    the collective sweep's largest message, the ZeRO / straggler micro-batches, the stale-gradient
    GPT's width, and the decode batch sweep (the largest batch that fits, then one power of two
    past the whole memory as the intended OOM step).
    """
    import torch

    budget = budget_bytes(gpu, world, share)
    p = replace(base, name=base.name, dtype=torch.bfloat16 if supports_bf16(gpu.capability) else torch.float16)
    top = p.collective.max_bytes
    while 3 * top > budget and top > 64 * MiB:
        top //= 2
    p = replace(p, collective=replace(p.collective, max_bytes=top))
    gpt, psi = _activation_sizes(p.gpt), gpt_params(**asdict(p.gpt))
    for unit in ("dp", "straggler"):  # the ZeRO and straggler / elastic micro-batches
        sizes = getattr(p, unit)
        while sizes.micro_batch > 1 and training_bytes(
                psi, micro_batch=rebalanced_micro_batch(sizes.micro_batch, world), **gpt) > budget:
            sizes = replace(sizes, micro_batch=sizes.micro_batch // 2)
        p = replace(p, **{unit: sizes})
    while p.comm_gpt.d_model > 256 and max(staleness_bytes(p), remedies_bytes(p)) > budget:
        p = replace(p, comm_gpt=replace(p.comm_gpt, d_model=p.comm_gpt.d_model - 256))
    fit = 1
    while decode_bytes(p, 2 * fit) <= budget and 2 * fit <= max(base.decode.batches):
        fit *= 2
    over = 2 * fit
    while decode_sweep_bytes(p, over) <= gpu.memory_bytes:  # the first batch past the whole memory: the OOM step
        over *= 2
    batches = tuple(b for b in base.decode.batches if b <= fit)
    return replace(p, decode=replace(p.decode, fit_batch=fit, batches=batches + ((over,) if over > fit else ())))


# Unit 2's model parallelism (tensor and pipeline parallel launches, recomputation): the ranks' device
# picks the sizes, the bytes over the link and the FLOPs at the measured ceiling the time they may take.
LINK_STEP_S = 2.0  # the most seconds a TP step's activations may spend on the emulated link (a lecture cell's pace)
LAUNCH_START_S = 60.0  # starting the ranks, their process groups and (on GPUs) CUDA and NCCL, before the first step
TIMEOUT_MARGIN = 4.0  # a launch may take this many times its predicted steps (a shared, loaded machine)


def train_step_flops(cfg) -> int:
    """FLOPs of one training step of ``cfg``'s GPT (a :class:`teraflops.sizing.TrainConfig`) on its
    ``micro_batch × seq_len`` tokens: ``6 · Ψ · tokens`` (Kaplan et al. 2020, §2.1)."""
    psi = gpt_params(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len)
    return 6 * psi * cfg.micro_batch * cfg.seq_len


def tp_step_bytes(cfg, dtype_bytes: int = 4) -> int:
    """Bytes a Megatron TP rank hands to its all-reduces per step: 2 forward + 2 backward per block,
    each the block's ``b·s·h`` activations (Megatron-LM §3), fp32: ``4 · L · b·s·h · dtype_bytes``."""
    return 4 * cfg.layers * cfg.micro_batch * cfg.seq_len * cfg.d_model * dtype_bytes


def launch_timeout(steps: int, flops: float, flops_per_s: float, nbytes: float = 0, link_rate: float | None = None) -> float:
    """Seconds a launch of ``steps`` steps (each ``flops`` FLOPs on a rank computing ``flops_per_s``,
    and ``nbytes`` over a link of ``link_rate`` bytes/s, None: no link to wait for) may take:
    ``LAUNCH_START_S + TIMEOUT_MARGIN · steps · (flops / flops_per_s + nbytes / link_rate)``."""
    per_step = flops / flops_per_s + (nbytes / link_rate if link_rate else 0.0)
    return LAUNCH_START_S + TIMEOUT_MARGIN * steps * per_step


def rank_config(cfg, on_gpus: bool, cpu_cfg):
    """``cfg`` (a :class:`teraflops.sizing.TrainConfig`) for ranks on GPUs; for CPU (gloo) ranks, each
    size at most ``cpu_cfg``'s (the CPU preset's model-parallel GPT): a GPU preset launched on CPU ranks
    (fewer GPUs than ranks) would compute 10¹³–10¹⁴ FLOPs per stage-step. The heads stay ``cfg``'s
    where the width still divides by them (the TP degree divides the heads), else ``cpu_cfg``'s."""
    if on_gpus:
        return cfg
    sizes = {k: min(getattr(cfg, k), getattr(cpu_cfg, k)) for k in ("vocab", "d_model", "layers", "seq_len", "micro_batch")}
    heads = cfg.heads if sizes["d_model"] % cfg.heads == 0 and sizes["d_model"] // cfg.heads >= 8 else cpu_cfg.heads
    return replace(cfg, heads=heads, **sizes)


def link_config(cfg, link_rate: float | None, multiple: int = 1, seconds: float = LINK_STEP_S):
    """``cfg`` with its batch halved (staying a multiple of ``multiple``, the data-parallel ranks) until a
    TP step's bytes (:func:`tp_step_bytes`) cross a link of ``link_rate`` bytes/s in ``seconds``; as is
    without a link (None)."""
    while link_rate and tp_step_bytes(cfg) / link_rate > seconds and cfg.micro_batch // 2 >= multiple \
            and (cfg.micro_batch // 2) % multiple == 0:
        cfg = replace(cfg, micro_batch=cfg.micro_batch // 2)
    return cfg
