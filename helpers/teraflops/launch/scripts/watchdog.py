"""Watchdog of one launch: ``python watchdog.py OWNER_PID OWNER_START RESULTS PORT ADDR PGIDS [ALSO]``.

Started by :func:`teraflops.launch.leftovers.start_watchdog` in a session of its own, so that a SIGKILL of the
notebook kernel (the owner) does not reach it; the launch terminates it when it is over. Twice a
second it checks that the owner still runs (same pid, same start time, field 22 of
``/proc/<pid>/stat``); once it is gone it SIGTERMs, then after 2 s SIGKILLs, the launchers' process
groups and every process whose environment names this launch's results folder, then removes the
launch's DeepSpeed shared-memory files (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_*``),
the folder and the launch's other folders ``ALSO`` (comma-separated paths; a served model's ``/dev/shm``
folder, :mod:`teraflops.compilation.serving`). Started as a script: importing the package would import torch.
"""

import glob
import os
import shutil
import signal
import sys
import time

import psutil

from proc_identity import proc_start  # this script's own folder is sys.path[0]


def _members(results: str) -> list:
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("TERAFLOPS_RESULTS_DIR") == results:
                out.append(p)
        except psutil.Error:
            pass
    return out


def main(owner: int, start: str, results: str, port: str, addr: str, pgids: list[int], also: list[str] = ()) -> None:
    while proc_start(owner) == start and os.path.isdir(results):
        time.sleep(0.5)
    if not os.path.isdir(results):
        return  # the launch ended and cleaned up after itself
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in pgids:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        victims = _members(results)
        for p in victims:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        if not psutil.wait_procs(victims, timeout=2)[1] and sig == signal.SIGTERM:
            alive = [g for g in pgids if _group_alive(g)]
            if not alive:
                break
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass
    for folder in [results, *also]:
        shutil.rmtree(folder, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), a[1], a[2], a[3], a[4], [int(g) for g in a[5].split(",") if g],
         [f for f in (a[6] if len(a) > 6 else "").split(",") if f])
