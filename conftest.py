"""Root test setup: nbval's notebook cells (solutions/*.ipynb) are ``slow`` (they run a kernel)."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
