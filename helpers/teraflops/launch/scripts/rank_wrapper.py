"""Wrapper each rank of a launch runs in: ``python rank_wrapper.py MODULE ARGS...`` (started by the launcher).

Runs ``python -m MODULE ARGS``, as ``python -m teraflops.launch.loopback MODULE ARGS`` so that a store the
rank hosts (``init_process_group`` under DeepSpeed's launcher) listens on one address only
(:mod:`teraflops.launch.loopback`), with its stdout and stderr appended to ``rank{RANK}.out`` and
``rank{RANK}.err`` in ``$TERAFLOPS_RESULTS_DIR``, then records how it ended in ``rank{RANK}.exit``
(JSON: ``returncode``, negative for a signal as in :mod:`subprocess`, ``time``, Unix seconds, and
``node``, the emulated node it ran on, 0 outside one),
so the notebook can name the rank that failed first, even one killed by SIGKILL. SIGTERM and
SIGINT are passed on to the rank; the wrapper then ends the way the rank did. The rank gets the
GPUs its placement chose (``TERAFLOPS_CUDA_VISIBLE_DEVICES``, :mod:`teraflops.launch.placement`) as its
``CUDA_VISIBLE_DEVICES``, whatever the launcher set there.

``$TERAFLOPS_OWNER`` (``pid:start``, :func:`teraflops.launch.leftovers.owner_env`) names the notebook-side
process of the launch: a thread checks twice a second that it still runs (same pid, same start time,
field 22 of ``/proc/<pid>/stat``) and, once it is gone, SIGKILLs the rank and exits, so that a killed
kernel does not leave its ranks running (``prctl(PR_SET_PDEATHSIG)`` would fire on the death of the
parent *thread*, and the owner is not the parent anyway).

Started as a script, not with ``-m``: importing the ``teraflops`` package would import torch here too.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from proc_identity import proc_start  # this script's own folder is sys.path[0]

VISIBLE_ENV = "TERAFLOPS_CUDA_VISIBLE_DEVICES"  # teraflops.launch.placement.VISIBLE_ENV (not imported: no torch here)


def _watch_owner(child: subprocess.Popen, spec: str) -> None:
    pid, _, start = spec.partition(":")
    while child.poll() is None:
        if proc_start(int(pid)) != start:
            child.kill()
            child.wait()
            os._exit(128 + signal.SIGKILL)
        time.sleep(0.5)


def main(argv: list[str]) -> None:
    rank = os.environ.get("RANK", "0")
    base = os.path.join(os.environ["TERAFLOPS_RESULTS_DIR"], f"rank{rank}")
    env = dict(os.environ)
    if VISIBLE_ENV in env:  # the placement's GPUs, put back over what a launcher set (DeepSpeed's does)
        env["CUDA_VISIBLE_DEVICES"] = env[VISIBLE_ENV]
    with open(base + ".out", "ab") as out, open(base + ".err", "ab") as err:
        child = subprocess.Popen([sys.executable, "-m", "teraflops.launch.loopback", *argv], stdout=out, stderr=err, env=env)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _frame: child.send_signal(s))
    if os.environ.get("TERAFLOPS_OWNER", "").count(":") == 1:
        threading.Thread(target=_watch_owner, args=(child, os.environ["TERAFLOPS_OWNER"]), daemon=True).start()
    code = child.wait()
    with open(base + ".exit.tmp", "w") as f:
        json.dump({"rank": int(rank), "returncode": code, "time": time.time(),
                   "node": int(os.environ.get("TERAFLOPS_NODE", "0"))}, f)
    os.replace(base + ".exit.tmp", base + ".exit")
    if code < 0:  # die of the same signal, so the launcher reports what happened to the rank
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two signals without a handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv[1:])
