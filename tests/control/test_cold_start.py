"""What a start cost: bytes per node and source as ranks and agents report them, and the warm-up shapes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from elastic_ep.control.cold_start import LoadLedger, TimeToReady
from elastic_ep.control.serving.warmup import warmup_shapes
from elastic_ep.wire import TransferStat


def test_bytes_by_node_and_source():
    ledger = LoadLedger()
    ledger.dense("n0", "host_memory", 10)
    ledger.dense("n1", "disk", 10)
    ledger.transfers("n0", [TransferStat("backup", 100, 0.1), TransferStat("backup_remote", 7, 0.1),
                            TransferStat("local", 50, 0.0), TransferStat("disk", 3, 0.1)])
    ledger.agent("n0", "s1", 500)
    ledger.agent("n0", "s1", 600)  # a running total: the latest counts
    ledger.agent("n0", "s2", 40)  # the node's agent again, a new session: counts on from its own 0
    assert ledger.by_node() == {"n0": {"storage": 643, "shared_memory": 110, "peer": 7},
                                "n1": {"storage": 10, "shared_memory": 0, "peer": 0}}
    registry = CollectorRegistry()
    registry.register(ledger)
    clock = TimeToReady()
    registry.register(clock)
    clock.mark("ranks_registered_s")
    clock.ready()
    text = generate_latest(registry).decode()
    assert 'elastic_ep_load_bytes_total{node="n0",source="storage"} 643.0' in text
    assert 'elastic_ep_time_to_ready_seconds{part="ranks_registered"}' in text
    assert 'elastic_ep_time_to_ready_seconds{part="total"}' in text


def test_warmup_shapes_are_the_decode_batches_and_a_full_prefill_chunk():
    assert warmup_shapes(32, 256) == [1, 2, 4, 8, 16, 32, 256]
    assert warmup_shapes(6, 6) == [1, 2, 4, 6]
    assert warmup_shapes(1, 64) == [1, 64]
