"""Stopping a launch's processes for good: its launchers, and every rank they started.

torchrun starts each rank in a session of its own, out of reach of a process-group kill, so ranks
are also found as the launcher's descendants and by the launch folder in their environment
(``$TERAFLOPS_RESULTS_DIR``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import suppress
from pathlib import Path

import psutil

from teraflops.launch.wire import RESULTS_ENV
from teraflops.teardown import uninterruptible


def stop_all(procs, results: Path | None) -> None:
    """:func:`stop` for each launcher, through more interrupts (:func:`uninterruptible`)."""
    for proc in procs:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)  # first, before anything slow
    uninterruptible(lambda: [stop(proc, results) for proc in procs])


def stop(proc, results: Path | None, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, the launcher's process group and every process of this launch; reap it.

    torchrun starts each rank in a session of its own, out of reach of the group kill: ranks are
    found as the launcher's descendants and by the results directory in their environment.
    """
    if proc is None and results is None:
        return
    found = {}
    if proc is not None and proc.poll() is None:  # still running, so the pid is still its own
        with suppress(psutil.Error):
            found = {p.pid: p for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]}
    for p in psutil.process_iter() if results else ():
        with suppress(psutil.Error):
            if p.pid != os.getpid() and p.environ().get(RESULTS_ENV) == str(results):
                found[p.pid] = p
    if proc is not None:
        found.pop(proc.pid, None)  # our own child is reaped by proc.wait, or its exit status reads 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with suppress(ProcessLookupError, PermissionError):
            if proc is not None:
                os.killpg(proc.pid, sig)
        for p in found.values():
            with suppress(psutil.Error):
                p.send_signal(sig)
        found = {p.pid: p for p in psutil.wait_procs(list(found.values()), timeout=grace)[1]}
        with suppress(subprocess.TimeoutExpired):
            if proc is not None:
                proc.wait(timeout=grace)
        if not found and (proc is None or proc.returncode is not None):
            break
    reap(proc)


def reap(proc, timeout: float = 30.0) -> None:
    """Wait for a SIGKILLed launcher ``proc`` (a Popen, or None) that outlived :func:`stop`'s grace period:
    it dies, on a loaded machine later than the grace; unreaped it stays a zombie child of the kernel."""
    if proc is not None and proc.returncode is None:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
