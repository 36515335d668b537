import pytest

from elastic_ep.harness.etcd import EtcdProcess, etcd_available


@pytest.fixture
def etcd():
    if not etcd_available():
        pytest.fail("etcd is not installed: run scripts/install-netbed-deps.sh (Debian's etcd-server)")
    proc = EtcdProcess()
    yield proc
    proc.stop()
