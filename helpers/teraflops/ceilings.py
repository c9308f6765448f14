"""Ceilings: how fast can this machine compute, and how fast can it move bytes?

Two sources, shown side by side in the course:

* **Measured** on this machine by short probes (:func:`measure_ceilings`): the FLOP/s of large
  square matmuls in the dtype in use (the best of two sizes: what the BLAS / cuBLAS library
  reaches, a practical peak) and the bandwidth of a large device-to-device copy, counted as STREAM "Copy" counts it:
  bytes read + bytes written (McCalpin, STREAM benchmark, https://www.cs.virginia.edu/stream/ref.html).
* **Published** datasheet numbers for known GPUs (:data:`teraflops.datasheets.PUBLISHED`, where
  the dense figures and their sources are explained).

The ratio ``peak FLOP/s / bandwidth`` is the **ridge point** of the roofline (Williams, Waterman &
Patterson, "Roofline: An Insightful Visual Performance Model for Multicore Architectures",
CACM 52(4), 2009): kernels with lower arithmetic intensity (FLOP per byte) are memory-bound.
Units: FLOP/s, bytes/s with GB = 1e9 bytes, TFLOP/s = 1e12 FLOP/s.
"""

from __future__ import annotations

import json
import numbers
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from teraflops import caches, machine
from teraflops.datasheets import pcie_link, published_for
from teraflops.errors import CourseError
from teraflops.machine import detect
from teraflops.sizing import preset
from teraflops.tables import GB, table
from teraflops.timing import benchmark


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
    spread: float = 0.0  # 1 - worst/best of the probe's repeats (the larger of the two probes'): 0 = steady
    load: float | None = None  # the 1-minute load average when measured, if the machine was busy (machine.busy_load)
    of_quiet: float | None = None  # the probe over this machine's remembered quiet figures (the lower of the two); None: none known
    doubt: str = ""  # on quiet values returned in place of a probe that was not trusted: that probe's reason

    @property
    def reason(self) -> str:
        """Why these ceilings are not :attr:`trusted` (one clause, the first that applies), or ``""``:

        * ``"machine busy (load 6.2)"``: measured while the 1-minute load average was over
          :data:`teraflops.machine.BUSY_LOAD_PER_CORE` per core;
        * ``"the probe's repeats disagree (spread 34 %, bound 25 %)"``: :attr:`spread` at or over
          :data:`SPREAD_LIMIT`;
        * ``"the probe read 40 % of this machine's quiet figures (bound 60 %)"``: :attr:`of_quiet` under
          :data:`QUIET_FLOOR`, a probe that lands on a busy moment the lagging load average has not
          caught yet (steady and low: a newcomer's first run read 94.8 GFLOP/s and 8.4 GB/s, 0.4x,
          at load 2.9 on 2 cores, under the busy bound of 3).
        """
        if self.load is not None:
            return f"machine busy (load {self.load:.1f})"
        if self.spread >= SPREAD_LIMIT:
            return f"the probe's repeats disagree (spread {self.spread:.0%}, bound {SPREAD_LIMIT:.0%})"
        if self.of_quiet is not None and self.of_quiet < QUIET_FLOOR:
            return f"the probe read {self.of_quiet:.0%} of this machine's quiet figures (bound {QUIET_FLOOR:.0%})"
        return ""

    @property
    def trusted(self) -> bool:
        """Whether these ceilings can place a verdict: measured on a machine that was not busy, steady
        across the probe's repeats (spread below :data:`SPREAD_LIMIT`) and not far below this machine's
        remembered quiet figures (:data:`QUIET_FLOOR`); :attr:`reason` says which failed. At load 4-8 on
        2 cores the probes read 0.1-0.4x their quiet values with a spread as low as 20 %: a steady busy
        machine is still a busy one, so the load decides first."""
        return not self.reason

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
        ``points`` are :class:`teraflops.model_definition.roofline.RooflinePoint`.

        The ceilings of a ``teraflops run`` (``source`` :data:`SHARED_SOURCE`) come back as they are:
        they are the run's one roof, the one its report card prints and every unit places its verdicts
        against; a point above them reads over 100 % of its roof instead. (Raising them here quoted a
        ridge point of 28.3 FLOP/byte in Unit 1 beside the card's 11.2 in one run.)
        """
        if self.source == SHARED_SOURCE:
            return self
        peak = max([self.peak_flops] + [p.achieved_flops for p in points if p.flops > 0])
        bandwidth = max([self.bandwidth] + [p.achieved_bandwidth for p in points])
        return replace(self, peak_flops=peak, bandwidth=bandwidth)

    def __str__(self) -> str:
        where = "" if self.source == "measured" else f" [{self.source}]"
        busy = "" if self.load is None else f", spread {self.spread:.0%} at load {self.load:.1f}"
        busy += f"; not trusted: {self.reason}" if self.reason and self.load is None else ""
        return (
            f"{self.device} ceilings ({str(self.dtype).replace('torch.', '')}): "
            f"peak {self.peak_flops / 1e12:.3g} TFLOP/s, copy bandwidth {self.bandwidth / 1e9:.3g} GB/s, "
            f"ridge point {self.ridge_point:.3g} FLOP/byte{where}{busy}"
        )

    def to_json(self) -> dict:
        return {"peak_flops": self.peak_flops, "bandwidth": self.bandwidth, "dtype": str(self.dtype).replace("torch.", ""),
                "device": self.device, "matmul_n": self.matmul_n, "copy_bytes": self.copy_bytes,
                "spread": self.spread, "load": self.load, "of_quiet": self.of_quiet, "doubt": self.doubt}

    @classmethod
    def from_json(cls, d: dict, source: str) -> "Ceilings":
        """The inverse of :meth:`to_json`, with ``source`` saying where they came from.

        Raises:
            KeyError, TypeError, ValueError, AttributeError: not a :meth:`to_json` dict.
        """
        load, of_quiet = d.get("load"), d.get("of_quiet")
        return cls(float(d["peak_flops"]), float(d["bandwidth"]), getattr(torch, d["dtype"]), str(d["device"]),
                   int(d["matmul_n"]), int(d["copy_bytes"]), source, float(d.get("spread", 0.0)),
                   None if load is None else float(load), None if of_quiet is None else float(of_quiet),
                   str(d.get("doubt") or ""))


SPREAD_LIMIT = 0.25  # a probe whose repeats differ by this much or more is not trusted
# A probe reading under this fraction of this machine's remembered quiet figures is not trusted: quiet
# probes read 0.95-1.02x of the best torch/NumPy rates here, probes at load 4-8 on 2 cores 0.3-0.4x.
QUIET_FLOOR = 0.6
REPEATS = 3  # interleaved rounds of the probes; the best of each is kept
QUIET_FILE = "quiet-ceilings.json"  # in caches.cache_dir(): the last ceilings measured on a quiet machine, by probe


SHARED_ENV = "TERAFLOPS_CEILINGS"  # a JSON file of Ceilings.to_json(): the run's one probe (teraflops run)
SHARED_SOURCE = "measured once for this teraflops run"


def shared_ceilings(dtype: torch.dtype, device: str, matmul_n: int, copy_bytes: int) -> Ceilings | None:
    """The ceilings ``teraflops run`` measured once before its first notebook (the file named by
    ``$TERAFLOPS_CEILINGS``), when they answer the same probe (dtype, device, sizes); else ``None``
    (unset, missing, unreadable or another probe: the caller measures)."""
    import os

    path = os.environ.get(SHARED_ENV)
    if not path:
        return None
    try:
        shared = Ceilings.from_json(json.loads(Path(path).read_text()), SHARED_SOURCE)
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
            preset's ``probe.matmul_n``).
        copy_bytes: bytes of the copied tensor (default the preset's ``probe.copy_bytes``).
        dtype: dtype of the matmuls (default the preset's ``dtype``).
        device: ``"cpu"`` or ``"cuda"`` (default this machine's, :func:`teraflops.machine.detect`).

    Defaults (``None``) come from :func:`teraflops.sizing.preset` for this machine; any other value
    is checked, so 0 is an error, not the default. Under ``teraflops run`` (``$TERAFLOPS_CEILINGS``
    names its probe's file) the same probe is not run again: the run's ceilings are returned, with
    ``source`` saying so, so that every unit of one run uses the same roof.

    The probe is :func:`probe`: interleaved repeats, the best kept, their spread reported; then
    :func:`judged` against this machine's remembered quiet figures. Measured on a quiet machine,
    steady and not far below the quiet figures, the result is also kept as quiet figures
    (:func:`remember_quiet`). When not :attr:`Ceilings.trusted` (a busy machine,
    :func:`teraflops.machine.busy_load`; a spread of :data:`SPREAD_LIMIT` or more; or a reading under
    :data:`QUIET_FLOOR` of the quiet figures), the quiet figures are returned instead, labelled as such
    in ``source`` and ``doubt``; without them, the measured ceilings come back with ``trusted`` False
    and :attr:`Ceilings.reason` saying why, and verdicts placed on them say they are inconclusive.

    Raises:
        CeilingsError: ``matmul_n`` not an int >= 2, ``copy_bytes`` not an int >= 4 (one float32),
            ``dtype`` not a torch dtype, or ``device`` not a non-empty string.
    """
    if matmul_n is None or copy_bytes is None or dtype is None:
        p = preset()
        matmul_n = p.probe.matmul_n if matmul_n is None else matmul_n
        copy_bytes = p.probe.copy_bytes if copy_bytes is None else copy_bytes
        dtype = p.dtype if dtype is None else dtype
    device = detect().device if device is None else device
    if isinstance(matmul_n, bool) or not isinstance(matmul_n, numbers.Integral) or matmul_n < 2:
        raise CeilingsError(f"matmul_n must be an int >= 2 (the probe matmuls are matmul_n // 2 and matmul_n "
                            f"square), got {matmul_n!r}. Hint: leave it None for the preset's probe.matmul_n")
    if isinstance(copy_bytes, bool) or not isinstance(copy_bytes, numbers.Integral) or copy_bytes < 4:
        raise CeilingsError(f"copy_bytes must be an int >= 4 (one float32) to time a copy, got {copy_bytes!r}. "
                            "Hint: leave it None for the preset's probe.copy_bytes, far beyond the last-level cache")
    if not isinstance(dtype, torch.dtype):
        raise CeilingsError(f"dtype must be a torch dtype, got {dtype!r}. Hint: e.g. torch.float32, or None for "
                            "the preset's")
    if not isinstance(device, str) or not device:
        raise CeilingsError(f"device must be 'cpu' or 'cuda', got {device!r}. Hint: leave it None for this machine's")
    matmul_n, copy_bytes = int(matmul_n), int(copy_bytes)
    shared = shared_ceilings(dtype, device, matmul_n, copy_bytes)
    if shared is not None:  # one probe per teraflops run: every unit uses the same roof
        return shared
    return judged(probe(matmul_n, copy_bytes, dtype, device), quiet_ceilings(dtype, device, matmul_n, copy_bytes))


def judged(measured: Ceilings, quiet: Ceilings | None) -> Ceilings:
    """What :func:`measure_ceilings` returns for a probe reading ``measured`` when this machine's
    remembered quiet figures for the same probe are ``quiet`` (``None``: none yet); no process, no clock.

    ``measured`` is compared with ``quiet`` (:attr:`Ceilings.of_quiet`: the lower of its two ratios).
    Trusted (:attr:`Ceilings.trusted`), it is returned and remembered (:func:`remember_quiet`). Not
    trusted, the quiet figures come back in its place, with ``source`` saying the machine is busy now
    and how far the probe read, and :attr:`Ceilings.doubt` holding the probe's :attr:`~Ceilings.reason`
    (a verdict timed now may be off even against the right roof); without quiet figures the probe
    comes back as measured, ``trusted`` False, and the verdicts placed on it say they are inconclusive.
    """
    if quiet is not None:
        measured = replace(measured, of_quiet=min(measured.peak_flops / quiet.peak_flops,
                                                  measured.bandwidth / quiet.bandwidth))
    if measured.trusted:
        remember_quiet(measured)
        return measured
    if quiet is None:
        return measured  # not trusted: Ceilings.reason says why, and the verdicts placed on them
    return replace(quiet, doubt=measured.reason,
                   source=f"{quiet.source}; the probe now is not trusted ({measured.reason}; it read "
                          f"{measured.peak_flops / quiet.peak_flops:.0%} and "
                          f"{measured.bandwidth / quiet.bandwidth:.0%} of them)")


def probe(matmul_n: int, copy_bytes: int, dtype: torch.dtype, device: str, repeats: int = REPEATS,
          min_run_time: float = 0.15) -> Ceilings:
    """The probes of :func:`measure_ceilings`, ``repeats`` rounds interleaved (matmuls of ``matmul_n // 2``
    and ``matmul_n``, then the copy, then again), in this process and with its torch threads (those
    of the work the ceilings judge); the best rate of each kept, as an empirical roofline keeps the
    best observed (Lo et al., PMBS 2014). Interleaving lets a burst of load hit both probes alike,
    so it cannot tilt the ridge point by slowing one of them. ``spread`` is ``1 - worst/best`` over
    the rounds (the larger of the two probes'), ``load`` the 1-minute load average if the machine
    was busy (:func:`teraflops.machine.busy_load`), else ``None``."""
    peaks, copies = [], []
    for _ in range(repeats):
        peaks.append(max(measure_peak_flops(n, dtype, device, min_run_time) for n in (matmul_n // 2, matmul_n)))
        copies.append(measure_copy_bandwidth(copy_bytes, device, min_run_time))
    spread = max(1 - min(peaks) / max(peaks), 1 - min(copies) / max(copies))
    return Ceilings(max(peaks), max(copies), dtype, device, matmul_n, copy_bytes, spread=spread,
                    load=machine.busy_load())


def _quiet_key(dtype: torch.dtype, device: str, matmul_n: int, copy_bytes: int) -> str:
    return f"{device}/{str(dtype).replace('torch.', '')}/{matmul_n}/{copy_bytes}/{torch.get_num_threads()}"


def _quiet_path() -> Path:
    return caches.cache_dir() / QUIET_FILE


def remember_quiet(c: Ceilings) -> None:
    """Keep ``c`` (measured on a quiet machine) in ``cache_dir()/quiet-ceilings.json`` under its probe
    (device, dtype, sizes, torch threads), for :func:`quiet_ceilings`: each figure the best seen so far,
    as an empirical roofline keeps the best observed (Lo et al., PMBS 2014), so that trusted readings a
    little low (down to :data:`QUIET_FLOOR`) cannot walk the quiet figures down run after run. Best
    effort: an unwritable cache keeps nothing."""
    try:
        path = _quiet_path()
        known = json.loads(path.read_text()) if path.exists() else {}
        key = _quiet_key(c.dtype, c.device, c.matmul_n, c.copy_bytes)
        old = known.get(key) or {}
        best = {"peak_flops": max(c.peak_flops, float(old.get("peak_flops", 0.0))),
                "bandwidth": max(c.bandwidth, float(old.get("bandwidth", 0.0)))}
        known[key] = {**c.to_json(), **best, "of_quiet": None, "doubt": "", "when": time.time()}
        path.write_text(json.dumps(known, indent=1) + "\n")
    except (OSError, ValueError, TypeError):
        pass


def quiet_ceilings(dtype: torch.dtype, device: str, matmul_n: int, copy_bytes: int) -> Ceilings | None:
    """The ceilings last measured on a quiet machine for this probe (:func:`remember_quiet`: by
    ``teraflops warmup``, ``preflight`` or any earlier quiet probe), labelled with when; ``None`` if none."""
    try:
        d = json.loads(_quiet_path().read_text())[_quiet_key(dtype, device, matmul_n, copy_bytes)]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(d["when"])))
        return Ceilings.from_json(d, f"quiet values measured on this machine at {when}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# ---- the bandwidth ladder (Unit 5) ---------------------------------------------------------------

# The ladder's copies are the preset's copies.ladder_bytes (teraflops.sizing: far beyond the last-level cache),
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
                             "Hint: e.g. the preset's copies.ladder_bytes (64 MiB on CPU, 256 MiB on a GPU)")
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


def bandwidth_ladder(nbytes: int | None = None, min_run_time: float = 0.3) -> list[dict]:
    """The bandwidth ladder of this machine, measured: memory copies, then host↔device, pageable vs pinned.

    Rows (dicts), fastest rung first on a GPU:

    * ``device copy``: on a GPU a device-to-device copy in HBM, compared with the datasheet bandwidth
      (:data:`teraflops.datasheets.PUBLISHED`); on a CPU a memory copy in DRAM (no datasheet figure: the course's CPU
      machine is a virtual machine on an unspecified board). Counted as STREAM "Copy": read + write.
    * ``host memory copy`` (GPU machines only): the same copy in CPU memory, for comparison.
    * ``H2D`` / ``D2H``, ``pageable`` / ``pinned``: :func:`measure_host_device_copy`, counting the
      bytes that cross the link once, against the per-direction bandwidth of the GPU's PCIe
      generation from :data:`teraflops.datasheets.PUBLISHED_LINKS` (after 128b/130b encoding). On a
      CPU machine these rows hold ``None`` and the note ``"skipped: needs a CUDA GPU"``; on a GPU
      without a PCIe generation in :data:`~teraflops.datasheets.PUBLISHED`, ``published`` is ``None`` and the note says
      ``"no published host link figure for <GPU name>"``.

    Each row: ``what`` (str), ``bandwidth`` (measured bytes/s or ``None``), ``counts`` (how bytes are
    counted), ``published`` (bytes/s or ``None``), ``source`` (of the published figure, or ``None``),
    ``note`` (str). ``nbytes`` (bytes per copy) defaults to :func:`teraflops.sizing.preset`'s
    ``copies.ladder_bytes``: 64 MiB on CPU, 256 MiB on a GPU, 8 MiB at ``tiny``. Takes ~1 s on CPU, a few on a GPU.

    Raises:
        CopyProbeError: ``nbytes`` not an int >= 4 (too small to hold one float32 to copy).
    """
    nbytes = preset().copies.ladder_bytes if nbytes is None else nbytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise CopyProbeError(f"nbytes must be an int >= 4 (one float32) to time a copy, got {nbytes!r}. "
                             "Hint: well beyond the last-level cache, e.g. the preset's copies.ladder_bytes "
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
        link = pcie_link(gpu)
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
    sources = list(dict.fromkeys(r["source"] for r in rows if r["source"]))
    body = table([(r["what"], "skipped" if r["bandwidth"] is None else r["bandwidth"] / GB,
                   "-" if r["published"] is None else r["published"] / GB,
                   "-" if r["bandwidth"] is None or r["published"] is None else f"{r['bandwidth'] / r['published']:.0%}",
                   r["counts"], r["note"] + (f" [{sources.index(r['source']) + 1}]" if r["source"] else ""))
                  for r in rows],
                 ["copy", "measured (GB/s)", "published (GB/s)", "of published", "bytes counted", "note"])
    return body + "".join(f"\n[{i}] {s}" for i, s in enumerate(sources, 1))
