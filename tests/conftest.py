"""Shared test setup: GPU tests skip with a reason on CPU-only machines, and a test that starts a
process without the ``slow`` marker fails, so ``pytest -m "not slow"`` stays the fast loop."""

import os
import subprocess

import matplotlib.font_manager  # noqa: F401 - a fresh environment's first font scan runs fc-list: done here, not in a test
import numpy.testing  # noqa: F401 - numpy 1.26 (the serving extra's pin) runs lscpu on its first import
import pytest
import torch

import teraflops  # noqa: F401 - configures Triton (interpreter on CPU) before any kernel is defined

NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); the CPU path is tested instead"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def zero_tiny_runs():
    """ZeRO stages 0-3 in one DeepSpeed launch (tiny preset, this machine's plan, 3 steps), and the
    DeepSpeed shared-memory files it left in /dev/shm; shared by test_zero and test_cluster."""
    from pathlib import Path

    from teraflops.launch import leftovers
    from teraflops.parallelization import zero
    from teraflops.sizing import PRESETS
    from teraflops.launch.placement import data_parallel_plan

    def shm():  # left behind: mapped by no live process (another launch on this machine maps its own)
        return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) - {Path(m) for m in leftovers.mapped()}

    before = shm()
    runs = zero.run_zero(stages=(0, 1, 2, 3), plan=data_parallel_plan(PRESETS["tiny"]), steps=3)
    return runs, shm() - before


@pytest.fixture(scope="session")
def remedies_tiny_run():
    """Every remedy setting in one launch of four gloo ranks at the tiny preset; shared by
    test_remedies and test_cluster."""
    from teraflops.hardware import remedies
    from teraflops.sizing import preset
    from teraflops.launch.placement import data_parallel_plan

    p = preset("tiny")
    return remedies.run(plan=data_parallel_plan(p, ranks_cpu=p.remedy.ranks_cpu), timeout=240)


@pytest.fixture(scope="session")
def lecture_runs(tmp_path_factory):
    """One folder for the lectures that this pytest run executes (tests/test_unitNN_run.py), shared by
    xdist's workers (their base temp folders sit side by side in one), so that tests/test_site.py
    builds the course site from them instead of executing every lecture again."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "lecture-runs"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture
def lecture_out(lecture_runs, request):
    """Where one tests/test_unitNN_run.py test has ``teraflops run`` write: a folder of its own (each run
    writes its own machine.json and ceilings.json) in :func:`lecture_runs`, marked :data:`DONE` when the
    test ends."""
    folder = lecture_runs / request.node.path.stem
    folder.mkdir(exist_ok=True)
    yield folder
    (folder / DONE).touch()  # also after a failure: tests/test_site.py waits for it under xdist


DONE = "done"  # in a lecture_out folder: that lecture's test has ended


@pytest.fixture(autouse=True)
def _first_failure_of_every_check():
    """Each test sees a check's hints as a learner's first failure does (grading.core.reveal)."""
    from teraflops.grading import core

    core.FAILURES.clear()
    yield
    core.FAILURES.clear()


class _StartsAProcess(RuntimeError):
    pass


def _refuse(*args, **kwargs):
    raise _StartsAProcess("this test starts a process (a subprocess, a kernel, a launch or a compiler): "
                          "mark it @pytest.mark.slow so that `pytest -m \"not slow\"` stays the fast loop")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_processes_unless_slow(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes_unless_slow(item):
        yield


class _no_processes_unless_slow:
    """While a test not marked ``slow`` (and its fixtures) runs, starting a process raises."""

    def __init__(self, item):
        self.active = "slow" not in item.keywords

    def __enter__(self):
        if self.active:
            self.saved = subprocess.Popen._execute_child, os.fork
            subprocess.Popen._execute_child, os.fork = _refuse, _refuse

    def __exit__(self, *exc):
        if self.active:
            subprocess.Popen._execute_child, os.fork = self.saved


@pytest.fixture(scope="module")
def hog():
    """Other learners' runs beside the test (``tests/hog.py``: two NumPy copiers, two torch matmuls),
    ended after the module's tests, also on failure. Tests using it start processes: ``slow``."""
    from hog import hog as busy

    with busy() as pids:
        yield pids
