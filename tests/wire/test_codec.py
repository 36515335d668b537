"""The wire codec: typed messages round-trip with their arrays and tensors; a frame without the
cluster key, undecodable, or of another socket is dropped and counted, never raised; a pickle
never runs; the key file is private."""

from __future__ import annotations

import os
import random
import stat

import msgspec
import numpy as np
import pytest
import torch

from elastic_ep.harness.wire_fuzz import KINDS, evil_pickle, frames
from elastic_ep.model.sampling import SamplingParams, TokenLogprobs
from elastic_ep.wire import (
    CONTROLLER_TO_WORKER,
    FETCH_REPLY,
    FETCH_REQUEST,
    HEALTH_TO_CONTROLLER,
    STEP_TO_CONTROLLER,
    AgentHello,
    BackupTensors,
    ChunkPlan,
    ClusterKey,
    ClusterKeyError,
    EpochStart,
    Heartbeat,
    Inbox,
    KVMove,
    Membership,
    NodeHeartbeat,
    NodeStepResults,
    Progress,
    RankBeat,
    ResendResult,
    SlotMap,
    SlotSource,
    StepErrorKind,
    StepFailed,
    StepPlan,
    StepResult,
    TermFence,
    WorkerHello,
    WorkerStarted,
    encode,
    rejected_counts,
    slot_map_for_wire,
)
from elastic_ep.wire.codec import MAC_BYTES

KEY = ClusterKey.generate()


def counted(socket: str) -> dict[str, int]:
    return {reason: n for (s, _, reason), n in rejected_counts().items() if s == socket}


def step_plan(num_seqs: int = 64) -> StepPlan:
    chunks = [ChunkPlan(i, [i + 1] * (1 if i % 4 else 32), 100 + i, True,
                        SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=i, logprobs=2), i, 20)
              for i in range(num_seqs)]
    return StepPlan(3, 17, chunks, [1, 2], dispatch_rows=16, kv_moves=[KVMove(5, 0, 1, [1, 2, 3])])


def test_step_messages_round_trip_with_their_arrays():
    load = np.arange(61 * 256, dtype=np.int64).reshape(61, 256)
    result = StepResult(3, 17, 2, {i: i + 7 for i in range(64)}, 0.01, 0.005, 0.002, 0.001, load, 1234,
                        {0: TokenLogprobs(-0.5, ((3, -0.5), (4, -1.5)))}, errors={9: "NaN"})
    got = Inbox("t_step", STEP_TO_CONTROLLER, KEY).read(KEY.seal(result))
    assert got.tokens == result.tokens and got.logprobs == result.logprobs and got.errors == result.errors
    assert got.expert_load.dtype == np.int64 and np.array_equal(got.expert_load, load)
    plan = step_plan()
    assert Inbox("t_worker", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(plan)) == plan
    start = EpochStart(4, Membership.of([0, 1], ["n0", "n1"]), SlotMap.of(np.arange(8).reshape(2, 4)), 2,
                       [SlotSource(0, 1, 3, "peer", 1, 0)], [(1, 0, 1)], {}, 30.0, 10.0)
    got = Inbox("t_worker", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(start))
    assert np.array_equal(got.slot_map.whole, start.slot_map.whole) and got.sources == start.sources
    assert got.slot_map.digest == start.slot_map.digest and got.slot_map.delta is None
    assert got.members == [0, 1] and got.nodes == ["n0", "n1"] and got.membership.node_of.dtype == np.int16
    failed = StepFailed(1, 2, 3, "boom", StepErrorKind.LOCAL, True)
    assert Inbox("t_step", STEP_TO_CONTROLLER, KEY).read(KEY.seal(failed)).kind is StepErrorKind.LOCAL
    not_run = StepFailed(1, 2, 3, "never ran epoch 1 step 2", StepErrorKind.NOT_RUN)
    assert Inbox("t_step", STEP_TO_CONTROLLER, KEY).read(KEY.seal(not_run)).kind is StepErrorKind.NOT_RUN
    assert Inbox("t_worker", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(ResendResult(1, 2))) == ResendResult(1, 2)


def test_an_epoch_start_carries_its_slot_map_in_the_narrowest_type_that_holds_the_experts():
    phy2log = np.tile(np.append(np.arange(256), -1), (58, 9))  # DeepSeek-V3's 58 x 256, some slots empty
    wide = EpochStart(1, Membership.of([0]), SlotMap.of(phy2log), 2, [], [], {}, 30.0, 10.0)
    narrow = EpochStart(1, Membership.of([0]), SlotMap.of(slot_map_for_wire(phy2log, 256)), 2, [], [], {}, 30.0,
                        10.0)
    got = Inbox("t_worker", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(narrow))
    assert got.slot_map.whole.dtype == np.int16 and np.array_equal(got.slot_map.whole, phy2log)
    assert len(encode(narrow)) < len(encode(wide)) / 3.9
    assert slot_map_for_wire(phy2log, 40_000).dtype == np.int32


def test_an_epochs_members_travel_as_columns_and_columns_that_do_not_fit_are_dropped():
    """1,024 members on 128 nodes: the ids one int32 column, the nodes named once and indexed; an
    `EpochStart` whose members and nodes do not line up is dropped and counted, never decoded."""
    members, nodes = list(range(1024)), [f"n{r // 8}" for r in range(1024)]
    start = EpochStart(1, Membership.of(members, nodes), SlotMap.of(np.zeros((1, 2), np.int16)), 2, [], [], {}, 30.0,
                       10.0)
    got = Inbox("t_members", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(start))
    assert got.members == members and got.nodes == nodes and len(got.membership.node_names) == 128
    assert Membership.of([3, 1]).nodes == [] and Membership.of([3, 1]).members == [3, 1]
    ids = np.arange(4, dtype=np.int32)
    bad = [(ids, ["n0"], np.array([0, 0, 1, 0], dtype=np.int16)),  # no node 1
           (ids, ["n0"], np.zeros(3, dtype=np.int16)),  # a member without one
           (ids.reshape(2, 2), [], None),  # not one column
           (ids.astype(np.float32), [], None),  # not ids
           (ids, ["n0"], None)]  # names without the members' nodes
    before = counted("t_members").get("undecodable", 0)
    inbox = Inbox("t_members", CONTROLLER_TO_WORKER, KEY)
    for rank_ids, names, node_of in bad:
        forged = Membership.of([0])  # a sender that skips the checks: its fields set past them
        for name, value in (("rank_ids", rank_ids), ("node_names", names), ("node_of", node_of)):
            msgspec.structs.force_setattr(forged, name, value)
        frames = KEY.seal(EpochStart(1, forged, SlotMap.of(np.zeros((1, 2), np.int16)), 2, [], [], {}, 30.0, 10.0))
        assert inbox.read(frames) is None
    assert counted("t_members").get("undecodable", 0) == before + len(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_travel_as_raw_bytes_in_their_dtype(dtype):
    w13, w2 = torch.randn(3, 8, 4).to(dtype), torch.randn(3, 4, 4).to(dtype)
    got = Inbox("t_fetch", FETCH_REPLY, KEY).read(KEY.seal(BackupTensors(w13, w2)))
    assert got.w13.dtype == dtype and torch.equal(got.w13, w13) and torch.equal(got.w2, w2)
    assert got.w13.is_contiguous() and got.w13.untyped_storage().data_ptr() != w13.untyped_storage().data_ptr()


def test_an_array_whose_bytes_do_not_fit_its_shape_is_dropped():
    good = encode(BackupTensors(torch.ones(2, 2), None))
    bad = good.replace(b"\x92\x02\x02", b"\x92\x02\x03")  # shape [2, 2] -> [2, 3]: 16 bytes for 24
    assert bad != good
    inbox = Inbox("t_shape", FETCH_REPLY, KEY)
    assert inbox.read([KEY.mac(bad), bad]) is None
    assert counted("t_shape") == {"undecodable": 1}


def test_junk_and_a_pickle_that_runs_code_are_dropped_and_counted(tmp_path):
    marker = tmp_path / "ran"
    inbox = Inbox("t_junk", HEALTH_TO_CONTROLLER, KEY)
    body = evil_pickle(str(marker))
    for message in ([b"\x00\x01not a pickle"], [body], [KEY.mac(body), body], [KEY.mac(b"\x00\x01not a pickle"),
                                                                              b"\x00\x01not a pickle"]):
        assert inbox.read(message) is None
    assert not marker.exists()
    assert counted("t_junk") == {"unauthenticated": 2, "undecodable": 2}


def test_a_frame_of_another_key_or_socket_is_refused_by_reason():
    progress = Progress(1, 2, 3, "dispatch", 4, 5.0)
    beat = NodeHeartbeat("n0", "s1", [RankBeat(1, 2, progress, 0.03)])
    health = Inbox("t_reason", HEALTH_TO_CONTROLLER, KEY)
    assert health.read(KEY.seal(beat)) == beat
    assert health.read(ClusterKey.generate().seal(beat)) is None
    assert health.read(KEY.seal(step_plan(2))) is None  # a worker's message, not the health socket's
    assert health.read(KEY.seal(Heartbeat(1, 2, progress))) is None  # a worker's heartbeat goes to its agent
    assert health.read([KEY.seal(beat)[1]]) is None  # no MAC frame
    assert counted("t_reason") == {"unauthenticated": 2, "unexpected": 2}


def test_a_registration_naming_a_rank_or_process_that_cannot_be_is_dropped_before_any_handler():
    """Values outside a field's domain (a negative rank id, a pid below 1, a join mode that does not
    exist) make an authenticated frame undecodable: the controller never acts on them (a forged
    adoption of rank -1 had made a rank of it, and an epoch over it)."""
    health, step = Inbox("t_domain", HEALTH_TO_CONTROLLER, KEY), Inbox("t_domain", STEP_TO_CONTROLLER, KEY)
    good = AgentHello("n0", 42, "tcp://f", 0, 4, "adopt", running=[(0, 1001)], session="s")
    assert health.read(KEY.seal(good)) == good
    for bad in (AgentHello("n0", 42, "tcp://f", 0, 4, "adopt", running=[(-1, 1001)], session="s"),
                AgentHello("n0", 42, "tcp://f", 0, 4, "adopt", running=[(0, 0)], session="s"),
                AgentHello("n0", 42, "tcp://f", 0, -1, session="s"),
                AgentHello("n0", 42, "tcp://f", 0, 4, "cpu", session="s"),
                WorkerStarted("n0", -1, 1001, "s")):
        assert health.read(KEY.seal(bad)) is None, bad
    assert step.read(KEY.seal(WorkerHello(0, "n0", 1001, "initial"))) is not None
    for bad in (WorkerHello(-1, "n0", 1001, "initial"), WorkerHello(0, "n0", -5, "initial"),
                WorkerHello(0, "n0", 1001, "node0")):
        assert step.read(KEY.seal(bad)) is None, bad
    assert counted("t_domain") == {"undecodable": 8}


def node_step_results(load: np.ndarray) -> NodeStepResults:
    """Ranks 0 and 1 of node n0 at epoch 3 step 17: rank 0 sampled sequence 7, rank 1 sequences 8
    and 9 and reported `load`."""
    return NodeStepResults("n0", "s1", 3, 17, [0, 1], [0.01, 0.012], [0.005, 0.006], [0.003, 0.004], [1234, 99],
                           [16, 16], [2, 3], [400, 500], [0.0, 0.0], [1, 2], [7, 8, 9], [70, 80, 90],
                           errors={1: {9: "nan logits"}}, expert_load={1: load})


def test_a_nodes_step_results_round_trip_in_columns():
    """`NodeStepResults` (an agent's gather of its ranks' results, in columns) on the health socket,
    the rare parts and an expert load included; on the step socket it is not a message of that socket."""
    load = np.arange(58 * 256, dtype=np.int32).reshape(58, 256)
    msg = node_step_results(load)
    got = Inbox("t_node_results", HEALTH_TO_CONTROLLER, KEY).read(KEY.seal(msg))
    assert (got.node, got.session, got.epoch, got.step, got.rank_ids) == ("n0", "s1", 3, 17, [0, 1])
    assert (got.token_counts, got.seq_ids, got.tokens, got.errors) == ([1, 2], [7, 8, 9], [70, 80, 90],
                                                                       {1: {9: "nan logits"}})
    assert np.array_equal(got.expert_load[1], load)
    assert Inbox("t_node_results", STEP_TO_CONTROLLER, KEY).read(KEY.seal(msg)) is None
    assert counted("t_node_results") == {"unexpected": 1}


@pytest.mark.parametrize("field,value", [  # field: its index in the message's array (0 is the tag)
    (6, [0.01]),  # step_s of one rank for two
    (5, [0, 0]),  # a rank listed twice
    (6, [0.01, float("nan")]),  # a time that is not a number
    (8, [-1.0, 0.0]),  # a negative wait
    (14, [1, 1]),  # token counts of two pairs for three
    (16, [70, 80]),  # two tokens for three sequences
    (5, [0, "one"]),  # a rank id that is not a number
    (19, {5: ["int32", [1, 1], b"\x00" * 4]}),  # an expert load of a rank not listed
    (19, {1: ["int32", [4], b"\x00" * 16]}),  # an expert load that is not [layers, experts]
])
def test_a_nodes_step_results_that_disagree_with_themselves_are_dropped_and_counted(field, value):
    raw = msgspec.msgpack.decode(encode(node_step_results(np.zeros((2, 3), np.int32))))
    raw[field] = value
    bad = msgspec.msgpack.encode(raw)
    socket = f"t_bad_node_results_{field}_{len(str(value))}"
    assert Inbox(socket, HEALTH_TO_CONTROLLER, KEY).read([KEY.mac(bad), bad]) is None
    assert counted(socket) == {"undecodable": 1}


def test_a_rejected_peer_is_logged_once(caplog):
    inbox = Inbox("t_log", HEALTH_TO_CONTROLLER, KEY)
    for _ in range(50):
        inbox.read([b"junk"])
    assert len([r for r in caplog.records if "t_log socket" in r.getMessage()]) == 1
    assert counted("t_log") == {"unauthenticated": 50}


@pytest.mark.parametrize("socket,accepts", [("step", STEP_TO_CONTROLLER), ("health", HEALTH_TO_CONTROLLER),
                                            ("fetch", FETCH_REQUEST)])
def test_no_fuzz_frame_decodes_into_a_message(tmp_path, socket, accepts):
    inbox = Inbox(f"t_fuzz_{socket}", accepts, KEY)
    rng = random.Random(1)
    for kind in KINDS:
        for message in frames(kind, socket, KEY, str(tmp_path / "ran"), rng, huge_bytes=1 << 16, flood_frames=50):
            assert inbox.read(message) is None, kind
    assert not (tmp_path / "ran").exists()


def test_key_file_is_written_private_and_refused_when_others_can_read_it(tmp_path):
    path = tmp_path / "cluster.key"
    KEY.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ClusterKey.read(path).mac(b"x") == KEY.mac(b"x")
    os.chmod(path, 0o644)
    with pytest.raises(ClusterKeyError, match="chmod 600"):
        ClusterKey.read(path)
    assert "ClusterKey(...)" == repr(KEY) and KEY.hex() not in repr(KEY)
    assert len(KEY.mac(b"")) == MAC_BYTES


def test_a_term_fence_drops_frames_of_a_lower_term_on_every_inbox_that_shares_it():
    fence = TermFence()
    step = Inbox("t_fence_step", CONTROLLER_TO_WORKER, KEY, "n", fence)
    beat = Inbox("t_fence_beat", CONTROLLER_TO_WORKER, KEY, "n", fence)
    plan = step_plan(1)
    assert step.read(KEY.seal(plan, 3)) == plan and step.term == 3 and fence.highest == 3
    assert beat.read(KEY.seal(plan, 2)) is None  # the other thread's socket, an older leader's frame
    assert beat.read(KEY.seal(plan, 3)) == plan and step.read(KEY.seal(plan, 5)) == plan
    assert step.read(KEY.seal(plan, 4)) is None
    counts = rejected_counts()
    assert counts[("t_fence_beat", "n", "stale_term")] == 1 and counts[("t_fence_step", "n", "stale_term")] == 1
    head, body = KEY.seal(plan, 1)
    forged = head[:-8] + (9).to_bytes(8, "big")  # a term raised without the key: the MAC no longer holds
    assert step.read([forged, body]) is None and fence.highest == 5
    assert counts.get(("t_fence_step", "n", "unauthenticated"), 0) + 1 == \
        rejected_counts()[("t_fence_step", "n", "unauthenticated")]
    assert Inbox("t_nofence", CONTROLLER_TO_WORKER, KEY).read(KEY.seal(plan, 1)) == plan  # the controller's side
