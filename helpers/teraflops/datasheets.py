"""Datasheets: what vendors and standards publish about the hardware, each number with its source.

The course compares every measurement with a published ceiling. This module is the one catalogue of
those numbers; nothing in it is measured:

* **GPUs** (:data:`PUBLISHED`, :func:`published_for`, :func:`published_peak`): dense tensor-core
  FLOP/s, HBM bandwidth and memory, NVLink and PCIe bandwidth per GPU, from NVIDIA's datasheets.
  From Ampere on, NVIDIA datasheets quote tensor-core FLOP/s "with sparsity"; the dense figure used
  here is half of it (the V100 and T4 predate sparsity: their figures are used as printed).
  Measured against them: :mod:`teraflops.ceilings` (roofline, Unit 1; bandwidth ladder, Unit 5).
* **Links** (:data:`PUBLISHED_LINKS`, :func:`cross_node_link`, :data:`ETHERNET_25G`): bytes/s **per
  direction**, the figure a collective's busbw is compared with (nccl-tests, ``doc/PERFORMANCE.md``),
  derived from the printed figure (often both directions, before line encoding) as each entry's
  ``note`` says. Measured against them: :mod:`teraflops.hardware.collectives` and :mod:`teraflops.hardware.fabrics`
  (Unit 5); priced with them: :mod:`teraflops.hardware.comm_budget`.

Units: TFLOP/s = 1e12 FLOP/s; GB/s with GB = 1e9 bytes; Gb/s = 1e9 bits/s; GT/s = 1e9 transfers/s.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from teraflops.errors import CourseError
from teraflops.tables import GB, table


# ---- GPUs -------------------------------------------------------------------------------------------


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
    :data:`PUBLISHED`. ``gpu_name`` ``None`` (no GPU here): the H100 SXM's
    (989.5 TFLOP/s bf16), the course's reference GPU, and the source says so.

    Raises:
        NoDatasheetError: ``gpu_name`` is not in the table ("no datasheet for <name>"): an
            unknown GPU is never priced as another one.
    """
    if gpu_name:
        gpu = published_for(gpu_name)
        if gpu is None:
            raise NoDatasheetError(f"no datasheet for {gpu_name!r} in teraflops.datasheets.PUBLISHED. "
                                   "Hint: pass its dense 16-bit peak yourself (peak_flops=...)")
        return gpu.tensor_tflops * 1e12, f"published {gpu.name} dense 16-bit, detected"
    gpu = next(g for g in PUBLISHED if g.name == "H100 SXM")
    return gpu.tensor_tflops * 1e12, f"published {gpu.name} dense 16-bit, default, no GPU here"


# ---- links ------------------------------------------------------------------------------------------


class LinkInputError(CourseError, ValueError):
    """A bad argument to :func:`cross_node_link` (a port count that is not an integer >= 1)."""


@dataclass(frozen=True)
class PublishedLink:
    """A link's datasheet bandwidth. ``bandwidth``: bytes/s **per direction** (what busbw is compared
    with: a ring sends and receives at once); ``note``: how the number follows from the source."""

    name: str
    bandwidth: float
    quoted: str  # the figure as the source prints it
    note: str
    source: str


PUBLISHED_LINKS: tuple[PublishedLink, ...] = (
    PublishedLink("NVLink 4 (H100 SXM)", 450e9, "900 GB/s",
                  "900 GB/s total per GPU = 18 links × 50 GB/s, counting both directions: 450 GB/s per direction "
                  "(data rate; NVSwitch connects all 8 GPUs of an HGX H100 at this rate)",
                  "NVIDIA H100 Tensor Core GPU datasheet (2023), https://resources.nvidia.com/en-us-tensor-core/"
                  "nvidia-tensor-core-gpu-datasheet; NVLink page, https://www.nvidia.com/en-us/data-center/nvlink/"),
    PublishedLink("PCIe Gen4 x16", 16 * 16e9 * 128 / 130 / 8, "16 GT/s per lane",
                  "16 lanes × 16 GT/s with 128b/130b encoding = 31.5 GB/s per direction (datasheets print "
                  "64 GB/s: both directions, before encoding); transaction-layer packet headers take a further share",
                  "PCI-SIG, PCI Express Base Specification Revision 4.0 (2017), https://pcisig.com/specifications"),
    PublishedLink("PCIe Gen5 x16", 16 * 32e9 * 128 / 130 / 8, "32 GT/s per lane",
                  "16 lanes × 32 GT/s with 128b/130b encoding = 63.0 GB/s per direction (the H100 datasheet's "
                  "128 GB/s: both directions, before encoding)",
                  "PCI-SIG, PCI Express Base Specification Revision 5.0 (2019), https://pcisig.com/specifications"),
    PublishedLink("InfiniBand NDR (400 Gb/s)", 400e9 / 8, "400 Gb/s",
                  "one 4x NDR port: 400 Gb/s of data per direction (4 lanes × 100 Gb/s; the line rate with FEC "
                  "is higher) = 50 GB/s; a DGX H100 has one such port per GPU",
                  "NVIDIA DGX SuperPOD data-center design guide (cabling), \"NDR Overview\", https://docs.nvidia.com/"
                  "dgx-superpod/design-guide-cabling-data-centers/latest/ndr-overview.html; InfiniBand Trade "
                  "Association roadmap, https://www.infinibandta.org/infiniband-roadmap/"),
)


# a commodity cluster's port, emulated beside the others in Unit 5 §6 (teraflops.hardware.fabrics); not a row of the tables
ETHERNET_25G = PublishedLink(
    "Ethernet 25GBASE-R", 25e9 / 8, "25 Gb/s",
    "one 25 Gb/s port: 3.125 GB/s of data per direction (64b/66b encoding is on top of it)",
    "IEEE Std 802.3by-2016, 25 Gb/s Ethernet, https://standards.ieee.org/ieee/802.3by/5750/")


def cross_node_link(nics_per_node: int = 8, nic: PublishedLink = PUBLISHED_LINKS[3],
                    intra: PublishedLink = PUBLISHED_LINKS[0]) -> PublishedLink:
    """The per-rank bandwidth of a ring all-reduce that crosses nodes with ``nics_per_node`` network
    ports per node: ``min(nics_per_node × nic, intra)``, as a :class:`PublishedLink` for
    :func:`teraflops.hardware.comm_budget.gradient_sync_rows`.

    NCCL builds one ring (channel) per port; each ring carries its share of the buffer and enters and
    leaves every node once, through its own port, while the hops inside a node use NVLink. So a node's
    ports add up, until the intra-node links become the limit (NVIDIA/nccl issue #412, the maintainer's
    answer: more NICs next to the GPUs give more inter-node bandwidth, "up to" the NVLink intra-node
    bandwidth; issue #569 measures it on DGX-2 nodes). ``nics_per_node = 1`` is a node whose GPUs share
    one port, the bare ``nic`` row of :data:`PUBLISHED_LINKS`; a DGX H100 has 8 NDR ports, one per GPU.

    Raises:
        LinkInputError: ``nics_per_node`` not an integer >= 1.
    """
    if isinstance(nics_per_node, bool) or not isinstance(nics_per_node, numbers.Integral) or nics_per_node < 1:
        raise LinkInputError(f"nics_per_node must be an integer >= 1, got {nics_per_node!r}. "
                             "Hint: a DGX H100 has 8 InfiniBand NDR ports, one per GPU")
    bandwidth = min(int(nics_per_node) * nic.bandwidth, intra.bandwidth)
    return PublishedLink(f"{nics_per_node} × {nic.name.split(' (')[0]} per node", bandwidth,
                         f"{nics_per_node} × {nic.quoted}",
                         f"a ring across nodes: one NCCL ring per port, {nics_per_node} × {nic.bandwidth / GB:g} GB/s "
                         f"= {nics_per_node * nic.bandwidth / GB:g} GB/s per direction, at most {intra.name}'s "
                         f"{intra.bandwidth / GB:g} GB/s",
                         f"{nic.source}; NVIDIA/nccl issue #412, https://github.com/NVIDIA/nccl/issues/412")


def links_table(links=PUBLISHED_LINKS) -> str:
    """The published links: GB/s per direction, the figure as printed and its source; then, numbered,
    how the one follows from the other."""
    body = table([(f"[{i}] {l.name}", l.bandwidth / GB, l.quoted, l.source.split(", http")[0])
                  for i, l in enumerate(links, 1)], ["link", "GB/s per direction", "as published", "source"])
    return body + "\n" + "\n".join(f"[{i}] {l.note}" for i, l in enumerate(links, 1))


def pcie_link(gpu: PublishedGPU | None) -> PublishedLink | None:
    """The :data:`PUBLISHED_LINKS` entry of a GPU's host link (its datasheet prints 64 GB/s for PCIe
    Gen4 x16, 128 GB/s for Gen5 x16, both directions), or ``None``."""
    want = {64.0: "PCIe Gen4 x16", 128.0: "PCIe Gen5 x16"}.get(gpu.pcie_gb_s) if gpu else None
    return next((l for l in PUBLISHED_LINKS if l.name == want), None)
