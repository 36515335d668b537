"""What a start cost: bytes per node and source as ranks and agents report them, and the warm-up shapes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from elastic_ep.control.cold_start import LoadLedger, TimeToReady
from elastic_ep.control.serving.warmup import ShapeTally, padded_tokens, warmup_shapes, warmup_steps
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


def test_with_dbo_each_shape_is_warmed_in_two_micro_batches_and_those_below_the_threshold_in_one_too():
    assert warmup_steps([1, 2, 4, 8], None) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    assert warmup_steps([1, 2, 4, 8], 2) == [(1, 1), (1, 2), (2, 2), (4, 2), (8, 2)]
    assert warmup_steps([1, 2, 4, 8], 4) == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (8, 2)]
    assert warmup_steps([1, 2], 4) == [(1, 1), (2, 1)]  # no step reaches --dbo-min-tokens: never two


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=6), st.sampled_from([None, 1, 2, 3, 8, 64, 200]))
def test_every_step_the_step_loop_can_plan_is_a_warmed_shape_and_micro_batch_count(tokens, dbo_min_tokens):
    """The step loop's rule (control/serving/step_loop.py: each rank padded to a shape, two
    micro-batches on every rank when the busiest padded rank reaches --dbo-min-tokens) never
    plans a (shape, micro-batches) that `warmup_steps` leaves out."""
    shapes = warmup_shapes(48, 100)
    padded = [padded_tokens(n, shapes) for n in tokens]
    micro_batches = 2 if dbo_min_tokens is not None and max(padded) >= dbo_min_tokens else 1
    assert {(p, micro_batches) for p in padded} <= set(warmup_steps(shapes, dbo_min_tokens))


def test_the_tally_counts_a_step_of_an_unwarmed_epoch_or_shape():
    tally = ShapeTally()
    tally.add(4, 1, True)
    tally.add(4, 2, True)
    tally.add(3, 2, False)
    assert tally.view() == {"steps_by_shape": {"3": 1, "4": 2}, "steps_by_micro_batches": {"1": 1, "2": 2},
                            "unwarmed_steps": 1}
