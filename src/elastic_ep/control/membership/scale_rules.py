"""Online scaling: what a scale request asks for, whether it is valid, which ranks it starts or
retires, and where it stands (the phases GET /is_scaling_elastic_ep reports).

The controller drives a `ScaleOp` at step boundaries; every membership change it makes is a new
epoch through the same path recovery uses. Phases (SGLang's names for scale-up, plus three for
scale-down):
  pending -> joining (new ranks start and load their weights) -> waiting_for_cohort (some have
  registered, the rest not yet) -> configuring_data_plane (the new epoch forms and moves experts)
  -> syncing_new_world (verified; requests spread over the new group) -> serving_expanded;
  pending -> draining (the ranks leaving, the highest ids or the caller's choice, take no new
  requests; in-flight ones finish or move)
  -> retiring (experts only they hold move while they are alive; then they leave in a new epoch
  and stop) -> serving_shrunk;
  failed: with `last_error` (a joiner died, the scale timed out); the service goes on serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..api import ScaleRejected

DONE_PHASES = ("serving_expanded", "serving_shrunk", "failed")


@dataclass
class ScaleOp:
    """One scale from `old_ep_size` to `new_ep_size`; `new_ranks` start (scale-up) or
    `retiring` ranks leave (scale-down): `chosen` by the caller (a drain, or a scale-down given
    its ranks), else the highest ids; `node` is the node a drain empties; `start_on` the node a
    scale-up starts its processes on (None: the agents running the fewest ranks). A scale-up
    resumed by a new leader begins with `new_ranks` set to the last leader's joiners still on
    their way (loading); it takes standbys and starts processes only for the rest."""

    old_ep_size: int
    new_ep_size: int
    chosen: list[int] | None = None
    node: str | None = None
    start_on: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    phase: str = "pending"
    new_ranks: list[int] = field(default_factory=list)
    retiring: list[int] = field(default_factory=list)
    drain_deadline: float = 0.0
    error: str | None = None
    finished_s: float | None = None

    @property
    def up(self) -> bool:
        return self.new_ep_size > self.old_ep_size

    @property
    def active(self) -> bool:
        return self.phase not in DONE_PHASES

    def finish(self, phase: str, error: str | None = None) -> None:
        self.phase, self.error = phase, error
        self.finished_s = round(time.monotonic() - self.started_at, 4)


def scale_limits(num_experts: int, slots_per_rank: int, max_ep_size: int) -> tuple[int, int]:
    """(fewest ranks that hold every expert, most ranks allowed)."""
    return -(-num_experts // slots_per_rank), max_ep_size


def check_idle(busy: ScaleOp | None) -> None:
    """Raise ScaleRejected 409 while a scale (or a drain) is in flight."""
    if busy is not None and busy.active:
        raise ScaleRejected(
            f"a scale from {busy.old_ep_size} to {busy.new_ep_size} ranks is in flight (phase {busy.phase}); "
            "wait until GET /is_scaling_elastic_ep says is_scaling_elastic_ep false", 409,
        )


def check_target(new_ep_size: int, current: int, limits: tuple[int, int], busy: ScaleOp | None) -> None:
    """Raise ScaleRejected (400 invalid, 409 busy) unless a scale to `new_ep_size` can start."""
    low, high = limits
    check_idle(busy)
    if not low <= new_ep_size <= high:
        raise ScaleRejected(
            f"new_ep_size {new_ep_size} is outside {low}..{high}: at least {low} ranks hold every expert, "
            f"at most --max-ep-size {high}", 400,
        )
    if new_ep_size == current:
        raise ScaleRejected(f"the cluster already has {current} ranks; ask for a different new_ep_size", 400)


def check_retiring(chosen: list[int], intended: list[int], new_ep_size: int | None, fewest: int,
                   param: str = "ranks") -> int:
    """The size left once the `chosen` ranks of `intended` retire; checked against `new_ep_size`
    when the caller gave both. Raise ScaleRejected 400 naming the problem: no ranks, a rank
    listed twice or not in the group, a size that does not match, fewer than `fewest` left."""
    if not chosen:
        raise ScaleRejected("no ranks to retire; name at least one rank listed by GET /cluster", 400, param)
    if len(set(chosen)) != len(chosen):
        raise ScaleRejected(f"ranks {chosen} name a rank twice", 400, param)
    unknown = sorted(set(chosen) - set(intended))
    if unknown:
        raise ScaleRejected(f"ranks {unknown} are not in the group (its ranks are {sorted(intended)}); "
                            "GET /cluster lists them", 400, param)
    left = len(intended) - len(chosen)
    if new_ep_size is not None and new_ep_size != left:
        raise ScaleRejected(f"retiring ranks {sorted(chosen)} of {len(intended)} leaves {left} ranks, not "
                            f"new_ep_size {new_ep_size}; give one of them, or both that agree", 400, param)
    if left < fewest:
        raise ScaleRejected(f"retiring ranks {sorted(chosen)} would leave {left} ranks, fewer than the {fewest} "
                            "that hold every expert; retire fewer, or scale up first", 400, param)
    return left


def new_rank_ids(taken: Iterable[int], count: int) -> list[int]:
    """The `count` smallest rank ids not in `taken`, so ids stay compact across scales."""
    used = set(taken)
    out: list[int] = []
    r = 0
    while len(out) < count:
        if r not in used:
            out.append(r)
        r += 1
    return out


def ranks_to_retire(ranks: Iterable[int], count: int) -> list[int]:
    """The `count` highest rank ids: the ones a later scale-up would add last."""
    return sorted(ranks)[len(list(ranks)) - count:] if count > 0 else []


def ranks_leaving(op: ScaleOp, intended: list[int]) -> list[int]:
    """The ranks a scale-down retires: the caller's choice, else the highest ids."""
    return sorted(op.chosen) if op.chosen is not None else ranks_to_retire(intended, len(intended) - op.new_ep_size)


def agent_for_new_rank(agents: Iterable[str], rank_nodes: Mapping[int, str]) -> str:
    """The node whose agent runs the fewest ranks (ties: the first name)."""
    count = {a: 0 for a in agents}
    for node in rank_nodes.values():
        if node in count:
            count[node] += 1
    return min(sorted(count), key=lambda a: count[a])


def status_view(op: ScaleOp | None, effective_ep_size: int) -> dict[str, Any]:
    """JSON for GET /is_scaling_elastic_ep (also /cluster's "scale")."""
    phase = op.phase if op is not None else "serving"
    scaling = op is not None and op.active
    return {
        "is_scaling_elastic_ep": scaling, "effective_ep_size": effective_ep_size, "scale_phase": phase,
        "last_error": op.error if op is not None else None,
        "old_ep_size": op.old_ep_size if op is not None else None,
        "new_ep_size": op.new_ep_size if op is not None else None,
        "new_ranks": list(op.new_ranks) if op is not None else [],
        "retiring": list(op.retiring) if op is not None else [],
        # the ranks the caller named to leave, before `retiring` is set (a cluster record written at once keeps them)
        "chosen": sorted(op.chosen) if op is not None and op.chosen is not None else None,
        "drained_node": op.node if op is not None else None,
        "elapsed_s": (op.finished_s if op.finished_s is not None else round(time.monotonic() - op.started_at, 4))
        if op is not None else None,
        # earlier names, kept for the dashboard and other readers
        "is_scaling": scaling, "state": phase, "ep_size": effective_ep_size,
    }
