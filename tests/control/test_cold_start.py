"""What a start cost: bytes per node and source as ranks and agents report them, and the warm-up shapes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from elastic_ep.control.cold_start import LoadLedger, TimeToReady
from elastic_ep.control.serving.warmup import ShapeTally, padded_tokens, warmup_shapes
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


def test_warmup_shapes_are_powers_of_two_the_decode_batch_and_a_full_prefill_chunk():
    assert warmup_shapes(32, 256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert warmup_shapes(6, 6) == [1, 2, 4, 6]
    assert warmup_shapes(1, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert warmup_shapes(48, 100) == [1, 2, 4, 8, 16, 32, 48, 64, 100]


def test_a_step_is_padded_to_the_smallest_warmed_shape_that_holds_it():
    shapes = warmup_shapes(48, 100)
    assert [padded_tokens(n, shapes) for n in (0, 1, 3, 5, 33, 48, 49, 65, 100)] == [1, 1, 4, 8, 48, 48, 64, 100, 100]
    assert padded_tokens(101, shapes) == 101  # more than the scheduler plans: run as it is
    assert all(padded_tokens(n, shapes) < 2 * n for n in range(2, 101))  # never twice the work


def test_the_tally_counts_a_step_of_an_unwarmed_epoch_or_shape():
    tally = ShapeTally()
    tally.add(4, True)
    tally.add(4, True)
    tally.add(3, False)
    assert tally.view() == {"steps_by_shape": {"3": 1, "4": 2}, "unwarmed_steps": 1}
