"""Expert placement: location maps, EPLB policies, transfer plans, measures. Pure; imports nothing
from the rest of elastic_ep but `errors`.

- `location.ExpertLocation`: phy2log [L, S_total], log2phy [L, E, R], logcnt [L, E] over all ranks.
- `deepseek.rebalance_experts`: DeepSeek EPLB, hierarchical and global.
- `fault_aware.fault_aware_placement`: live ranks, minimal movement, failure domains, speeds.
- `redundancy.choose_redundant_experts`: the fewest redundant slots that outlive a rank or node loss.
- `transfer.plan_transfers`: per-slot sources (keep, local, peer, backup, disk) from one placement to the next.
- `measures`: balancedness, bytes moved, replicas sharing a node, experts without a live replica.
"""

from elastic_ep.placement.deepseek import rebalance_experts
from elastic_ep.placement.fault_aware import fault_aware_placement
from elastic_ep.placement.location import EMPTY, ExpertLocation
from elastic_ep.placement.measures import (
    balancedness,
    bytes_moved,
    copies_on_same_rank,
    experts_without_live_replica,
    rank_loads,
    replicas_sharing_node,
    slots_moved,
)
from elastic_ep.placement.redundancy import (
    RedundancyChoice,
    Survival,
    choose_redundant_experts,
    losses_survived,
)
from elastic_ep.placement.transfer import SOURCE_KINDS, Transfer, TransferPlan, plan_transfers

__all__ = [
    "EMPTY",
    "SOURCE_KINDS",
    "ExpertLocation",
    "RedundancyChoice",
    "Survival",
    "Transfer",
    "TransferPlan",
    "balancedness",
    "bytes_moved",
    "choose_redundant_experts",
    "copies_on_same_rank",
    "experts_without_live_replica",
    "fault_aware_placement",
    "losses_survived",
    "plan_transfers",
    "rank_loads",
    "rebalance_experts",
    "replicas_sharing_node",
    "slots_moved",
]
