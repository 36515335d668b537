"""Stand-ins for what the control roles are built with: a control plane that records what it
sends, and a cluster of ranks on nodes. Each role's tests build the role with these and with
callables of their own, as the loop (control/controller.py) builds it with the real ones."""

from __future__ import annotations

from elastic_ep.control.cluster import ClusterState
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.ranks import AgentInfo, RankInfo, RankStatus
from elastic_ep.control.timing import ControlTimes
from elastic_ep.wire import WorkerHello


class Plane:
    """Records every message by destination; its heard clock is set by the test."""

    step_addr = "tcp://127.0.0.1:1"
    health_addr = "tcp://127.0.0.1:2"
    plan_addr = "tcp://127.0.0.1:3"

    def __init__(self):
        self.now = 0.0
        self.term = 0
        self.to_identities: list[tuple[bytes, object]] = []
        self.to_workers: list[tuple[int, object]] = []
        self.relayed: list[dict[int, str] | None] = []  # each step's rank -> node whose agent relays its plan
        self.sealed_ahead: list[bool] = []  # each step's: its nodes' frames sealed while the step before ran
        self.times = ControlTimes()

    def heard_clock(self) -> float:
        return self.now

    def to_identity(self, identity: bytes, msg: object) -> None:
        self.to_identities.append((identity, msg))

    def to_worker(self, rank_id: int, msg: object) -> None:
        self.to_workers.append((rank_id, msg))

    def plans_to_workers(self, plans: list[tuple[int, object]], relayed: dict[int, str] | None = None,
                         sealed: list[tuple[str, list[tuple[int, object]]]] | None = None) -> None:
        """With `sealed` (`seal_for_agents`'s), the relayed ranks get what was sealed, not `plans`."""
        if sealed is None:
            self.to_workers.extend(plans)
        else:
            self.to_workers.extend([p for _, node_plans in sealed for p in node_plans]
                                   + [(r, p) for r, p in plans if r not in relayed])
        self.relayed.append(relayed)
        self.sealed_ahead.append(sealed is not None)

    def seal_for_agents(self, by_node: dict[str, list[tuple[int, object]]]) -> list[tuple[str, list]]:
        return [(node, list(plans)) for node, plans in by_node.items()]

    def messages_to_workers(self, messages: list[tuple[int, object]]) -> tuple[float, float, int]:
        self.to_workers.extend(messages)
        return 0.0, 0.0, 0

    def seal_for_workers(self, messages: list[tuple[int, object]]) -> list[tuple[int, object]]:
        return list(messages)

    def send_sealed(self, frames: list[tuple[int, object]]) -> tuple[float, int]:
        self.to_workers.extend(frames)
        return 0.0, 0

    def sent(self, kind: type) -> list[object]:
        """Every message of `kind` sent anywhere, in order."""
        return [m for _, m in self.to_identities + self.to_workers if isinstance(m, kind)]


def config(**flags) -> ServeConfig:
    return ServeConfig(model_dir="unused", model_name="unused", ep_size=flags.pop("ep_size", 4), **flags)


def cluster_of(ranks: dict[int, str], *, experts: int = 8, slots: int = 4, members: list[int] | None = None,
               status: RankStatus = RankStatus.SERVING) -> ClusterState:
    """`ranks`: rank_id -> node, each registered (pid 1000 + rank) with its node's agent; the
    members (default all) in epoch 0."""
    c = ClusterState(num_layers=1, num_experts=experts, slots_per_rank=slots)
    for node in sorted(set(ranks.values())):
        c.agents[node] = AgentInfo(node, f"a{node}".encode(), "tcp://x", num_ranks=4, session="s")
    for r, node in ranks.items():
        c.ranks[r] = RankInfo(r, node, pid=1000 + r, status=status,
                              hello=WorkerHello(r, node, 1000 + r, "initial", device="cpu"))
    c.members = sorted(ranks) if members is None else members
    c.epoch = 0
    return c
