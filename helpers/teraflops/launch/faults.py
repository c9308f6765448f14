"""Fault injection for the course's runs: a rank told to fail, on purpose, at a given step.

``TERAFLOPS_FAULT=KIND:rank=R:step=S`` makes rank R, at ``fault_point(S)``, SIGKILL itself
(``kill``), sleep forever (``hang``) or raise RuntimeError (``raise``), in the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0), so that an elastic restart (torchrun ``--max-restarts``)
recovers. The host side (:func:`teraflops.launch.launcher.launch`) parses it before starting
anything, so a malformed value fails in the notebook, not in a rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NamedTuple

FAULT_ENV, FAULT_KINDS = "TERAFLOPS_FAULT", ("kill", "hang", "raise")


class Fault(NamedTuple):
    kind: str  # one of FAULT_KINDS
    rank: int
    step: int


def parse_fault(spec: str | None) -> Fault | None:
    """``"kill:rank=1:step=3"`` → ``Fault("kill", 1, 3)``; empty or None → None; ValueError otherwise."""
    if not spec:
        return None
    kind, *fields = spec.strip().split(":")
    pairs = dict(f.split("=", 1) for f in fields if "=" in f)
    if kind not in FAULT_KINDS or len(fields) != 2 or set(pairs) != {"rank", "step"} or not all(
            v.isascii() and v.isdigit() for v in pairs.values()):
        raise ValueError(f"{FAULT_ENV}={spec!r} is not KIND:rank=R:step=S with KIND one of "
                         f"{', '.join(FAULT_KINDS)} (e.g. kill:rank=1:step=3)")
    return Fault(kind, int(pairs["rank"]), int(pairs["step"]))


def fault_point(step: int) -> None:
    """Fail here if ``$TERAFLOPS_FAULT`` names this rank and ``step`` (see the module docstring)."""
    fault = parse_fault(os.environ.get(FAULT_ENV))
    if fault is None or fault.step != step or str(fault.rank) != os.environ.get("RANK", "0") or int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
        return
    print(f"{FAULT_ENV}: fault '{fault.kind}' injected in rank {fault.rank} at step {step}", file=sys.stderr,
          flush=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV} at step {step}")
    while True:
        time.sleep(3600)
