"""Ceilings: how fast can this machine compute, and how fast can it move bytes?

Two sources, shown side by side in the course:

* **Measured** on this machine by short probes (:func:`measure_ceilings`): the FLOP/s of large
  square matmuls in the dtype in use (the best of two sizes: what the BLAS / cuBLAS library
  reaches, a practical peak) and the bandwidth of a large device-to-device copy, counted as STREAM "Copy" counts it:
  bytes read + bytes written (McCalpin, STREAM benchmark, https://www.cs.virginia.edu/stream/ref.html).
* **Published** datasheet numbers for known GPUs (:data:`PUBLISHED`). From Ampere on, NVIDIA
  datasheets quote tensor-core FLOP/s "with sparsity"; the dense figure used here is half of it
  (the V100 predates sparsity: its figure is used as printed).

The ratio ``peak FLOP/s / bandwidth`` is the **ridge point** of the roofline (Williams, Waterman &
Patterson, "Roofline: An Insightful Visual Performance Model for Multicore Architectures",
CACM 52(4), 2009): kernels with lower arithmetic intensity (FLOP per byte) are memory-bound.
Units: FLOP/s, bytes/s with GB = 1e9 bytes, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .errors import CourseError
from .machine import detect
from .sizing import preset
from .tables import GB
from .timing import benchmark


@dataclass(frozen=True)
class PublishedGPU:
    """Datasheet ceilings of one GPU (dense tensor-core FLOP/s; bandwidths in GB/s, GB = 1e9)."""

    name: str
    pattern: str  # regex matched (case-insensitive) against torch.cuda.get_device_name()
    bf16_tflops: float | None  # dense bf16 tensor core, TFLOP/s (None: no bf16 tensor cores)
    fp16_tflops: float  # dense fp16 tensor core (fp32 accumulate), TFLOP/s
    hbm_gb_s: float  # device memory bandwidth
    memory_gb: float
    nvlink_gb_s: float | None  # total bidirectional NVLink bandwidth per GPU
    pcie_gb_s: float  # host link, bidirectional, as the datasheet states
    source: str

    @property
    def tensor_tflops(self) -> float:
        """Dense 16-bit tensor-core TFLOP/s: bf16 where the GPU has it, else fp16."""
        return self.bf16_tflops or self.fp16_tflops


_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021), https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU product page and datasheet (2024), https://www.nvidia.com/en-us/data-center/h200/"

_ADA = ("NVIDIA Ada GPU Architecture whitepaper v1.1 (2023), Table 2 (GeForce RTX 4090), "
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
_GH200 = ("NVIDIA GH200 Grace Hopper Superchip datasheet (2024), "
          "https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip")

# Order matters: the first pattern that matches wins, so variants come before the base name.
# Dense figures: NVIDIA prints Ampere-and-later tensor-core peaks as "dense | sparse" (or "with
# sparsity" only, halved here); Turing (T4) and Volta (V100) have no sparsity and are used as printed.
# The GeForce RTX 4090's 16-bit tensor rate with fp32 accumulate is half its fp16-accumulate rate
# (Ada whitepaper, Table 2): the fp32-accumulate figure is the one a training matmul gets.
# A GH200's host link is NVLink-C2C (900 GB/s both directions), not PCIe.
PUBLISHED: tuple[PublishedGPU, ...] = (
    PublishedGPU("V100 SXM2", r"\bV100\b", None, 125.0, 900.0, 32.0, 300.0, 32.0,
                 "NVIDIA Tesla V100 datasheet (2020), https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    PublishedGPU("T4", r"\bT4\b", None, 65.0, 320.0, 16.0, None, 32.0,
                 "NVIDIA T4 Tensor Core GPU datasheet (2019), https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"),
    PublishedGPU("A10", r"\bA10\b", 125.0, 125.0, 600.0, 24.0, None, 64.0,
                 "NVIDIA A10 Tensor Core GPU datasheet (2021), https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"),
    PublishedGPU("A100 40GB", r"\bA100\b.*\b40GB\b", 312.0, 312.0, 1555.0, 40.0, 600.0, 64.0, _A100),
    PublishedGPU("A100 PCIe 80GB", r"\bA100\b.*PCIE", 312.0, 312.0, 1935.0, 80.0, 600.0, 64.0, _A100),
    PublishedGPU("A100 SXM 80GB", r"\bA100\b", 312.0, 312.0, 2039.0, 80.0, 600.0, 64.0, _A100),
    PublishedGPU("L40S", r"\bL40S\b", 362.05, 362.05, 864.0, 48.0, None, 64.0,
                 "NVIDIA L40S GPU datasheet (2023), https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    PublishedGPU("L4", r"\bL4\b", 121.0, 121.0, 300.0, 24.0, None, 64.0,
                 "NVIDIA L4 Tensor Core GPU datasheet (2023), https://www.nvidia.com/en-us/data-center/l4/"),
    PublishedGPU("RTX 4090", r"\bRTX 4090\b", 165.2, 165.2, 1008.0, 24.0, None, 64.0, _ADA),
    PublishedGPU("GH200 144GB", r"\bGH200\b.*\b144G", 989.5, 989.5, 4900.0, 144.0, 900.0, 900.0, _GH200),
    PublishedGPU("GH200 96GB", r"\bGH200\b", 989.5, 989.5, 4000.0, 96.0, 900.0, 900.0, _GH200),
    PublishedGPU("H100 PCIe", r"\bH100\b.*PCIE", 756.0, 756.0, 2000.0, 80.0, 600.0, 128.0, _H100),
    PublishedGPU("H100 NVL", r"\bH100\b.*NVL", 835.5, 835.5, 3900.0, 94.0, 600.0, 128.0, _H100),
    PublishedGPU("H100 SXM", r"\bH100\b", 989.5, 989.5, 3350.0, 80.0, 900.0, 128.0, _H100),
    PublishedGPU("H200 NVL", r"\bH200\b.*NVL", 835.5, 835.5, 4800.0, 141.0, 900.0, 128.0, _H200),
    PublishedGPU("H200 SXM", r"\bH200\b", 989.5, 989.5, 4800.0, 141.0, 900.0, 128.0, _H200),
    PublishedGPU("B200", r"\bB200\b", 2250.0, 2250.0, 8000.0, 180.0, 1800.0, 128.0,
                 "NVIDIA HGX B200 specifications (2025; per GPU = the 8-GPU figures ÷ 8, FP16/BF16 "
                 "36 PFLOPS with sparsity), https://www.nvidia.com/en-us/data-center/hgx/"),
)


def published_for(gpu_name: str | None) -> PublishedGPU | None:
    """The first :data:`PUBLISHED` entry whose pattern matches ``gpu_name`` (e.g. ``"NVIDIA H200"``);
    ``None`` for a CPU or a GPU not in the table (an L40S is not an L4, a GH200 not an H200)."""
    if not gpu_name:
        return None
    for entry in PUBLISHED:
        if re.search(entry.pattern, gpu_name, re.IGNORECASE):
            return entry
    return None


class NoDatasheetError(CourseError):
    """A GPU name that :data:`PUBLISHED` has no datasheet for."""


def published_peak(gpu_name: str | None = None) -> tuple[float, str]:
    """``(FLOP/s, source)``: dense 16-bit tensor-core peak of ``gpu_name`` from
    :data:`teraflops.ceilings.PUBLISHED`. ``gpu_name`` ``None`` (no GPU here): the H100 SXM's
    (989.5 TFLOP/s bf16), the course's reference GPU, and the source says so.

    Raises:
        NoDatasheetError: ``gpu_name`` is not in the table ("no datasheet for <name>"): an
            unknown GPU is never priced as another one.
    """
    if gpu_name:
        gpu = published_for(gpu_name)
        if gpu is None:
            raise NoDatasheetError(f"no datasheet for {gpu_name!r} in teraflops.ceilings.PUBLISHED. "
                                   "Hint: pass its dense 16-bit peak yourself (peak_flops=...)")
        return gpu.tensor_tflops * 1e12, f"published {gpu.name} dense 16-bit, detected"
    gpu = next(g for g in PUBLISHED if g.name == "H100 SXM")
    return gpu.tensor_tflops * 1e12, f"published {gpu.name} dense 16-bit, default, no GPU here"


@dataclass(frozen=True)
class Ceilings:
    """Measured ceilings of one device.

    Attributes:
        peak_flops: FLOP/s of the probe matmul (``2·n³`` FLOP per call).
        bandwidth: bytes/s of the probe copy (read + write).
        dtype: dtype of the matmul probe.
        device: ``"cpu"`` or ``"cuda"``.
        matmul_n: size of the probe matmul; copy_bytes: size of the copied tensor.
    """

    peak_flops: float
    bandwidth: float
    dtype: torch.dtype
    device: str
    matmul_n: int
    copy_bytes: int
    source: str = "measured"  # "measured" here, or where they came from (SHARED_ENV's file, "given")

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline bends: ``peak_flops / bandwidth``."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """Roofline: ``min(peak_flops, bandwidth × intensity)`` in FLOP/s."""
        return min(self.peak_flops, self.bandwidth * intensity)

    def covering(self, points) -> "Ceilings":
        """These ceilings raised to the best rates the roofline points reached, if any went higher.

        An empirical roofline's ceilings are the best rates observed on the machine (the convention
        of the Empirical Roofline Toolkit, Lo et al., "Roofline Model Toolkit", PMBS 2014): a probe
        that landed on a busy moment must not leave measured points above the roof.
        ``points`` are :class:`teraflops.roofline.RooflinePoint`.
        """
        peak = max([self.peak_flops] + [p.achieved_flops for p in points if p.flops > 0])
        bandwidth = max([self.bandwidth] + [p.achieved_bandwidth for p in points])
        return replace(self, peak_flops=peak, bandwidth=bandwidth)

    def __str__(self) -> str:
        where = "" if self.source == "measured" else f" [{self.source}]"
        return (
            f"{self.device} ceilings ({str(self.dtype).replace('torch.', '')}): "
            f"peak {self.peak_flops / 1e12:.3g} TFLOP/s, copy bandwidth {self.bandwidth / 1e9:.3g} GB/s, "
            f"ridge point {self.ridge_point:.3g} FLOP/byte{where}"
        )

    def to_json(self) -> dict:
        return {"peak_flops": self.peak_flops, "bandwidth": self.bandwidth, "dtype": str(self.dtype).replace("torch.", ""),
                "device": self.device, "matmul_n": self.matmul_n, "copy_bytes": self.copy_bytes}


SHARED_ENV = "TERAFLOPS_CEILINGS"  # a JSON file of Ceilings.to_json(): the run's one probe (teraflops run)
SHARED_SOURCE = "measured once for this teraflops run"


def shared_ceilings(dtype: torch.dtype, device: str, matmul_n: int, copy_bytes: int) -> Ceilings | None:
    """The ceilings ``teraflops run`` measured once before its first notebook (the file named by
    ``$TERAFLOPS_CEILINGS``), when they answer the same probe (dtype, device, sizes); else ``None``
    (unset, missing, unreadable or another probe: the caller measures)."""
    import json
    import os

    path = os.environ.get(SHARED_ENV)
    if not path:
        return None
    try:
        d = json.loads(Path(path).read_text())
        shared = Ceilings(float(d["peak_flops"]), float(d["bandwidth"]), getattr(torch, d["dtype"]), str(d["device"]),
                          int(d["matmul_n"]), int(d["copy_bytes"]), SHARED_SOURCE)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    same = (shared.dtype, shared.device, shared.matmul_n, shared.copy_bytes) == (dtype, device, matmul_n, copy_bytes)
    return shared if same else None


def measure_peak_flops(n: int, dtype: torch.dtype, device: str, min_run_time: float = 0.3) -> float:
    """FLOP/s of ``a @ b`` for ``n×n`` matrices: ``2·n³`` FLOP per call (multiply + add)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = benchmark(lambda: a @ b, min_run_time=min_run_time)
    return 2 * n**3 / t.median


def measure_copy_bandwidth(nbytes: int, device: str, min_run_time: float = 0.3) -> float:
    """Bytes/s of ``dst.copy_(src)`` for an ``nbytes`` tensor: counts ``2·nbytes`` (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = benchmark(lambda: dst.copy_(src), min_run_time=min_run_time)
    return 2 * src.numel() * 4 / t.median


class CeilingsError(CourseError, ValueError):
    """A bad argument to :func:`measure_ceilings` (one line, with a hint)."""


def measure_ceilings(matmul_n: int | None = None, copy_bytes: int | None = None,
                     dtype: torch.dtype | None = None, device: str | None = None) -> Ceilings:
    """Probe this machine's peak matmul FLOP/s and copy bandwidth (a few seconds).

    Args:
        matmul_n: size of the square probe matmuls (``matmul_n // 2`` and ``matmul_n``; default the
            preset's ``probe_matmul_n``).
        copy_bytes: bytes of the copied tensor (default the preset's ``probe_copy_bytes``).
        dtype: dtype of the matmuls (default the preset's ``dtype``).
        device: ``"cpu"`` or ``"cuda"`` (default this machine's, :func:`teraflops.machine.detect`).

    Defaults (``None``) come from :func:`teraflops.sizing.preset` for this machine; any other value
    is checked, so 0 is an error, not the default. Under ``teraflops run`` (``$TERAFLOPS_CEILINGS``
    names its probe's file) the same probe is not run again: the run's ceilings are returned, with
    ``source`` saying so, so that every unit of one run uses the same roof.

    Raises:
        CeilingsError: ``matmul_n`` not an int >= 2, ``copy_bytes`` not an int >= 4 (one float32),
            ``dtype`` not a torch dtype, or ``device`` not a non-empty string.
    """
    if matmul_n is None or copy_bytes is None or dtype is None:
        p = preset()
        matmul_n = p.probe_matmul_n if matmul_n is None else matmul_n
        copy_bytes = p.probe_copy_bytes if copy_bytes is None else copy_bytes
        dtype = p.dtype if dtype is None else dtype
    device = detect().device if device is None else device
    if isinstance(matmul_n, bool) or not isinstance(matmul_n, numbers.Integral) or matmul_n < 2:
        raise CeilingsError(f"matmul_n must be an int >= 2 (the probe matmuls are matmul_n // 2 and matmul_n "
                            f"square), got {matmul_n!r}. Hint: leave it None for the preset's probe_matmul_n")
    if isinstance(copy_bytes, bool) or not isinstance(copy_bytes, numbers.Integral) or copy_bytes < 4:
        raise CeilingsError(f"copy_bytes must be an int >= 4 (one float32) to time a copy, got {copy_bytes!r}. "
                            "Hint: leave it None for the preset's probe_copy_bytes, far beyond the last-level cache")
    if not isinstance(dtype, torch.dtype):
        raise CeilingsError(f"dtype must be a torch dtype, got {dtype!r}. Hint: e.g. torch.float32, or None for "
                            "the preset's")
    if not isinstance(device, str) or not device:
        raise CeilingsError(f"device must be 'cpu' or 'cuda', got {device!r}. Hint: leave it None for this machine's")
    matmul_n, copy_bytes = int(matmul_n), int(copy_bytes)
    shared = shared_ceilings(dtype, device, matmul_n, copy_bytes)
    if shared is not None:  # one probe per teraflops run: every unit uses the same roof
        return shared
    # The best of two sizes: one probe on a shared CPU can land on a slow moment.
    flops = max(measure_peak_flops(n, dtype, device) for n in (matmul_n // 2, matmul_n))
    bw = measure_copy_bandwidth(copy_bytes, device)
    return Ceilings(flops, bw, dtype, device, matmul_n, copy_bytes)


# ---- the bandwidth ladder (Unit 5) ---------------------------------------------------------------

# The ladder's copies are the preset's ladder_bytes (teraflops.sizing: far beyond the last-level cache),
# read when bandwidth_ladder() is called, so importing this module probes no hardware.
NEEDS_GPU = "skipped: needs a CUDA GPU"  # the ladder's note on rows a CPU machine cannot measure


class CopyProbeError(CourseError, RuntimeError):
    """A copy probe that cannot run here (host↔device without a GPU) or got a bad argument."""


def measure_host_device_copy(nbytes: int, pinned: bool, direction: str = "h2d",
                             min_run_time: float = 0.3) -> float:
    """Bytes/s of one ``nbytes`` copy between host (CPU) memory and the GPU, over PCIe (or NVLink-C2C).

    Counts ``nbytes`` once: the bytes that cross the host link (unlike :func:`measure_copy_bandwidth`,
    which counts read + write within one memory). ``pinned=True`` copies from/to page-locked host memory
    (``pin_memory=True``), which the GPU's copy engine reads directly by DMA, with ``non_blocking=True``;
    ``pinned=False`` uses ordinary pageable memory, which the CUDA driver first stages through a pinned
    buffer of its own (an extra host copy) — the gap between the two rows of :func:`bandwidth_ladder`
    (NVIDIA, "CUDA C++ Best Practices Guide", §"Pinned Memory",
    https://docs.nvidia.com/cuda/cuda-c-best-practices-guide/#pinned-memory). Timed by
    :func:`teraflops.timing.benchmark` (torch.utils.benchmark synchronises CUDA around each block).

    Args:
        nbytes: bytes per copy (an int >= 1; uint8 tensors). pinned: page-locked host buffer or not.
        direction: ``"h2d"`` (host to device) or ``"d2h"`` (device to host).

    Raises:
        CopyProbeError: a bad ``nbytes`` or ``direction``; or no CUDA GPU (there is no host↔device
            link to measure on a CPU-only machine).
    """
    if direction not in ("h2d", "d2h"):
        raise CopyProbeError(f"direction must be 'h2d' or 'd2h', got {direction!r}. "
                             "Hint: h2d = host (CPU) memory to the GPU, d2h = back")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise CopyProbeError(f"nbytes must be an int >= 1, got {nbytes!r}. "
                             "Hint: e.g. the preset's ladder_bytes (64 MiB on CPU, 256 MiB on a GPU)")
    if not torch.cuda.is_available():
        raise CopyProbeError("measure_host_device_copy needs a CUDA GPU: a host↔device copy crosses the link "
                             "between CPU memory and GPU memory (PCIe), and this machine has no GPU "
                             "(torch.cuda.is_available() is False). Hint: measure_copy_bandwidth(nbytes, 'cpu') "
                             "measures this machine's memory copy")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(2)
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    t = benchmark(lambda: dst.copy_(src, non_blocking=pinned), min_run_time=min_run_time)
    return nbytes / t.median


def _pcie_link(gpu: PublishedGPU | None):
    """The :data:`teraflops.collectives.PUBLISHED_LINKS` entry of a GPU's host link (its datasheet
    prints 64 GB/s for PCIe Gen4 x16, 128 GB/s for Gen5 x16, both directions), or ``None``."""
    from .collectives import PUBLISHED_LINKS

    want = {64.0: "PCIe Gen4 x16", 128.0: "PCIe Gen5 x16"}.get(gpu.pcie_gb_s) if gpu else None
    return next((l for l in PUBLISHED_LINKS if l.name == want), None)


def bandwidth_ladder(nbytes: int | None = None, min_run_time: float = 0.3) -> list[dict]:
    """The bandwidth ladder of this machine, measured: memory copies, then host↔device, pageable vs pinned.

    Rows (dicts), fastest rung first on a GPU:

    * ``device copy``: on a GPU a device-to-device copy in HBM, compared with the datasheet bandwidth
      (:data:`PUBLISHED`); on a CPU a memory copy in DRAM (no datasheet figure: the course's CPU
      machine is a virtual machine on an unspecified board). Counted as STREAM "Copy": read + write.
    * ``host memory copy`` (GPU machines only): the same copy in CPU memory, for comparison.
    * ``H2D`` / ``D2H``, ``pageable`` / ``pinned``: :func:`measure_host_device_copy`, counting the
      bytes that cross the link once, against the per-direction bandwidth of the GPU's PCIe
      generation from :data:`teraflops.collectives.PUBLISHED_LINKS` (after 128b/130b encoding). On a
      CPU machine these rows hold ``None`` and the note ``"skipped: needs a CUDA GPU"``; on a GPU
      without a PCIe generation in :data:`PUBLISHED`, ``published`` is ``None`` and the note says
      ``"no published host link figure for <GPU name>"``.

    Each row: ``what`` (str), ``bandwidth`` (measured bytes/s or ``None``), ``counts`` (how bytes are
    counted), ``published`` (bytes/s or ``None``), ``source`` (of the published figure, or ``None``),
    ``note`` (str). ``nbytes`` (bytes per copy) defaults to :func:`teraflops.sizing.preset`'s
    ``ladder_bytes``: 64 MiB on CPU, 256 MiB on a GPU, 8 MiB at ``tiny``. Takes ~1 s on CPU, a few on a GPU.

    Raises:
        CopyProbeError: ``nbytes`` not an int >= 4 (too small to hold one float32 to copy).
    """
    nbytes = preset().ladder_bytes if nbytes is None else nbytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise CopyProbeError(f"nbytes must be an int >= 4 (one float32) to time a copy, got {nbytes!r}. "
                             "Hint: well beyond the last-level cache, e.g. the preset's ladder_bytes "
                             "(64 MiB on CPU, 256 MiB on a GPU)")
    rw, once = "read + write (2 × bytes)", "bytes crossing the link"
    machine = detect()
    rows = []
    if machine.device == "cuda":
        gpu = published_for(machine.gpu_name)
        rows.append({"what": "device copy (GPU HBM, device to device)",
                     "bandwidth": measure_copy_bandwidth(nbytes, "cuda", min_run_time), "counts": rw,
                     "published": gpu.hbm_gb_s * GB if gpu else None, "source": gpu.source if gpu else None,
                     "note": f"datasheet of the {gpu.name}" if gpu else f"{machine.gpu_name}: not in PUBLISHED"})
        rows.append({"what": "host memory copy (CPU DRAM)", "bandwidth": measure_copy_bandwidth(nbytes, "cpu", min_run_time),
                     "counts": rw, "published": None, "source": None, "note": "all torch threads"})
        link = _pcie_link(gpu)
    else:
        rows.append({"what": "device copy (CPU DRAM, memory to memory)",
                     "bandwidth": measure_copy_bandwidth(nbytes, "cpu", min_run_time), "counts": rw,
                     "published": None, "source": None,
                     "note": f"all {torch.get_num_threads()} torch threads; no datasheet for this virtual machine"})
        link = None
    for direction in ("h2d", "d2h"):
        for pinned in (False, True):
            what = f"{direction.upper()} {'pinned' if pinned else 'pageable'} (host↔device)"
            row = {"what": what, "bandwidth": None, "counts": once, "published": link.bandwidth if link else None,
                   "source": link.source if link else None,
                   "note": f"{link.name}, per direction" if link
                   else f"no published host link figure for {machine.gpu_name}" if machine.device == "cuda"
                   else NEEDS_GPU}
            if machine.device == "cuda":
                row["bandwidth"] = measure_host_device_copy(nbytes, pinned, direction, min_run_time)
            rows.append(row)
    return rows


def ladder_table(rows: list[dict]) -> str:
    """:func:`bandwidth_ladder` rows as a table: measured and published GB/s (GB = 1e9 bytes), the
    fraction of the published figure reached, how bytes are counted and a note; sources numbered below."""
    from .tables import table

    sources = list(dict.fromkeys(r["source"] for r in rows if r["source"]))
    body = table([(r["what"], "skipped" if r["bandwidth"] is None else r["bandwidth"] / GB,
                   "-" if r["published"] is None else r["published"] / GB,
                   "-" if r["bandwidth"] is None or r["published"] is None else f"{r['bandwidth'] / r['published']:.0%}",
                   r["counts"], r["note"] + (f" [{sources.index(r['source']) + 1}]" if r["source"] else ""))
                  for r in rows],
                 ["copy", "measured (GB/s)", "published (GB/s)", "of published", "bytes counted", "note"])
    return body + "".join(f"\n[{i}] {s}" for i, s in enumerate(sources, 1))
