"""What machine are we on? Device kind, GPUs, CPU cores, memory, and how Triton will run.

Everything the course sizes or skips is decided from :func:`detect`, so the same notebook runs
on a CPU-only laptop, in CI, on one GPU and on many.

Triton kernels need a GPU driver; without one they run in Triton's interpreter, which executes
each program instance with NumPy on the CPU (``TRITON_INTERPRET=1``, see
https://triton-lang.org/main/programming-guide/chapter-3/debugging.html). The variable must be
set before any ``@triton.jit`` decorator runs, so :func:`configure_triton` is called when
``teraflops`` is imported, before any module of ours imports triton.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import warnings
from dataclasses import dataclass, field
from functools import lru_cache

GiB = 2**30  # memory sizes in this module are bytes; printed in GiB (2**30)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def configure_triton() -> str:
    """Choose how Triton runs here and set ``TRITON_INTERPRET`` accordingly.

    Returns ``"compiled"`` when a CUDA GPU is visible and ``"interpreter"`` otherwise. A value the
    user already set (``TRITON_INTERPRET=1`` or ``0``) is respected.
    """
    if "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "0" if _cuda_available() else "1"
        if os.environ["TRITON_INTERPRET"] == "1" and "triton" in sys.modules:
            # triton.language's own helpers were already built for compiled mode; kernels would
            # fail later with "Cannot call @triton.jit'd outside of the scope of a kernel".
            warnings.warn("triton was imported before teraflops on a machine without a GPU: restart the "
                          "kernel and `import teraflops` first, so Triton runs in its interpreter",
                          stacklevel=3)
    return triton_mode()


def triton_mode() -> str:
    """``"interpreter"`` if ``TRITON_INTERPRET=1`` is in force, else ``"compiled"`` (decided by
    :func:`configure_triton` first if nothing has decided it yet)."""
    if "TRITON_INTERPRET" not in os.environ:
        return configure_triton()
    return "interpreter" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "compiled"


@dataclass(frozen=True)
class GPU:
    """One visible GPU: ``memory_bytes`` total, ``free_bytes`` free when detected (None: unknown;
    NVML's count through ``torch.cuda.device_memory_used``, which creates no CUDA context)."""

    index: int
    name: str
    memory_bytes: int
    capability: tuple[int, int]
    free_bytes: int | None = None


@dataclass(frozen=True)
class Machine:
    """A snapshot of this machine.

    Attributes:
        device: ``"cuda"`` when at least one CUDA GPU is visible, else ``"cpu"``.
        gpus: one :class:`GPU` per visible device (empty on CPU).
        cpu_cores: logical cores usable by this process.
        cpu_threads: threads torch uses for intra-op work (``torch.get_num_threads()``).
        memory_bytes: total system memory in bytes (psutil).
        triton: ``"compiled"`` or ``"interpreter"``.
        hostname, platform: for reports.
    """

    device: str
    gpus: tuple[GPU, ...] = field(default_factory=tuple)
    cpu_cores: int = 1
    cpu_threads: int = 1
    memory_bytes: int = 0
    triton: str = "interpreter"
    hostname: str = ""
    platform: str = ""

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def gpu_name(self) -> str | None:
        return self.gpus[0].name if self.gpus else None

    @property
    def kind(self) -> str:
        """``"cpu"``, ``"gpu"`` or ``"multi-gpu"``: the axis problem sizes are chosen along."""
        if not self.gpus:
            return "cpu"
        return "gpu" if len(self.gpus) == 1 else "multi-gpu"

    def summary(self) -> str:
        """One line: ``cpu: 2 cores, 23.4 GiB, Triton interpreter`` or the GPU equivalent."""
        mem = f"{self.memory_bytes / GiB:.1f} GiB RAM"
        if self.gpus:
            g = self.gpus[0]
            gpus = f"{self.gpu_count}x {g.name} ({g.memory_bytes / GiB:.0f} GiB)"
            return f"{gpus}, {self.cpu_cores} CPU cores, {mem}, Triton {self.triton}"
        return f"CPU only: {self.cpu_cores} cores, {mem}, Triton {self.triton}"


def _free_bytes(index: int, total: int) -> int | None:
    """Free memory of GPU ``index`` from NVML (``torch.cuda.device_memory_used``; None without NVML)."""
    import torch

    try:
        return max(0, total - int(torch.cuda.device_memory_used(index)))
    except Exception:  # no NVML (pynvml) here: the budget then reads the total  # noqa: BLE001
        return None


@lru_cache(maxsize=1)
def detect() -> Machine:
    """Detect this machine once per process (cached)."""
    import psutil
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(GPU(i, p.name, int(p.total_memory), (p.major, p.minor), _free_bytes(i, int(p.total_memory))))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return Machine(
        device="cuda" if gpus else "cpu",
        gpus=tuple(gpus),
        cpu_cores=cores,
        cpu_threads=torch.get_num_threads(),
        memory_bytes=int(psutil.virtual_memory().total),
        triton=triton_mode(),
        hostname=platform.node(),
        platform=f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
    )


def busy_warning(threshold: float = 0.3, interval: float = 0.5) -> str | None:
    """A one-line warning if other processes keep this machine's CPUs busy, else ``None``.

    Samples system-wide CPU use for ``interval`` seconds while this process sleeps
    (``psutil.cpu_percent``). On a small machine a second busy process slows multi-threaded
    kernels erratically (a thread that loses its core stalls the others at the next barrier), so
    timings become noisy; memory and FLOP counts are unaffected.
    """
    import psutil

    used = psutil.cpu_percent(interval=interval) / 100
    if used < threshold:
        return None
    return (f"other processes are using {used:.0%} of the CPU right now: timings will be noisy "
            "(close them, or run again on a quiet machine)")


# ---- load: how busy the machine is (one home for the busy-machine signal) -------------------------

BUSY_LOAD_PER_CORE = 1.5  # 1-minute load average per core above which timings (and ceilings) are not trusted


def load_average() -> float:
    """The 1-minute load average (runnable + uninterruptible tasks, averaged; ``os.getloadavg``);
    0.0 where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def busy_load(threshold: float = BUSY_LOAD_PER_CORE) -> float | None:
    """The 1-minute load average if it exceeds ``threshold`` per core of this process
    (:func:`detect`'s ``cpu_cores``), else ``None``: the machine is too busy for a measured
    ceiling or a timing-based verdict to be trusted. Compared per core because two learners on a
    16-core box are not a busy box."""
    load = load_average()
    return load if load > threshold * max(1, detect().cpu_cores) else None


def busy_note(load: float) -> str:
    """The one line that says a check could not tell on a busy machine: ``"inconclusive: machine
    busy (load 6.2)"``."""
    return f"inconclusive: machine busy (load {load:.1f})"


class LoadMonitor:
    """Samples :func:`load_average` every ``every`` seconds in a daemon thread while in a ``with``
    block (and once at each end); :meth:`summary` gives the mean and max seen, the load a unit ran under."""

    def __init__(self, every: float = 5.0):
        self.every = every
        self.samples: list[float] = []

    def __enter__(self) -> "LoadMonitor":
        self._stop = threading.Event()
        self.samples.append(load_average())

        def sample() -> None:
            while not self._stop.wait(self.every):
                self.samples.append(load_average())

        self._thread = threading.Thread(target=sample, name="teraflops-load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(load_average())

    def summary(self) -> dict:
        """``{"mean": float, "max": float, "cores": int}`` of the 1-minute load averages sampled."""
        s = self.samples or [load_average()]
        return {"mean": sum(s) / len(s), "max": max(s), "cores": detect().cpu_cores}
