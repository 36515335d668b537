"""Rolling restart: which process goes next and how, whether a rollout can start at all, and where it
stands (`/cluster`'s "rollout", GET /rolling_restart). The driver is rolling_restart.py.

Every worker process running when `POST /rolling_restart` arrives (members and standbys) is
replaced once, one at a time, by a process started with the new options (`ROLLOUT_OPTIONS`) and
with the elastic-ep installed on its node now (a new process imports the code afresh: that is
how a new version rolls out). A process is "old" while its rank still runs the pid it had then;
one that died and was restarted during the rollout already runs the new options and counts as
replaced. The next turn (`next_turn`):

- an old standby first (`standby`): it is retired; the standby upkeep starts a new one;
- an old member, with --standby-ranks > 0 (`surge`): once a new standby is ready (`wait` until
  then), it joins (a scale-up by one), then the member drains and stops (a scale-down naming
  it): the group never has fewer ranks than when the rollout began;
- without standbys (or no room: --max-ep-size), when one rank fewer still holds every expert
  (`restart`): the member drains and stops, then a new process starts on its node and rejoins
  (a scale-up by one); the group is one rank short meanwhile;
- else it cannot go on (`stuck`: the request is refused with 409 when that is already so when
  it arrives).

Steps of the rank in flight (`PLANS`): standby: retiring_standby; surge: taking_standby ->
draining -> stopping; restart: draining -> stopping -> starting. States of a rollout: running
-> done | failed, and aborting -> aborted after an abort: the rank in flight finishes its plan
(its replacement serves, the group is whole again), no later rank is touched.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The per-worker options a rollout may change (WorkerLaunch fields, named as serve's flags but
# `model_dir` for --model): where the checkpoint is read from (the same model: rolling_restart.py
# checks its config and tensors), and the KV pool's size, fixed when a worker starts.
ROLLOUT_OPTIONS = ("model_dir", "kv_cache_memory", "gpu_memory_utilization", "num_gpu_blocks_override")
PLANS: dict[str, tuple[str, ...]] = {
    "standby": ("retiring_standby",),
    "surge": ("taking_standby", "draining", "stopping"),
    "restart": ("draining", "stopping", "starting"),
}
DONE_STATES = ("done", "aborted", "failed")


@dataclass(frozen=True)
class GroupView:
    """What the next turn depends on. old_standbys / old_members: ranks still running the process
    they had when the rollout began (in the order they go); new_standbys: standbys started since;
    size: the members now; fewest: the ranks that hold every expert; most: --max-ep-size;
    standbys_wanted: --standby-ranks."""

    old_standbys: Sequence[int]
    old_members: Sequence[int]
    new_standbys: Sequence[int]
    size: int
    fewest: int
    most: int
    standbys_wanted: int


@dataclass(frozen=True)
class Turn:
    """The next rank (None when done) and its plan: standby, surge, restart, wait or stuck (`reason` says why)."""

    rank_id: int | None
    plan: str
    reason: str = ""


def next_turn(view: GroupView) -> Turn:
    """Which process is replaced next, and how (see the module docstring)."""
    if view.old_standbys:
        return Turn(view.old_standbys[0], "standby")
    if not view.old_members:
        return Turn(None, "done")
    rank = view.old_members[0]
    grows = view.size + 1 <= view.most
    if view.new_standbys and grows:
        return Turn(rank, "surge")
    if view.standbys_wanted > 0 and grows:
        return Turn(rank, "wait", f"waiting for a new standby to register: it takes rank {rank}'s place before "
                                  "that leaves")
    if view.size - 1 >= view.fewest:
        return Turn(rank, "restart")
    return Turn(rank, "stuck", f"the group has {view.size} ranks and {view.fewest} are needed to hold every expert: "
                               f"rank {rank} cannot leave to restart and no standby can take its place; start serve "
                               "with --standby-ranks 1 (and --max-ep-size above the group), or scale up first "
                               "(POST /scale_elastic_ep)")


def refusal(view: GroupView) -> str:
    """Why a rollout over `view` cannot even begin ("" when it can): its first member could never
    leave, not even once a standby the upkeep starts is ready."""
    turn = next_turn(GroupView([], view.old_members, [-1] if view.standbys_wanted else [], view.size, view.fewest,
                               view.most, view.standbys_wanted))
    return turn.reason if turn.plan == "stuck" else ""


def old_processes(pids: Mapping[int, int | None], old: Mapping[int, int]) -> list[int]:
    """The ranks of `old` (rank -> pid when the rollout began) still running that pid; `pids`:
    every rank's pid now."""
    return sorted(r for r, pid in old.items() if pids.get(r) == pid)


@dataclass
class RolloutOp:
    """One rolling restart: `old` rank -> pid to replace, `options` the WorkerLaunch fields it
    changes. The rank in flight: `rank_id`, its `plan` and `step` (an index into PLANS[plan]),
    `joined` (the rank that takes its place: a standby, or its restarted process); `replaced`:
    one entry per rank done; `waiting`: why no rank is in flight now."""

    old: dict[int, int]
    options: dict[str, Any]
    started_at: float = field(default_factory=time.monotonic)
    state: str = "running"
    rank_id: int | None = None
    plan: str | None = None
    step: int = 0
    step_started_at: float = 0.0
    rank_started_at: float = 0.0
    joined: int | None = None
    replaced: list[dict[str, Any]] = field(default_factory=list)
    waiting: str = ""
    error: str | None = None
    finished_s: float | None = None

    @property
    def active(self) -> bool:
        return self.state not in DONE_STATES

    @property
    def phase(self) -> str | None:
        """The step of the rank in flight (None between ranks)."""
        return PLANS[self.plan][self.step] if self.plan is not None else None

    def begin(self, turn: Turn, now: float) -> None:
        self.rank_id, self.plan, self.step, self.joined, self.waiting = turn.rank_id, turn.plan, 0, None, ""
        self.rank_started_at = self.step_started_at = now

    def next_step(self, now: float) -> bool:
        """Move to the next step of the rank in flight; False when its plan is done."""
        assert self.plan is not None
        self.step += 1
        self.step_started_at = now
        return self.step < len(PLANS[self.plan])

    def rank_done(self, old_pid: int, new_pid: int | None, now: float) -> None:
        self.replaced.append({"rank_id": self.rank_id, "old_pid": old_pid, "plan": self.plan,
                              "new_rank_id": self.joined, "new_pid": new_pid,
                              "took_s": round(now - self.rank_started_at, 3)})
        self.rank_id, self.plan, self.step, self.joined = None, None, 0, None
        if self.state == "aborting":
            self.finish("aborted")

    def finish(self, state: str, error: str | None = None) -> None:
        self.state, self.error = state, error
        self.finished_s = round(time.monotonic() - self.started_at, 3)


def rollout_view(op: RolloutOp | None, pending: Sequence[int]) -> dict[str, Any]:
    """JSON for GET /rolling_restart and /cluster's "rollout"; `pending`: old processes left."""
    if op is None:
        return {"state": "idle", "active": False}
    return {
        "state": op.state, "active": op.active, "options": dict(op.options),
        "total": len(op.old), "replaced_count": len(op.old) - len(pending), "pending": list(pending),
        "rank_in_flight": op.rank_id, "plan": op.plan, "phase": op.phase, "joined": op.joined,
        "waiting": op.waiting or None, "replaced": list(op.replaced), "error": op.error,
        "elapsed_s": op.finished_s if op.finished_s is not None else round(time.monotonic() - op.started_at, 3),
    }
