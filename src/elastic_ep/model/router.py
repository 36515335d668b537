"""Top-k routing of tokens to routed experts, as pure functions over router logits."""

from __future__ import annotations

import torch


def grouped_sigmoid_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores, bias-corrected choice limited to the best groups.

    logits: [T, E], correction_bias: [E] -> topk_ids [T, k] int64, topk_weights [T, k] float32.
    A group's score is the sum of its two best bias-corrected scores; only experts of the
    `topk_groups` best groups may be chosen. Weights are the uncorrected scores (normalized to
    sum 1 when `normalize`), without routed_scaling_factor.
    """
    tokens, num_experts = logits.shape
    scores = logits.float().sigmoid()
    choice = scores + correction_bias
    group_size = num_experts // num_groups
    group_scores = choice.view(tokens, num_groups, group_size).topk(2, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand(tokens, num_groups, group_size).reshape(tokens, num_experts)
    topk_ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, topk_ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, weights


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: softmax over all experts, then the top k.

    logits: [T, E] -> topk_ids [T, k] int64, topk_weights [T, k] float32 (renormalized when `normalize`).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, topk_ids = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return topk_ids, weights
