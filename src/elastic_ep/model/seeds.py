"""Request seeds: their range, and the seed of each choice of a request. Free of torch, so
that the router (which only forwards requests) computes a choice's seed as serve does."""

from __future__ import annotations

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index`: seed + index, wrapped into the signed 64-bit range."""
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN
