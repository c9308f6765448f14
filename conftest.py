"""Root test setup: nbval's notebook cells (solutions/*.ipynb) are ``slow`` (they run a kernel); under
pytest-xdist (README's test command runs ``pytest -n 2``), the tests that act on the whole machine run
one after another on one worker.

Machine-wide tests are those that make or take down emulated nodes (``teraflops cluster down --all``
takes down every cluster on the machine), run Slurm (one controller per machine), add Unix users or
open folders to them (tests/traversal.py), or count every process or launch folder on the machine: two
of them at once would see each other's work. They share the xdist group ``machine``; every other file
is one unit of work (xdist's ``loadscope``: a notebook's cells stay in order on one kernel, a module's
fixtures run once) and runs beside them. A test file joins by being named in :data:`MACHINE_WIDE`, a
single test by ``@pytest.mark.machine_wide``.
"""

import pytest

MACHINE_WIDE = frozenset({
    "test_cluster.py", "test_grading_unit03.py", "test_hub.py", "test_loopback.py", "test_placement.py",
    "test_ray.py", "test_sbatch.py", "test_slurm.py", "test_slurm_queue.py", "test_tensor_parallel.py",
    "test_traversal.py", "test_unit03_run.py", "test_unit05_run.py", "test_workshop.py",
    # not machine-wide, but they share a session fixture's launch with test_cluster (tests/conftest.py): one run
    "test_remedies.py", "test_zero.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
        if item.path.name in MACHINE_WIDE or item.get_closest_marker("machine_wide"):
            item.add_marker(pytest.mark.xdist_group("machine"))
    # the longest unit of work first, so that it does not start last and run alone at the end
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
