"""A busy machine on demand: other learners' runs beside a test.

:func:`hog` starts four processes in their own session, as two or three learners' work on the same
cores would be: two stream memory with NumPy copies (``numpy.copyto`` of 64 MiB arrays, far beyond
the last-level cache) and two multiply matrices with torch (512 × 512 float32, one thread each).
Memory-bandwidth contention is what moved the triage verdicts (four pure-Python loops did not), so
both kinds are here. The processes are always ended (SIGTERM, then SIGKILL), when the ``with`` block
ends, also on a failure or a KeyboardInterrupt.

Used by the busy-machine tests (``@pytest.mark.slow``: they start processes) through the
``hog`` fixture of ``tests/conftest.py`` and by ``scripts/busy_acceptance.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

COPY = """
import numpy as np
src = np.ones(64 << 18, dtype=np.float32)  # 64 MiB
dst = np.empty_like(src)
while True:
    np.copyto(dst, src)
"""

MATMUL = """
import torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
b = torch.randn(512, 512)
while True:
    a @ b
"""

KINDS = (COPY, COPY, MATMUL, MATMUL)


@contextlib.contextmanager
def hog(kinds=KINDS, settle: float = 1.0):
    """Run the hog processes (``kinds``: Python sources, default two NumPy copiers and two torch
    matmuls) for the duration of the block; yields their PIDs. ``settle`` seconds are waited so
    that they are busy when the block starts. Each process runs in a new session and is ended on
    exit, whatever happens (a SIGTERM to this process included)."""
    procs: list[subprocess.Popen] = []
    # A SIGTERM (a CI runner's timeout, a `kill`) ends this process through the finally below too.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_term) if main else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    try:
        for code in kinds:
            procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(settle)
        dead = [p.args[-1].strip().splitlines()[1] for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"hog process(es) exited at start: {dead}")
        yield [p.pid for p in procs]
    finally:
        _end(procs)
        if main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_term(signum, frame):
    raise SystemExit(128 + signum)


def _end(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
