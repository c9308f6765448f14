"""Clean-up that finishes: a teardown run to its end however many times Ctrl-C is pressed.

A notebook cell that started processes or made namespaces must remove them even when the learner
interrupts it, and an impatient second Ctrl-C must not cut that removal short (leaving ranks
holding a port, or emulated nodes behind). Python delivers SIGINT as :class:`KeyboardInterrupt` in
the main thread between bytecodes (Python docs, ``signal`` module, "Execution of Python signal
handlers", https://docs.python.org/3/library/signal.html), so a teardown that is safe to run again
can simply be restarted after each interrupt and the interrupt re-raised once it is done. Used by
:func:`teraflops.launch.launcher.launch` (stopping a launch's processes) and
:mod:`teraflops.nodes.cluster` (removing emulated nodes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def uninterruptible(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run to the end even if Ctrl-Cs arrive meanwhile (it is restarted
    after each; clean-up must not be cut short by an impatient second Ctrl-C); a KeyboardInterrupt
    that came is raised afterwards. ``fn`` must be safe to call again."""
    interrupted = False
    while True:
        try:
            out = fn(*args, **kwargs)
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt
    return out


def stop_groups(procs, grace: float = 5.0) -> None:
    """SIGTERM the process group of each live ``subprocess.Popen`` in ``procs`` (each started with
    ``start_new_session=True``), all at once; wait up to ``grace`` s in all, then SIGKILL the groups still
    running and reap them. Used by the daemons of emulated nodes (:mod:`teraflops.nodes.slurm`,
    :mod:`teraflops.nodes.ray`)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(5)


@dataclass(frozen=True)
class StateFolders:
    """Where an emulated cluster's daemons keep their files: one folder per cluster under a root that an
    environment variable moves (default under ``/run/teraflops``, a tmpfs: gone at reboot, like the
    namespaces). One home for :mod:`teraflops.nodes.slurm`'s and :mod:`teraflops.nodes.ray`'s folders.

    Attributes:
        env: the variable that moves the root (``TERAFLOPS_SLURM_DIR``, ``TERAFLOPS_RAY_DIR``).
        default: the root when ``env`` is unset or empty.
    """

    env: str
    default: str

    def root(self) -> Path:
        """``$env`` or :attr:`default`."""
        return Path(os.environ.get(self.env) or self.default)

    def dir(self, name: str) -> Path:
        """Cluster ``name``'s folder: ``root() / name``."""
        return self.root() / name

    def names(self) -> list[str]:
        """The clusters that have a folder now (up, or left by a run whose nodes are gone), sorted."""
        root = self.root()
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def remove(self, name: str) -> None:
        """Delete cluster ``name``'s folder (after its daemons are gone); nothing there is fine."""
        shutil.rmtree(self.dir(name), ignore_errors=True)
