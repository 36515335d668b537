"""The scale driver: moves a `ScaleOp` (control/membership/scale_rules.py, the rules) on at step boundaries.

Scale-up takes standby ranks first (registered and warm, `--standby-ranks`), starts the rest
through the agents on nodes that are not cordoned, waits for all of them to register while the
old group serves, then admits them together in one epoch. Scale-down drains the leaving ranks
(the highest ids, or the ones the caller names), moves the experts only they hold in an epoch
where they still send, then drops and stops them. A drain (`POST /drain`) is a scale-down
that names its ranks, or a node: that node is cordoned (no rank is started on it until
`POST /uncordon`), its standbys are stopped, and once its last rank is gone its agent, if it
runs as `elastic-ep agent`, is told to stop (it exits 0: what a preStop hook waits for).
Every change of members is a `ScaleStep` epoch through the same epoch change as recovery. A
joiner that dies or stops before it is a member fails the scale, not the service, and so does a
step with no placement over its ranks (the old epoch serves on); a fault of a member during a
scale is recovered as anywhere else and the scale resumes; a slow joiner only makes the scale
slower, up to --elastic-ep-scale-timeout.

A new leader of a controller group takes over the last leader's target size and resumes the scale
its cluster record shows in flight (`resume`): it asks for it again (the same size, leaving ranks
or drained node) once its adopting epoch formed; the processes a scale-up had started were adopted
as they run and stand by, so it takes them first and starts none again; one still loading its
weights (it follows the new leader once loaded, runtime/worker.py) is a joiner of the resumed
scale, which waits for it to register. A scale that a rolling
restart had in flight is not resumed: the rollout ends with the takeover.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ..api import ScaleRejected
from ..cluster import ClusterState
from ..config import ServeConfig
from ..epochs.epoch_change import EpochReport, NoPlacement
from ..epochs.epoch_plan import trimmed
from ..epochs.requests import EpochRequest, ScaleStep
from ..events import EventKind
from ..ranks import RankStatus
from .scale_rules import (
    ScaleOp,
    agent_for_new_rank,
    check_idle,
    check_retiring,
    check_target,
    new_rank_ids,
    ranks_leaving,
    scale_limits,
    status_view,
)


class Processes(Protocol):
    """The rank processes (membership/nodes.py)."""

    def start_new_rank(self, rank_id: int, node: str, spare: bool = False) -> None: ...
    def forget_rank(self, rank_id: int, message: str) -> None: ...
    def stop_rank(self, rank_id: int) -> None: ...
    def retire(self, rank_id: int, reason: str) -> None: ...
    def release_if_drained(self, node: str) -> None: ...


class Drains(Protocol):
    """The scheduler, as a scale-down drains ranks."""

    def drain(self, ranks: list[int]) -> None: ...
    def undrain(self, ranks: list[int]) -> None: ...
    def num_requests(self, rank_id: int) -> int: ...


class ScaleDriver:
    """Built with the cluster state, the rank processes, the scheduler's drains, and the callables
    `take_standbys(count)`, `joiners()` (ranks from outside that an epoch over the members would
    admit), `form(EpochRequest, reason)` (the loop's epoch change: a report, `NoPlacement`, or
    RecoveryNeeded raised), `publish()` and `ended(result)` ("succeeded" or "failed", as a scale ends)."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, processes: Processes, drains: Drains, *,
                 take_standbys: Callable[[int], list[int]], joiners: Callable[[], list[int]],
                 form: Callable[[EpochRequest, str], EpochReport | NoPlacement], publish: Callable[[], None],
                 ended: Callable[[str], None] = lambda result: None):
        self.cluster = cluster
        self.cfg = cfg
        self.processes = processes
        self.drains = drains
        self.take_standbys = take_standbys
        self.joiners = joiners
        self.form = form
        self.publish = publish
        self.ended = ended  # told "succeeded" or "failed" as each scale ends (the metric)
        self.op: ScaleOp | None = None
        self.target_ep_size = cfg.ep_size  # what the last finished scale asked for: new agents fill up to it

    def request(self, new_ep_size: int | None, ranks: list[int] | None = None, node: str | None = None,
                param: str = "ranks", start_on: str | None = None) -> dict[str, Any]:
        """Start a scale (control thread): to `new_ep_size`, or retiring the `ranks` named (a
        scale-down that keeps the others), or both when they agree. `node` marks a drain of that
        node; `start_on`: the node a scale-up starts its processes on while it is schedulable (a
        rolling restart's rank restarts where it ran). Raises ScaleRejected: 409 while another
        scale is in flight or before the first epoch, 400 for a size outside the limits or ranks
        not in the group."""
        c = self.cluster
        old = len(c.members)
        limits = scale_limits(c.num_experts, c.slots_per_rank, self.cfg.max_ranks)
        check_idle(self.op)
        if c.epoch < 0:
            raise ScaleRejected("the cluster is still starting; retry once GET /ready answers 200", 409)
        if ranks is not None:
            new_ep_size = check_retiring(ranks, c.intended_ranks(), new_ep_size, limits[0], param)
        assert new_ep_size is not None
        check_target(new_ep_size, old, limits, self.op)
        self.op = ScaleOp(old, new_ep_size, chosen=None if ranks is None else list(ranks), node=node,
                          start_on=start_on)
        return {"old_ep_size": old, "new_ep_size": new_ep_size}

    def drain(self, ranks: list[int] | None, node: str | None) -> dict[str, Any]:
        """Retire the `ranks` named, or every rank of `node` (which is cordoned first); returns
        {"ranks", "node", "old_ep_size", "new_ep_size"}. A node with no rank in the group is only
        cordoned (its standbys stopped, its agent told to stop). Raises ScaleRejected as
        `request`, and 400 for a node no agent registered."""
        c = self.cluster
        if (ranks is None) == (node is None):
            raise ScaleRejected('give "ranks" (rank ids listed by GET /cluster) or "node" (a node name), not both',
                                400, "ranks")
        if node is None:
            return {"ranks": sorted(ranks or []), "node": None, **self.request(None, ranks)}
        if node not in c.agents and node not in c.cordoned:
            raise ScaleRejected(f"no node {node!r}; nodes are {sorted(c.agents)}", 400, "node")
        on_node = [r for r in c.intended_ranks() if c.ranks[r].node == node]
        answer = ({"old_ep_size": len(c.members), "new_ep_size": len(c.members)} if not on_node
                  else self.request(None, on_node, node, param="node"))
        c.cordoned.add(node)
        for r in [r.rank_id for r in c.ranks.values() if r.node == node and r.rank_id not in on_node]:
            self.processes.retire(r, f"its node {node} is drained")
        c.events.add(EventKind.SCALE, f"node {node} cordoned; draining its ranks {on_node}", node=node)
        self.processes.release_if_drained(node)
        self.publish()
        return {"ranks": on_node, "node": node, **answer}

    def uncordon(self, node: str) -> dict[str, Any]:
        """New ranks may start on `node` again (a scale-up, a standby, an agent that registers).
        Raises ScaleRejected 400 when it is not cordoned."""
        c = self.cluster
        if node not in c.cordoned:
            raise ScaleRejected(f"node {node!r} is not cordoned; cordoned nodes are {sorted(c.cordoned)}", 400, "node")
        c.cordoned.discard(node)
        c.events.add(EventKind.SCALE, f"node {node} uncordoned: new ranks may start there", node=node)
        self.publish()
        return {"node": node, "cordoned": False}

    def status(self) -> dict[str, Any]:
        return {**status_view(self.op, len(self.cluster.members)), "target_ep_size": self.target_ep_size}

    def take_target(self, last: dict[str, Any]) -> None:
        """A new leader's target size: the last leader's (its record's `scale`, as `status` gave it)."""
        if isinstance(last.get("target_ep_size"), int) and last["target_ep_size"] > 0:
            self.target_ep_size = last["target_ep_size"]

    def resume(self, last: dict[str, Any], rollout: dict[str, Any]) -> str:
        """A new leader, once its adopting epoch formed: ask again for the scale the last leader's
        `last` status shows in flight (unless its `rollout` was in flight: that ends here). Returns
        what became of it: "none", "resumed", "ended" (a rolling restart's) or "refused" (it no
        longer applies: the ranks it named are gone)."""
        c = self.cluster
        if rollout.get("active"):
            c.events.add(EventKind.SCALE_FAILED, f"the last leader's rolling restart (rank "
                         f"{rollout.get('rank_in_flight')}, {rollout.get('phase')}) ends with the takeover; its scale "
                         "is not resumed: POST /rolling_restart again replaces the ranks still on their old processes")
            return "ended"
        if not last.get("is_scaling_elastic_ep"):
            return "none"
        node, size = last.get("drained_node"), last.get("new_ep_size")
        leaving = last.get("retiring") or last.get("chosen") or None  # `chosen` alone: recorded before it began
        try:
            if node is not None:
                self.drain(None, node)
            else:
                self.request(None if leaving else size, leaving)
                if self.op.up:  # its joiners still loading, adopted as they run, are this scale's
                    self.op.new_ranks = [r for r in last.get("new_ranks") or [] if r in c.ranks
                                         and r not in c.members and c.ranks[r].status == RankStatus.STARTING]
        except ScaleRejected as e:
            c.events.add(EventKind.SCALE_FAILED, f"the last leader's scale {last.get('old_ep_size')} -> {size} "
                         f"({last.get('scale_phase')}) cannot be resumed: {e}")
            return "refused"
        c.events.add(EventKind.SCALE, f"resuming the last leader's scale {last.get('old_ep_size')} -> {size} (it was "
                     f"{last.get('scale_phase')})" + (f": draining node {node}" if node else "") +
                     (f": ranks {leaving} leave" if leaving and not node else ""), resumed=True)
        return "resumed"

    @property
    def active(self) -> bool:
        return self.op is not None and self.op.active

    def joiner(self, rank_id: int) -> bool:
        """Started by the scale in flight."""
        return self.active and rank_id in self.op.new_ranks  # type: ignore[union-attr]

    def leaves(self, rank_id: int) -> bool:
        """Chosen to leave by a scale-down, or started by a scale-up that failed."""
        op = self.op
        return op is not None and (rank_id in op.retiring or (op.phase == "failed" and rank_id in op.new_ranks))

    def fail(self, error: str) -> None:
        op = self.op
        assert op is not None
        c = self.cluster
        op.finish("failed", error)
        self.ended("failed")
        c.events.add(EventKind.SCALE_FAILED, f"scale {op.old_ep_size} -> {op.new_ep_size} failed: {error}")
        for r in op.new_ranks:
            if r in c.ranks and r not in c.members and c.ranks[r].status != RankStatus.RETIRING:
                self.processes.stop_rank(r)
        self.drains.undrain(op.retiring)
        for r in op.retiring:
            if r in c.ranks and c.ranks[r].status == RankStatus.DRAINING:
                c.ranks[r].status = RankStatus.SERVING
        op.retiring = []
        self.publish()

    def advance(self) -> bool:
        """Move the scale on at a step boundary; True when it changed the epoch."""
        op = self.op
        assert op is not None
        cfg = self.cfg
        if time.monotonic() - op.started_at > cfg.elastic_ep_scale_timeout_s:
            self.fail(f"not serving at {op.new_ep_size} ranks within --elastic-ep-scale-timeout "
                      f"{cfg.elastic_ep_scale_timeout_s:g}s; check the new ranks' logs")
            return False
        if op.phase == "pending":
            self._begin(op)
            return False
        return self._advance_up(op) if op.up else self._advance_down(op)

    def _begin(self, op: ScaleOp) -> None:
        c = self.cluster
        intended = c.intended_ranks()
        if op.up:
            rank_nodes = c.rank_nodes()
            coming = op.new_ranks  # on their way already (counted in `intended`): a resumed scale's
            count = max(op.new_ep_size - len(intended), 0)
            standbys = self.take_standbys(count)  # registered and warm: they join without a process start
            fresh = new_rank_ids(c.ranks, count - len(standbys))
            if fresh and not c.schedulable_agents():
                self.fail(f"every node is cordoned ({sorted(c.cordoned)}); POST /uncordon one to start ranks on it")
                return
            op.new_ranks = coming + standbys + fresh
            for rank_id in fresh:
                node = op.start_on if op.start_on in c.schedulable_agents() else \
                    agent_for_new_rank(c.schedulable_agents(), rank_nodes)
                rank_nodes[rank_id] = node
                self.processes.start_new_rank(rank_id, node)
            op.phase = "joining"
            c.events.add(EventKind.SCALE, f"scale-up {op.old_ep_size} -> {op.new_ep_size}: "
                         + (f"ranks {coming} on their way, " if coming else "")
                         + f"standby ranks {standbys}, starting ranks {fresh}", standbys=standbys)
        else:
            op.retiring = ranks_leaving(op, intended)
            for rank_id in op.retiring:
                if rank_id not in c.members:  # down and waiting for a restart: nothing to drain
                    self.processes.forget_rank(rank_id, f"rank {rank_id} retired while down")
            op.retiring = [r for r in op.retiring if r in c.members]
            for rank_id in op.retiring:
                c.ranks[rank_id].status = RankStatus.DRAINING
            self.drains.drain(op.retiring)
            op.drain_deadline = time.monotonic() + self.cfg.scale_drain_timeout_s
            op.phase = "draining"
            c.events.add(EventKind.SCALE,
                         f"scale-down {op.old_ep_size} -> {op.new_ep_size}: draining ranks {op.retiring}")
        self.publish()

    def _advance_up(self, op: ScaleOp) -> bool:
        c = self.cluster
        registered = [r for r in op.new_ranks if c.ranks[r].hello is not None]
        if len(registered) < len(op.new_ranks):
            op.phase = "waiting_for_cohort" if registered else "joining"
            return False
        op.phase = "configuring_data_plane"
        self.publish()
        live = sorted(set(c.members) | set(op.new_ranks) | set(self.joiners()))
        if not self._step(ScaleStep(live), f"scale-up to {len(live)} ranks"):
            return False
        if all(c.ranks[r].status == RankStatus.SERVING for r in op.new_ranks):
            op.phase = "syncing_new_world"
            self._finish(op, "serving_expanded")
        return True

    def _advance_down(self, op: ScaleOp) -> bool:
        c, cfg = self.cluster, self.cfg
        busy = [r for r in op.retiring if self.drains.num_requests(r)]
        if op.phase == "draining" and busy and time.monotonic() < op.drain_deadline:
            return False
        if op.phase == "draining":
            drained_s = time.monotonic() - op.drain_deadline + cfg.scale_drain_timeout_s
            c.events.add(EventKind.DRAINED, f"ranks {op.retiring} drained in {drained_s:.2f}s; {len(busy)} of them "
                         f"still ran requests, which move to the staying ranks", moved_from=busy)
        op.phase = "retiring"
        self.publish()
        keep = [r for r in c.members if r not in op.retiring]
        if op.retiring:
            # The leaving ranks stay in this epoch only to send the experts no one else holds.
            moved = self._step(ScaleStep(list(c.members), holding=keep),
                               f"scale-down: moving experts off ranks {op.retiring}")
            if not (moved and self._step(ScaleStep(keep, target=trimmed(c.location, max(cfg.ep_size, max(keep) + 1))),
                                         f"scale-down to {len(keep)} ranks")):
                return moved
        for r in op.retiring:
            self.processes.stop_rank(r)
        self._finish(op, "serving_shrunk")
        return True

    def _step(self, request: ScaleStep, reason: str) -> bool:
        """One epoch of the scale; False when no placement exists over its ranks, which fails the
        scale (the old epoch serves on). Raises RecoveryNeeded when the epoch did not form."""
        outcome = self.form(request, reason)
        if isinstance(outcome, NoPlacement):
            self.fail(outcome.reason)
            return False
        return True

    def _finish(self, op: ScaleOp, phase: str) -> None:
        op.finish(phase)
        self.ended("succeeded")
        self.target_ep_size = op.new_ep_size
        self.cluster.events.add(EventKind.SCALE, f"serving at {len(self.cluster.members)} ranks "
                                f"{op.finished_s:.2f}s after the request")
        self.publish()
