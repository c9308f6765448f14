"""DeepSpeed's CPU ops, built once before any launch needs them, and what its runs leave in ``/dev/shm``.

On CPU every ``deepspeed.init_distributed`` loads ``deepspeed_shm_comm`` (C++, JIT-built on first
use into ``TORCH_EXTENSIONS_DIR``, :func:`teraflops.caches.extensions_dir`) and fails without it:
:func:`prepare_deepspeed_ops` builds it behind a progress bar, outside any launch's timeout, and
copies a workshop host's warm build in first (:mod:`teraflops.caches`). A killed rank can leave
torch's build lock behind (:func:`clear_stale_build_lock`) and DeepSpeed's shared-memory
all-reduce buffers (:func:`shm_buffers`).

NVMe offload (Unit 5 §5, :mod:`teraflops.hardware.offload`) needs a second op, ``async_io`` (DeepSpeed's
libaio reads and writes, with its ``pin_memory`` op): :func:`prepare_aio_op` builds both the same way,
once per machine, and :func:`aio_unavailable` says in one line why it cannot (no libaio headers).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
from tqdm.auto import tqdm

from teraflops import caches
from teraflops.caches import extensions_dir, with_ninja
from teraflops.errors import CourseError
from teraflops.launch.diagnosis import last_line
from teraflops.launch.placement import place
from teraflops.launch.processes import stop
from teraflops.machine import detect


SHM_OP = "deepspeed_shm_comm"  # the C++ op DeepSpeed's CPU accelerator JIT-builds in init_distributed
SHM_PREFIX = "deepspeed_allreduce_buffer"  # its shared-memory files, in /dev/shm
class OpBuildFailed(CourseError, RuntimeError):
    """A DeepSpeed op did not compile; the message has the compiler's last line and the log's path."""


def shm_buffers(port: int, addr: str = "127.0.0.1") -> list[Path]:
    """The shared-memory files DeepSpeed's CPU comm op made for the launch on ``addr:port``.

    On CPU, with every rank on one host, ``deepspeed.init_distributed`` has each rank create
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (~67 MB, its all-reduce
    workspace; ``csrc/cpu/comm/shm.cpp``) and never unlinks it: they hold RAM until removed.
    """
    shm = Path("/dev/shm")
    return sorted(shm.glob(f"{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_*")) if shm.is_dir() else []


def remove_shm_buffers(port: int, addr: str = "127.0.0.1") -> None:
    """Unlink :func:`shm_buffers` of a finished launch (its ranks must be gone)."""
    for path in shm_buffers(port, addr):
        path.unlink(missing_ok=True)


def clear_stale_build_lock() -> bool:
    """Remove the build lock of DeepSpeed's CPU comm op when no live process holds it; True if removed.

    ``torch.utils.cpp_extension.load`` takes a lock file (``FileBaton``, ``<op folder>/lock``, made
    with ``O_EXCL``) around every load, also when nothing needs building, and the others wait for
    the file to go (``torch/utils/file_baton.py``). A rank killed while it holds the lock leaves the
    file, and every later ``deepspeed.init_distributed`` on CPU then waits forever. The holder keeps the
    descriptor of its ``O_EXCL`` open until it releases the baton (``FileBaton.release`` closes it, then
    removes the file), so a lock is stale exactly when no process has it open (:func:`holders`); waiters
    only poll for the path, they never open it. (An earlier rule, "a launch's process older than the lock
    may hold it", kept a stale lock for as long as another run of the same cache was alive.)
    """
    lock = extensions_dir() / SHM_OP / "lock"
    if not lock.exists() or holders(lock):
        return False
    lock.unlink(missing_ok=True)
    return True


def holders(path: Path) -> list[int]:
    """Pids of the processes that have ``path`` open now (their ``/proc/PID/fd`` links; processes whose
    descriptors this user cannot read are not counted: another user's runs use their own caches)."""
    target, found = str(path), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with suppress(OSError):
                    if os.readlink(fd.path) == target:
                        found.append(int(pid))
                        break
    return found


@dataclass(frozen=True)
class OpBuild:
    """One of DeepSpeed's JIT-built CPU ops: its ``builder`` (the accelerator's op-builder class name),
    the ``folders`` its load builds under ``TORCH_EXTENSIONS_DIR`` (the op's own last: its stamp goes
    there) and ``desc``, what the progress bar and errors call it."""

    builder: str
    folders: tuple[str, ...]
    desc: str

    @property
    def folder(self) -> str:
        """The op's own folder, where its stamp goes."""
        return self.folders[-1]


SHM_BUILD = OpBuild("ShareMemCommBuilder", (SHM_OP,), "DeepSpeed's CPU comm op")
# AsyncIOBuilder.load loads PinMemoryBuilder's op first (deepspeed/ops/op_builder/cpu/async_io.py)
AIO_BUILD = OpBuild("AsyncIOBuilder", ("pin_memory", "async_io"), "DeepSpeed's async_io op (NVMe offload)")


def _builds(ext: Path, builder: str = SHM_BUILD.builder) -> list[int]:
    """Pids of other processes building (or loading) DeepSpeed's op ``builder`` into ``ext`` now."""
    found = []
    for p in psutil.process_iter():
        with suppress(psutil.Error):
            if p.pid != os.getpid() and any(builder in a for a in p.cmdline()) and \
                    p.environ().get("TORCH_EXTENSIONS_DIR") == str(ext):
                found.append(p.pid)
    return found


def _compiler_error(log: Path) -> bool:
    """True if the build log has a compiler or ninja error (not just a missing ``.so`` after a wait)."""
    with suppress(OSError):
        text = log.read_text(errors="replace")
        return bool(re.search(r"error:|FAILED:|ninja: build stopped|Error building extension", text))
    return False


def _build_once(ext: Path, log_path: Path, timeout: float) -> tuple[int | None, float]:
    """One build of the CPU comm op in a subprocess: (its exit code, None after ``timeout`` s; seconds taken)."""
    return _build_op(ext, log_path, timeout, SHM_BUILD)


def _build_op(ext: Path, log_path: Path, timeout: float, op: OpBuild) -> tuple[int | None, float]:
    """One build of ``op`` in a subprocess: (its exit code, None after ``timeout`` s; seconds taken)."""
    script = ("from deepspeed.accelerator import get_accelerator\n"
              f"b = get_accelerator().create_op_builder({op.builder!r})\n"
              "if b is None or not b.is_compatible():\n"
              f"    raise SystemExit(f'{{get_accelerator()._name}} accelerator: no compatible {op.builder}')\n"
              "b.load()\n")
    proc, start = None, time.monotonic()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    # a CPU rank's environment (GPUs hidden) and accelerator, also where this
                                    # process sees a GPU: CUDA's accelerator has no such builder, nothing is built
                                    env=with_ninja({**os.environ, **place(1, gpus=False).rank_env(),
                                                    "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu"}))
        with tqdm(desc=f"compiling {op.desc} (once)", bar_format="{desc}: {elapsed}") as bar:
            while proc.poll() is None and time.monotonic() - start < timeout:
                time.sleep(0.5)
                bar.refresh()
        timed_out = proc.poll() is None
    finally:
        stop(proc, None)
        if proc is not None and proc.returncode != 0 and not _builds(ext, op.builder):
            for folder in op.folders:  # torch's lock outlives a killed build
                (ext / folder / "lock").unlink(missing_ok=True)
    return (None if timed_out else proc.returncode), time.monotonic() - start


def prepare_deepspeed_ops(timeout: float = 900, cpu: bool | None = None) -> None:
    """Compile DeepSpeed's CPU comm op once, behind a progress bar; a fast no-op once done.

    On CPU every ``deepspeed.init_distributed`` loads ``deepspeed_shm_comm`` (C++, JIT-built on first
    use into ``TORCH_EXTENSIONS_DIR``, ~1 min on 2 cores) and fails without it; a stale build lock
    is removed first (:func:`clear_stale_build_lock`). Building it here, into
    :func:`cache_dir`, keeps the wait out of a launch's timeout. With CUDA there is no such op.
    ``cpu`` says whether the ranks run on CPU (default: when this process sees no GPU); ranks whose
    GPUs are hidden (``CUDA_VISIBLE_DEVICES=""``) need the op although this process sees one.
    The build runs the Python environment's ninja (:func:`teraflops.caches.with_ninja`), as the
    ranks do, and a host's warm build (``teraflops warmup``) is copied in first if there is one.

    Raises:
        OpBuildFailed: the build failed (it needs g++ and ninja) or took over ``timeout`` s.
    """
    cpu = detect().device != "cuda" if cpu is None else cpu
    if not cpu or sys.platform != "linux":
        return
    ext = extensions_dir()
    stamp = ext / SHM_OP / caches.op_stamp()
    why = caches.unwritable_reason(ext)  # a TERAFLOPS_CACHE of another user
    if why:
        raise OpBuildFailed(why)
    caches.seed_op(ext)  # the host's `teraflops warmup` build, copied: nothing to compile
    clear_stale_build_lock()  # a killed run's lock would make every rank wait forever
    if stamp.exists():
        return
    ext.mkdir(parents=True, exist_ok=True)
    log_path = ext / f"{SHM_OP}.build.{os.getpid()}.log"  # one per process: a waiter must not clobber the builder's
    for attempt in range(2):  # a second try when another process's build, that we waited for, died
        others = _builds(ext)
        code, elapsed = _build_once(ext, log_path, timeout)
        if code == 0:
            break
        if code is not None and code > 0 and others and attempt == 0 and not _compiler_error(log_path):
            continue  # we waited on the other build's lock; it ended without the op: build it ourselves
        raise _build_failed(code, elapsed, timeout, others, log_path)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()


def _build_failed(code: int | None, elapsed: float, timeout: float, others: list[int], log_path: Path,
                  op: OpBuild = SHM_BUILD) -> OpBuildFailed:
    """The one line of a failed build of the op: how it ended (exit ``code``, None at ``timeout``), the
    other builds it waited for, what to do."""
    if code is None:
        what = f"not done after {timeout:g} s"
    elif code < 0:
        what = f"the build was killed by {signal.Signals(-code).name} after {elapsed:.0f} s"
    else:
        what = f'"{last_line(log_path)}"'
    if others:
        what += f" (after waiting for another build of it, pid {', '.join(map(str, others))}, that did not finish it)"
    missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None]
    hint = (f"it needs {' and '.join(missing)} (apt install g++; pip install ninja)" if missing else
            "the compiler's whole error is in the log" if code and code > 0 else "run it again")
    need = "DeepSpeed cannot start on CPU without it" if op is SHM_BUILD else "NVMe offload cannot run without it"
    return OpBuildFailed(f"compiling DeepSpeed's {op.folder} op failed: {what}. "
                         f"Hint: {hint}; {need}. Log: {log_path}")


# ---- the async_io op of NVMe offload ------------------------------------------------------------

AIO_FIX = "apt-get install libaio-dev"


class AioUnavailable(CourseError, RuntimeError):
    """DeepSpeed's ``async_io`` op cannot be built here; the message is one line naming the fix."""


def _include_dirs() -> list[Path]:
    """Where a C compiler looks for headers: ``CPATH``/``C_INCLUDE_PATH``/``CPLUS_INCLUDE_PATH``, ``-I`` of
    ``CFLAGS``, then the system's folders (``/usr/include``, its multiarch folder, ``/usr/local/include``)."""
    found = [Path(d) for var in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")
             for d in os.environ.get(var, "").split(os.pathsep) if d]
    found += [Path(f[2:]) for f in os.environ.get("CFLAGS", "").split() if f.startswith("-I") and len(f) > 2]
    return found + [Path("/usr/local/include"), Path("/usr/include"), *Path("/usr/include").glob("*-linux-gnu")]


def aio_unavailable() -> str | None:
    """Why DeepSpeed's ``async_io`` op (NVMe offload) cannot be built here, in one line naming the fix;
    None if it can. Checked without compiling: Linux, DeepSpeed, g++, and libaio's header ``libaio.h``
    (``AsyncIOBuilder.is_compatible`` compiles and links a call of ``io_submit``, which needs the header
    and ``libaio.so``: Debian's ``libaio-dev`` ships both)."""
    if sys.platform != "linux":
        return f"NVMe offload's async_io op needs Linux's libaio; this is {sys.platform}"
    if importlib.util.find_spec("deepspeed") is None:  # found, not imported: doctor asks on every setup cell
        return "NVMe offload needs DeepSpeed: pip install deepspeed"
    if shutil.which("g++") is None:
        return "DeepSpeed's async_io op (NVMe offload) is compiled here and needs g++: apt-get install g++"
    if not any((d / "libaio.h").is_file() for d in _include_dirs()):
        return (f"DeepSpeed's async_io op (NVMe offload) needs libaio's headers (libaio.h, not found). "
                f"Fix: {AIO_FIX}")
    return None


def _seed_aio(ext: Path) -> bool:
    """Copy a host's warm build of the async_io op (``teraflops warmup``: :func:`teraflops.caches.warm_dir`)
    into ``ext`` if it has none, each folder of :data:`AIO_BUILD` without its lock, as
    :func:`teraflops.caches.seed_op` does for the comm op (modification times kept: ninja compiles
    nothing). True if copied."""
    source, built = caches.warm_dir() / "torch_extensions" / ext.name, caches.op_stamp()
    if not (source / AIO_BUILD.folder / built).exists() or (ext / AIO_BUILD.folder / built).exists() or \
            source == ext:
        return False
    ext.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".async_io-seed-", dir=ext))
    try:
        for folder in AIO_BUILD.folders:
            shutil.copytree(source / folder, scratch / folder, ignore=shutil.ignore_patterns("lock"))
            if (ext / folder).exists():
                shutil.rmtree(ext / folder, ignore_errors=True)  # an unbuilt or half-built folder of our own
            with suppress(OSError):
                os.rename(scratch / folder, ext / folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return (ext / AIO_BUILD.folder / built).exists()


def prepare_aio_op(timeout: float = 1800) -> float:
    """Compile DeepSpeed's ``async_io`` op (and its ``pin_memory`` op) once per machine, behind a progress
    bar, into :func:`teraflops.caches.extensions_dir` as :func:`prepare_deepspeed_ops` does the comm op: a
    host's warm build copied in first, stale locks removed, a stamp naming the versions. Returns the
    seconds spent compiling (0.0 when it was already built).

    Raises:
        AioUnavailable: :func:`aio_unavailable` (one line with the fix).
        OpBuildFailed: the build failed or took over ``timeout`` s (~5 min on 2 busy cores).
    """
    why = aio_unavailable()
    if why:
        raise AioUnavailable(why)
    ext = extensions_dir()
    why = caches.unwritable_reason(ext)
    if why:
        raise OpBuildFailed(why)
    _seed_aio(ext)
    for folder in AIO_BUILD.folders:  # a killed build's lock would make every later load wait forever
        lock = ext / folder / "lock"
        if lock.exists() and not holders(lock):
            lock.unlink(missing_ok=True)
    stamp = ext / AIO_BUILD.folder / caches.op_stamp()
    if stamp.exists():
        return 0.0
    ext.mkdir(parents=True, exist_ok=True)
    log_path = ext / f"{AIO_BUILD.folder}.build.{os.getpid()}.log"
    for attempt in range(2):  # a second try when another process's build, that we waited for, died
        others = _builds(ext, AIO_BUILD.builder)
        code, elapsed = _build_op(ext, log_path, timeout, AIO_BUILD)
        if code == 0:
            break
        if code is not None and code > 0 and others and attempt == 0 and not _compiler_error(log_path):
            continue
        raise _build_failed(code, elapsed, timeout, others, log_path, AIO_BUILD)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()
    return elapsed
