"""Root test setup: nbval's notebook cells (solutions/*.ipynb) are ``slow`` (they run a kernel); under
pytest-xdist (README's test command, ``pytest -n 2``) every test file is one unit of work and the tests
that act on the whole machine run one after another on one worker.

* **One file, one worker** (:class:`FileScheduling`, xdist's ``loadfile`` rule): a notebook's cells run in
  order on one kernel, a module's fixtures run once.
* **Machine-wide files are one unit of work**, so they never run at once: those that run Slurm (one
  controller per machine) or submit to it, take down every cluster (``teraflops cluster down --all``),
  add Unix users or open folders to them (tests/traversal.py), or scan every process, socket or launch
  folder on the machine. A file joins by being named in :data:`MACHINE_WIDE`. Emulated clusters
  themselves may run side by side (each has its own bridge and namespaces: teraflops.nodes.cluster).
  (xdist's own ``--dist loadgroup`` with ``xdist_group`` marks would say the same, but with pytest 9.2
  it silently stops grouping: it renames node ids through a field pytest no longer reads,
  pytest-xdist issue #1386; the scheduler here groups by file name, which needs no renaming.)
* **Quiet files run alone**: those whose assertions are about load (a hog of their own beside them,
  tests/hog.py) or whose verdicts are measured and compared with a committed answer form one unit of
  work near the end that holds an exclusive lock while every other test holds a shared one for its own
  run (:class:`_Quiet`): the other worker waits between two of its tests. A file joins by :data:`QUIET`, one test by
  ``@pytest.mark.quiet``. Without xdist the lock is not taken; the controller removes its file at the end.
"""

import fcntl
import os
import tempfile
import time
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

MACHINE_WIDE = frozenset({
    "test_cluster.py", "test_grading_unit03.py", "test_hub.py", "test_loopback.py", "test_placement.py",
    "test_ray.py", "test_ray_elastic.py", "test_sbatch.py", "test_slurm.py", "test_slurm_queue.py",
    "test_tensor_parallel.py", "test_traversal.py", "test_unit03_run.py", "test_unit05_run.py",
    "test_workshop.py",
    # scans every process and port for a Triton server left behind
    "test_serving.py",
    # lab 3's checks submit to the real Slurm (grading.unit03)
    "03_orchestration.ipynb",
    # not machine-wide, but they share a session fixture's launch with test_cluster (tests/conftest.py): one run
    "test_remedies.py", "test_zero.py",
})
LAST = "test_site.py"  # builds the site from the lectures tests/test_unitNN_run.py executed
# a hog of their own (tests/hog.py) and what they assert about it; measured verdicts checked against the
# committed answer (Unit 6: issue 29 records verdicts flipping at load ~3)
QUIET = frozenset({"test_busy_widgets.py", "test_busy_verdicts.py", "06_triage.ipynb", "test_unit06_run.py",
                   "test_preflight.py", "test_demo.py", "test_workloads.py",
                   # a measured verdict (Unit 6's mysteries), a copy-bandwidth ratio and pipeline bubbles (a busy core beside a
                   # stage reads as bubble): the other worker's load flipped each
                   "test_grading_unit06.py", "test_contention.py", "test_pipeline.py"})


def unit_of_work(nodeid: str) -> str:
    """The unit of work a test belongs to under xdist: ``machine`` for :data:`MACHINE_WIDE` files, ``quiet``
    for :data:`QUIET` files (one exclusive block: the lock is asked for once, not once per file), else its
    file (the node id up to ``::``)."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    return "machine" if name in MACHINE_WIDE else "quiet" if name in QUIET else path


def _group(item) -> str:
    return unit_of_work(item.nodeid)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    # the longest unit of work (the machine-wide files) first, so that it does not start last and run alone
    # at the end; the quiet block near the end (asked for at the start, it waited out the machine unit's
    # first test, a cluster's 100 s set-up); the course site last, built from the lectures the run executed
    # (tests/test_site.py); a stable sort keeps every file's order
    order = {"machine": 0, "quiet": 2}
    items.sort(key=lambda item: 3 if item.path.name == LAST else order.get(_group(item), 1))


def pytest_xdist_make_scheduler(config, log):
    return FileScheduling(config, log)


class FileScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with :func:`unit_of_work` as the scope, units handed out in collection
    order (machine-wide first), not reordered by their number of tests."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of_work(nodeid)


LOCK_ENV = "TERAFLOPS_PYTEST_LOCK"  # the quiet lock's file, made by the controller, inherited by its workers


def pytest_configure(config):
    """The controller of an xdist run makes the quiet lock's file (:class:`_Quiet`) for its workers."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="teraflops-pytest-", suffix=".lock")
        os.close(fd)
        Path(path + ".turn").touch(mode=0o600)
        os.environ[LOCK_ENV] = config.stash[_LOCK_FILE] = path


def pytest_unconfigure(config):
    if _LOCK_FILE in config.stash:
        for suffix in ("", ".turn"):
            Path(config.stash[_LOCK_FILE] + suffix).unlink(missing_ok=True)
        os.environ.pop(LOCK_ENV, None)


class _Quiet:
    """A readers-writer lock across xdist's workers (``flock`` on the file ``$TERAFLOPS_PYTEST_LOCK``): the
    quiet block holds it exclusively from its first test's setup to its last test's teardown, every other
    test holds it shared for its own run. Writers go first: a writer holds the turnstile file (``.turn``)
    while it waits, and a reader passes the turnstile before it takes its shared lock, so a waiting writer
    waits for the test running now, not for every test the other worker starts meanwhile (plain ``flock``
    let a reader that releases and asks again overtake it: 273 s of waits in one run)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = self.turn = None
        self.exclusive_group = None

    def acquire(self, mode: int) -> None:
        self.turn = os.open(self.path + ".turn", os.O_RDWR)
        fcntl.flock(self.turn, fcntl.LOCK_EX)  # a reader waits here while a writer waits or holds
        self.fd = os.open(self.path, os.O_RDWR)
        fcntl.flock(self.fd, mode)
        if mode != fcntl.LOCK_EX:
            os.close(self.turn)
            self.turn = None

    def release(self) -> None:
        for fd in (self.fd, self.turn):
            if fd is not None:
                os.close(fd)  # closing the descriptor releases its flock
        self.fd = self.turn = None


def _quiet_group(item) -> bool:
    return item.path.name in QUIET


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(LOCK_ENV) if hasattr(item.config, "workerinput") else None
    if not path:  # one process: nothing runs beside the test
        yield
        return
    lock = item.config.stash.setdefault(_LOCK, _Quiet(path))
    group = _group(item)
    asked = time.time()
    if lock.exclusive_group != group:
        if _quiet_group(item):
            lock.acquire(fcntl.LOCK_EX)
            lock.exclusive_group = group
        else:
            lock.acquire(fcntl.LOCK_EX if item.get_closest_marker("quiet") else fcntl.LOCK_SH)
    start = time.time()
    try:
        yield
    finally:
        if lock.exclusive_group is None or nextitem is None or _group(nextitem) != lock.exclusive_group:
            lock.release()
            lock.exclusive_group = None
        _timeline(item, asked, start, time.time())


TIMELINE_ENV = "TERAFLOPS_PYTEST_TIMELINE"  # a file: each worker appends a line per test (maintainers)


def _timeline(item, asked: float, start: float, end: float) -> None:
    """With ``$TERAFLOPS_PYTEST_TIMELINE`` set, append ``worker asked start end nodeid`` (Unix seconds; the
    gap from asked to start is time spent waiting for the quiet lock) to that file, to see where a
    two-worker run's wall time goes."""
    out = os.environ.get(TIMELINE_ENV)
    if out:
        with open(out, "a") as f:
            f.write(f"{item.config.workerinput['workerid']} {asked:.2f} {start:.2f} {end:.2f} {item.nodeid}\n")


_LOCK = pytest.StashKey[_Quiet]()
_LOCK_FILE = pytest.StashKey[str]()
