"""`NodeStepPlans`: a node's plans of one step in one frame, a shared plan carried once, read back by
each of the node's ranks through the inbox of its relayed plans."""

from types import SimpleNamespace

import msgspec
import pytest

from elastic_ep.model.sampling import SamplingParams
from elastic_ep.runtime.worker import Worker
from elastic_ep.wire import (
    CONTROLLER_TO_WORKER,
    RELAYED_TO_WORKER,
    ChunkPlan,
    ClusterKey,
    DecodeRows,
    Inbox,
    NodePlan,
    NodeStepPlans,
    StepPlan,
    encode,
    node_step_plans,
    rejected_counts,
)

KEY = ClusterKey.generate()


def test_a_plan_shared_by_ranks_is_carried_once_and_each_rank_reads_its_own():
    empty = StepPlan(4, 77, [], [], report_load=False)
    busy = StepPlan(4, 77, [ChunkPlan(9, [5, 6, 7], 0, True, SamplingParams(), 1, 3, [0])], [2])
    decoding = StepPlan(4, 77, [], [], decode=DecodeRows([11, 12], [3, 4], [20, 31]))
    frame = node_step_plans("n1", [(8, empty), (9, busy), (10, empty), (11, decoding), (12, empty)])
    assert (frame.node, frame.epoch, frame.step) == ("n1", 4, 77)
    assert sorted(p.rank_ids for p in frame.plans) == [[8, 10, 12], [9], [11]]
    assert len(encode(frame)) < len(encode(empty)) * 3 + len(encode(busy)) + len(encode(decoding))
    read = Inbox("worker_plans", RELAYED_TO_WORKER, KEY, "n1").read(KEY.seal(frame, 3))
    assert isinstance(read, NodeStepPlans)
    assert {r: read.plan_of(r) for r in range(8, 14)} == {8: empty, 9: busy, 10: empty, 11: decoding, 12: empty,
                                                          13: None}


def test_a_node_frame_is_not_a_message_of_the_step_socket_and_a_forged_one_is_dropped():
    frame = node_step_plans("n1", [(0, StepPlan(1, 2, [], []))])
    before = rejected_counts()
    assert Inbox("worker_step", CONTROLLER_TO_WORKER, KEY, "n1").read(KEY.seal(frame)) is None
    forged = KEY.seal(frame)
    forged[1] = forged[1][:-1] + bytes([forged[1][-1] ^ 1])
    assert Inbox("worker_plans", RELAYED_TO_WORKER, KEY, "n1").read(forged) is None
    after = rejected_counts()
    assert after.get(("worker_step", "n1", "unexpected"), 0) == before.get(("worker_step", "n1", "unexpected"), 0) + 1
    assert after.get(("worker_plans", "n1", "unauthenticated"), 0) == \
        before.get(("worker_plans", "n1", "unauthenticated"), 0) + 1


def test_a_rank_decodes_only_its_own_plan_and_a_plan_that_is_not_one_is_dropped_and_counted():
    """Each plan travels as its own bytes: rank 1's plan reads though rank 2's bytes are not a plan
    (the frame's MAC holds: a controller of another version), and rank 2's reader drops it, counted."""
    good = StepPlan(3, 9, [], [5])
    frame = NodeStepPlans("n2", 3, 9, [NodePlan([1], msgspec.Raw(encode(good))),
                                       NodePlan([2], msgspec.Raw(msgspec.msgpack.encode(["StepPlan", "junk"])))])
    frames = KEY.seal(frame)
    inbox = Inbox("worker_plans", RELAYED_TO_WORKER, KEY, "n2")
    read = inbox.read(frames)
    assert read.plan_of(1) == good
    with pytest.raises(msgspec.DecodeError):
        read.plan_of(2)
    before = rejected_counts().get(("worker_plans", "n2", "undecodable"), 0)
    worker = SimpleNamespace(args=SimpleNamespace(rank_id=2, node="n2"), plan_inbox=inbox)
    assert Worker._own_plan(worker, frames, read) is None
    assert rejected_counts()[("worker_plans", "n2", "undecodable")] == before + 1
    worker.args.rank_id = 1
    assert Worker._own_plan(worker, frames, read) == good
