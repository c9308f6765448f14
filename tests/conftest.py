"""Shared test setup: GPU tests skip with a reason on CPU-only machines, and a test that starts a
process without the ``slow`` marker fails, so ``pytest -m "not slow"`` stays the fast loop."""

import os
import subprocess

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
