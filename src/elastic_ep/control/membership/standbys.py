"""Warm standby ranks (`--standby-ranks K`): worker processes started, loaded and warmed up outside
the group, so that replacing a lost or evicted rank, or growing the group by one, is an epoch
change instead of a process start (Python, torch, the dense weights: seconds).

- which registered ranks join: the group takes ranks from outside only up to its target size
  (`--ep-size`, or the last finished scale): restarted members first, then standbys, then spares
  that just registered (`joiners`). Whatever registered beyond that becomes a STANDBY at the
  next step boundary (`park`) and is never admitted by itself.
- who takes one: recovery (a fault or an eviction leaves the group short of its target, so the
  next epoch takes a standby), a rejoin at a step boundary, and a scale-up (`take`).
- upkeep: with K > 0, at each step boundary of a ready cluster, processes are started on the
  agents running the fewest ranks until the ranks outside the group, on their way there (started,
  or down and due to restart) and standing by, cover the group's shortfall plus K. An evicted
  rank is never restarted (its card is suspect): a new process replaces it, whatever K is. A standby that
  dies or stops beating is stopped and replaced, never treated as a fault of the group.
The decisions are the pure `admission` below; this role applies them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..cluster import ClusterState
from ..events import EventKind
from ..ranks import RankInfo, RankStatus
from .scale_rules import agent_for_new_rank, new_rank_ids


@dataclass(frozen=True)
class Admission:
    """admit: ranks the next epoch takes; park: registered ranks left over, to stand by."""

    admit: list[int]
    park: list[int]


def admission(registered: Sequence[RankInfo], standbys: Sequence[int], shortfall: int) -> Admission:
    """Of the registered ranks outside the group (restarted members first, spares after) and the
    standbys, the first `shortfall` join; the registered ones left over stand by."""
    fresh = sorted(registered, key=lambda r: (r.spare, r.rank_id))
    order = [r.rank_id for r in fresh if not r.spare] + sorted(standbys) + [r.rank_id for r in fresh if r.spare]
    admit = order[:max(shortfall, 0)]
    return Admission(admit, [r.rank_id for r in fresh if r.rank_id not in admit])


def processes_to_start(wanted: int, shortfall: int, coming: int) -> int:
    """How many spare processes to start so that the ranks standing by or on their way (`coming`)
    cover the group's shortfall plus `wanted` standbys."""
    return max(wanted + max(shortfall, 0) - coming, 0) if wanted > 0 else 0


class Processes(Protocol):
    """The rank processes (membership/nodes.py)."""

    def start_new_rank(self, rank_id: int, node: str, spare: bool = False) -> None: ...
    def retire(self, rank_id: int, reason: str) -> None: ...
    def restarting(self, rank_id: int) -> bool: ...


class Standbys:
    """Built with the cluster state, `wanted` (--standby-ranks), the rank processes, and the
    callables `target_size()` (the group's target), `joiner(rank_id)` (started by the scale in
    flight) and `faulted(rank_id)` (a fault is pending)."""

    def __init__(self, cluster: ClusterState, wanted: int, processes: Processes, *, target_size: Callable[[], int],
                 joiner: Callable[[int], bool], faulted: Callable[[int], bool]):
        self.cluster = cluster
        self.wanted = wanted
        self.processes = processes
        self.target_size = target_size
        self.joiner = joiner
        self.faulted = faulted
        self.owed: list[int] = []  # evicted ranks whose replacement is still to start

    def ready(self) -> list[int]:
        return sorted(r.rank_id for r in self.cluster.ranks.values() if r.status == RankStatus.STANDBY)

    def shortfall(self, live: Sequence[int]) -> int:
        return self.target_size() - len(live)

    def joiners(self, live: Sequence[int]) -> list[int]:
        """The ranks from outside the next epoch over `live` takes (not a scale's own joiners)."""
        return admission(self._registered_outside(), self._free(self.ready()), self.shortfall(live)).admit

    def park(self) -> None:
        """At a step boundary: registered ranks the group does not need stand by."""
        c = self.cluster
        for rank_id in admission(self._registered_outside(), [], self.shortfall(c.members)).park:
            r = c.ranks[rank_id]
            r.status, r.spare = RankStatus.STANDBY, True
            c.events.add(EventKind.STANDBY, f"rank {rank_id} stands by (loaded and warm, outside the group of "
                         f"{len(c.members)})", rank_id, standbys=len(self.ready()))

    def take(self, count: int) -> list[int]:
        """Up to `count` standbys for a scale-up (they are registered: the scale admits them at once)."""
        return self.ready()[:count]

    def admitted(self, live: Sequence[int]) -> None:
        """Members are no spares any more."""
        for r in live:
            self.cluster.ranks[r].spare = False

    def replace_later(self, rank_id: int) -> None:
        """An evicted rank is replaced by a new process at the next step boundary (after the
        recovery that fences it: starting a process first would slow the fence down)."""
        self.owed.append(rank_id)

    def upkeep(self) -> None:
        """Start the replacements owed, and spare processes until standbys and ranks on their way
        cover the shortfall plus K."""
        c = self.cluster
        members = set(c.members)  # once per step: a list's `in` per rank was 256 x 256 comparisons a step
        coming = [r for r in c.ranks.values() if r.rank_id not in members and not self.joiner(r.rank_id)
                  and (r.status in (RankStatus.STANDBY, RankStatus.STARTING) or self.processes.restarting(r.rank_id))]
        spares = processes_to_start(self.wanted, self.shortfall(c.members), len(coming))
        why = (f"to replace evicted rank(s) {self.owed}" if self.owed else f"to keep {self.wanted} standby rank(s)")
        for _ in range(max(spares, len(self.owed))):
            self.start_spare(why)
        self.owed = []

    def start_spare(self, why: str) -> int | None:
        """Start one process on the agent running the fewest ranks (not a cordoned one); it stands
        by or joins once it registers. None when no agent is there to start it."""
        c = self.cluster
        nodes = c.schedulable_agents()
        if not nodes:
            return None
        node = agent_for_new_rank(nodes, c.rank_nodes())
        rank_id = new_rank_ids(c.ranks, 1)[0]
        self.processes.start_new_rank(rank_id, node, spare=True)
        c.events.add(EventKind.STANDBY, f"starting rank {rank_id} on node {node} {why}", rank_id, node=node)
        return rank_id

    def lost(self, rank_id: int, detail: str) -> None:
        """A standby died or went silent: stop it for good (its exit report removes it); the
        upkeep starts another."""
        self.processes.retire(rank_id, f"standby lost: {detail}")
        self.cluster.events.add(EventKind.STANDBY, f"standby rank {rank_id} lost: {detail}", rank_id)

    def _registered_outside(self) -> list[RankInfo]:
        c = self.cluster
        return [c.ranks[r] for r in self._free(c.registered_outside())]

    def _free(self, ranks: list[int]) -> list[int]:
        """Not a pending fault, not a joiner of the scale in flight."""
        return [r for r in ranks if not self.faulted(r) and not self.joiner(r)]
