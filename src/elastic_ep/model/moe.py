"""Routed-expert math: one expert, a stack of experts, and the single-process `moe_fn`.

A `moe_fn(layer, hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]` returns
sum_k weight * expert_k(hidden) over the routed experts. The EP runtime provides its own
(dispatch, `grouped_expert_forward` on its slots, combine); `local_moe_fn` computes every
expert in this process. Every function computes on the device and in the dtype of its inputs
(the expert weights and the hidden states agree; routing weights may be float32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layers import gated_mlp

MoEFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# One routed expert is a gated MLP: x [n, H], w13 [2I, H], w2 [H, I] -> [n, H].
expert_forward = gated_mlp


def grouped_expert_forward(
    x: torch.Tensor, slot_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Row r of x through the expert in slot slot_ids[r] of the stack.

    x: [N, H], slot_ids: [N] int64, w13: [S, 2I, H], w2: [S, H, I] -> [N, H] (unweighted).
    """
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    order = torch.argsort(slot_ids, stable=True)
    counts = torch.bincount(slot_ids, minlength=w13.shape[0]).tolist()
    sorted_x = x[order]
    results = []
    start = 0
    for slot, count in enumerate(counts):
        if count:
            results.append(expert_forward(sorted_x[start : start + count], w13[slot], w2[slot]))
            start += count
    out[order] = torch.cat(results)
    return out


def combine_weighted(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Sum the k expert outputs of each token.

    expert_out: [T * k, H] in token-major order (row t * k + j is token t's j-th choice),
    topk_weights: [T, k] -> [T, H].
    """
    tokens, k = topk_weights.shape
    weighted = expert_out.view(tokens, k, expert_out.shape[-1]) * topk_weights[..., None].to(expert_out.dtype)
    return weighted.sum(dim=1)


def local_moe_fn(experts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> MoEFn:
    """A moe_fn over all experts held here: experts[layer] = (w13 [E, 2I, H], w2 [E, H, I])."""

    def moe_fn(layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        w13, w2 = experts[layer]
        rows = hidden.repeat_interleave(topk_ids.shape[1], dim=0)
        expert_out = grouped_expert_forward(rows, topk_ids.reshape(-1), w13, w2)
        return combine_weighted(expert_out, topk_weights)

    return moe_fn
