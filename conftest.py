"""Root test setup: nbval's notebook cells (solutions/*.ipynb) are ``slow`` (they run a kernel); under
pytest-xdist (README's test command, ``pytest -n 2``) every test file is one unit of work, and the files
that act on the whole machine are one unit of work together, so they never run at once.

No test here asserts how fast the machine is (tests/test_no_timed_tests.py holds that), so nothing waits
for a quiet machine: the only reason a file runs apart from another is that both would act on the same
thing, and that reason is written beside its name in :data:`MACHINE_WIDE`.

(xdist's own ``--dist loadgroup`` with ``xdist_group`` marks would say the same, but with pytest 9 it
silently stops grouping: it renames node ids through a field pytest no longer reads, pytest-xdist issue
#1386; the scheduler here groups by file name, which needs no renaming.)
"""

import sys

import pytest
from xdist.scheduler import LoadScopeScheduling

from teraflops.course import any_folder


MACHINE_WIDE = frozenset({
    # Slurm: one controller per machine (its config, spool and ports are the machine's), or submit to it
    "test_slurm.py", "test_slurm_queue.py", "test_sbatch.py", "test_grading_unit03.py", "03_orchestration.ipynb",
    "test_unit03_run.py",
    # take down every cluster of the machine (`teraflops cluster down --all`) or count every node namespace
    "test_cluster.py", "test_placement.py", "test_ray.py", "test_ray_elastic.py", "test_workshop.py",
    "test_unit05_run.py", "test_tensor_parallel.py",
    # add Unix users or open folders to them (tests/traversal.py), run a hub with its own users
    "test_traversal.py", "test_hub.py",
    # scan every process, socket or launch folder on the machine
    "test_loopback.py", "test_serving.py",
    # share one session fixture's launch with test_cluster (tests/conftest.py): one run of it
    "test_remedies.py", "test_zero.py",
})
LAST = "test_site.py"  # builds the course site from the lectures that tests/test_unitNN_run.py executed


def unit_of_work(nodeid: str) -> str:
    """The unit of work a test belongs to under xdist: ``machine`` for :data:`MACHINE_WIDE` files, else its
    file (the node id up to ``::``)."""
    path = nodeid.split("::", 1)[0]
    return "machine" if path.rsplit("/", 1)[-1] in MACHINE_WIDE else path


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    # the longest unit of work (the machine-wide files) first, so that it does not start last and run alone;
    # the course site last, built from the lectures the run executed; a stable sort keeps every file's order
    items.sort(key=lambda item: 2 if item.path.name == LAST else 0 if unit_of_work(item.nodeid) == "machine" else 1)


@pytest.hookimpl(optionalhook=True)  # also without xdist (`-p no:xdist`)
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


def pytest_configure(config):
    """A virtual environment in a folder with a space: pytest restarts once through a space-free link to
    it, so that DeepSpeed's op build and torch.compile's C++ build work (the workers and every process
    the tests start inherit the link; teraflops.course.any_folder says why). Only a pytest started from
    the command line restarts (not one run inside another process), and only after pytest's capture of
    the output is stopped: the restarted process inherits the file descriptors, which capture points at
    its temporary files."""
    args = list(config.invocation_params.args)
    if hasattr(config, "workerinput") or sys.argv[1:] != args or not any_folder.needs_link():
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()
    any_folder.reexec(["-m", "pytest", *args])
