"""Why a launch failed, in one line: the rank to blame, how it ended, its last error line, a hint.

Read after the fact from the launch folder (each rank's ``rank{r}.exit`` record written by
``workers/_rank.py``, its ``rank{r}.err``, the launchers' logs), so the same diagnosis serves
torchrun agents, the DeepSpeed launcher and a Slurm batch job.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Sequence

from teraflops.launch.faults import FAULT_ENV
from teraflops.launch.wire import read_json


_NOISE = re.compile(r"warn|^\s|^\[?[WI]\d{4}|\[(INFO|WARNING)\]|^[*=-]+$", re.IGNORECASE)
VICTIMS = (-signal.SIGTERM, -signal.SIGINT)  # how launchers stop the other ranks after a failure
def diagnose(results: Path, nproc: int, code: int | None, timeout: float, launcher: str, fault: str | None,
             hosts: Sequence[str] | None = None):
    """(rank or None, one line: what happened, the rank's last error line, a hint). ``hosts``: each
    node's host name (by the ``node`` of the ranks' exit records), named for the failed rank."""
    exits = [read_json(results / f"rank{r}.exit") for r in range(nproc)]
    timeouts = {r: t for r in range(nproc) if (t := nccl_timeout(results / f"rank{r}.err"))}
    if timeouts:  # NCCL's watchdog aborts the process: faulthandler's last line says only "Aborted"
        return _nccl_line(timeouts, nproc)
    rank, what, rc = _what_happened(results, exits, nproc, code, timeout, launcher, hosts)
    logs = [f"rank{rank}.err"] if rank is not None else sorted(  # the agents' logs, or the batch job's output
        p.name for p in [*results.glob("launcher*.log"), *results.glob("slurm-*.out")])
    line = next((found for found in map(last_line, (results / name for name in logs)) if found), "")
    others = [r for r, e in enumerate(exits) if r != rank and (e is None or e["returncode"] in VICTIMS)]
    return rank, f"{what}" + (f': "{line}"' if line else "") + f". Hint: {_hint(rc, line, others, code, rank, fault)}."


def _what_happened(results: Path, exits: list, nproc: int, code: int | None, timeout: float, launcher: str,
                   hosts: Sequence[str] | None) -> tuple[int | None, str, int]:
    """(the rank to blame or None, what happened to it, its exit status: 0 when none failed)."""
    failed = sorted((e["time"], e["rank"], e["returncode"]) for e in exits if e and e["returncode"])
    failed = [f for f in failed if f[2] not in VICTIMS] or failed  # the first real failure
    if failed:
        _, rank, rc = failed[0]
        return rank, f"rank {rank} of {nproc} {_on(exits, rank, hosts)}" + (
            f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"), rc
    missing = [r for r in range(nproc) if not (results / f"rank{r}.json").exists()]
    if code is None:
        running = [r for r in range(nproc) if exits[r] is None]  # suspect first one that said something
        rank = next((r for r in running if last_line(results / f"rank{r}.err")), (running or [None])[0])
        return rank, f"timed out after {timeout:g} s with rank(s) {running} still running", 0
    if missing and (code == 0 or all(exits)):
        return missing[0], f"rank {missing[0]} exited without a result (did it call write_result?)", 0
    return None, f"the {launcher} launcher exited with code {code}", 0


def _on(exits: list, rank: int, hosts: Sequence[str] | None) -> str:
    """``"on node1 "``: the host of the node ``rank``'s exit record names, where ``hosts`` are known; else ``""``."""
    node = next((e.get("node") for e in exits if e and e["rank"] == rank), None)
    return f"on {hosts[node]} " if hosts and isinstance(node, int) and 0 <= node < len(hosts) else ""


def _nccl_line(timeouts: dict[int, str], nproc: int) -> tuple[int, str]:
    """The first rank whose NCCL collective timed out, and the line that says so and who never came."""
    first = min(timeouts)
    late = [r for r in range(nproc) if r not in timeouts]
    why = (f"rank(s) {late} never reached it (hung, crashed or much slower)" if late else
           "every rank waited: the collectives did not match (different order or sizes) or the network is stuck")
    return first, (f"rank {first} of {nproc}: {timeouts[first]}. Hint: {why}; raise the timeout only if the run "
                   "is just slow.")


def _hint(rc: int, line: str, others: list[int], code: int | None, rank: int | None, fault: str | None) -> str:
    """What to look at next, from how the rank ended (``rc``) and its last error ``line``."""
    if rc == -signal.SIGKILL:
        return "SIGKILL usually comes from the out-of-memory killer (see `dmesg`)" + (
            f", or from {FAULT_ENV}={fault}" if fault else "")
    if re.search(r"timed? ?out", line, re.IGNORECASE) and others:
        return f"a collective timed out: rank(s) {others} never reached it (hung, crashed or much slower)"
    if code is None:
        return "a rank stuck in a collective waits for one that never comes; if the run is just slow, raise timeout="
    return "the whole error is in " + (f"rank{rank}.err" if rank is not None else "launcher.log")


_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d+), OpType=(\w+)"
                       r".*?Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")
def nccl_timeout(path: Path) -> str | None:
    """One line for the NCCL watchdog timeout in a rank's log ``path``, or None.

    When a collective waits longer than the process group's timeout, NCCL's watchdog thread logs
    ``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=S, OpType=OP, ..., Timeout(ms)=T)
    ran for M milliseconds before timing out`` and aborts the process (torch's
    ``ProcessGroupNCCL.cpp``), so the log ends in faulthandler's "Fatal Python error: Aborted".
    """
    try:
        found = _WATCHDOG.search(path.read_text(errors="replace"))
    except OSError:
        return None
    if found is None:
        return None
    seq, op, limit_ms, ran_ms = found.groups()
    return (f"NCCL {op.lower()} (collective #{seq}) timed out: it waited {int(ran_ms) / 1e3:g} s against a "
            f"{int(limit_ms) / 1e3:g} s timeout (NCCL watchdog)")


def last_line(path: Path) -> str:
    """The exception line of the last traceback in ``path``, else its last line that is not noise."""
    try:  # torch prefixes a rank's traceback lines with "[rankN]: "
        lines = [re.sub(r"^\[rank\d+\]: ?", "", s) for s in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    starts = [i for i, s in enumerate(lines) if s.startswith("Traceback (most recent call last)")]
    found = next((s for s in lines[starts[-1] + 1:] if s.strip() and not s[0].isspace()), None) if starts else None
    found = found or next((s for s in reversed(lines) if s.strip() and not _NOISE.search(s)), "")
    return found.strip()[:300]
