"""What the controller knows about each rank and each node agent.

A rank's `state`: starting (process up, not in an epoch yet), serving, fencing (its agent is
killing it), fenced (killed on the controller's order), dead (exited on its own).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic_ep.placement.location import ExpertLocation

from .messages import BackupSite, Progress, WorkerHello


def _percentiles_ms(values) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64) * 1000
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3)}


@dataclass
class RankState:
    rank_id: int
    node: str
    pid: int | None = None
    state: str = "starting"
    last_heartbeat: float = 0.0
    progress: Progress = field(default_factory=Progress)
    step_s: deque = field(default_factory=lambda: deque(maxlen=256))
    wait_s: deque = field(default_factory=lambda: deque(maxlen=256))
    own_s: deque = field(default_factory=lambda: deque(maxlen=256))
    slot_tokens: deque = field(default_factory=lambda: deque(maxlen=64))
    hello: WorkerHello | None = None

    def view(self, location: ExpertLocation | None, total_slots: int, requests: int, delay_s: float,
             now: float) -> dict[str, Any]:
        """This rank in /cluster: identity, state, slots (experts per MoE layer), timing."""
        experts = (location.experts_of_rank(self.rank_id).tolist()
                   if location is not None and self.rank_id < location.num_ranks else [])
        used = sum(1 for layer in experts for e in layer if e >= 0)
        return {
            "rank_id": self.rank_id, "node": self.node, "pid": self.pid, "state": self.state,
            "slots": {"used": used, "total": total_slots, "experts": experts},
            "requests": requests,
            "step_ms": _percentiles_ms(self.step_s), "wait_ms": _percentiles_ms(self.wait_s),
            "own_ms": _percentiles_ms(self.own_s),
            "heartbeat_age_s": round(now - self.last_heartbeat, 3) if self.last_heartbeat else None,
            "progress": vars(self.progress),
            # the per-rank gate: requests go to a rank only once it serves in a verified epoch
            "ready": self.state == "serving",
            "dense_source": self.hello.dense_source if self.hello is not None else None,
            "slow_delay_s": delay_s,
        }


@dataclass
class AgentState:
    node: str
    identity: bytes
    fetch_addr: str
    num_ranks: int
    auto_recover: bool = False
    backup: BackupSite | None = None
    backup_experts: list[tuple[int, int]] = field(default_factory=list)
