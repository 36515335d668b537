"""Token sampling: greedy, or seeded per (request seed, position) so that a recomputation
on any rank, in any batch, draws the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token of one request.

    temperature 0 means greedy. `seed` None means a seed derived from the request id
    by the caller; sampling is always a pure function of (seed, position, logits).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


_SEED_MIX = 0x9E3779B97F4A7C15


def _generator(seed: int, position: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(((seed * _SEED_MIX) ^ (position + 1) * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Pick one token.

    logits: [V] float, the next-token logits of one sequence, on any device: they are drawn
        from on the CPU, so a seed gives the same token whatever device computed them.
    position: index of the token being produced (prompt length + tokens so far), so that the
        same request at the same position always draws the same token.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    scaled = logits.float().cpu() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scaled.numel())
        kth = torch.topk(scaled, k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=_generator(seed, position)).item())


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> list[int]:
    """Pick one token per row. logits: [B, V]; params, seeds, positions: length B."""
    if all(p.temperature == 0 for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_token(logits[i], params[i], seeds[i], positions[i]) for i in range(len(params))]
