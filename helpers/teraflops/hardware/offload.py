"""Unit 5 §5, the memory ceiling: when the model states outgrow the GPU, offload them to CPU memory.

Ψ = parameters, Nd = data-parallel degree (GPUs); mixed-precision Adam, K = 12 (bytes of each state from
:func:`teraflops.parallelization.model_states.model_states`). Three placements, ``mode``:

* ``"none"``: ZeRO stage 2 (P_os+g) all on the GPU, ``2Ψ + 14Ψ/Nd`` bytes per GPU; nothing crosses PCIe.
* ``"optimizer"``, **ZeRO-Offload** (J. Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
  Training", USENIX ATC 2021, arXiv:2101.06840). §3 ("Unique Optimal Offload Strategy"): any split of a
  step's data-flow graph between GPU and CPU cuts two edges of at least 2Ψ bytes, so 4Ψ is the least
  traffic; of the splits that move 4Ψ, the one that frees most GPU memory (Table 1, 8×) keeps the fp16
  parameters (2Ψ) on the GPU and puts the fp16 gradients, the fp32 optimizer states (2Ψ + 12Ψ) and the
  Adam step on the CPU: fp16 gradients go down (2Ψ), updated fp16 parameters come up (2Ψ). On Nd GPUs
  (§4.2) each rank moves only its 1/Nd partition over its own link and the GPUs all-gather the rest:
  **4Ψ/Nd bytes per GPU per step**; 2Ψ on each GPU, 14Ψ/Nd of CPU memory per GPU.
* ``"params"``, **ZeRO-Infinity** offloading to CPU memory (S. Rajbhandari et al., "ZeRO-Infinity: Breaking
  the GPU Memory Wall for Extreme Scale Deep Learning", SC 2021, arXiv:2104.07857): stage 3 with the
  parameters on the CPU too. Section "Bandwidth Requirements", "Quantifying AIT in DL training": per
  iteration the parameters are loaded at least twice (forward, backward), once more where activation
  checkpointing recomputes the forward, and the gradients stored once: 2 × 3Ψ bytes in fp16, or 2 × 4Ψ
  (the paper's count, which assumes checkpointing: ``recompute=True``). Optimizer states would add
  2 × 16Ψ if the update ran on the GPU; CPU Adam updates them where they live. "Bandwidth-Centric
  Partitioning" has each rank fetch 1/Nd of every parameter over its own link and all-gather the rest:
  **6Ψ/Nd per GPU per step (8Ψ/Nd with recompute)**. CPU: 16Ψ/Nd per GPU. GPU: only the paper's "model
  state working memory", 4 bytes per parameter of the largest operator, which must be on the GPU whole.

**Time** (:func:`offload_rows`): ``bytes / bandwidth`` against ``6Ψ · tokens / (peak × MFU)``
(:func:`teraflops.hardware.comm_budget.train_flops`; 8Ψ with recompute). ZeRO-Offload overlaps the gradient copies
with the backward pass and the CPU step with the next step (§5, one-step delayed update). The gradients go
down during backward and the parameters come up after the CPU step, in different phases, so the time is
the two directions summed, each at one direction's bandwidth (the host→device figure stands for both; a
PCIe link is symmetric). ``PCIe / compute <= 1`` is necessary for the transfer to hide, not sufficient:
the download must fit under backward alone (about 4/6 of the math), and without the delayed update the
upload and CPU Adam sit on the critical path. Both grow with Ψ, so the ratio depends only on tokens per GPU, Nd
and the two rates. Not modelled: CPU Adam time, GPU collectives, activations, gradient accumulation.

**NVMe, for real** (:func:`run_nvme_offload`): ZeRO-Infinity's third tier run by DeepSpeed on this machine,
the optimizer states and the parameters swapped to a folder on disk by its ``async_io`` op, next to the
same run offloading to CPU memory. What DeepSpeed reads and writes per step is derived from its source in
:func:`nvme_step_bytes` and measured from the rank's ``/proc/self/io`` (:func:`parse_proc_io`); the step time
is set against those bytes over the disk's measured bandwidth (:func:`disk_bandwidth`). DeepSpeed's
parameter swapper needs a pinned buffer per swapped parameter in flight: :func:`swap_buffers` sizes them
from the model, so that "Not enough buffers" (a ``buffer_count`` below the parameters live at once)
cannot happen.

Units: bytes (GB = 1e9), seconds, bytes/s per direction, FLOP/s.
"""

from __future__ import annotations

import math
import numbers
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from teraflops import ceilings
from teraflops.caches import cache_dir
from teraflops.datasheets import PUBLISHED_LINKS, NoDatasheetError, published_peak
from teraflops.errors import CourseError
from teraflops.hardware.comm_budget import train_flops
from teraflops.machine import detect
from teraflops.models import GPT
from teraflops.parallelization.model_states import deepspeed_estimators, memory_capacities, model_states
from teraflops.launch.launcher import launch
from teraflops.launch.ops import prepare_aio_op
from teraflops.launch.rank import RankIdentity
from teraflops.sizing import TrainConfig, dp_config, preset
from teraflops.tables import GB, fmt, fmt_bytes, table

OFFLOAD_MODES = ("none", "optimizer", "params")
HOST_LINK = "PCIe Gen5 x16"  # the published link used when there is no GPU to measure


class OffloadError(CourseError, ValueError):
    """A bad argument to this module: an unknown mode, a count or a rate out of range."""


def _positive(name, x, hint) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not 0 < x < math.inf:
        raise OffloadError(f"{name} must be a finite number > 0, got {x!r}. Hint: {hint}")
    return float(x)


def _integer(name, x, hint, low=1) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < low:
        raise OffloadError(f"{name} must be an integer >= {low}, got {x!r}. Hint: {hint}")
    return int(x)


def _check(psi, nd, mode, nodes=1) -> tuple[float, int, int]:
    psi = _positive("psi", psi, "a count of parameters: 7 billion is 7e9")
    nd = _integer("nd", nd, "the number of data-parallel GPUs; 1 is a single GPU")
    nodes = _integer("nodes", nodes, "the GPUs of a node share its CPU memory; 1 puts all nd on one node")
    if nd % nodes:
        raise OffloadError(f"nd = {nd} GPUs do not split evenly over nodes = {nodes}. Hint: e.g. nd=16, nodes=2")
    if not isinstance(mode, str) or mode not in OFFLOAD_MODES:
        raise OffloadError(f"mode must be one of {OFFLOAD_MODES}, got {mode!r}. Hint: 'optimizer' is "
                           "ZeRO-Offload, 'params' ZeRO-Infinity's stage 3 with the parameters on the CPU too")
    return psi, nd, nodes


def pcie_bytes(psi: float, nd: int, mode: str = "optimizer", *, recompute: bool = False) -> float:
    """Bytes crossing one GPU's host link (PCIe) per step, both directions: ``"none"`` 0; ``"optimizer"``
    ``(2 + 2)Ψ/Nd`` (fp16 gradients down, fp16 parameters up); ``"params"`` ``(2 + 2 + 2)Ψ/Nd`` (fp16
    parameters up for the forward and again for the backward, fp16 gradients down), ``8Ψ/Nd`` with
    ``recompute`` (activation checkpointing loads them once more). Sources: the module docstring.

    Raises:
        OffloadError: ``psi`` not > 0, ``nd`` not an integer >= 1, an unknown ``mode``, ``recompute`` not a bool.
    """
    psi, nd, _ = _check(psi, nd, mode)
    if not isinstance(recompute, bool):
        raise OffloadError(f"recompute must be True or False, got {recompute!r}. "
                           "Hint: True with activation checkpointing")
    return {"none": 0, "optimizer": 2 + 2, "params": 2 * (3 if recompute else 2) + 2}[mode] * psi / nd


@dataclass(frozen=True)
class OffloadMemory:
    """Model-state bytes of one placement: ``gpu_bytes`` per GPU, ``cpu_bytes`` of CPU memory per GPU
    (its rank's partition), ``gpus_per_node`` ranks sharing one node's CPU memory."""

    psi: float
    nd: int
    mode: str
    stage: int
    gpu_bytes: float
    cpu_bytes: float
    gpus_per_node: int

    @property
    def cpu_node_bytes(self) -> float:
        """CPU memory of one node: ``cpu_bytes × gpus_per_node``."""
        return self.cpu_bytes * self.gpus_per_node


def offload_memory(psi: float, nd: int, mode: str = "optimizer", *, stage: int | None = None,
                   largest_layer_params: int | None = None, nodes: int = 1) -> OffloadMemory:
    """Model states of ZeRO ``stage`` (2 or 3; default 2, 3 for ``"params"``) with ``mode`` offloaded,
    split from :func:`teraflops.parallelization.model_states.model_states`: ``"none"`` all on the GPU; ``"optimizer"``
    fp16 parameters on the GPU (2Ψ at stage 2, 2Ψ/Nd at stage 3), gradients and optimizer states on the
    CPU (14Ψ/Nd); ``"params"`` (stage 3) all on the CPU (16Ψ/Nd). At stage 3 the GPU also holds the model
    state working memory, ``4 × largest_layer_params`` (``None`` counts 0; DeepSpeed adds the same 4L).

    Raises:
        OffloadError: bad ``psi``, ``nd``, ``mode``, ``nodes`` (must divide ``nd``), ``stage`` (``"params"``
            needs 3), or ``largest_layer_params`` not an integer between 0 and ``psi``.
    """
    psi, nd, nodes = _check(psi, nd, mode, nodes)
    stage = (3 if mode == "params" else 2) if stage is None else stage
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage not in (2, 3) or \
            (mode == "params" and stage != 3):
        raise OffloadError(f"stage must be 2 or 3 (3 for mode 'params'), got {stage!r}. "
                           "Hint: offloading the parameters needs them partitioned, ZeRO stage 3")
    layer = 0 if largest_layer_params is None else largest_layer_params
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer <= psi:
        raise OffloadError(f"largest_layer_params must be an integer between 0 and psi, got {largest_layer_params!r}. "
                           "Hint: the parameters of the biggest single module, often the embedding (vocab × hidden)")
    s = model_states(psi, int(stage), nd)
    gpu, cpu = {"none": (s.total_bytes, 0.0), "optimizer": (s.params_bytes, s.grads_bytes + s.optimizer_bytes),
                "params": (0.0, s.total_bytes)}[mode]
    return OffloadMemory(psi, nd, mode, int(stage), gpu + (4 * layer if stage == 3 else 0), cpu, nd // nodes)


def host_link_bandwidth(nbytes: int | None = None) -> tuple[float, str]:
    """``(bytes/s, source)`` of the host→device link: with a CUDA GPU, one pinned H2D copy of ``nbytes``
    (default the preset's ``copies.ladder_bytes``, :mod:`teraflops.sizing`) timed by :func:`teraflops.ceilings.measure_host_device_copy`;
    without one there is no PCIe to measure: the published PCIe Gen5 x16 figure per direction
    (:data:`teraflops.datasheets.PUBLISHED_LINKS`)."""
    if detect().device == "cuda":
        n = preset().copies.ladder_bytes if nbytes is None else nbytes
        return ceilings.measure_host_device_copy(n, pinned=True), f"measured pinned H2D, {fmt_bytes(n)}"
    return next(l.bandwidth for l in PUBLISHED_LINKS if l.name == HOST_LINK), f"published {HOST_LINK}, no GPU here"


def _detected_peak() -> tuple[float, str]:
    """:func:`published_peak` of the detected GPU; for a GPU without a datasheet entry, the H100
    SXM reference figure, with a source that says "no datasheet for <name>"."""
    name = detect().gpu_name
    try:
        return published_peak(name)
    except NoDatasheetError:
        flops, source = published_peak(None)
        return flops, f"no datasheet for {name}: {source.split(',')[0]} as the reference"


def offload_rows(params=(1e9, 7e9, 13e9, 70e9), nd: int = 8, tokens_per_gpu: int = 8192, mode: str = "optimizer",
                 bandwidth: float | None = None, *, peak_flops: float | None = None, mfu: float = 0.4,
                 recompute: bool = False, nodes: int = 1) -> list[dict]:
    """Per model size: does ZeRO-2 fit, what ``mode`` moves over PCIe per step, does it hide under compute.

    ``bandwidth`` (bytes/s) ``None``: :func:`host_link_bandwidth`, measured once for all rows;
    ``peak_flops`` ``None``: :func:`published_peak` of the detected GPU (an unlisted GPU: the H100 SXM
    figure, its ``peak_source`` saying "no datasheet for <name>"). Rows (dicts): ``params``, ``nd``,
    ``mode``, ``zero2_gpu_bytes`` (no offload), ``fits`` (in 80 GB, :func:`teraflops.parallelization.model_states.memory_capacities`;
    model states only), ``gpu_bytes``, ``offload_fits`` and ``cpu_node_bytes`` with offload (:func:`offload_memory`,
    no largest-layer term), ``pcie_bytes``, ``pcie_s``, ``compute_s``, ``ratio`` (PCIe / compute), ``hidden``
    (ratio <= 1), and the inputs ``tokens_per_gpu``, ``bandwidth``, ``bandwidth_source``, ``peak_flops``,
    ``peak_source``, ``mfu``.

    Raises:
        OffloadError: a bad count, mode or rate, no models, or ``mfu`` outside (0, 1].
    """
    counts = [params] if isinstance(params, (numbers.Real, str)) or params is None else list(params)
    for p in counts or [None]:
        _check(p, nd, mode, nodes)
    tokens = _positive("tokens_per_gpu", tokens_per_gpu, "tokens one GPU processes per step, e.g. 2 × 4096")
    if not _positive("mfu", mfu, "model FLOP utilisation, a fraction such as 0.4") <= 1:
        raise OffloadError(f"mfu must be at most 1, got {mfu!r}. Hint: 40% is 0.4")
    pcie_bytes(1.0, nd, mode, recompute=recompute)  # validates recompute
    bw, bw_source = (host_link_bandwidth() if bandwidth is None else
                     (_positive("bandwidth", bandwidth, "bytes/s: 63 GB/s is 63e9"), "given"))
    peak, peak_source = (_detected_peak() if peak_flops is None else
                         (_positive("peak_flops", peak_flops, "FLOP/s: 989.5 TFLOP/s is 989.5e12"), "given"))
    capacity, rows = memory_capacities()[0][1] * GB, []
    for p in counts:
        mem, base = offload_memory(p, nd, mode, nodes=nodes), offload_memory(p, nd, "none", nodes=nodes)
        nbytes = pcie_bytes(p, nd, mode, recompute=recompute)
        compute = train_flops(p, tokens) * (8 / 6 if recompute else 1) / (peak * mfu)
        rows.append({"params": float(p), "nd": nd, "mode": mode, "zero2_gpu_bytes": base.gpu_bytes,
                     "fits": base.gpu_bytes <= capacity, "gpu_bytes": mem.gpu_bytes,
                     "offload_fits": mem.gpu_bytes <= capacity, "cpu_node_bytes": mem.cpu_node_bytes,
                     "pcie_bytes": nbytes, "pcie_s": nbytes / bw, "compute_s": compute, "ratio": nbytes / bw / compute,
                     "hidden": nbytes / bw <= compute, "tokens_per_gpu": tokens, "bandwidth": bw,
                     "bandwidth_source": bw_source, "peak_flops": peak, "peak_source": peak_source, "mfu": float(mfu)})
    return rows


def offload_table(rows: list[dict]) -> str:
    """:func:`offload_rows` as a table (GB = 1e9 bytes) under a line naming the bandwidth, the peak and the
    fewest tokens per GPU that hide the transfer (``tokens × ratio``: the ratio falls as 1/tokens)."""
    if not rows:
        raise OffloadError("offload_table got no rows. Hint: offload_table(offload_rows())")
    r0, cap = rows[0], memory_capacities()[0][1]
    head = (f"# offload {r0['mode']!r}, Nd = {r0['nd']}, {fmt(r0['tokens_per_gpu'])} tokens per GPU; PCIe "
            f"{r0['bandwidth'] / GB:.3g} GB/s ({r0['bandwidth_source']}); compute at {r0['mfu']:.0%} of "
            f"{r0['peak_flops'] / 1e12:.4g} TFLOP/s ({r0['peak_source']})")
    if r0["ratio"] > 0:
        head += f"; PCIe hides under compute from {fmt(r0['tokens_per_gpu'] * r0['ratio'])} tokens per GPU"
    # with the parameters offloaded the GPU holds only the largest layer at work (4 bytes per parameter), which
    # the rows leave out: "4L" says so rather than a 0
    body = table([(f"{r['params'] / 1e9:g}B", r["zero2_gpu_bytes"] / GB, r["fits"],
                   "4L" if r["mode"] == "params" and r["gpu_bytes"] == 0 else r["gpu_bytes"] / GB,
                   r["offload_fits"], r["cpu_node_bytes"] / GB, r["pcie_bytes"] / GB, r["pcie_s"], r["compute_s"],
                   r["ratio"])
                  for r in rows],
                 ["model", "ZeRO-2 GPU (GB)", f"fits {cap:g} GB", "offload GPU (GB)", "fits", "CPU/node (GB)",
                  "PCIe/step (GB)", "PCIe (s)", "compute (s)", "PCIe/compute"])
    return head + "\n" + body


def deepspeed_offload_check(psi: int, nd: int, largest_layer_params: int | None = None, nodes: int = 1) -> list[dict]:
    """Ours (:func:`offload_memory`) next to DeepSpeed's estimators with offload: ``nd`` GPUs on ``nodes`` nodes.

    DeepSpeed 0.19.8 (``estimate_zero2_model_states_mem_needs``, ``deepspeed/runtime/zero/stage_1_and_2.py``;
    ``estimate_zero3_model_states_mem_needs``, ``stage3.py``, with ``zero_init=True``) computes, in bytes,
    with N = all GPUs, L = ``largest_layer_params``, f = ``additional_buffer_factor`` = 1.5 (CPU only, per node):

    * stage 2, optimizer offloaded: GPU ``2Ψ``; CPU ``Ψ · max(4N, 16) · f``.
    * stage 3, optimizer offloaded: GPU ``4L + int(2Ψ/N)``; CPU ``16Ψ / nodes · f``.
    * stage 3, optimizer and parameters offloaded: GPU ``4L``; CPU ``18Ψ / nodes · f``.

    The GPU figures equal ours. The CPU figures exceed ours (14Ψ, 14Ψ, 16Ψ per node): the factor f;
    an fp32 gradient partition kept on the CPU for CPU Adam (4 bytes where the paper counts fp16, 2:
    16 = 4 + 12, 18 = 2 + 4 + 12); and stage 2's ``max(4N, 16)``, unexplained in the code and growing with
    all GPUs, not per node: 4 bytes per parameter per rank fits every rank building the fp32 model in CPU
    memory before partitioning (stage 3 has that term only with ``zero_init=False``, which avoids it).

    Returns:
        One dict per case: ``stage``, ``mode``, ``deepspeed_gpu_bytes``, ``ours_gpu_bytes``, ``gpu_ratio``
        (DeepSpeed / ours; NaN where ours is 0), ``deepspeed_cpu_bytes``, ``ours_cpu_bytes`` (per node),
        ``cpu_ratio``, ``deepspeed_formula``.

    Raises:
        OffloadError: as :func:`offload_memory`. ImportError: DeepSpeed is not installed.
    """
    offload_memory(psi, nd, "params", largest_layer_params=largest_layer_params, nodes=nodes)  # validates
    zero2, zero3 = deepspeed_estimators()
    total, layer, per_node = int(round(psi)), int(largest_layer_params or 0), nd // nodes
    cases = [(2, "optimizer", zero2(total, per_node, nodes, cpu_offload=True), "GPU 2Ψ; CPU Ψ·max(4N, 16)·1.5"),
             (3, "optimizer", zero3(total, layer, per_node, nodes, cpu_offload=True, cpu_offload_params=False,
                                    zero_init=True)[:2], "GPU 4L + 2Ψ/N; CPU 16Ψ/nodes·1.5"),
             (3, "params", zero3(total, layer, per_node, nodes, cpu_offload=True, cpu_offload_params=True,
                                 zero_init=True)[:2], "GPU 4L; CPU 18Ψ/nodes·1.5")]
    rows = []
    for stage, mode, (ds_cpu, ds_gpu), formula in cases:
        ours = offload_memory(psi, nd, mode, stage=stage, largest_layer_params=largest_layer_params, nodes=nodes)
        rows.append({"stage": stage, "mode": mode, "deepspeed_gpu_bytes": ds_gpu, "ours_gpu_bytes": ours.gpu_bytes,
                     "gpu_ratio": ds_gpu / ours.gpu_bytes if ours.gpu_bytes else math.nan,
                     "deepspeed_cpu_bytes": ds_cpu, "ours_cpu_bytes": ours.cpu_node_bytes,
                     "cpu_ratio": ds_cpu / ours.cpu_node_bytes, "deepspeed_formula": formula})
    return rows


def deepspeed_offload_table(rows: list[dict]) -> str:
    """:func:`deepspeed_offload_check` rows as a table (GB = 1e9 bytes; DeepSpeed itself prints GiB)."""
    return table([(r["stage"], r["mode"], r["deepspeed_gpu_bytes"] / GB, r["ours_gpu_bytes"] / GB,
                   "-" if math.isnan(r["gpu_ratio"]) else r["gpu_ratio"],
                   r["deepspeed_cpu_bytes"] / GB, r["ours_cpu_bytes"] / GB, r["cpu_ratio"], r["deepspeed_formula"])
                  for r in rows],
                 ["stage", "offload", "DS GPU (GB)", "ours GPU (GB)", "ratio", "DS CPU/node (GB)", "ours CPU/node (GB)",
                  "ratio", "DeepSpeed computes"])


# ---- NVMe, for real: DeepSpeed's swapping derived, sized and measured -----------------------------

MIN_AIO_BYTES = 1 << 20
"""DeepSpeed's smallest tensor it swaps (``MIN_AIO_BYTES`` in ``deepspeed/runtime/swap_tensor/utils.py``; the
swappers use ``max(MIN_AIO_BYTES, aio block_size)``): a smaller parameter partition, gradient or optimizer
sub-group stays in CPU memory (``swappable_tensor`` / ``is_swappable_tensor``)."""
AIO_ALIGNED_BYTES = 1024
"""DeepSpeed's I/O alignment (``AIO_ALIGNED_BYTES`` × the aio ``intra_op_parallelism``, 1 here): each swapped
tensor is read and written rounded up to a multiple of it (``_io_aligned_numel``)."""
AIO_BLOCK_SIZE = 1 << 20  # the aio config's block_size: DeepSpeed's default, which keeps min_aio_bytes at 1 MiB
ADAM_STATES = 2  # torch AdamW's exp_avg and exp_avg_sq (its 'step' is a 0-d tensor: never swapped)
OFFLOAD_DEVICES = ("nvme", "cpu")
WORKER = "teraflops.workers.nvme_offload"


def _numels(param_numels) -> list[int]:
    numels = list(param_numels) if not isinstance(param_numels, (str, bytes)) else None
    if not numels or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in numels):
        raise OffloadError(f"param_numels must be a non-empty list of integers >= 1, got {param_numels!r}. "
                           "Hint: [p.numel() for p in model.parameters()]")
    return [int(n) for n in numels]


def _ceil_to(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def sub_groups(partitions: list[int], sub_group_size: int) -> list[list[int]]:
    """DeepSpeed's optimizer sub-groups (``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``): all the
    partitions in one group when ``sub_group_size`` covers them, else consecutive runs closed as soon as they
    reach ``sub_group_size`` elements (the last one with what is left)."""
    if sub_group_size >= sum(partitions):
        return [list(partitions)]
    groups, run = [], []
    for i, n in enumerate(partitions):
        run.append(n)
        if sum(run) >= sub_group_size or i == len(partitions) - 1:
            groups.append(run)
            run = []
    return groups


@dataclass(frozen=True)
class NvmeStepBytes:
    """Bytes one rank reads from and writes to NVMe per training step (after the first), by what DeepSpeed
    swaps (:func:`nvme_step_bytes`): ``parts`` maps ``"params"``, ``"grads"``, ``"optimizer"`` to (read, write);
    ``swapped_params``/``kept_params``: parameter tensors whose partition is on NVMe / stays in CPU memory."""

    read: int
    write: int
    parts: dict[str, tuple[int, int]]
    swapped_params: int
    kept_params: int


def nvme_step_bytes(param_numels, nd: int = 1, *, param_bytes: int = 4, master_bytes: int = 4,
                    states: int = ADAM_STATES, min_aio_bytes: int = MIN_AIO_BYTES, align: int = AIO_ALIGNED_BYTES,
                    sub_group_size: int = 10**9) -> NvmeStepBytes:
    """What ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe moves per step, one rank of ``nd``.

    ZeRO-Infinity (Rajbhandari et al., SC 2021, arXiv:2104.07857, §5 "Bandwidth Requirements" and §6.1
    "Infinity Offload Engine") keeps the parameters and the optimizer states on NVMe and counts per
    iteration the parameters read for the forward and again for the backward, the gradients written, and
    the fp32 states read and written by the CPU optimizer step. DeepSpeed 0.19.8 does, per parameter
    partition (each parameter padded to ``nd`` equal partitions, ``ceil(numel / nd)`` elements):

    * **params** (``partitioned_param_swapper.py``, ``AsyncPartitionedParameterSwapper``): ``swap_in`` when a
      module's forward and again its backward fetch it (``partition_parameters.py``, ``_ensure_availability_of_partitioned_params``;
      a released partition is dropped, not written: it "exists in nvme"), and one write of the updated
      values after the step (``swap_out_partitioned_params``, from ``stage3.py``
      ``_partitioned_params_swap_out``): read 2 × P, write 1 × P, P = ``param_bytes`` × partition.
    * **grads** (``optimizer_utils.py``, ``_swap_out_gradients``): each parameter's fp32 gradient partition,
      its whole multiples of ``align`` bytes (``_adjust_for_misaligned_lengths``), written at the end of the
      backward and read back for the step (``partitioned_optimizer_swapper.py``, ``_swap_in_gradients``).
    * **optimizer** (``swap_in_optimizer_state`` / ``swap_out_optimizer_state``): per optimizer sub-group
      (:func:`sub_groups`), the fp32 master partition and the optimizer's ``states`` tensors of the same
      size, read before the sub-group's step and written after it; the gradients are not written back.

    Two settings decide whether any of this reaches the disk (:func:`offload_config`, the rank program):
    ``offload_param.max_in_cpu`` (default 1e9 elements) is how much of the parameters the ZeRO-3 optimizer
    copies back into CPU memory for good (``stage3.py``, ``_create_param_groups_fp16_flat_cpu_memory`` and
    ``_move_to_flat_buffer``): a small model then never reads a parameter from disk, so it is 0 here; and
    ``zero.Init`` must get the fp32 dtype from the config (see :mod:`teraflops.workers.nvme_offload`), else
    on the CPU the parameter swapper counts 2-byte elements and keeps every fp32 tensor under 2 MiB.

    Two rules of DeepSpeed make the bytes differ from Ψ × bytes per element: a tensor smaller than
    ``min_aio_bytes`` (:data:`MIN_AIO_BYTES`) is never swapped but kept in CPU memory, and every swapped
    tensor moves rounded up to ``align`` bytes (:data:`AIO_ALIGNED_BYTES`). ``min_aio_bytes=0, align=1``
    gives the paper's count, every byte of every tensor: read ``(2·param_bytes + 4 + 12)Ψ/Nd``, write
    ``(param_bytes + 4 + 12)Ψ/Nd`` with mixed-precision Adam.

    Raises:
        OffloadError: ``param_numels`` not integers >= 1, or ``nd``, ``param_bytes``, ``master_bytes``, ``align``,
            ``sub_group_size`` not integers >= 1, or ``states``, ``min_aio_bytes`` not integers >= 0.
    """
    numels = _numels(param_numels)
    for name, x in (("nd", nd), ("param_bytes", param_bytes), ("master_bytes", master_bytes), ("align", align),
                    ("sub_group_size", sub_group_size)):
        _integer(name, x, "see nvme_step_bytes's docstring")
    for name, x in (("states", states), ("min_aio_bytes", min_aio_bytes)):
        _integer(name, x, "see nvme_step_bytes's docstring", low=0)
    parts = [-(-n // nd) for n in numels]
    swapped = [k for k in parts if k * param_bytes >= min_aio_bytes]
    p = sum(_ceil_to(k * param_bytes, align) for k in swapped)
    g = o = 0
    for group in sub_groups(parts, sub_group_size):
        if sum(group) * master_bytes < min_aio_bytes:
            continue  # the whole sub-group stays in CPU memory, its gradients too
        o += (1 + states) * _ceil_to(sum(group) * master_bytes, align)
        g += sum(b for b in (k * master_bytes // align * align for k in group) if b >= min_aio_bytes)
    return NvmeStepBytes(read=2 * p + g + o, write=p + g + o, parts={"params": (2 * p, p), "grads": (g, g),
                         "optimizer": (o, o)}, swapped_params=len(swapped), kept_params=len(parts) - len(swapped))


@dataclass(frozen=True)
class SwapBuffers:
    """``offload_param``'s ``buffer_count`` and ``buffer_size`` (elements of the parameters' dtype)."""

    buffer_count: int
    buffer_size: int


def swap_buffers(param_numels, nd: int = 1, *, param_bytes: int = 4, min_aio_bytes: int = MIN_AIO_BYTES,
                 align: int = AIO_ALIGNED_BYTES) -> SwapBuffers:
    """Pinned parameter buffers that cannot run out: one per swapped parameter, each the largest swapped partition.

    DeepSpeed's parameter swapper owns ``buffer_count`` pinned buffers of ``buffer_size`` elements; every
    parameter partition read from NVMe takes one until it is released, and a fetch that finds too few
    raises "Not enough buffers" (``AsyncPartitionedParameterSwapper.swap_in``; DeepSpeed issue #3062: a model
    with more layers than ``buffer_count``, at step 2, when the step's writes and the next forward's reads
    overlap). Which parameters are live at once depends on prefetching, reuse distance and the step; the
    count of swapped parameters bounds them all, so ``buffer_count`` is that and ``buffer_size`` the largest
    swapped partition (elements, rounded up to ``align`` bytes). The pinned memory this takes is at most
    count × largest; a large model would instead size the count to a layer's parameters plus prefetch.
    """
    numels = _numels(param_numels)
    parts = [-(-n // _integer("nd", nd, "data-parallel ranks")) for n in numels]
    swapped = [k for k in parts if k * param_bytes >= min_aio_bytes]
    largest = max(swapped, default=max(parts))
    return SwapBuffers(max(1, len(swapped)), _ceil_to(largest * param_bytes, align) // param_bytes)


def buffers_short(buffers: SwapBuffers, param_numels, nd: int = 1, *, param_bytes: int = 4,
                  min_aio_bytes: int = MIN_AIO_BYTES) -> str | None:
    """Why ``buffers`` could run out for this model (one line), None if :func:`swap_buffers` would accept them."""
    need = swap_buffers(param_numels, nd, param_bytes=param_bytes, min_aio_bytes=min_aio_bytes)
    if buffers.buffer_size < need.buffer_size:
        return (f"buffer_size {buffers.buffer_size} < the largest swapped partition, {need.buffer_size} elements: "
                f"DeepSpeed asserts 'More elements than buffer size'")
    if buffers.buffer_count < need.buffer_count:
        return (f"buffer_count {buffers.buffer_count} < {need.buffer_count} swapped parameters: a step that has "
                f"them all in flight raises 'Not enough buffers' (DeepSpeed #3062)")
    return None


def offload_config(device: str, micro_batch: int, nvme_path: str | None, buffers: SwapBuffers | None,
                   *, states: int = ADAM_STATES) -> dict:
    """DeepSpeed config (https://www.deepspeed.ai/docs/config-json/) of a fp32 ZeRO-3 run with the parameters
    and the optimizer offloaded to ``device`` (``"nvme"``: swapped to files in ``nvme_path``, parameter
    ``buffers`` from :func:`swap_buffers`; ``"cpu"``: kept in CPU memory). Every parameter is partitioned and
    released after use, nothing prefetched (so each is fetched once for the forward and once for the backward),
    the optimizer's swapping not pipelined (its reads and writes sit in the step), torch's AdamW kept
    (``zero_force_ds_cpu_optimizer`` off: no ``cpu_adam`` op to compile)."""
    if device not in OFFLOAD_DEVICES:
        raise OffloadError(f"device must be one of {OFFLOAD_DEVICES}, got {device!r}. Hint: 'nvme' is ZeRO-Infinity's disk tier")
    param, opt = {"device": device}, {"device": device}
    if device == "nvme":
        if not nvme_path or buffers is None:
            raise OffloadError("device 'nvme' needs nvme_path and buffers. Hint: swap_buffers(param_numels)")
        # max_in_cpu: parameter elements the ZeRO-3 optimizer copies back into CPU memory for good (stage3.py,
        # _create_param_groups_fp16_flat_cpu_memory; default 1e9, i.e. every parameter of a small model): 0 keeps
        # them all on NVMe
        param.update(nvme_path=nvme_path, buffer_count=buffers.buffer_count, buffer_size=buffers.buffer_size,
                     max_in_cpu=0)
        # the swap-in of a sub-group takes its master, its states and its gradient at once
        opt.update(nvme_path=nvme_path, buffer_count=states + 2, pipeline_read=False, pipeline_write=False)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "aio": {"block_size": AIO_BLOCK_SIZE, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "zero_optimization": {
            "stage": 3, "offload_param": param, "offload_optimizer": opt,
            "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
        },
    }


def parse_proc_io(text: str) -> dict[str, int]:
    """``/proc/<pid>/io`` as ``{field: int}`` (``rchar``, ``wchar``, ``syscr``, ``syscw``, ``read_bytes``,
    ``write_bytes``, ``cancelled_write_bytes``). ``read_bytes``/``write_bytes`` count what the process made
    the block layer fetch and send (proc(5)): DeepSpeed's ``O_DIRECT`` reads and writes land there, page-cache
    hits do not; ``rchar``/``wchar`` count ``read``/``write`` calls, which libaio's ``io_submit`` is not.

    Raises:
        OffloadError: a line that is not ``name: integer``, or no ``read_bytes``/``write_bytes``.
    """
    out = {}
    for line in filter(str.strip, text.splitlines()):
        name, _, value = line.partition(":")
        if not value.strip().isdigit():
            raise OffloadError(f"not a /proc/<pid>/io line: {line!r}. Hint: the file has 'name: integer' lines")
        out[name.strip()] = int(value)
    if not {"read_bytes", "write_bytes"} <= out.keys():
        raise OffloadError("no read_bytes/write_bytes in /proc/<pid>/io: the kernel lacks task I/O accounting "
                           "(CONFIG_TASK_IO_ACCOUNTING). Hint: a stock Linux kernel has it")
    return out


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """:func:`parse_proc_io` of ``/proc/<pid>/io`` now (the whole process: all its threads, live and ended)."""
    return parse_proc_io(Path(f"/proc/{pid}/io").read_text())


def io_delta(before: dict[str, int], after: dict[str, int]) -> tuple[int, int]:
    """``(read_bytes, write_bytes)`` between two :func:`proc_io` readings."""
    return after["read_bytes"] - before["read_bytes"], after["write_bytes"] - before["write_bytes"]


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential ``O_DIRECT`` bandwidth of the disk under ``folder`` (bytes/s), one pass of ``nbytes`` each way
    in ``block``-byte requests, and the process's ``/proc/self/io`` bytes over each pass (a check that the
    kernel accounts direct I/O: they should equal ``nbytes``)."""

    folder: str
    nbytes: int
    block: int
    write: float
    read: float
    accounted_write: int
    accounted_read: int


def disk_bandwidth(folder, nbytes: int = 64 << 20, block: int = 1 << 20) -> DiskBandwidth:
    """Write ``nbytes`` to a file in ``folder`` and read it back, both ``O_DIRECT`` (no page cache, as
    DeepSpeed's ``async_io`` opens its swap files: ``csrc/aio/common/deepspeed_aio_utils.cpp``), one request
    of ``block`` bytes at a time from a page-aligned buffer; the write is timed up to its ``fsync``. One
    synchronous request in flight is a floor: DeepSpeed keeps ``queue_depth`` (8) in flight.

    Raises:
        OffloadError: ``nbytes``/``block`` not positive multiples of 4096 with ``block`` <= ``nbytes``;
            OSError: the filesystem refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some overlay setups).
    """
    import mmap

    for name, x in (("nbytes", nbytes), ("block", block)):
        if _integer(name, x, "bytes, a multiple of 4096 (O_DIRECT's alignment)") % 4096:
            raise OffloadError(f"{name} must be a multiple of 4096, got {x}. Hint: 64 << 20 is 64 MiB")
    if block > nbytes:
        raise OffloadError(f"block ({block}) must be at most nbytes ({nbytes}). Hint: block=1 << 20")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".bandwidth-{os.getpid()}.bin"
    buf = mmap.mmap(-1, block)  # anonymous maps are page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    try:
        fd, io0, start = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT), proc_io(), time.perf_counter()
        try:
            for offset in range(0, nbytes, block):
                os.pwritev(fd, [buf], offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s, io1 = time.perf_counter() - start, proc_io()
        fd, start = os.open(path, os.O_RDONLY | os.O_DIRECT), time.perf_counter()
        try:
            for offset in range(0, nbytes, block):
                os.preadv(fd, [buf], offset)
        finally:
            os.close(fd)
        read_s, io2 = time.perf_counter() - start, proc_io()
    finally:
        path.unlink(missing_ok=True)
        buf.close()
    return DiskBandwidth(str(folder), nbytes, block, nbytes / write_s, nbytes / read_s,
                         io_delta(io0, io1)[1], io_delta(io1, io2)[0])


def nvme_folder() -> Path:
    """Where the swap files go: ``$TERAFLOPS_NVME`` (on a GPU box, a folder on its NVMe drive), else
    ``nvme/`` under :func:`teraflops.caches.cache_dir` (this machine's disk)."""
    return Path(os.environ.get("TERAFLOPS_NVME") or cache_dir() / "nvme")


@dataclass(frozen=True)
class OffloadPass:
    """One offload setting :mod:`teraflops.workers.nvme_offload` runs: ``device`` and its DeepSpeed ``config``."""

    device: str
    config: dict[str, object]


@dataclass(frozen=True)
class OffloadSpec:
    """What :mod:`teraflops.workers.nvme_offload` runs: ``model`` trained ``steps`` steps under each pass in
    turn (the same seed and batches), ``timeout_s`` seconds a collective may wait."""

    model: TrainConfig
    steps: int
    passes: tuple[OffloadPass, ...]
    timeout_s: float = 120


@dataclass(frozen=True)
class OffloadPassResult:
    """One pass on one rank: per step, ``read_bytes``/``write_bytes`` (``/proc/self/io`` around it),
    ``step_s`` and ``losses``; ``param_numels`` (the model's, in order), ``nvme_params`` (parameters DeepSpeed
    placed on NVMe), ``swap_file_bytes`` (the swap folder's files after the last step)."""

    device: str
    read_bytes: list[int]
    write_bytes: list[int]
    step_s: list[float]
    losses: list[float]
    param_numels: list[int]
    nvme_params: int
    swap_file_bytes: int


@dataclass(frozen=True)
class OffloadResult(RankIdentity):
    """One rank's passes, in the spec's order."""

    passes: tuple[OffloadPassResult, ...]


@dataclass(frozen=True)
class OffloadRun:
    """One pass of :func:`run_nvme_offload`, rank 0's, steps after the first: ``read``/``write`` bytes per
    step (mean), ``step_s`` (median), the ``model`` (:func:`nvme_step_bytes`; DeepSpeed's rules) and
    ``paper`` (every byte of every tensor), the ``disk`` bandwidth, ``buffers`` used; ``result`` as returned."""

    device: str
    nd: int
    read: float
    write: float
    step_s: float
    model: NvmeStepBytes
    paper: NvmeStepBytes
    disk: DiskBandwidth
    buffers: SwapBuffers
    result: OffloadPassResult = field(repr=False)

    @property
    def io_floor_s(self) -> float:
        """Seconds the measured bytes take at the disk's measured bandwidth, reads and writes in turn."""
        return self.read / self.disk.read + self.write / self.disk.write


def gpt_numels(cfg: TrainConfig) -> list[int]:
    """Elements of each parameter of ``cfg``'s :class:`teraflops.models.GPT`, in ``parameters()`` order (built on
    the meta device: no memory)."""
    with torch.device("meta"):
        model = GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq_len)
    return [p.numel() for p in model.parameters()]


def nvme_spec(cfg: TrainConfig, steps: int, folder: Path, devices=OFFLOAD_DEVICES, nd: int = 1) -> OffloadSpec:
    """The :class:`OffloadSpec` of ``cfg`` on ``nd`` ranks: one pass per ``devices``, NVMe swap files in
    ``folder``, parameter buffers from :func:`swap_buffers`."""
    buffers = swap_buffers(gpt_numels(cfg), nd)
    return OffloadSpec(cfg, steps, tuple(OffloadPass(d, offload_config(d, cfg.micro_batch, str(folder), buffers))
                                         for d in devices))


def run_nvme_offload(cfg: TrainConfig | None = None, steps: int | None = None, devices=OFFLOAD_DEVICES,
                     folder=None, timeout: float = 900) -> list[OffloadRun]:
    """Train the course GPT (default :func:`teraflops.sizing.dp_config` of the preset: Unit 2 §3's and Unit 5 §2's
    model) under ZeRO-3 with parameters and optimizer offloaded to each of ``devices`` in turn, one rank
    started by the DeepSpeed launcher, and measure it (the module docstring).

    ``steps`` (default the preset's ``zero.steps``, at least 3: the first is warm-up and creates the optimizer
    states); ``folder`` for the swap files (default :func:`nvme_folder`; a fresh subfolder, removed after).
    Builds DeepSpeed's ``async_io`` op first (:func:`teraflops.launch.ops.prepare_aio_op`, once per machine)
    and measures the disk's bandwidth in the same folder.

    Raises:
        AioUnavailable: no libaio (one line with the fix). OpBuildFailed: the op did not compile.
        LaunchFailed: the run failed or passed ``timeout`` s.
    """
    p = preset()
    cfg = cfg or dp_config(p)
    steps = max(3, steps or p.zero.steps)
    prepare_aio_op()
    root = Path(folder or nvme_folder())
    run_dir = root / f"run-{os.getpid()}-{time.time_ns()}"
    run_dir.mkdir(parents=True)
    try:
        disk = disk_bandwidth(run_dir)
        spec = nvme_spec(cfg, steps, run_dir, devices)
        ranks = launch(WORKER, 1, spec=spec, result=OffloadResult, launcher="deepspeed", timeout=timeout,
                       desc="ZeRO-3 offload to " + " and ".join(devices))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return [_summary(r, disk, ranks[0].world_size) for r in ranks[0].passes]


def _summary(r: OffloadPassResult, disk: DiskBandwidth, nd: int) -> OffloadRun:
    later = slice(1, None)  # the first step creates the optimizer states and writes them the first time
    model = nvme_step_bytes(r.param_numels, nd)
    return OffloadRun(r.device, nd, statistics.fmean(r.read_bytes[later]), statistics.fmean(r.write_bytes[later]),
                      statistics.median(r.step_s[later]), model,
                      nvme_step_bytes(r.param_numels, nd, min_aio_bytes=0, align=1), disk,
                      swap_buffers(r.param_numels, nd), r)


def _ratio(measured: float, model: float) -> str:
    return f"{measured / model:.3f}" if model else ("-" if measured == 0 else "inf")


def offload_run_table(runs: list[OffloadRun]) -> str:
    """:func:`run_nvme_offload`'s passes as a table (MB = 1e6 bytes per step): measured against DeepSpeed's
    rules (:func:`nvme_step_bytes`) and the paper's count, the step time against the I/O floor (the measured
    bytes at the disk's measured bandwidth), under a line with the disk's bandwidth. The CPU pass's model is
    0: nothing goes to disk."""
    if not runs:
        raise OffloadError("offload_run_table got no runs. Hint: offload_run_table(run_nvme_offload())")
    d, MB = runs[0].disk, 1e6
    head = (f"# disk {d.folder}: O_DIRECT sequential write {d.write / MB:.0f} MB/s, read {d.read / MB:.0f} MB/s "
            f"({d.nbytes >> 20} MiB in {d.block >> 20} MiB requests)")
    rows = []
    for r in runs:
        model = r.model if r.device == "nvme" else NvmeStepBytes(0, 0, {}, 0, 0)
        rows.append((r.device, r.read / MB, model.read / MB, _ratio(r.read, model.read), r.write / MB,
                     model.write / MB, _ratio(r.write, model.write),
                     (r.paper.read if r.device == "nvme" else 0) / MB, r.step_s, r.io_floor_s))
    return head + "\n" + table(rows, ["offload", "read/step (MB)", "model", "ratio", "write/step (MB)", "model",
                                      "ratio", "paper read (MB)", "step (s)", "I/O floor (s)"])
