"""The step loop's recompute (control/serving/step_loop.py): an interrupted step is planned again
from what the scheduler holds, since nothing of it was committed; a step that keeps failing with
every rank alive is recomputed `MAX_RETRIES_WITHOUT_CULPRIT` times, then its requests end with
the error, and a fault with a culprit never counts towards that. An answer lost on the way is
asked for again past the result deadline: sent again, the step completes; a rank that never ran
the step, or says nothing, fails it. With --step-plans-via agent the plans of a node whose agent is
known and not silent go through it, the rest directly."""

from __future__ import annotations

import time

import numpy as np
import pytest
from control_standins import Plane, cluster_of, config
from prometheus_client import CollectorRegistry

from elastic_ep.control.api import GenerationRequest
from elastic_ep.control.faults.detector import Fault, FaultCause, FaultDetector, RecoveryNeeded
from elastic_ep.control.metrics import ClusterMetrics
from elastic_ep.control.ranks import RankInfo, RankStatus
from elastic_ep.control.serving.isolation import Isolation
from elastic_ep.control.serving.recorder import ExpertRecorder
from elastic_ep.control.serving.scheduler import Scheduler, Sequence
from elastic_ep.control.serving.step_loop import MAX_RETRIES_WITHOUT_CULPRIT, StepLoop
from elastic_ep.control.serving.streams import Streams
from elastic_ep.control.serving.warmup import WarmUpGate
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.node.step_gather import node_results
from elastic_ep.wire import (
    SAMPLED_TOKEN,
    Progress,
    ResendResult,
    StepErrorKind,
    StepFailed,
    StepPlan,
    StepResult,
    rejected_counts,
)


def loop_with_one_request(warmed_shapes: list[int] | None = None, registry: CollectorRegistry | None = None,
                          **flags):
    cfg = config(**flags)
    cluster = cluster_of({0: "n0", 1: "n0"})
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.set_ranks([0, 1])
    scheduler.add(Sequence(5, GenerationRequest("r5", [1, 2, 3], SamplingParams(max_tokens=4), 0), 64, (0,)))
    streams = Streams(scheduler)
    detector = FaultDetector(cfg)
    isolation = Isolation(streams, cluster.events, detector.record, cfg.isolation_max_steps)
    gate = None if warmed_shapes is None else WarmUpGate(cluster, Plane(), warmed_shapes, 1.0, lambda timeout_s: None,
                                                         lambda ranks: False)
    steps = StepLoop(cluster, cfg, Plane(), scheduler, detector, ClusterMetrics(registry or CollectorRegistry()),
                     ExpertRecorder(1, 8, [1]), streams, isolation, 2, pump=lambda timeout_s: None, warmup=gate)
    return steps, scheduler, detector


def interrupt(steps, detector):
    """Send the step; a fault arrives while it waits."""
    steps.pump = lambda timeout_s: detector.error("rank 1: gloo: connection closed")
    with pytest.raises(RecoveryNeeded):
        steps.run()
    detector.clear()


def test_an_interrupted_step_is_planned_again_the_same():
    steps, scheduler, detector = loop_with_one_request()
    interrupt(steps, detector)
    first = steps.uncommitted
    assert first is not None and first.chunks and scheduler.by_id[5].num_cached == 0  # nothing committed
    interrupt(steps, detector)  # the recompute, interrupted too
    assert steps.uncommitted.chunks == first.chunks


def test_a_step_failing_with_every_rank_alive_ends_its_requests_after_the_retries():
    steps, scheduler, detector = loop_with_one_request()
    for attempt in range(1, MAX_RETRIES_WITHOUT_CULPRIT + 1):
        interrupt(steps, detector)
        steps.after_fault(culprit_found=False, error="gloo: connection closed")
        assert (5 in scheduler.by_id) == (attempt < MAX_RETRIES_WITHOUT_CULPRIT)
    assert steps.uncommitted is None and steps.retries_without_culprit == 0
    assert "failed the requests of a step" in steps.cluster.events.all()[-1]["message"]


def test_a_fault_with_a_culprit_does_not_count_as_a_retry():
    steps, scheduler, detector = loop_with_one_request()
    for _ in range(MAX_RETRIES_WITHOUT_CULPRIT + 1):
        interrupt(steps, detector)
        detector.record(Fault(1, FaultCause.EXITED, "exited"))
        steps.after_fault(culprit_found=True, error="rank 1: exited")
        detector.clear()
    assert 5 in scheduler.by_id and steps.retries_without_culprit == 0


def test_without_chaos_a_step_sends_its_plans_and_nothing_else():
    steps, _, detector = loop_with_one_request()
    interrupt(steps, detector)
    assert [type(m) for _, m in steps.plane.to_workers] == [StepPlan, StepPlan]


def test_with_the_readiness_gate_every_rank_runs_a_warmed_shape():
    """The 3-token prompt on rank 0 is padded to 4, idle rank 1 runs the smallest shape (1 token);
    the padded dispatch is sized for the padded tokens. Without the gate nothing is padded."""
    steps, _, detector = loop_with_one_request([1, 2, 4, 8])
    interrupt(steps, detector)
    plans = dict(steps.plane.to_workers)
    assert (len(plans[0].chunks[0].token_ids), plans[0].pad_tokens) == (3, 1)
    assert (plans[1].chunks, plans[1].pad_tokens) == ([], 1)
    assert plans[0].dispatch_rows == 4 * 2  # the busiest rank's 4 tokens (3 and a pad) x top-2
    steps, _, detector = loop_with_one_request()
    interrupt(steps, detector)
    assert [p.pad_tokens for _, p in steps.plane.to_workers] == [0, 0]


def answer_of(rank_id: int, plan: StepPlan) -> StepResult:
    """A rank's answer to `plan`: token 7 for every sequence it samples."""
    return StepResult(plan.epoch, plan.step, rank_id, {c.seq_id: 7 for c in plan.chunks if c.sample}, 0.01, 0.01,
                      0.0, 0.0, np.zeros((0, 0), np.int32), 0, {})


def losing_rank_1(steps, on_resend, in_step_for_pumps: int = 0):
    """The step loop's pump as the ranks answer: rank 0 at once; rank 1 runs its plan but its answer
    is lost, then answers each `ResendResult` with on_resend(its kept answer) (None: silence). With
    `in_step_for_pumps`, rank 1's heartbeat shows it inside the step that long, then it answers."""
    seen, kept, pumps = 0, {}, [0]

    def pump(timeout_s: float) -> None:
        nonlocal seen
        time.sleep(timeout_s)
        pumps[0] += 1
        assert pumps[0] < 2_500, "the step still waits for rank 1's answer after 5 s (100 result deadlines)"
        for rank_id, msg in steps.plane.to_workers[seen:]:
            if isinstance(msg, StepPlan) and rank_id == 0:
                steps.on_reply(answer_of(0, msg))
            elif isinstance(msg, StepPlan):
                kept[msg.step] = answer_of(1, msg)
                steps.cluster.ranks[1].progress = Progress(msg.epoch, msg.step, 0, "dispatch" if in_step_for_pumps
                                                           else "idle", 1)
            elif isinstance(msg, ResendResult) and (reply := on_resend(kept[msg.step])) is not None:
                steps.on_reply(reply)
        seen = len(steps.plane.to_workers)
        if in_step_for_pumps and pumps[0] == in_step_for_pumps:
            steps.on_reply(kept[steps.cluster.step])
    return pump


def lost(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("elastic_ep_lost_step_results_total", {"outcome": outcome}) or 0.0


FAST = {"result_timeout_floor_s": 0.05, "resend_timeout_s": 0.05}  # deadlines of a unit test, not of a server


def test_a_lost_answer_is_asked_for_again_and_the_step_completes_with_its_token():
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, **FAST)
    steps.pump = losing_rank_1(steps, on_resend=lambda kept: kept)
    assert steps.run() is not None
    assert scheduler.by_id[5].output == [7]
    assert [(r, m) for r, m in steps.plane.to_workers if isinstance(m, ResendResult)] == [(1, ResendResult(0, 1))]
    assert lost(registry, "resent") == 1 and "asked to send it again" in steps.cluster.events.all()[-1]["message"]


def test_a_rank_that_never_ran_the_step_fails_it_and_nothing_is_committed():
    registry = CollectorRegistry()
    steps, scheduler, detector = loop_with_one_request(registry=registry, **FAST)
    steps.pump = losing_rank_1(steps, on_resend=lambda kept: StepFailed(
        kept.epoch, kept.step, 1, "never ran epoch 0 step 1", StepErrorKind.NOT_RUN))
    with pytest.raises(RecoveryNeeded):
        steps.run()
    assert detector.errors == ["rank 1: never ran epoch 0 step 1"] and not detector.faults
    assert scheduler.by_id[5].output == [] and steps.uncommitted is not None  # recomputed by the next step
    assert lost(registry, "not_run") == 1


def test_a_rank_silent_to_the_resend_is_a_fault_of_its_own():
    registry = CollectorRegistry()
    steps, scheduler, detector = loop_with_one_request(registry=registry, **FAST)
    steps.pump = losing_rank_1(steps, on_resend=lambda kept: None)
    with pytest.raises(RecoveryNeeded):
        steps.run()
    assert list(detector.faults) == [1] and detector.faults[1].cause == FaultCause.NO_ANSWER
    assert scheduler.by_id[5].output == [] and lost(registry, "unanswered") == 1


def test_a_rank_inside_the_step_past_the_deadline_is_never_asked():
    """Slow, not lost: its heartbeat shows it in the step's collective; its answer comes late."""
    steps, scheduler, _ = loop_with_one_request(**FAST)
    steps.pump = losing_rank_1(steps, on_resend=lambda kept: kept, in_step_for_pumps=100)  # 100 pumps: >= 0.2 s
    assert steps.run() is not None and scheduler.by_id[5].output == [7]
    assert not [m for _, m in steps.plane.to_workers if isinstance(m, ResendResult)]


def answering_per_node(steps, session_of_rank_1: str = "s"):
    """The pump as the agent of node n0 answers with --step-results-via agent: both ranks' results of
    a step in one `NodeStepResults` (rank 1's under `session_of_rank_1`: an agent session given up
    on when not "s"); rank 1 answers `ResendResult` directly with its kept answer."""
    seen, kept = 0, {}

    def pump(timeout_s: float) -> None:
        nonlocal seen
        time.sleep(timeout_s)
        for rank_id, msg in steps.plane.to_workers[seen:]:
            if isinstance(msg, StepPlan):
                kept[rank_id] = answer_of(rank_id, msg)
                steps.cluster.ranks[rank_id].progress = Progress(msg.epoch, msg.step, 0, "idle", 1)
            elif isinstance(msg, ResendResult):
                steps.on_reply(kept[rank_id])
        if len(kept) == 2 and seen < len(steps.plane.to_workers):
            steps.on_node_results(node_results("n0", "s", [kept[0]]))
            steps.on_node_results(node_results("n0", session_of_rank_1, [kept[1]]))
        seen = len(steps.plane.to_workers)
    return pump


def test_a_step_completes_with_the_results_its_nodes_agent_gathered():
    steps, scheduler, _ = loop_with_one_request(**FAST)
    steps.pump = answering_per_node(steps)
    assert steps.run() is not None and scheduler.by_id[5].output == [7]
    assert not [m for _, m in steps.plane.to_workers if isinstance(m, ResendResult)]


def test_results_of_an_agent_session_given_up_on_are_asked_for_again_from_the_rank():
    steps, scheduler, _ = loop_with_one_request(**FAST)
    steps.pump = answering_per_node(steps, session_of_rank_1="an older session")
    assert steps.run() is not None and scheduler.by_id[5].output == [7]
    assert [(r, m) for r, m in steps.plane.to_workers if isinstance(m, ResendResult)] == [(1, ResendResult(0, 1))]


def invalid_frames(node: str) -> int:
    return sum(n for (_, at, reason), n in rejected_counts().items() if at == node and reason == "invalid")


def test_a_nodes_frame_with_a_rank_of_another_node_is_dropped_whole_and_counted():
    steps, _, _ = loop_with_one_request()
    steps.cluster.agents["n1"] = steps.cluster.agents["n0"]
    plan = StepPlan(steps.cluster.epoch, steps.cluster.step, [], [])
    before = invalid_frames("n1")
    steps.on_node_results(node_results("n1", "s", [answer_of(0, plan)]))  # rank 0 is on n0
    assert not steps.replies and invalid_frames("n1") == before + 1



def test_plans_go_through_the_agents_that_are_known_and_not_silent_else_directly():
    """Relayed: the members of a node whose agent is registered, not stalled, and brought their
    heartbeats within RELAY_FRESH_BEATS intervals (rank 1's last is older: its agent, or itself, is
    behind), and that chaos sent no `ChaosStep` for this step (it goes directly: a relayed plan
    could overtake it)."""
    class Injected:
        def before_step(self, epoch, step, batch, members) -> set[int]:
            return {1}

    for via, agents, relayed in (("direct", {}, None), ("agent", {}, {0: "n0", 1: "n0"}),
                                 ("agent", {"stalled": True}, {}), ("agent", {"gone": True}, {}),
                                 ("agent", {"rank 1 heard": 9.0}, {0: "n0"}), ("agent", {"chaos": True}, {0: "n0"})):
        steps, _, _ = loop_with_one_request(step_plans_via=via)
        steps.chaos = Injected() if agents.get("chaos") else None
        steps.plane.now = 10.0
        for r in (0, 1):
            steps.cluster.ranks[r].last_heartbeat = 9.9
        steps.cluster.ranks[1].last_heartbeat = agents.get("rank 1 heard", 9.9)
        agent = steps.cluster.agents["n0"]
        agent.stalled = agents.get("stalled", False)
        if agents.get("gone"):
            del steps.cluster.agents["n0"]
        steps.pump = lambda timeout_s, steps=steps: [steps.on_reply(StepResult(
            steps.cluster.epoch, steps.cluster.step, r, {}, 0.01, 0.01, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {}))
            for r in (0, 1)]
        steps.run()
        assert steps.plane.relayed == [relayed], (via, agents)


def answering(steps, token: int = 7, add_at_step: int | None = None, fail_at_step: int | None = None):
    """The ranks' pump: each answers its plan at once, `token` for every sequence it samples (a decode
    row's too); at step `add_at_step` a request arrives while the step runs; at `fail_at_step` rank 0's
    computation fails."""
    seen = [0]

    def pump(timeout_s: float) -> None:
        for rank_id, msg in steps.plane.to_workers[seen[0]:]:
            if isinstance(msg, StepPlan) and msg.step == fail_at_step and rank_id == 0:
                steps.on_reply(StepFailed(msg.epoch, msg.step, 0, "RuntimeError: boom", StepErrorKind.LOCAL))
            elif isinstance(msg, StepPlan):
                rows = msg.decode.seq_ids if msg.decode is not None else []
                steps.on_reply(StepResult(msg.epoch, msg.step, rank_id, dict.fromkeys(
                    [c.seq_id for c in msg.chunks if c.sample] + rows, token), 0.01, 0.01, 0.0, 0.0,
                    np.zeros((0, 0), np.int32), 0, {}))
                if msg.step == add_at_step and rank_id == 0:
                    steps.scheduler.add(Sequence(6, GenerationRequest("r6", [4, 5], SamplingParams(max_tokens=2), 0),
                                                 64, (0,)))
        seen[0] = len(steps.plane.to_workers)
    return pump


def prepared(registry: CollectorRegistry, outcome: str) -> float:
    return registry.get_sample_value("elastic_ep_prepared_steps_total", {"outcome": outcome}) or 0.0


@pytest.mark.parametrize("flag", [False, True])
def test_with_async_scheduling_the_decodes_planned_during_a_step_go_when_it_commits(flag):
    """Request 5 (4 tokens): its prefill, then a decode planned the usual way, during which the next
    two are prepared and sent as soon as the step before committed; its last token ends it, so
    nothing is prepared after it. The same tokens and steps as without the flag."""
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, async_scheduling=flag)
    steps.pump = answering(steps)
    while scheduler.has_work:
        steps.run()
    plans = [m for r, m in steps.plane.to_workers if r == 0 and isinstance(m, StepPlan)]
    assert [p.step for p in plans] == [1, 2, 3, 4]
    assert [p.decode.positions if p.decode else None for p in plans] == [None, [3], [4], [5]]
    assert [p.decode.tokens if p.decode else None for p in plans] == [None, [7]] + [[SAMPLED_TOKEN]] * 2 * flag + [
        [7]] * 2 * (not flag)
    assert (prepared(registry, "sent"), prepared(registry, "dropped")) == ((2.0, 0.0) if flag else (0.0, 0.0))


def test_with_async_scheduling_and_plans_via_agent_the_prepared_steps_go_through_the_agents():
    """With --step-plans-via agent a prepared step's node frames are sealed while the step before
    runs and sent as they are: every step's plans go to the node's agent, the prepared ones too."""
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, async_scheduling=True, step_plans_via="agent")
    steps.plane.now = 10.0
    for r in (0, 1):
        steps.cluster.ranks[r].last_heartbeat = 9.9
    steps.pump = answering(steps)
    while scheduler.has_work:
        steps.run()
    plans = [m for r, m in steps.plane.to_workers if r == 0 and isinstance(m, StepPlan)]
    assert [p.decode.tokens if p.decode else None for p in plans] == [None, [7], [SAMPLED_TOKEN], [SAMPLED_TOKEN]]
    assert steps.plane.relayed == [{0: "n0", 1: "n0"}] * 4
    assert steps.plane.sealed_ahead == [False, False, True, True]
    assert prepared(registry, "sent") == 2


def test_a_prepared_steps_node_frames_are_sealed_again_when_the_ranks_to_relay_changed():
    """Rank 1's heartbeats fall behind while step 2 runs (step 3 was prepared with it relayed): at
    the send it is no longer relayed, so step 3's plans go sealed again, rank 1's directly, with
    the same plans as prepared (no `schedule`); step 4 is prepared and sent as sealed."""
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, async_scheduling=True, step_plans_via="agent")
    steps.plane.now = 10.0
    for r in (0, 1):
        steps.cluster.ranks[r].last_heartbeat = 9.9
    answer = answering(steps)

    def pump(timeout_s: float) -> None:
        answer(timeout_s)
        if steps.cluster.step == 2:
            steps.cluster.ranks[1].last_heartbeat = 9.0
    steps.pump = pump
    while scheduler.has_work:
        steps.run()
    assert steps.plane.relayed == [{0: "n0", 1: "n0"}] * 2 + [{0: "n0"}] * 2
    assert steps.plane.sealed_ahead == [False, False, False, True]
    plans = [m for r, m in steps.plane.to_workers if r == 0 and isinstance(m, StepPlan)]
    assert [p.decode.tokens if p.decode else None for p in plans] == [None, [7], [SAMPLED_TOKEN], [SAMPLED_TOKEN]]
    assert prepared(registry, "sent") == 2 and prepared(registry, "dropped") == 0


def test_with_async_scheduling_a_request_arriving_during_the_step_drops_the_prepared_one():
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, async_scheduling=True)
    steps.pump = answering(steps, add_at_step=2)
    while scheduler.has_work:
        steps.run()
    plans = [m for r, m in steps.plane.to_workers if isinstance(m, StepPlan) and m.step == 3]
    assert 6 in {c.seq_id for p in plans for c in p.chunks}  # admitted at once, in a step planned anew
    assert prepared(registry, "dropped") == 1 and scheduler.by_id == {}


def test_with_async_scheduling_a_failed_step_drops_the_prepared_one():
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, async_scheduling=True)
    steps.pump = answering(steps, fail_at_step=2)
    steps.run()
    assert steps.run() is None and steps.prepared is None  # step 2 prepared step 3, then failed
    steps.run()
    plans = [m for r, m in steps.plane.to_workers if isinstance(m, StepPlan) and m.step == 3]
    assert all(p.decode is None for p in plans) and prepared(registry, "sent") == 0


def test_with_async_scheduling_a_request_ending_during_the_step_is_taken_out_of_the_prepared_one():
    """Request 5 (4 tokens) ends at step 4, while request 6 (8 tokens) decodes on: step 5, prepared
    during step 4, goes with request 6's row only and request 5's KV freed, its plans built again."""
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, async_scheduling=True)
    scheduler.add(Sequence(6, GenerationRequest("r6", [4, 5], SamplingParams(max_tokens=8), 0), 64, (0,)))
    steps.pump = answering(steps)
    while scheduler.has_work:
        steps.run()
    step5 = [m for _, m in steps.plane.to_workers if isinstance(m, StepPlan) and m.step == 5]
    assert [p.free for p in step5 if p.free] == [[5]]
    assert [(p.decode.seq_ids, p.decode.tokens) for p in step5 if p.decode] == [([6], [SAMPLED_TOKEN])]
    assert prepared(registry, "rebuilt") == 1 and prepared(registry, "dropped") == 0


def answering_with(steps, answer):
    """The pump as the ranks answer: `answer(plans)` with every `StepPlan` sent since the last pump
    (rank_id -> plan), once both ranks' have come."""
    seen = 0

    def pump(timeout_s: float) -> None:
        nonlocal seen
        plans = {r: m for r, m in steps.plane.to_workers[seen:] if isinstance(m, StepPlan)}
        seen = len(steps.plane.to_workers)
        if len(plans) == 2:
            answer(plans)
    return pump


def group_steps_observed(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("elastic_ep_group_step_seconds_count")


def test_a_rank_that_answered_directly_is_left_out_of_its_nodes_frame_and_counted_once():
    """Rank 1's answer sent again reaches the controller before its node's frame with both: the frame
    gives rank 0's, the step completes with its token, and each rank's step is observed once."""
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry)

    def answer(plans):
        steps.on_reply(answer_of(1, plans[1]))
        steps.on_node_results(node_results("n0", "s", [answer_of(0, plans[0]), answer_of(1, plans[1])]))
    steps.pump = answering_with(steps, answer)
    assert steps.run() is not None and scheduler.by_id[5].output == [7]
    steps.observe()
    assert group_steps_observed(registry) == 2


def test_an_expert_load_in_a_nodes_frame_is_summed_and_one_not_of_the_models_shape_is_dropped():
    steps, _, _ = loop_with_one_request(load_report_every_steps=1)

    def load_of(plan, r, load):
        a = answer_of(r, plan)
        return StepResult(a.epoch, a.step, r, a.tokens, a.step_s, a.compute_s, 0.0, 0.0, load, 0, {})

    def answer(plans):
        wrong = np.ones((2, 8), np.int32)  # the model has 1 MoE layer
        steps.on_node_results(node_results("n0", "s", [load_of(plans[0], 0, wrong), answer_of(1, plans[1])]))
        steps.on_reply(load_of(plans[0], 0, wrong))
        assert not steps.replies and invalid_frames("n0") == before + 2
        load = np.arange(8, dtype=np.int32).reshape(1, 8)
        steps.on_node_results(node_results("n0", "s", [load_of(plans[0], 0, load), load_of(plans[1], 1, load)]))
    before = invalid_frames("n0")
    steps.pump = answering_with(steps, answer)
    assert steps.run() is not None
    steps.observe()
    assert steps.load_window.estimate().tolist() == [[2 * e + 1.0 for e in range(8)]]


def test_a_steps_timings_go_to_each_ranks_ring_and_a_new_process_of_an_id_starts_with_none():
    """Step, wait, own time and slot tokens once the next step's plans went out (or `observe` at a
    boundary that runs none), the round trip less the step as answers come (rank 1 directly, rank 0
    in its node's frame), each rank's once a step."""
    steps, _, _ = loop_with_one_request()

    def answer(plans):
        steps.on_reply(answer_of(1, plans[1]))
        steps.on_node_results(node_results("n0", "s", [answer_of(0, plans[0])]))
    steps.pump = answering_with(steps, answer)
    assert steps.run() is not None
    c = steps.cluster
    assert c.timings.window("step_s", 0, c.ranks[0].record) == []  # not before the next step is out
    assert steps.run() is not None
    assert c.timings.window("step_s", 0, c.ranks[0].record) == [0.01]
    steps.observe()
    for r in (0, 1):
        record = c.ranks[r].record
        assert c.timings.window("step_s", r, record) == [0.01, 0.01] == c.timings.window("own_s", r, record)
        assert c.timings.window("wait_s", r, record) == [0.0, 0.0]
        assert len(c.timings.window("link_s", r, record)) == 2
        assert all(link >= 0.0 for link in c.timings.window("link_s", r, record))
    assert steps.run() is not None
    c.ranks[1] = RankInfo(1, "n0", pid=2001, status=RankStatus.SERVING)  # its process replaced after a commit
    assert c.timings.window("step_s", 1, c.ranks[1].record) == []
    assert steps.run() is not None  # observes the step before: the old process's, not the new one's
    assert c.timings.window("step_s", 1, c.ranks[1].record) == []
    steps.observe()
    assert c.timings.window("step_s", 1, c.ranks[1].record) == [0.01]
    assert len(c.timings.window("step_s", 0, c.ranks[0].record)) == 4
    assert steps.run() is not None
    record = c.ranks[1].record
    del c.ranks[1]  # it left after the commit, its measures forgotten: the step's observation leaves it out
    steps.observe()
    assert c.timings.window("step_s", 1, record) == [0.01]
    assert len(c.timings.window("step_s", 0, c.ranks[0].record)) == 5


def test_the_boundarys_housekeeping_runs_once_a_step_after_its_plans_went_out():
    """`during_step` (the controller's housekeeping) runs in the step's wait: the step's plans are
    already out, no answer has been waited for, and the step before is already observed."""
    registry = CollectorRegistry()
    steps, _, _ = loop_with_one_request(registry=registry)
    seen: list[tuple[int, float]] = []  # per call: the plans sent so far, the steps observed then

    def housekeeping() -> None:
        assert not steps.replies
        seen.append((sum(isinstance(m, StepPlan) for _, m in steps.plane.to_workers), group_steps_observed(registry)))
    steps.during_step = housekeeping
    steps.pump = answering_with(steps, lambda plans: [steps.on_reply(answer_of(r, plans[r])) for r in (0, 1)])
    assert steps.run() is not None and steps.run() is not None
    assert seen == [(2, 0.0), (4, 2.0)]


def run_all(steps, scheduler) -> None:
    """Steps until nothing is left, those sent ahead included (as the controller runs them)."""
    while scheduler.has_work or steps.ahead is not None:
        steps.run()


def test_with_send_ahead_the_next_step_goes_before_the_last_commits_and_the_outputs_are_the_same():
    """Requests 5 (4 tokens, rank 0) and 6 (8 tokens, rank 1), --send-ahead-steps 4: after the prefill
    and a decode planned the usual way, each decode step is sent while the one before is in flight (the
    ranks' answers to both come in the same pump: those of the step ahead wait with it). Request 5's
    length ends it in step 4: step 5, prepared during step 4, leaves its row out, and its KV is freed in
    step 6, the next sent. The same outputs as without overlap; at most 4 steps ahead in a row."""
    def outputs(**flags):
        registry = CollectorRegistry()
        steps, scheduler, _ = loop_with_one_request(registry=registry, **flags)
        seqs = [scheduler.by_id[5], Sequence(6, GenerationRequest("r6", [4, 5], SamplingParams(max_tokens=8), 0), 64,
                                             (0,))]
        scheduler.add(seqs[1])
        sent_during: dict[int, int] = {}  # step -> the step in flight when its plans went
        plane = steps.plane
        for name in ("plans_to_workers", "send_sealed"):  # built now, or sealed while the step before ran
            def sending(plans, *args, send=getattr(plane, name)):
                sent_during[plans[0][1].step] = steps.cluster.step
                return send(plans, *args)
            setattr(plane, name, sending)
        steps.pump = answering(steps)
        run_all(steps, scheduler)
        plans = [m for r, m in steps.plane.to_workers if r == 0 and isinstance(m, StepPlan)]
        return {q.seq_id: q.output for q in seqs}, plans, registry, sent_during

    want, plain, _, _ = outputs()
    got, plans, registry, sent_during = outputs(async_scheduling=True, send_ahead_steps=4)
    assert got == want == {5: [7] * 4, 6: [7] * 8}
    assert prepared(registry, "ahead") == 5 and prepared(registry, "dropped") == 0
    assert [p.step for p in plans] == [p.step for p in plain] == list(range(1, 9))
    # steps 3-6 sent ahead in a row, then step 7 after step 6 committed, and 8 ahead of it
    assert [s for s in range(1, 9) if sent_during[s] == s - 1] == [3, 4, 5, 6, 8]
    assert [(p.free, p.decode.seq_ids if p.decode else None) for p in plans[3:6]] == [([], [5]), ([], None),
                                                                                      ([5], None)]


def test_a_failed_step_gives_up_the_step_sent_ahead_and_the_next_plan_is_full():
    """Step 2 fails on rank 0 (its computation) while step 3 is already sent ahead: step 3 is given up
    (its answers match nothing), its number skipped; isolation holds the request out of step 4, and
    when it runs again it goes as a chunk (what the ranks kept is forgotten), never as a decode row."""
    registry = CollectorRegistry()
    steps, scheduler, _ = loop_with_one_request(registry=registry, async_scheduling=True, send_ahead_steps=4)
    steps.pump = answering(steps, fail_at_step=2)
    steps.run()
    assert steps.run() is None and steps.ahead is None and steps.cluster.step == 2
    assert prepared(registry, "ahead") == 1 and prepared(registry, "dropped") == 1
    steps.run()
    assert steps.cluster.step == 4
    step4 = [m for _, m in steps.plane.to_workers if isinstance(m, StepPlan) and m.step == 4]
    assert [p.decode for p in step4] == [None, None]
    run_all(steps, scheduler)
    again = [m for _, m in steps.plane.to_workers if isinstance(m, StepPlan) and m.step > 4
             and (5 in {c.seq_id for c in m.chunks} or (m.decode is not None and 5 in m.decode.seq_ids))]
    assert again and 5 in {c.seq_id for c in again[0].chunks}


def test_an_interrupted_step_keeps_its_number_for_the_recovery_and_gives_up_the_one_ahead():
    """A fault while step 2 waits with step 3 sent ahead: the recovery gathers step 2's answers (the
    step number stays 2), an answer to step 3 is dropped, and the next step is numbered 4."""
    steps, scheduler, detector = loop_with_one_request(async_scheduling=True, send_ahead_steps=4)
    steps.pump = answering(steps)
    steps.run()
    steps.pump = lambda timeout_s: detector.error("rank 1: gloo: connection closed")
    with pytest.raises(RecoveryNeeded):
        steps.run()
    detector.clear()
    assert steps.cluster.step == 2 and steps.ahead is None and steps.unanswered(set()) == [0, 1]
    sent = {m.step for _, m in steps.plane.to_workers if isinstance(m, StepPlan)}
    assert sent == {1, 2, 3}
    c = steps.cluster
    steps.on_reply(StepResult(c.epoch, 3, 0, {5: 7}, 0.01, 0.01, 0.0, 0.0, np.zeros((0, 0), np.int32), 0, {}))
    steps.on_reply(StepFailed(c.epoch, 2, 0, "CollectiveError: aborted", StepErrorKind.COLLECTIVE))
    assert list(steps.replies) == [0] and steps.unanswered(set()) == [1]
    detector.clear()  # the recovery takes the fault that answer named
    steps.abandon()
    steps.pump = answering(steps)
    steps.run()
    assert steps.cluster.step == 4
