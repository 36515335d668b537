"""Cluster state: what several roles read (ranks, agents, the epoch and its members, the placement,
readiness, the event log), with the queries they ask of it and the `/cluster` snapshot.

Owned by the control thread: other threads only ever see the snapshot it publishes. When a rank
dies, hangs or is slow nothing here reacts; the detector names it, recovery asks for a new epoch.
`ClusterState` lists who writes each field; the other roles only read it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from elastic_ep.placement.location import ExpertLocation
from elastic_ep.wire import BackupSite

from .api import Readiness
from .cold_start import LoadLedger
from .events import EventLog
from .rank_timings import RankTimings
from .ranks import AgentInfo, RankInfo, RankLiveness, RankStatus, safe_to_terminate

TIMING_FIELDS = {"step_ms": "step_s", "wait_ms": "wait_s", "own_ms": "own_s", "link_ms": "link_s"}  # /cluster <- series


class PlacementView:
    """A placement's JSON parts for /cluster: the slot map (`ExpertLocation.slot_map_dict`: no
    log2phy, whose padding to the hottest expert's replicas made /cluster 64 MB after 10 minutes at 1,024 ranks;
    a reader rebuilds it with `ExpertLocation.from_json`), and each rank's experts per MoE layer
    with the number of its slots in use (built when first asked for: a Python count over a rank's
    [L][slots] at every snapshot was 15 ms of a 1,024-rank publish's 39)."""

    def __init__(self, location: ExpertLocation | None):
        self.location = location
        self.placement = location.slot_map_dict() if location is not None else None
        self._slots: dict[int, tuple[list[list[int]], int]] = {}

    def slots_of(self, rank_id: int) -> tuple[list[list[int]], int]:
        """([L][slots_per_rank] experts of the rank, its slots in use); ([], 0) when the placement has
        no such rank."""
        loc = self.location
        if loc is None or rank_id >= loc.num_ranks:
            return [], 0
        if rank_id not in self._slots:
            experts = loc.experts_of_rank(rank_id)
            self._slots[rank_id] = experts.tolist(), int((experts >= 0).sum())
        return self._slots[rank_id]


class ClusterState:
    """num_layers: MoE layers; slots_per_rank: expert slots per rank and layer.

    Who writes what:
    - `ranks`, `agents`, `device_kind`, `backup_*`: the node role (membership/nodes.py), which
      creates and drops rank records and moves a process through starting / fencing / fenced /
      dead / retiring. A rank's `status` is also set where the group decides it: the epoch change
      (serving, draining, as the new epoch holds it), the scale driver (draining before a
      scale-down, serving again when it fails) and the standbys (standby, `spare`).
    - `epoch`, `members`, `location`: the epoch change (epochs/epoch_change.py) alone.
    - a rank's heartbeat and progress (`last_heartbeat`, `progress`, `progress_at`): the
      detector as heartbeats arrive (the node role stamps them when a process starts and
      registers); its timings in `timings` (`step_s`, `wait_s`, `own_s`, `slot_tokens`, `link_s`,
      control/rank_timings.py): the step loop.
    - `step`: the step loop (serving/step_loop.py) alone.
    - `readiness`, `degraded_since`: the loop (ready once an epoch forms, the fatal reason),
      recovery (degraded), the node role while ranks register and the sleep mode (not ready
      while asleep).
    - `cordoned`: the scale driver (a node drain cordons, `POST /uncordon` lifts it); the node
      role starts no rank on a cordoned node and stops its agent once it has no rank left.
    - `events`: every role appends; nothing edits an event.
    """

    def __init__(self, num_layers: int, num_experts: int, slots_per_rank: int):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.slots_per_rank = slots_per_rank
        self.ranks: dict[int, RankInfo] = {}
        self.timings = RankTimings()  # every rank's recent step timings, by rank id and record
        self.agents: dict[str, AgentInfo] = {}
        self.epoch = -1
        self.members: list[int] = []
        self.location: ExpertLocation | None = None
        self.step = 0
        self._view: PlacementView | None = None
        self.cache_placement_view = True  # benchmarks/control_plane.py --before: False
        self.events = EventLog()
        self.readiness = Readiness(False, "starting: waiting for ranks to register")
        self.degraded_since: float | None = None
        # The host-memory backup, for saying why an expert came from disk (`why_disk`):
        self.backup_off = "the backup is written once the first epoch serves"  # "" when on
        self.backup_progress: dict[str, tuple[int, int]] = {}  # node -> (experts written, share) while writing
        self.backup_lost: dict[str, str] = {}  # node -> why its backup can no longer be used
        # What every rank computes on, "cpu" or "cuda": the first rank to register decides (under
        # --device auto a node whose GPUs are gone would otherwise serve on its CPU, far behind the
        # others, with checksums of another kind).
        self.device_kind: str | None = None
        self.cordoned: set[str] = set()  # nodes drained: no new rank starts on them
        self.loads = LoadLedger()  # bytes each node loaded, by source (cold_start.py)

    # ---- queries ---------------------------------------------------------------------------

    @property
    def min_ranks(self) -> int:
        """The fewest ranks whose slots hold every expert once."""
        return -(-self.num_experts // self.slots_per_rank)

    def can_serve(self, ranks: Iterable[int]) -> bool:
        return len(list(ranks)) >= self.min_ranks

    def rank_nodes(self) -> dict[int, str]:
        return {r.rank_id: r.node for r in self.ranks.values()}

    def member_nodes(self) -> dict[str, list[int]]:
        """The members of the current epoch by node: the host groups of the hierarchical all-to-all."""
        nodes: dict[str, list[int]] = {}
        for r in self.members:
            nodes.setdefault(self.ranks[r].node, []).append(r)
        return nodes

    def schedulable_agents(self) -> list[str]:
        """Nodes a new rank may start on: every agent's but the cordoned ones."""
        return [node for node in self.agents if node not in self.cordoned]

    def registered_outside(self) -> list[int]:
        """Ranks that registered and wait outside the group (restarted or new)."""
        return sorted(r.rank_id for r in self.ranks.values()
                      if r.hello is not None and r.status == RankStatus.STARTING and r.rank_id not in self.members)

    def intended_ranks(self) -> list[int]:
        """Ranks meant to serve: members plus ranks starting or waiting to be restarted (not
        standbys: they are spares)."""
        return sorted(r.rank_id for r in self.ranks.values()
                      if r.status not in (RankStatus.RETIRING, RankStatus.STANDBY) and not r.spare)

    def down_ranks(self) -> list[int]:
        return sorted(r.rank_id for r in self.ranks.values() if r.status.down)

    def backup_sites(self) -> dict[str, BackupSite]:
        return {a.node: a.backup for a in self.agents.values() if a.backup is not None}

    def backup_map(self) -> dict[tuple[int, int], str]:
        """(layer, expert) -> the node whose backup holds it."""
        return {tuple(item): a.node for a in self.agents.values() if a.backup is not None for item in a.backup_experts}

    def why_disk(self) -> str:
        """Why a transfer plan reads experts from disk: the backup is off, still being written,
        or gone with its node; else no backup holds them."""
        if self.backup_off:
            return self.backup_off
        why = [f"node {n}'s backup is still being written ({done} of {share} experts)"
               for n, (done, share) in self.backup_progress.items()]
        why += [f"node {n}'s backup is gone: {reason}" for n, reason in self.backup_lost.items()]
        return "; ".join(why) or "no node's backup holds these experts"

    def dense_site(self, node: str) -> BackupSite | None:
        """An agent with the dense weights in host memory: the rank's own node first."""
        sites = list(self.backup_sites().values())
        return next((s for s in sites if s.node == node), sites[0] if sites else None)

    def set_readiness(self, ready: bool, reason: str = "") -> None:
        """Ready clears `degraded_since`; recovery sets it when it degrades."""
        self.readiness = Readiness(ready, reason)
        if ready:
            self.degraded_since = None

    # ---- /cluster ----------------------------------------------------------------------------

    def _placement_view(self) -> PlacementView:
        """The placement as /cluster shows it, built once per placement (it changes only with an epoch)."""
        if self._view is None or self._view.location is not self.location or not self.cache_placement_view:
            self._view = PlacementView(self.location)
        return self._view

    def snapshot(self, requests_of: Callable[[int], int], slow_delays: Mapping[int, float], controller_addr: str,
                 deadlines: dict[str, float], readiness: Readiness, liveness: Mapping[int, RankLiveness],
                 heard: float, verdicts: Mapping[int, dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The JSON of GET /cluster (see control/api.py `Engine.cluster` for the fields); injected
        delay per rank (chaos), `readiness` as published (it adds the stall check to
        `self.readiness`), liveness of running ranks, the heard clock (ages of heartbeats and
        progress), straggler verdicts of members, `extra` top-level fields (`scale` among them)."""
        total_slots = self.slots_per_rank * self.num_layers
        placement = self._placement_view()
        infos = sorted(self.ranks.values(), key=lambda r: r.rank_id)
        ids, records = [r.rank_id for r in infos], [r.record for r in infos]
        timings = [dict(zip(TIMING_FIELDS, per_rank, strict=True)) for per_rank in zip(
            *(self.timings.percentiles_ms(series, ids, records) for series in TIMING_FIELDS.values()),
            strict=True)] if infos else []
        members = set(self.members)  # a list's `in` per rank was quadratic in the ranks (1,024: ~0.5 M compares)
        ranks = [{**r.view(*placement.slots_of(r.rank_id), total_slots, requests_of(r.rank_id),
                           slow_delays.get(r.rank_id, 0.0), heard, liveness.get(r.rank_id), verdicts.get(r.rank_id),
                           timing),
                  "safe_to_terminate": safe_to_terminate(r.rank_id in members, requests_of(r.rank_id))}
                 for r, timing in zip(infos, timings, strict=True)]
        node_busy = {r.node for r in self.ranks.values() if r.rank_id in members or requests_of(r.rank_id)}
        return {
            "time_s": time.time(), "epoch": self.epoch, "ep_size": len(self.members), "members": list(self.members),
            "controller": controller_addr, "slots_per_rank": self.slots_per_rank, "ranks": ranks,
            "ready": readiness.ready, "reason": readiness.reason, "deadlines": deadlines,
            "step": self.step, **extra,
            "agents": [{"node": a.node, "host": a.host, "ranks": a.num_ranks, "standalone": a.standalone,
                        "backup": a.backup is not None, "fetch": a.fetch_addr, "cordoned": a.node in self.cordoned,
                        "zygote": a.zygote,
                        "safe_to_terminate": a.node not in node_busy} for a in self.agents.values()],
            "cordoned": sorted(self.cordoned),
            "placement": placement.placement,
            "events": self.events.all(),
        }
