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

import re
from dataclasses import dataclass, replace

import torch

from .machine import detect
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

# Order matters: the first pattern that matches wins, so variants come before the base name.
PUBLISHED: tuple[PublishedGPU, ...] = (
    PublishedGPU("V100 SXM2", r"\bV100\b", None, 125.0, 900.0, 32.0, 300.0, 32.0,
                 "NVIDIA Tesla V100 datasheet (2020), https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    PublishedGPU("A100 40GB", r"\bA100\b.*\b40GB\b", 312.0, 312.0, 1555.0, 40.0, 600.0, 64.0, _A100),
    PublishedGPU("A100 PCIe 80GB", r"\bA100\b.*PCIE", 312.0, 312.0, 1935.0, 80.0, 600.0, 64.0, _A100),
    PublishedGPU("A100 SXM 80GB", r"\bA100\b", 312.0, 312.0, 2039.0, 80.0, 600.0, 64.0, _A100),
    PublishedGPU("L4", r"\bL4\b", 121.0, 121.0, 300.0, 24.0, None, 64.0,
                 "NVIDIA L4 Tensor Core GPU datasheet (2023), https://www.nvidia.com/en-us/data-center/l4/"),
    PublishedGPU("H100 PCIe", r"\bH100\b.*PCIE", 756.0, 756.0, 2000.0, 80.0, 600.0, 128.0, _H100),
    PublishedGPU("H100 NVL", r"\bH100\b.*NVL", 835.5, 835.5, 3900.0, 94.0, 600.0, 128.0, _H100),
    PublishedGPU("H100 SXM", r"\bH100\b", 989.5, 989.5, 3350.0, 80.0, 900.0, 128.0, _H100),
    PublishedGPU("H200 NVL", r"\bH200\b.*NVL", 835.5, 835.5, 4800.0, 141.0, 900.0, 128.0, _H200),
    PublishedGPU("H200 SXM", r"\bH200\b", 989.5, 989.5, 4800.0, 141.0, 900.0, 128.0, _H200),
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
        return (
            f"{self.device} ceilings ({str(self.dtype).replace('torch.', '')}): "
            f"peak {self.peak_flops / 1e12:.3g} TFLOP/s, copy bandwidth {self.bandwidth / 1e9:.3g} GB/s, "
            f"ridge point {self.ridge_point:.3g} FLOP/byte"
        )


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


def measure_ceilings(matmul_n: int | None = None, copy_bytes: int | None = None,
                     dtype: torch.dtype | None = None, device: str | None = None) -> Ceilings:
    """Probe this machine's peak matmul FLOP/s and copy bandwidth (a few seconds).

    Sizes and dtype default to :func:`teraflops.sizing.preset` for this machine.
    """
    from .sizing import preset

    p = preset()
    device = device or detect().device
    dtype = dtype or p.dtype
    matmul_n = matmul_n or p.probe_matmul_n
    copy_bytes = copy_bytes or p.probe_copy_bytes
    # The best of two sizes: one probe on a shared CPU can land on a slow moment.
    flops = max(measure_peak_flops(n, dtype, device) for n in (matmul_n // 2, matmul_n))
    bw = measure_copy_bandwidth(copy_bytes, device)
    return Ceilings(flops, bw, dtype, device, matmul_n, copy_bytes)
