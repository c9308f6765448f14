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
import signal
import subprocess
import time


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
