"""Folders other users may pass through for one test: the tests that run a throw-away Unix user
(tests/test_hub.py's learners, tests/test_workshop.py's second user) need that user to run this Python
and import this clone of the course, which may sit behind a folder closed to others (a pyenv under a
mode-700 ``/root``, a clone in a ``mktemp -d`` folder or a home directory).

:func:`traversable` gives those folders o+x (enter, not list) for the test and puts each mode back
after it, pass or fail; each change is recorded in :data:`GRANTS` before it is made, so what a killed
run changed is put back by the next run (:func:`sweep_dead_runs`). One home for this, used by both.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]  # this clone
GRANTS = Path("/var/tmp/teraflops-test-grants")  # <pid>-*.json: the modes a run changed, until it puts them back


def course_paths() -> list[Path]:
    """What another user's process of this course reads: this Python (``sys.executable``, whose real
    interpreter may lie elsewhere, and ``sys.prefix``), the ``teraflops`` package this process imports
    (an editable install points into the clone; ``PYTHONPATH`` may point at another tree), every
    ``PYTHONPATH`` entry and this clone's ``helpers/``."""
    import teraflops

    entries = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [Path(sys.executable), Path(sys.prefix), Path(teraflops.__file__).parent, *entries, ROOT / "helpers"]


def _restore(record: Path) -> None:
    """Put back the modes a record lists, where they are still as its run left them."""
    try:
        changed = json.loads(record.read_text() or "[]")
    except (OSError, ValueError):
        changed = []
    for path, mode in changed:
        try:
            if stat.S_IMODE(os.stat(path).st_mode) == mode | stat.S_IXOTH:
                os.chmod(path, mode)
        except FileNotFoundError:
            pass
    record.unlink(missing_ok=True)


def sweep_dead_runs() -> None:
    """Modes changed by runs that are gone (killed before they put them back): back as they were."""
    for record in GRANTS.glob("*.json") if GRANTS.is_dir() else []:
        pid = record.stem.split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            _restore(record)


@contextmanager
def traversable(paths):
    """Every folder on the way to each of ``paths`` (symbolic links resolved) that others cannot enter
    gets o+x for the ``with`` block; each mode is put back afterwards, also when the block raises, and
    by the next run if this process is killed. Leaves alone folders others can enter already."""
    sweep_dead_runs()
    GRANTS.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{os.getpid()}-", suffix=".json", dir=GRANTS)
    os.close(fd)
    record = Path(name)
    changed: list[tuple[str, int]] = []
    try:
        for path in paths:
            target = Path(path).resolve()
            for d in [*reversed(target.parents), target]:
                if not d.is_dir() or str(d) in (c for c, _ in changed):
                    continue
                mode = stat.S_IMODE(d.stat().st_mode)
                if not mode & stat.S_IXOTH:
                    changed.append((str(d), mode))
                    record.write_text(json.dumps(changed))  # before the change: a kill now is undone next run
                    os.chmod(d, mode | stat.S_IXOTH)
        yield
    finally:
        _restore(record)
