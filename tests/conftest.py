import os
from contextlib import ExitStack

import pytest

from elastic_ep.harness.browser import find_chromium
from elastic_ep.harness.netns import TestBed, netbed_unavailable

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items):
    """Every test under tests/e2e (real servers) and tests/harness (namespace hosts) starts real
    processes: mark it `e2e`, so `pytest -m "not e2e"` is the fast loop (other multi-process
    tests carry the mark themselves)."""
    for item in items:
        if {"e2e", "harness"} & set(item.path.parts):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def netbed():
    """Makes network test beds: `netbed(n_hosts, **TestBed kwargs)` gives n namespace hosts on a
    bridge (elastic_ep.harness.netns). Every bed is removed when the test ends, pass or fail.
    Skips with the reason where this machine cannot make one (not root, no `ip`)."""
    if reason := netbed_unavailable():
        pytest.skip(reason)
    with ExitStack() as beds:
        yield lambda n_hosts, **kwargs: beds.enter_context(TestBed(n_hosts, **kwargs))


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, for the dashboard's tests (scripts/install-netbed-deps.sh installs it
    before `make test`). Missing, the test fails in CI (CI=true) and skips elsewhere."""
    path = find_chromium()
    if path is None:
        why = "needs Debian's chromium (apt-get install chromium, as scripts/install-netbed-deps.sh does)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}")
        pytest.skip(why)
    return path
