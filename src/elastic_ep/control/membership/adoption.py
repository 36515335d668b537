"""A new leader of the controller group (serve --etcd) takes over the ranks that run.

At the takeover it reads the last leader's cluster record from etcd (group/record.py): the epoch,
its members and their nodes, the expert placement. Its agents register in adopt mode naming the
workers they run (membership/nodes.py `_adopt`), and each worker, handed the new leader's launch by
its agent, registers again (`WorkerHello` join_mode adopt) saying the highest epoch it was told of
and the epoch whose slots it holds whole. `wait` lasts until every member of the record has
registered or is known not to run, or the agent lease (--lease-s) passes: a node that reaches
neither this leader nor etcd within it has fenced itself. The epoch that adopts them (`Adopt`,
epochs/requests.py) is numbered past every epoch any of them was told of (the record may lag the
last leader by one write), keeps the record's placement on every rank that holds it whole, so
nothing moves and no weight is read again, and restores the experts of the others (a member that
never came back, a rank whose slots an unfinished epoch was changing) as recovery does. A member
that did not come back is a down rank, started again after --restart-delay-s by its agent. The
KV each adopted rank still holds (its hello's `held_kv`) goes to the scheduler with the ids of the
journaled requests, which take it over (control/serving/adopted_kv.py). The ranks outside the group
an agent named (the last leader's standbys, a scale-up's joiners) stand by once registered (one still
registering counts as a rank on its way), and the scale the record shows in flight is asked again
(membership/scale_driver.py `resume`). The nodes it names cordoned stay cordoned (`cordoned_nodes`),
so a drained node takes no rank under the new leader either.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_ep.errors import PlacementError
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import HeldKV, WorkerHello

from ..cluster import ClusterState
from ..config import ServeConfig
from ..events import EventKind
from ..ranks import RankInfo, RankStatus
from .nodes import Nodes


@dataclass(frozen=True)
class AdoptionPlan:
    """What the last leader's record says: its `epoch`, the `members` and each one's node, the
    placement they hold, its `scale` (GET /is_scaling_elastic_ep as it was) and `rollout`."""

    epoch: int
    members: list[int]
    nodes: dict[int, str]
    placement: ExpertLocation
    scale: dict[str, Any] = field(default_factory=dict)
    rollout: dict[str, Any] = field(default_factory=dict)


def adoption_plan(record: dict[str, Any] | None) -> AdoptionPlan | None:
    """The plan of a cluster record; None when there is nothing to adopt (no record, or the last
    leader never formed an epoch with a placement): the new leader then starts as a first leader does."""
    epoch = record.get("epoch") if record else None
    if epoch is None or epoch < 0 or record.get("placement") is None or not record.get("members"):
        return None
    try:
        placement = ExpertLocation.from_json(json.dumps(record["placement"]))
    except PlacementError:
        return None
    nodes = {int(r["rank_id"]): str(r["node"]) for r in record.get("ranks", [])}
    members = [int(r) for r in record["members"]]
    return AdoptionPlan(int(epoch), members, {r: nodes.get(r, "") for r in members}, placement,
                        dict(record.get("scale") or {}), dict(record.get("rollout") or {}))


def cordoned_nodes(record: dict[str, Any] | None) -> list[str]:
    """The nodes the last leader had cordoned (a drain's, until POST /uncordon), as its record names them."""
    return [str(node) for node in (record or {}).get("cordoned") or []]


def adopted(plan: AdoptionPlan, hellos: dict[int, WorkerHello]) -> tuple[list[int], list[int], int]:
    """Of the members' registrations `hellos` (rank -> its adopt hello): (the ranks to adopt, those of
    them whose slots hold the record's placement whole, the epoch to number past: the record's or a
    later one a rank was told of)."""
    live = sorted(r for r in plan.members if r in hellos)
    whole = [r for r in live if hellos[r].held_epoch == plan.epoch]
    after = max([plan.epoch, *(hellos[r].epoch for r in live), *(hellos[r].held_epoch for r in live)])
    return live, whole, after


class Adoption:
    """The takeover of `plan`'s ranks; `pump(timeout_s)` handles input while it waits; `journaled`:
    the ids of the last leader's unfinished requests, which this leader runs on."""

    def __init__(self, plan: AdoptionPlan, cluster: ClusterState, cfg: ServeConfig, nodes: Nodes,
                 pump: Callable[[float], None], journaled: set[str] | None = None):
        self.plan, self.cluster, self.cfg, self.nodes, self.pump = plan, cluster, cfg, nodes, pump
        self.journaled = journaled or set()
        self.started_at = time.monotonic()

    def hellos(self) -> dict[int, WorkerHello]:
        """The members that registered with this leader as adopted ranks."""
        c = self.cluster
        return {r: c.ranks[r].hello for r in self.plan.members
                if r in c.ranks and c.ranks[r].hello is not None and c.ranks[r].hello.join_mode == "adopt"}

    def held_kv(self, ranks: list[int]) -> dict[int, list[HeldKV]]:
        """The KV each of `ranks` (the adopting epoch's members) said it holds when it registered."""
        hellos = self.hellos()
        return {r: hellos[r].held_kv for r in ranks if r in hellos}

    def settled(self) -> bool:
        """Every member registered, or its node's agent registered without naming it (it does not run)."""
        c, hellos = self.cluster, self.hellos()
        return all(r in hellos or (self.plan.nodes[r] in c.agents and r not in c.ranks) for r in self.plan.members)

    def wait(self, stopping: threading.Event) -> None:
        """Until `settled` or the agent lease (plus the time to notice a silent agent) passed."""
        c, plan = self.cluster, self.plan
        deadline = self.started_at + self.cfg.lease_s + self.cfg.agent_timeout_s
        while not stopping.is_set() and not self.settled() and time.monotonic() < deadline:
            c.set_readiness(False, f"taking over: {len(self.hellos())}/{len(plan.members)} ranks of epoch "
                            f"{plan.epoch} registered")
            self.pump(0.02)

    def request(self) -> tuple[list[int], list[int], int]:
        """The adoption epoch's (live, whole, after_epoch); when any rank came back, every member that
        did not is a down rank from now on, started again by its agent after --restart-delay-s."""
        c, plan = self.cluster, self.plan
        live, whole, after = adopted(plan, self.hellos())
        if not live:
            return live, whole, after
        for r in plan.members:
            if r not in c.ranks:  # no agent named it: down (one named but not registered yet joins later)
                c.ranks[r] = RankInfo(r, plan.nodes[r], status=RankStatus.DEAD)
                self.nodes.schedule_restart(r)
        c.events.add(EventKind.ADOPTED, f"taking over epoch {plan.epoch} of the last leader: ranks {live} adopted "
                     f"({len(whole)} hold its placement whole), {sorted(set(plan.members) - set(live))} did not come "
                     f"back, after {time.monotonic() - self.started_at:.2f}s", adopted=live, whole=whole,
                     record_epoch=plan.epoch)
        return live, whole, after
