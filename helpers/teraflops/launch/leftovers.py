"""A launch's leftovers: removed by the run itself when its notebook dies, or by the next launch.

Outside its processes a launch leaves its folder (``/tmp/teraflops-launch-*``), torchrun's log
folder (``torchelastic_*``, put inside the launch folder by ``--log-dir``) and, for DeepSpeed on CPU,
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (~67 MB each). Its **owner** is
the notebook-side process that called :func:`teraflops.launch.launcher.launch` (:mod:`teraflops.ownership`).

* While it runs, a watchdog (``launch/scripts/watchdog.py``, a process of its own session, so a SIGKILL of
  the kernel does not reach it) checks the owner twice a second; once the owner is gone it stops the
  launchers and ranks and removes the files. Each rank's wrapper (``launch/scripts/rank_wrapper.py``) also watches
  the owner, in case the watchdog is killed too.
* :func:`sweep` (at the start of every launch) removes what a run of a dead owner left: launch folders
  (in the temporary folder, and a served model's in ``/dev/shm``: :mod:`teraflops.compilation.serving`)
  whose ``owner.json`` names a process that is gone, shared-memory files of this user that no live
  launch owns and no process maps, and ``/tmp/torchelastic_*`` folders of this user that no live
  torchrun older than the folder can be writing. A live run's files are never touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

from teraflops import ownership
from teraflops.launch.scripts.proc_identity import proc_start

OWNER_ENV = "TERAFLOPS_OWNER"  # "pid:start" of the notebook-side process, read by each rank's wrapper
_WATCHDOG = Path(__file__).resolve().parent / "scripts" / "watchdog.py"
SHM = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"


def owner_env(pid: int | None = None) -> dict:
    """``{TERAFLOPS_OWNER: "pid:start"}`` for a launch's processes (default owner: this process)."""
    pid = os.getpid() if pid is None else pid
    return {OWNER_ENV: f"{pid}:{proc_start(pid)}"}


def record(results: Path, port: int, addr: str = "127.0.0.1") -> None:
    """Write ``owner.json`` (owner record, port, address) into a launch folder."""
    (results / "owner.json").write_text(json.dumps({**ownership.owner(), "port": port, "addr": addr}))


def start_watchdog(results: Path, port: int, pgids: list[int], addr: str = "127.0.0.1",
                   also: list[Path] = ()) -> subprocess.Popen:
    """Start the watchdog of a launch (terminate it when the launch is over); ``also``: more folders of the
    launch it removes with ``results`` (a served model's ``/dev/shm`` folder)."""
    return subprocess.Popen([sys.executable, str(_WATCHDOG), str(os.getpid()), str(proc_start(os.getpid())),
                             str(results), str(port), addr, ",".join(map(str, pgids)), ",".join(map(str, also))],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def shm_files(port: int | None = None, addr: str | None = None, uid: int | None = None) -> list[Path]:
    """This user's DeepSpeed shared-memory files (``..._<uid>_<addr>_<port>_<rank>``), of one launch if given."""
    uid = os.getuid() if uid is None else uid
    pattern = f"{SHM_PREFIX}_{uid}_{addr or '*'}_{port or '*'}_*"
    return sorted(SHM.glob(pattern)) if SHM.is_dir() else []


def mapped() -> set[str]:
    """Paths under /dev/shm that some process of this user maps now (``/proc/<pid>/maps``)."""
    out = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with suppress(OSError):
            with open(f"/proc/{entry.name}/maps") as f:
                out.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
    return out


def live_launches() -> dict[Path, dict]:
    """Launch folders whose owner lives, with their ``owner.json``."""
    out = {}
    for folder in Path(tempfile.gettempdir()).glob("teraflops-launch-*"):
        with suppress(OSError, ValueError):
            held = json.loads((folder / "owner.json").read_text())
            if ownership.alive(held):
                out[folder] = held
    return out


def sweep() -> list[Path]:
    """Remove leftovers of launches whose owner is gone (see the module docstring); returns what went."""
    import psutil

    removed, tmp, uid = [], Path(tempfile.gettempdir()), os.getuid()
    for folder in [*tmp.glob("teraflops-launch-*"), *SHM.glob("teraflops-launch-*")]:
        try:
            held = json.loads((folder / "owner.json").read_text())
        except (OSError, ValueError):
            continue  # no record (being made, or made before records existed): not provably stale
        if held.get("uid") == uid and not ownership.alive(held):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    live_ports = {(h.get("addr"), str(h.get("port"))) for h in live_launches().values()}
    mapped_now = mapped()
    for path in shm_files():
        parts = path.name[len(SHM_PREFIX) + 1:].split("_")  # uid, addr, port, rank
        if len(parts) == 4 and (parts[1], parts[2]) not in live_ports and str(path) not in mapped_now:
            path.unlink(missing_ok=True)
            removed.append(path)
    agents = []
    for p in psutil.process_iter(["uids", "cmdline", "create_time"]):
        with suppress(psutil.Error, TypeError):
            if p.info["uids"].real == uid and any(re.search(r"torch\.distributed\.run|torchrun", a)
                                                  for a in p.info["cmdline"] or ()):
                agents.append(p.info["create_time"])
    for folder in tmp.glob("torchelastic_*"):
        with suppress(OSError):
            st = folder.stat()
            if st.st_uid == uid and not any(started <= st.st_mtime + 1 for started in agents):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed
