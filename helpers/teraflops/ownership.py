"""Who owns what on a shared machine: a process (pid and start time) and its Unix user.

A workshop puts many learners on one box. Anything a run leaves outside its own process (an emulated
cluster's namespaces, a launch's folder and shared-memory files) carries an **owner record**: the
process it belongs to. A thing whose owner is gone is a *leftover* anyone may remove; one whose owner
lives is never touched by another owner (unless the host asks, ``teraflops cluster down --all``).

A pid alone can be reused by a new process after its owner dies; the record also keeps the owner's
start time (``psutil.Process.create_time``) and the owner counts as alive only while both match.

A notebook's run belongs to the kernel (the calling process). What a **command** makes
(``teraflops cluster up``) belongs to the caller's **login session**: its session leader
(:func:`session_owner`; ``os.getsid``, what ``ps -o sess`` shows; POSIX ``setsid(2)``), the shell of
the user's terminal, which lives as long as the user is logged in there. Not the command's parent:
under ``timeout 60``, ``make``, a script or ``sudo`` that parent ends with the command, and what it
owned would be a leftover at once. Subshells, scripts and ``make`` run in their shell's session
(only ``setsid`` opens a new one; ``timeout`` only a process group of its own), so they share an
owner with it; another terminal, an ``ssh`` login or another user is another session.

Cluster records live in :func:`cluster_dir` (``/run/teraflops/clusters``: ``/run`` is a tmpfs, gone
at reboot with the namespaces themselves). A record is claimed with ``O_CREAT | O_EXCL`` (POSIX
``open(2)``): of two processes claiming one name at once exactly one gets it.
"""

from __future__ import annotations

import json
import os
import pwd
import time
from contextlib import suppress
from pathlib import Path

CLUSTER_DIR_ENV = "TERAFLOPS_CLUSTER_RECORDS"


def cluster_dir() -> Path:
    """Where cluster owner records live: ``$TERAFLOPS_CLUSTER_RECORDS`` or ``/run/teraflops/clusters``."""
    return Path(os.environ.get(CLUSTER_DIR_ENV) or "/run/teraflops/clusters")


def user_name(uid: int | None = None) -> str:
    """The login name of ``uid`` (default: this process's), or ``uid<N>`` without a passwd entry."""
    uid = os.getuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


def start_time(pid: int) -> float | None:
    """When process ``pid`` started (Unix seconds, psutil), or None if there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def owner(pid: int | None = None) -> dict:
    """An owner record of process ``pid`` (default: this one): ``pid``, ``start``, ``uid``, ``user``."""
    pid = os.getpid() if pid is None else pid
    import psutil

    try:
        uid = psutil.Process(pid).uids().real
    except psutil.Error:
        uid = os.getuid()
    return {"pid": pid, "start": start_time(pid), "uid": uid, "user": user_name(uid)}


# Commands that may open a session for the one command they run: sudo with ``use_pty`` (Debian's default
# sudoers) runs it in a new session on a pseudo-terminal whose leader is sudo's monitor process
# (sudo(8), "Process model"); ``su -c`` may run it in a new session (su(1), ``--session-command``).
WRAPPERS = frozenset({"sudo", "su", "runuser", "doas", "pkexec"})


def _name(pid: int) -> str | None:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None


def parent(pid: int) -> int | None:
    """The parent of process ``pid``, or None when there is no such process (or it has none)."""
    import psutil

    try:
        return psutil.Process(pid).ppid() or None
    except psutil.Error:
        return None


def login_session(pid: int | None = None) -> int | None:
    """The leader of process ``pid``'s login session (default: this process): its session id
    (``os.getsid``), looked through a session that sudo or su (:data:`WRAPPERS`) opened for one
    command, to the session of the process that ran them. None when ``pid`` is in no login session:
    the kernel's or init's (session 0 or 1; also 0 when the leader is outside this pid namespace),
    or there is no such process."""
    pid = os.getpid() if pid is None else pid
    for _ in range(8):  # sudo in su in sudo...: a few wrappers deep at most
        try:
            sid = os.getsid(pid)
        except OSError:
            return None
        if sid <= 1:
            return None
        above = parent(sid)
        if above is None or (_name(sid) not in WRAPPERS and _name(above) not in WRAPPERS):
            return sid
        pid = above  # the session a wrapper opened: the one of whoever ran the wrapper
    return sid


def session_owner(pid: int | None = None) -> int:
    """Who owns what command ``pid`` (default: this process) makes outside itself: the leader of its
    login session (:func:`login_session`). A process that leads its own session (``setsid CMD``)
    belongs to the login session of its parent; without any login session, to its parent, as
    before sessions counted (to itself when that is init)."""
    pid = os.getpid() if pid is None else pid
    leader = login_session(pid)
    above = parent(pid)
    if leader == pid and above is not None:
        leader = login_session(above)
    if leader is None or leader == pid:
        return above if above is not None and above > 1 else pid
    return leader


def same_owner(record: dict | None, other: dict | None) -> bool:
    """True if two owner records name one process: the same pid and, where both have one, the same
    start time (a reused pid is another owner)."""
    if not record or not other or record.get("pid") != other.get("pid") or record.get("pid") is None:
        return False
    a, b = record.get("start"), other.get("start")
    return a is None or b is None or abs(a - b) < 1.0


def alive(record: dict | None) -> bool:
    """True while the process a record names runs (same pid, same start time, not a zombie)."""
    import psutil

    if not record or not isinstance(record.get("pid"), int):
        return False
    try:
        p = psutil.Process(record["pid"])
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        started = p.create_time()
    except psutil.Error:
        return False
    return record.get("start") is None or abs(started - record["start"]) < 1.0


def describe(record: dict | None) -> str:
    """``"alice (pid 4242)"``, with ``", gone"`` when that process has ended."""
    if not record:
        return "unknown owner"
    return f"{record.get('user', '?')} (pid {record.get('pid', '?')}" + ("" if alive(record) else ", gone") + ")"


def _path(name: str) -> Path:
    return cluster_dir() / f"{name}.json"


def read(name: str) -> dict | None:
    """Cluster ``name``'s record (owner fields plus ``name``, ``nodes``), or None."""
    try:
        return json.loads(_path(name).read_text())
    except (OSError, ValueError):
        return None


def records() -> dict[str, dict]:
    """Every cluster record, by name."""
    out = {}
    for path in sorted(cluster_dir().glob("*.json")) if cluster_dir().is_dir() else ():
        with suppress(OSError, ValueError):
            out[path.stem] = json.loads(path.read_text())
    return out


def claim(name: str, nodes: int, pid: int | None = None) -> tuple[bool, dict | None]:
    """Claim cluster ``name`` for process ``pid`` (default: this one), atomically.

    Returns ``(True, record)`` when claimed (also when the old owner is gone: its record is replaced),
    else ``(False, the live owner's record)``; never changes another live owner's record.
    """
    directory = cluster_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    record = {"name": name, "nodes": nodes, "created": time.time(), **owner(pid)}
    for _ in range(2):
        try:
            fd = os.open(_path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = read(name)
            if held is None or alive(held):
                if held is not None and held.get("pid") == record["pid"] and held.get("start") == record["start"]:
                    return True, held  # ours already
                if held is None:  # being written right now by its claimer
                    time.sleep(0.05)
                    held = read(name)
                return False, held
            stale = _path(name).with_name(f"{name}.json.stale{os.getpid()}")
            with suppress(OSError):
                os.rename(_path(name), stale)  # of two takers of a stale record only one renames it
                stale.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return True, record
    return False, read(name)


def release(name: str) -> None:
    """Remove cluster ``name``'s record (after its namespaces are gone)."""
    _path(name).unlink(missing_ok=True)


def mark_taken_down(name: str, by: dict) -> None:
    """Leave a note that cluster ``name`` was removed by ``by`` (an owner record) for its own jobs to read
    (notes older than an hour are removed here)."""
    for old in cluster_dir().glob("*.down"):
        with suppress(OSError):
            if time.time() - old.stat().st_mtime > 3600:
                old.unlink()
    with suppress(OSError):
        (cluster_dir() / f"{name}.down").write_text(json.dumps({**by, "time": time.time()}))


def taken_down_by(name: str) -> dict | None:
    """Who removed cluster ``name`` though it was not theirs (:func:`mark_taken_down`), or None."""
    try:
        return json.loads((cluster_dir() / f"{name}.down").read_text())
    except (OSError, ValueError):
        return None


def clear_taken_down(name: str) -> None:
    (cluster_dir() / f"{name}.down").unlink(missing_ok=True)
