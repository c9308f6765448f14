"""A notebook run headless in a fresh Jupyter kernel, one cell at a time: what ``teraflops run`` does to a
lecture and ``teraflops grade`` to a lab.

:func:`make_client` makes the nbclient client (the python3 kernel of this environment, the notebook's
folder as working directory, :mod:`teraflops.launch.kernel_client`'s channels, which never wait out a
timeout unseen); :func:`execute_cells` runs the cells behind a progress bar that says how long the
running cell has taken, and returns each failure as a :class:`CellFailure` (where, the exception, the
one line that names the cause: :func:`cause_line`); :func:`cell_stall` finds cells whose answer reached
the client late (:class:`CellStall`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

__all__ = ["CellFailure", "CellStall", "STALL_SECONDS", "cause_line", "one_line", "execute_cells", "cell_stall",
           "make_client"]


@dataclass(frozen=True)
class CellFailure:
    """Where and how a notebook stopped. ``cell_index`` is ``None`` if the kernel never started.
    ``evalue`` is one line, the one that names the problem (:func:`cause_line`); ``detail`` is the
    whole message and traceback, which :func:`run_notebook` writes to a file beside the notebook."""

    cell_index: int | None
    ename: str
    evalue: str
    detail: str = field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        where = "kernel" if self.cell_index is None else f"cell {self.cell_index}"
        return f"{where}: {self.ename}: {self.evalue}" if self.evalue else f"{where}: {self.ename}"


STALL_SECONDS = 5.0  # a cell whose last message reached us this long after the kernel sent it: a stall


@dataclass(frozen=True)
class CellStall:
    """A cell the client got the kernel's answer to ``seconds`` after the kernel sent it: time a
    headless run waited on nothing (the widget race of :mod:`teraflops.launch.kernel_client`)."""

    cell_index: int
    source: str  # the cell's first line, to find it by
    seconds: float

    def __str__(self) -> str:
        return f"cell {self.cell_index} `{self.source}` waited {self.seconds:.0f} s after the kernel's reply"


def one_line(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# lines that name what went wrong inside a long message (a compiler's or linker's output in an
# OpBuildFailed or InductorError), best first: the tool's own error, then what it could not find
_CAUSES = (re.compile(r"\b(fatal error|error)\b\s*:", re.I), re.compile(r"cannot find|no such file|undefined reference", re.I))
_NOT_A_CAUSE = re.compile(r"^collect2: error: ld returned|^ninja: build stopped|^error: command .* failed", re.I)


def cause_line(message: str, limit: int = 200) -> str:
    """The one line of an exception's ``message`` that names the problem, at most ``limit`` characters:
    a short message as it is; in a long one (a compiler dump: the command line, then the compiler's
    output) the first line that reads like the tool's own error (``error:``, ``fatal error:``, "cannot
    find", "No such file", "undefined reference"), skipping the summaries that only say a tool failed
    (``collect2: error: ld returned 1 exit status``); else the message's first line."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(message)).splitlines() if ln.strip()]
    if not lines:
        return ""
    if len(lines) == 1:
        return one_line(lines[0], limit)
    for pattern in _CAUSES:
        for ln in lines[1:] + lines[:1]:
            if pattern.search(ln) and not _NOT_A_CAUSE.search(ln) and len(ln) <= 4 * limit:
                return one_line(ln, limit)
    return one_line(lines[0], limit)


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """Set environment variables for the duration (a kernel inherits os.environ when it starts)."""
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute_cells(client, nb, desc: str, stop_on_error: bool = True, env: dict[str, str] | None = None,
                  stalls: list | None = None) -> list[CellFailure]:
    """Run the cells of ``nb`` one by one in ``client``'s kernel behind a progress bar.

    The kernel starts with ``env`` added to this process's environment, and with ``TQDM_DISABLE=1``:
    nobody watches the notebook's own progress bars when it runs headless, and in the saved
    notebook they would only be widget state. Returns the failures: errors (when the client does
    not allow them), cell timeouts, a dead kernel, or a kernel that did not start (``cell_index``
    None). With ``stop_on_error`` the first failure ends the run. Never raises for what the
    notebook does. ``stalls``, if given, receives a :class:`CellStall` for every cell whose answer
    reached us :data:`STALL_SECONDS` or more after the kernel sent it (:func:`cell_stall`).
    """
    from nbclient.exceptions import CellExecutionError, CellTimeoutError
    from tqdm.auto import tqdm

    failures: list[CellFailure] = []
    try:
        with _environ({"TQDM_DISABLE": "1", **(env or {})}), client.setup_kernel():
            _set_language_info(client, nb)
            with tqdm(total=len(nb.cells), desc=desc, unit="cell", disable=False) as bar, _ticking(bar) as running:
                for index, cell in enumerate(nb.cells):
                    failure = None
                    running(index, cell)
                    try:
                        client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                    except CellExecutionError as e:
                        failure = CellFailure(index, e.ename, cause_line(e.evalue), detail=_ANSI.sub("", str(e)))
                    except CellTimeoutError:
                        failure = CellFailure(index, "CellTimeoutError",
                                              f"cell ran longer than the {client.timeout} s limit per cell")
                    except Exception as e:  # dead kernel, ...
                        failure = CellFailure(index, type(e).__name__, cause_line(str(e)), detail=str(e))
                    stall = cell_stall(cell, index)
                    if stall is not None and stalls is not None:
                        stalls.append(stall)
                    bar.update(1)
                    if failure is not None:
                        failures.append(failure)
                        if stop_on_error or failure.ename != "CellTimeoutError":
                            break
            client.set_widgets_metadata()
    except Exception as e:  # the kernel did not start (or shut down badly)
        if not failures:
            failures.append(CellFailure(None, type(e).__name__, cause_line(str(e)), detail=str(e)))
    return failures


def cell_stall(cell, index: int, now: float | None = None) -> CellStall | None:
    """How long after the kernel sent a cell's last answer (the later of its ``execute_reply`` and its
    ``status: idle``, the kernel's own timestamps that nbclient records in
    ``cell.metadata.execution``) we got it, as a :class:`CellStall` if :data:`STALL_SECONDS` or more,
    else ``None`` (also when the kernel never answered: that is a timeout, reported as a failure).
    ``now``: seconds since the epoch, default ``time.time()`` (kernel and client share the clock)."""
    sent = []
    for key in ("shell.execute_reply", "iopub.status.idle"):
        stamp = cell.get("metadata", {}).get("execution", {}).get(key)
        try:
            sent.append(datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp())
        except ValueError:
            continue
    if not sent:
        return None
    late = (time.time() if now is None else now) - max(sent)
    first = (cell.source.strip().splitlines() or [""])[0]
    return CellStall(index, one_line(first, 60), late) if late >= STALL_SECONDS else None


TICK_SECONDS = 1.0  # how often the progress bar says how long the running cell has taken, in a terminal
TICK_SECONDS_LOG = 10.0  # the same when stderr is a file or a pipe (a CI log keeps every refresh)


@contextlib.contextmanager
def _ticking(bar, every: float | None = None):
    """While a cell runs, refresh ``bar``'s postfix every ``every`` seconds with the cell's number
    and elapsed time ("cell 12: 95 s"; every 10 s when stderr is not a terminal), so a long cell (a one-off compile, a multi-process run) shows
    that it is alive, in a terminal as in Jupyter. Yields ``running(index, cell)``, called as each
    cell starts."""
    import sys
    import threading

    if every is None:
        every = TICK_SECONDS if getattr(sys.stderr, "isatty", lambda: False)() else TICK_SECONDS_LOG
    current: dict = {}
    stop = threading.Event()

    def running(index, cell) -> None:
        current.update(index=index, start=time.perf_counter(), code=cell.cell_type == "code")
        bar.set_postfix_str(f"cell {index}", refresh=False)

    def tick() -> None:
        while not stop.wait(every):
            if current.get("code"):
                bar.set_postfix_str(f"cell {current['index']}: {time.perf_counter() - current['start']:.0f} s")

    thread = threading.Thread(target=tick, name="teraflops-progress", daemon=True)
    thread.start()
    try:
        yield running
    finally:
        stop.set()
        thread.join()


def make_client(nb, path: Path, timeout: int, allow_errors: bool = False):
    """An nbclient ``NotebookClient`` for ``nb`` (read from ``path``): the ``python3`` kernel of the
    current environment, working directory = the notebook's folder, ``timeout`` seconds per cell.
    With ``allow_errors`` (grading) a cell that times out is interrupted and the next cells still
    run. The kernel client is :class:`teraflops.launch.kernel_client.SlicedKernelClient`, so that no
    message waits out a timeout unseen (widget cells on a busy machine). Used by ``teraflops run``,
    ``grade`` and ``labs refresh``."""
    from nbclient import NotebookClient

    from teraflops.launch import kernel_client  # lazy: jupyter_client and zmq (~0.4 s), only when notebooks run

    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                            interrupt_on_timeout=allow_errors,
                            resources={"metadata": {"path": str(Path(path).parent.resolve())}})
    client.km = client.create_kernel_manager()
    client.km.client_class = kernel_client.CLIENT_CLASS  # no poll sleeps through a message (widget cells)
    _encrypt_if_possible(client.km)
    return client


def _encrypt_if_possible(km) -> None:
    """Let jupyter_client provision CurveZMQ keys when it and the kernel support them.

    Recent ipykernel warns on every start that the local TCP channels are unencrypted; with keys
    the channels are encrypted and the warning goes away. Older jupyter_client: nothing to do.
    """
    try:
        import zmq

        if km.has_trait("transport_encryption") and zmq.has("curve"):
            km.transport_encryption = "auto"
    except Exception:
        pass


def _set_language_info(client, nb) -> None:
    """Store the kernel's language_info in the notebook, as ``NotebookClient.execute`` does (for
    syntax highlighting in the HTML)."""
    try:
        reply = client.wait_for_reply(client.kc.kernel_info())
        if reply and "language_info" in reply["content"]:
            nb.metadata["language_info"] = reply["content"]["language_info"]
    except Exception:
        pass  # cosmetic only
