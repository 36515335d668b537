"""What the controller knows about each rank and each node agent, the one list of rank states,
and the one list of liveness values.

A rank has two separate fields: its `RankStatus` (where it is in its life: what the controller
decided and did, changed only by the control loop's actions) and, while its process should be
running, its `Liveness` (what the controller observes this moment: heartbeats and progress, which
can change every heartbeat and decides nothing by itself). A serving rank can be stalled: a hang
with long fencing deadlines is visible at once, before any action is taken.

Everything here is written by the control thread only; `/cluster`, the dashboard, the doctor and
the docs show `RankStatus` and `Liveness` values as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from msgspec.structs import asdict

from elastic_ep.wire import BackupSite, Progress, WorkerHello

_RECORDS = itertools.count()  # RankInfo.record: one number per record made in this process


class RankStatus(str, Enum):
    """A rank's state. Who sets it, and when:

    - STARTING: its agent reported the process up (`WorkerStarted`); it loads its weights and
      registers (`WorkerHello`), then waits outside the group until an epoch admits it
      (start, rejoin, scale-up). Heartbeats are watched once it has registered.
    - STANDBY: registered (loaded and warmed up) and kept outside the group as a warm spare
      (`--standby-ranks`, control/membership/standbys.py): never admitted as a joiner by itself; a fault,
      an eviction or a scale-up takes it into the next epoch instead of starting a process.
      Watched like a member; one that dies or goes silent is stopped and replaced, never a fault.
    - SERVING: a member of the current verified epoch that holds experts and takes requests.
    - DRAINING: a member that takes no new requests: it leaves with a scale-down, and in the
      epoch that moves its experts away it only sends.
    - FENCING: a fault named it; its agent was told to SIGKILL it and has not confirmed yet.
    - FENCED: killed on the controller's order (confirmed). Restarted after --restart-delay-s
      (or by its agent with --auto-recover), taken over by a `--join-mode recover` agent, or
      left down.
    - DEAD: exited on its own (crash, OOM kill), or its fence was never confirmed within
      --fence-timeout-s. Handled like FENCED.
    - RETIRING: leaving the cluster for good (scale-down, or a joiner of a failed scale); never a
      fault, never restarted; dropped from `/cluster` once its process is gone.
    """

    STARTING = "starting"
    STANDBY = "standby"
    SERVING = "serving"
    DRAINING = "draining"
    FENCING = "fencing"
    FENCED = "fenced"
    DEAD = "dead"
    RETIRING = "retiring"

    @property
    def down(self) -> bool:
        """The process is gone (or being killed): not a member of any later epoch until restarted."""
        return self in (RankStatus.FENCED, RankStatus.DEAD)


class Liveness(str, Enum):
    """What a rank's heartbeats and progress show now (`control/faults/health_rules.py` `rank_liveness` decides):

    - LIVE: heartbeats on time, and not holding up a step.
    - SUSPECT: its heartbeat is late (--heartbeat-suspect-s) but not yet for the stall deadline.
    - WAITING: the step in flight has stalled and this rank waits inside a collective: a victim
      of another rank, or of a cut link when every rank waits.
    - STALLED: no heartbeat for the stall deadline (stopped, frozen, cut off), or the step has
      stalled while this rank is outside every collective: it holds the others up.
    The stall deadline is max(--stall-floor-s, --stall-multiple x median recent step time); the
    fencing deadlines (--heartbeat-timeout-s, --watchdog-floor-s) act later and on their own.
    """

    LIVE = "live"
    SUSPECT = "suspect"
    WAITING = "waiting"
    STALLED = "stalled"


@dataclass(frozen=True)
class RankLiveness:
    """A rank's liveness, for how long it has been stalled or waiting (s), and why."""

    state: Liveness
    stalled_s: float | None = None
    reason: str = ""


def safe_to_terminate(member: bool, requests: int) -> bool:
    """Whether killing a rank's process costs the service nothing: no epoch waits on it (it is
    not a member: a standby, a rank that left the group, one down or not yet admitted) and it
    runs no request. A member is never safe, even one whose experts others also hold: its loss
    is a fault, and the group pauses until recovery forms a new epoch."""
    return not member and requests == 0


@dataclass
class RankInfo:
    """One rank (worker process): where it runs, its state, its last heartbeat and progress.
    `record` tells this record from any other of its rank id: its recent per-step timings are kept
    in `ClusterState.timings` (control/rank_timings.py) under it, so a new record starts with none."""

    rank_id: int
    node: str
    pid: int | None = None
    status: RankStatus = RankStatus.STARTING
    last_heartbeat: float = 0.0  # on the heard clock (ControlPlane.heard_clock), as progress_at
    progress: Progress = field(default_factory=Progress)
    progress_at: float = 0.0  # when `progress` last changed
    hello: WorkerHello | None = None
    spare: bool = False  # started as a standby (control/membership/standbys.py) until a membership takes it
    record: int = field(default_factory=lambda: next(_RECORDS), compare=False)

    @property
    def watched(self) -> bool:
        """Its process should be running and beating: a member, or registered and waiting to join."""
        return self.status in (RankStatus.SERVING, RankStatus.DRAINING, RankStatus.STANDBY) or (
            self.status == RankStatus.STARTING and self.hello is not None)

    def view(self, experts: list[list[int]], used: int, total_slots: int, requests: int, delay_s: float,
             now: float, liveness: RankLiveness | None = None, verdict: dict[str, Any] | None = None,
             timing: Mapping[str, dict[str, float] | None] | None = None) -> dict[str, Any]:
        """This rank in /cluster: identity, state, liveness, slots (`experts`: [L][slots] the experts it
        holds per MoE layer, `used` of them occupied), timing (`step_ms`, `wait_ms`, `own_ms`,
        `link_ms`: the percentiles of its recent steps, `RankTimings.percentiles_ms`), straggler
        verdict."""
        timing = timing or {}
        return {
            "rank_id": self.rank_id, "node": self.node, "pid": self.pid, "state": self.status.value,
            "slots": {"used": used, "total": total_slots, "experts": experts},
            "requests": requests,
            "step_ms": timing.get("step_ms"), "wait_ms": timing.get("wait_ms"), "own_ms": timing.get("own_ms"),
            # the controller <-> rank round trip less the step: a rank behind a slow link shows here (slow, not dead)
            "link_ms": timing.get("link_ms"),
            "heartbeat_age_s": round(now - self.last_heartbeat, 3) if self.last_heartbeat else None,
            "progress": asdict(self.progress),
            "progress_age_s": round(now - self.progress_at, 3) if self.progress_at else None,
            "last_collective": (f"#{self.progress.seq} of epoch {self.progress.epoch}, now at step "
                                f"{self.progress.step} layer {self.progress.layer} {self.progress.phase}"
                                if self.progress.seq else None),
            "liveness": None if liveness is None else {
                "state": liveness.state.value, "stalled_s": liveness.stalled_s, "reason": liveness.reason},
            "verdict": verdict,
            # the per-rank gate: requests go to a rank only once it serves in a verified epoch
            "ready": self.status == RankStatus.SERVING,
            "dense_source": self.hello.dense_source if self.hello is not None else None,
            "version": self.hello.version if self.hello is not None else None,
            "slow_delay_s": delay_s,
        }


@dataclass
class AgentInfo:
    """One node agent: its control-plane identity and session, its host address, its fetch
    address (backup and dense weights), how many ranks it offers, when it was last heard
    (monotonic), and its host-memory backup once written."""

    node: str
    identity: bytes
    fetch_addr: str
    num_ranks: int
    auto_recover: bool = False
    session: str = ""
    host: str = ""
    last_alive: float = 0.0  # its last AgentAlive (or hello), on the heard clock (ControlPlane.heard_clock)
    standalone: bool = True
    stalled: bool = False  # an in-process agent silent past --agent-timeout-s (Nodes.check_agents)
    alive_heard: bool = False  # an AgentAlive of its session came: its welcome reached it
    backup: BackupSite | None = None
    backup_experts: list[tuple[int, int]] = field(default_factory=list)
    zygote: str = "unknown"  # its worker zygote as its last AgentAlive said (wire/codec.py `ZygoteState`)
