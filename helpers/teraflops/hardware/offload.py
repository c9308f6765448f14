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

Units: bytes (GB = 1e9), seconds, bytes/s per direction, FLOP/s.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from teraflops import ceilings
from teraflops.datasheets import PUBLISHED_LINKS, NoDatasheetError, published_peak
from teraflops.errors import CourseError
from teraflops.hardware.comm_budget import train_flops
from teraflops.machine import detect
from teraflops.parallelization.model_states import deepspeed_estimators, memory_capacities, model_states
from teraflops.sizing import preset
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
