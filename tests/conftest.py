import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    """Every test under tests/e2e starts real server processes: mark it `e2e`, so
    `pytest -m "not e2e"` is the fast loop (other multi-process tests carry the mark themselves)."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.e2e)
