"""EPLB in the loop, as pure decisions: when to look, and whether a new
placement is worth an epoch.

A slow rank is part of the decision when speeds are given: imbalance is judged in time
(load / speed), so a rank that takes twice as long with an even share of tokens is the
imbalance to fix, and a plan that unloads it is not rejected as worse by token counts. A dead
rank never appears here: rebalancing runs only between faults, over the current members.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from elastic_ep.placement.fault_aware import fault_aware_placement
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.measures import balancedness


def eplb_due(step: int, interval: int, window_steps: int, last_step: int) -> bool:
    """Every `interval` steps, once the load window holds that many steps."""
    return step > 0 and step % interval == 0 and window_steps >= interval and last_step != step


@dataclass(frozen=True)
class Rebalance:
    placement: ExpertLocation
    before: float  # max / mean rank load (in time when speeds are given)
    after: float


def plan_rebalance(current: ExpertLocation, load: np.ndarray, members: list[int], rank_nodes: Mapping[int, str],
                   speeds: Mapping[int, float] | None, threshold: float) -> Rebalance | None:
    """A placement over `members` for `load` [L, E] when the current one's imbalance is at least
    `threshold` and the new one is better; None otherwise."""
    before = float(1 / balancedness(current, load, members, speeds).min())
    if before < threshold:
        return None
    new = fault_aware_placement(load, members, rank_nodes, speeds, current.slots_per_rank, current.num_ranks,
                                current=current, movement_tolerance=0.0)
    after = float(1 / balancedness(new, load, members, speeds).min())
    if new == current or after >= before:
        return None
    return Rebalance(new, before, after)


def eplb_plan(current: ExpertLocation, load: np.ndarray, members: list[int], rank_nodes: Mapping[int, str],
              speeds: Mapping[int, float] | None, threshold: float) -> tuple[Rebalance | None, ExpertLocation | None]:
    """EPLB's check at its interval: `plan_rebalance`'s plan and, when there is one, the placement
    computed from scratch its walk is judged against when it ends (None without a plan). Pure:
    computed off the control thread from ~16 ranks on (seconds at 1,024)."""
    plan = plan_rebalance(current, load, members, rank_nodes, speeds, threshold)
    if plan is None:
        return None, None
    return plan, fault_aware_placement(load, members, rank_nodes, speeds, current.slots_per_rank, current.num_ranks)


def rebalance_targets(load: np.ndarray, members: list[int], rank_nodes: Mapping[int, str],
                      speeds: Mapping[int, float] | None, slots_per_rank: int, num_ranks: int,
                      current: ExpertLocation) -> tuple[ExpertLocation, ExpertLocation]:
    """A background rebalance's target (a balanced placement over `members` for `load` [L, E] that
    keeps what it can of `current`) and the placement computed from scratch it is judged against
    when the walk ends. Pure: computed off the control thread from ~16 ranks on (seconds at 1,024)."""
    target = fault_aware_placement(load, members, rank_nodes, speeds, slots_per_rank, num_ranks, current=current)
    scratch = fault_aware_placement(load, members, rank_nodes, speeds, slots_per_rank, num_ranks)
    return target, scratch
