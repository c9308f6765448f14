"""DeepSpeed's CPU op, built once before any launch needs it, and what its runs leave in ``/dev/shm``.

On CPU every ``deepspeed.init_distributed`` loads ``deepspeed_shm_comm`` (C++, JIT-built on first
use into ``TORCH_EXTENSIONS_DIR``, :func:`teraflops.caches.extensions_dir`) and fails without it:
:func:`prepare_deepspeed_ops` builds it behind a progress bar, outside any launch's timeout, and
copies a workshop host's warm build in first (:mod:`teraflops.caches`). A killed rank can leave
torch's build lock behind (:func:`clear_stale_build_lock`) and DeepSpeed's shared-memory
all-reduce buffers (:func:`shm_buffers`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
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


def _builds(ext: Path) -> list[int]:
    """Pids of other processes building (or loading) DeepSpeed's CPU op into ``ext`` now."""
    found = []
    for p in psutil.process_iter():
        with suppress(psutil.Error):
            if p.pid != os.getpid() and any("ShareMemCommBuilder" in a for a in p.cmdline()) and \
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
    """One build of the op in a subprocess: (its exit code, None after ``timeout`` s; seconds taken)."""
    script = ("from deepspeed.accelerator import get_accelerator\n"
              "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
              "if b is None or not b.is_compatible():\n"
              "    raise SystemExit(f'{get_accelerator()._name} accelerator: no compatible ShareMemCommBuilder')\n"
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
        with tqdm(desc="compiling DeepSpeed's CPU comm op (once)", bar_format="{desc}: {elapsed}") as bar:
            while proc.poll() is None and time.monotonic() - start < timeout:
                time.sleep(0.5)
                bar.refresh()
        timed_out = proc.poll() is None
    finally:
        stop(proc, None)
        if proc is not None and proc.returncode != 0 and not _builds(ext):  # torch's lock outlives a killed build
            (ext / SHM_OP / "lock").unlink(missing_ok=True)
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


def _build_failed(code: int | None, elapsed: float, timeout: float, others: list[int], log_path: Path) -> OpBuildFailed:
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
    return OpBuildFailed(f"compiling DeepSpeed's {SHM_OP} op failed: {what}. Hint: {hint}; "
                         f"DeepSpeed cannot start on CPU without it. Log: {log_path}")
