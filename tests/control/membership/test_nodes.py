"""Whether a registering rank may join: every rank of a group computes on one device kind, so a
rank that comes up on the CPU of a node whose GPUs are gone (under --device auto) is refused,
with the node and the flag to pass.

The node role (control/membership/nodes.py) built with stand-ins: it gives a new agent free rank
ids up to the target size, turns a worker's exit into a fault (not for a rank that was leaving),
drops a silent agent and makes every rank of its node a fault (not a new session whose welcome
is slow to reach it), takes no process started in a session it gave up on, nor a backup piece announced in another
session than the node's current one, counts a rank on an
unreachable node as down at once, and restarts a down rank after --restart-delay-s or hands it to a
recover-mode agent. A cordoned node is given no rank, and its standalone agent is told to stop
once its last rank is gone (the one inside `elastic-ep serve` stays)."""

from __future__ import annotations

import threading
import time

import pytest
from control_standins import Plane, cluster_of, config

from elastic_ep.control.faults.detector import FaultCause
from elastic_ep.control.membership.nodes import Nodes, device_kind, wrong_device
from elastic_ep.control.ranks import RankStatus
from elastic_ep.errors import ElasticEPError
from elastic_ep.wire import (
    AgentAlive,
    AgentBye,
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupReady,
    BackupSite,
    FenceWorker,
    LeaseRenew,
    NodeHeartbeat,
    SessionEnded,
    StartWorker,
    WorkerExited,
    WorkerFenced,
    WorkerHello,
    WorkerStarted,
    WorkerStartFailed,
)


def hello(device: str) -> WorkerHello:
    return WorkerHello(3, "node1", 1234, "recover", device=device)


def test_ranks_on_the_groups_device_kind_join_whatever_their_gpu():
    assert device_kind("cuda:5") == "cuda"
    assert wrong_device("cuda", hello("cuda:1")) == ""
    assert wrong_device("cpu", hello("cpu")) == ""


def test_a_rank_on_another_device_kind_is_refused_with_the_node_and_the_flag():
    reason = wrong_device("cuda", hello("cpu"))
    assert "rank 3 on node1 came up on cpu, but the group runs on cuda" in reason
    assert "--device cuda" in reason


class Rig:
    def __init__(self, ranks: dict[int, str], **flags):
        self.cluster = cluster_of(ranks)
        self.plane = Plane()
        self.faults, self.undrained, self.forgotten = [], [], []
        self.nodes = Nodes(self.cluster, config(**flags), self.plane, 29500, 1024, fault=self.faults.append,
                           target_size=lambda: 4, undrain=self.undrained.extend,
                           forget_measures=self.forgotten.append, pump=lambda timeout_s: None, publish=lambda: None,
                           set_pool_size=lambda rank_id, blocks: None)


def test_a_new_agent_is_welcomed_and_given_the_free_rank_ids_up_to_the_target():
    rig = Rig({0: "n0", 1: "n0"})
    rig.nodes.on_agent_hello(b"an1", AgentHello("n1", 42, "tcp://f", 0, num_ranks=4, session="s1"))
    assert [type(m) for _, m in rig.plane.to_identities][0] is AgentWelcome
    assert [m.rank_id for m in rig.plane.sent(StartWorker)] == [2, 3]
    assert rig.cluster.ranks[2].node == "n1" and "n1" in rig.cluster.agents


def test_a_worker_exit_is_a_fault_but_a_leaving_rank_exits_quietly():
    rig = Rig({0: "n0", 1: "n0", 2: "n0"})
    rig.nodes.on_worker_exited(WorkerExited("n0", 1, 1001, -9))
    assert [(f.rank_id, f.cause) for f in rig.faults] == [(1, FaultCause.EXITED)]
    assert rig.cluster.ranks[1].status == RankStatus.DEAD

    rig.nodes.stop_rank(2)
    assert rig.undrained == [2]
    rig.nodes.on_worker_exited(WorkerExited("n0", 2, 1002, 0))
    assert len(rig.faults) == 1 and 2 not in rig.cluster.ranks and rig.forgotten == [2]


def test_an_exit_report_of_another_process_is_ignored():
    rig = Rig({0: "n0"})
    rig.nodes.on_worker_exited(WorkerExited("n0", 0, 999, -9))  # an earlier process of rank 0
    assert rig.faults == [] and rig.cluster.ranks[0].status == RankStatus.SERVING


def test_a_silent_agent_makes_every_rank_of_its_node_a_fault():
    rig = Rig({0: "n0", 1: "n1", 2: "n1"}, agent_timeout_s=1.0)
    rig.cluster.ranks[2].status = RankStatus.FENCING
    rig.cluster.agents["n0"].last_alive = rig.cluster.agents["n1"].last_alive = 0.0
    rig.cluster.agents["n0"].last_alive = 5.0
    rig.nodes.check_agents(5.5)
    assert [(f.rank_id, f.cause) for f in rig.faults] == [(1, FaultCause.NODE_LOST)]
    assert rig.cluster.ranks[2].status == RankStatus.DEAD  # no one is left to confirm its fence
    assert "n1" not in rig.cluster.agents and "n0" in rig.cluster.agents


def test_an_agents_node_heartbeats_are_word_from_it_between_its_alives():
    # its AgentAlive goes every 0.5 s while its NodeHeartbeats go (node/lease.py): each of them, of
    # its own session, keeps the agent; one of a session given up on keeps nothing and is not taken
    rig = Rig({0: "n0", 1: "n1"}, agent_timeout_s=0.3)
    for agent in rig.cluster.agents.values():
        agent.last_alive, agent.alive_heard = 10.0, True
    session = rig.cluster.agents["n0"].session
    for heard in (10.1, 10.2, 10.3, 10.4):
        assert rig.nodes.on_node_heartbeat(NodeHeartbeat("n0", session, []), heard)
        assert not rig.nodes.on_node_heartbeat(NodeHeartbeat("n1", "an old session", []), heard)
    rig.nodes.check_agents(10.5)
    assert "n0" in rig.cluster.agents and "n1" not in rig.cluster.agents
    assert [(f.rank_id, f.cause) for f in rig.faults] == [(1, FaultCause.NODE_LOST)]


def test_a_new_session_whose_welcome_is_slow_to_arrive_is_not_given_up_on():
    # after a heal the link held the welcome back for more than --agent-timeout-s (seen: 1.04 s),
    # while the agent's repeated hello came through: its first alive must renew, not end, the session
    rig = Rig({0: "n0", 1: "n0"}, agent_timeout_s=1.0)
    rig.cluster.agents["n0"].last_alive = 100.0
    comeback = AgentHello("n1", 7, "tcp://f", 0, num_ranks=2, join_mode="recover", session="s2")
    rig.plane.now = 10.0
    rig.nodes.on_agent_hello(b"an1", comeback)
    rig.plane.now = 10.9
    rig.nodes.on_agent_hello(b"an1", comeback)  # repeated: our welcome has not reached it yet
    rig.nodes.check_agents(11.6)
    assert "n1" in rig.cluster.agents
    rig.plane.now = 11.7
    rig.nodes.on_agent_alive(b"an1", AgentAlive("n1", "s2"))
    assert rig.plane.sent(SessionEnded) == [] and rig.plane.sent(LeaseRenew)[-1].session == "s2"
    rig.nodes.check_agents(12.8)  # once it has said alive, --agent-timeout-s alone
    assert "n1" not in rig.cluster.agents


def test_a_new_session_silent_past_the_hello_interval_is_given_up_on():
    rig = Rig({0: "n0"}, agent_timeout_s=1.0)
    rig.cluster.agents["n0"].last_alive = 100.0
    rig.nodes.on_agent_hello(b"an1", AgentHello("n1", 7, "tcp://f", 0, num_ranks=2, session="s2"))
    rig.nodes.check_agents(1.9)
    assert "n1" in rig.cluster.agents
    rig.nodes.check_agents(2.1)  # neither an alive nor its repeated hello (every AGENT_HELLO_INTERVAL_S)
    assert "n1" not in rig.cluster.agents


def test_a_process_started_in_a_session_given_up_on_is_not_taken_and_the_next_session_gets_its_ranks():
    # the order seen across hosts: n1's agent comes back (s2) and is given its down ranks; the
    # controller gives up on s2 before s2's WorkerStarted arrive; s2's alive is answered with
    # SessionEnded, so that agent kills those processes and registers again (s3)
    rig = Rig({0: "n0", 1: "n0", 2: "n1", 3: "n1"}, agent_timeout_s=1.0)
    rig.cluster.agents["n0"].last_alive = 100.0
    del rig.cluster.agents["n1"]  # lost at the cut: its ranks are down
    for rank_id in (2, 3):
        rig.cluster.ranks[rank_id].status = RankStatus.DEAD
    rig.nodes.on_agent_hello(b"an1", AgentHello("n1", 7, "tcp://f", 0, num_ranks=2, join_mode="recover",
                                                session="s2"))
    rig.nodes.check_agents(2.5)
    assert "n1" not in rig.cluster.agents
    for rank_id in (2, 3):
        rig.nodes.on_worker_started(b"an1", WorkerStarted("n1", rank_id, 3000 + rank_id, "s2"))
    assert all(rig.cluster.ranks[r].status == RankStatus.DEAD for r in (2, 3))
    rig.nodes.on_agent_alive(b"an1", AgentAlive("n1", "s2"))
    assert [m.session for m in rig.plane.sent(SessionEnded)] == ["s2"]
    rig.nodes.on_agent_hello(b"an1", AgentHello("n1", 7, "tcp://f", 0, num_ranks=2, join_mode="recover",
                                                session="s3"))
    assert [(m.rank_id, m.join_mode) for m in rig.plane.sent(StartWorker)] == [(2, "recover"), (3, "recover")] * 2
    rig.nodes.on_worker_started(b"an1", WorkerStarted("n1", 2, 4002, "s3", started_by="fork"))
    assert (rig.cluster.ranks[2].status, rig.cluster.ranks[2].pid) == (RankStatus.STARTING, 4002)
    started = [e["message"] for e in rig.cluster.events.all() if e["kind"] == "started"]
    assert started == ["rank 2 started on n1 (pid 4002, forked from the node's zygote)"]


def test_a_backup_piece_of_another_session_than_the_nodes_current_one_is_not_taken():
    # n1's agent process was replaced (new session s2); a piece its previous process (s1) announced
    # arrives late and names a file that process took with it
    rig = Rig({0: "n0", 1: "n0"})
    rig.nodes.on_agent_hello(b"an1", AgentHello("n1", 42, "tcp://f", 0, num_ranks=2, session="s2"))
    site = BackupSite("n1", "/dev/shm/gone", "tcp://f")
    rig.nodes.on_backup_ready(BackupReady("n1", site, [(0, 1), (0, 2)], 10, 2, session="s1"))
    agent = rig.cluster.agents["n1"]
    assert (agent.backup, agent.backup_experts) == (None, [])
    rig.nodes.on_backup_ready(BackupReady("n1", site, [(0, 1), (0, 2)], 10, 2, session="s2"))
    assert (agent.backup, agent.backup_experts) == (site, [(0, 1), (0, 2)])


def test_a_silent_in_process_agent_is_a_stall_event_not_a_lost_node():
    rig = Rig({0: "n0", 1: "n0"}, agent_timeout_s=1.0)
    agent = rig.cluster.agents["n0"]
    agent.standalone, agent.last_alive = False, 0.0
    rig.nodes.check_agents(5.0)
    rig.nodes.check_agents(6.0)
    assert rig.faults == [] and "n0" in rig.cluster.agents
    stalls = [e for e in rig.cluster.events.all() if "in-process agent was silent" in e["message"]]
    assert len(stalls) == 1  # once per silence
    rig.nodes.on_agent_alive(agent.identity, AgentAlive("n0", agent.session))
    assert not agent.stalled


def test_an_agents_zygote_is_what_its_last_alive_said():
    rig = Rig({0: "n0", 1: "n0"})
    agent = rig.cluster.agents["n0"]
    assert agent.zygote == "unknown"  # until its first AgentAlive
    for state in ("starting", "ready", "down"):
        rig.nodes.on_agent_alive(agent.identity, AgentAlive("n0", agent.session, zygote=state))
        assert agent.zygote == state
    rig.nodes.on_agent_alive(agent.identity, AgentAlive("n0", "another session", zygote="ready"))
    assert agent.zygote == "down"  # a session given up on says nothing of the node


def test_a_fence_goes_through_the_agent_and_a_rank_on_an_unreachable_node_is_down_at_once():
    rig = Rig({0: "n0", 1: "n1"})
    rig.nodes.fence(0, "hung")
    assert rig.cluster.ranks[0].status == RankStatus.FENCING
    assert [(m.rank_id, m.pid) for m in rig.plane.sent(FenceWorker)] == [(0, 1000)]
    rig.nodes.on_worker_fenced(WorkerFenced("n0", 0, 1000))
    assert rig.cluster.ranks[0].status == RankStatus.FENCED

    del rig.cluster.agents["n1"]
    rig.nodes.fence(1, "hung")
    assert rig.cluster.ranks[1].status == RankStatus.DEAD and len(rig.plane.sent(FenceWorker)) == 1


def test_a_down_rank_restarts_after_the_delay_or_goes_to_a_recover_mode_agent():
    rig = Rig({0: "n0", 1: "n0"}, restart_delay_s=5.0)
    rig.cluster.ranks[1].status = RankStatus.DEAD
    rig.nodes.schedule_restart(1)
    assert rig.nodes.restarting(1)
    rig.nodes.restart_due(time.monotonic())
    assert rig.plane.sent(StartWorker) == []  # not yet
    rig.nodes.restart_due(time.monotonic() + 6.0)
    assert [(m.rank_id, m.join_mode) for m in rig.plane.sent(StartWorker)] == [(1, "recover")]
    assert not rig.nodes.restarting(1)

    rig.nodes.schedule_restart(1)
    rig.nodes.on_agent_hello(b"an9", AgentHello("n9", 7, "tcp://f", 0, num_ranks=1, join_mode="recover",
                                                session="s9"))
    assert rig.cluster.ranks[1].node == "n9" and not rig.nodes.restarting(1)
    assert [(m.rank_id, m.join_mode) for m in rig.plane.sent(StartWorker)][-1] == (1, "recover")


def test_no_restart_without_a_delay_or_when_the_agent_restarts_its_own_ranks():
    rig = Rig({0: "n0"}, restart_delay_s=-1.0)
    rig.nodes.schedule_restart(0)
    assert not rig.nodes.restarting(0)
    rig = Rig({0: "n0"})
    rig.cluster.agents["n0"].auto_recover = True
    rig.nodes.schedule_restart(0)
    assert not rig.nodes.restarting(0)


def test_a_cordoned_node_gets_no_rank_and_its_agent_stops_once_its_last_rank_is_gone():
    rig = Rig({0: "n0", 1: "n1", 2: "n1"})
    rig.cluster.cordoned.add("n1")
    rig.nodes.on_agent_hello(b"an2", AgentHello("n2", 43, "tcp://f", 0, num_ranks=4, session="s2"))
    assert [m.rank_id for m in rig.plane.sent(StartWorker)] == [3]  # n2 is not cordoned
    rig.cluster.cordoned.add("n2")
    rig.nodes.on_agent_hello(b"an3", AgentHello("n2", 44, "tcp://f", 0, num_ranks=4, session="s3"))
    assert [m.rank_id for m in rig.plane.sent(StartWorker)] == [3]
    for r in (1, 2):
        rig.cluster.ranks[r].status = RankStatus.RETIRING
    rig.nodes.on_worker_exited(WorkerExited("n1", 1, 1001, 0))
    assert rig.plane.sent(AgentShutdown) == []  # rank 2 still runs there
    rig.nodes.on_worker_exited(WorkerExited("n1", 2, 1002, 0))
    assert len(rig.plane.sent(AgentShutdown)) == 1 and rig.faults == []


def test_the_agent_inside_serve_is_never_told_to_stop():
    rig = Rig({0: "n0", 1: "n0"})
    rig.cluster.agents["n0"].standalone = False
    rig.cluster.cordoned.add("n0")
    rig.cluster.ranks[1].status = RankStatus.RETIRING
    rig.nodes.on_worker_exited(WorkerExited("n0", 1, 1001, 0))
    rig.cluster.ranks[0].status = RankStatus.RETIRING
    rig.nodes.on_worker_exited(WorkerExited("n0", 0, 1000, 0))
    assert rig.plane.sent(AgentShutdown) == [] and rig.cluster.ranks == {}

def test_a_rank_that_ends_during_startup_is_reported_with_how_it_ended():
    rig = Rig({0: "n0", 1: "n0"}, ep_size=2, startup_timeout_s=10.0)
    for r in rig.cluster.ranks.values():
        r.status, r.hello = RankStatus.STARTING, None
    rig.nodes.on_worker_exited(WorkerExited("n0", 1, 1001, -9))
    with pytest.raises(ElasticEPError, match=r"rank 1 ended during startup \(killed by SIGKILL\)"):
        rig.nodes.wait_for_ranks(threading.Event())


def test_a_start_its_agent_could_not_make_is_an_exit_with_the_reason():
    """`WorkerStartFailed`: during startup the server stops naming the reason; a live rank's
    failed start is a fault; a down rank's failed restart is tried again after --restart-delay-s;
    a report of a session given up on, or of another node than the rank's, changes nothing."""
    rig = Rig({0: "n0", 1: "n0"}, ep_size=2, startup_timeout_s=10.0)
    for r in rig.cluster.ranks.values():
        r.status, r.hello = RankStatus.STARTING, None
    rig.nodes.on_worker_start_failed(WorkerStartFailed("n0", 1, "Cannot allocate memory (OSError)", "s"))
    assert [(f.rank_id, f.cause) for f in rig.faults] == [(1, FaultCause.EXITED)]
    event = rig.cluster.events.all()[-1]
    assert (event["kind"], event["rank_id"], event["node"], event["reason"]) == (
        "start-failed", 1, "n0", "Cannot allocate memory (OSError)")
    with pytest.raises(ElasticEPError, match=r"rank 1 ended during startup \(could not be started on n0: Cannot "
                                             r"allocate memory \(OSError\)\)"):
        rig.nodes.wait_for_ranks(threading.Event())

    rig = Rig({0: "n0", 1: "n0"}, restart_delay_s=5.0)
    rig.cluster.ranks[1].status = RankStatus.DEAD
    rig.nodes.on_worker_start_failed(WorkerStartFailed("n0", 1, "Resource temporarily unavailable", "old"))
    rig.nodes.on_worker_start_failed(WorkerStartFailed("n9", 1, "Resource temporarily unavailable", "s"))
    assert not rig.nodes.restarting(1)
    rig.nodes.on_worker_start_failed(WorkerStartFailed("n0", 1, "Resource temporarily unavailable", "s"))
    assert rig.nodes.restarting(1) and rig.faults == [] and rig.cluster.ranks[1].status == RankStatus.DEAD
    rig.nodes.restart_due(time.monotonic() + 6.0)
    assert [(m.rank_id, m.join_mode) for m in rig.plane.sent(StartWorker)] == [(1, "recover")]


def test_a_hello_of_a_rank_no_agent_started_makes_no_rank():
    """A `WorkerHello` for a rank id the cluster does not have (its scale ended before it registered,
    or a forged one) is not taken; it used to add that rank to the cluster, never to leave."""
    rig = Rig({0: "n0"})
    rig.nodes.on_worker_hello(WorkerHello(7, "n0", 4242, "initial", device="cpu"))
    assert sorted(rig.cluster.ranks) == [0]


def test_an_agents_bye_is_taken_only_from_its_current_session():
    """A bye from an agent process that stopped, come late after the node's next agent registered,
    leaves the new one registered; the current session's bye drops the agent and its backup."""
    rig = Rig({0: "n0", 1: "n1"})
    rig.cluster.agents["n1"].backup = BackupSite("n1", "/dev/shm/b", "tcp://f")
    rig.nodes.on_agent_bye(AgentBye("n1", "an-earlier-session"))
    assert "n1" in rig.cluster.agents and rig.cluster.agents["n1"].backup is not None
    rig.nodes.on_agent_bye(AgentBye("n1", "s"))
    assert "n1" not in rig.cluster.agents and "n1" in rig.cluster.backup_lost


def test_a_rolling_restarts_options_go_with_every_start_and_a_new_checkpoint_is_read_from_its_disk():
    rig = Rig({0: "n0", 1: "n0"})
    rig.cluster.agents["n0"].backup = BackupSite("n0", "/dev/shm/x", "tcp://f")
    rig.nodes.start_new_rank(2, "n0")
    plain = rig.plane.sent(StartWorker)[-1]
    assert plain.launch is None and plain.dense_site is not None  # no options: the welcome's launch
    rig.nodes.options.update({"num_gpu_blocks_override": 64})
    rig.nodes.start_new_rank(3, "n0")
    sized = rig.plane.sent(StartWorker)[-1]
    assert sized.launch.num_gpu_blocks_override == 64 and sized.launch.model_dir == "unused"
    assert sized.dense_site is not None  # the same checkpoint: its host copy serves
    rig.nodes.options.update({"model_dir": "/moved"})
    rig.nodes.start_new_rank(4, "n0")
    moved = rig.plane.sent(StartWorker)[-1]
    assert moved.launch.model_dir == "/moved" and moved.dense_site is None  # read from the new directory
    assert rig.nodes.launch().model_dir == "/moved"  # and what a new agent is welcomed with
