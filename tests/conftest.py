"""Shared test setup: GPU tests skip with a reason on CPU-only machines."""

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
