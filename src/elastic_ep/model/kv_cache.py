"""Per-sequence key/value cache, padded so a batch of sequences is attended in one call.

Layout per layer: keys [max_seqs, kv_heads, capacity, k_dim], values [max_seqs, kv_heads,
capacity, v_dim]: heads before positions, so the keys of a batch are a [B * heads, len, dim]
batch of matrices for attention without a copy. A sequence owns one row (its slot) while allocated. `capacity` grows by
doubling up to `max_model_len`, so a cache sized for long contexts costs memory only once
a sequence is that long.

Writing is idempotent: a forward of a chunk at positions [start, start + n) overwrites those
positions and sets the length to start + n, so re-running a step interrupted half-way (some
layers already wrote) gives the same result as running it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_ep.errors import ElasticEPError

from .memory import huge_zeros


class CacheCapacityError(ElasticEPError):
    """A sequence does not fit: too many sequences at once, or longer than max_model_len."""


@dataclass(frozen=True)
class KVShape:
    """Per-token cache shape of one layer: kv_heads heads of k_dim keys and v_dim values."""

    kv_heads: int
    k_dim: int
    v_dim: int


class KVCache:
    """KV cache of up to `max_seqs` sequences of up to `max_model_len` tokens each."""

    def __init__(
        self,
        num_layers: int,
        shape: KVShape,
        max_seqs: int,
        max_model_len: int,
        initial_capacity: int = 256,
    ):
        if max_seqs < 1 or max_model_len < 1:
            raise ValueError(f"max_seqs and max_model_len must be >= 1, got {max_seqs}, {max_model_len}")
        self.shape = shape
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.num_layers = num_layers
        self.capacity = min(initial_capacity, max_model_len)
        self.keys = [
            huge_zeros(max_seqs, shape.kv_heads, self.capacity, shape.k_dim) for _ in range(num_layers)
        ]
        self.values = [
            huge_zeros(max_seqs, shape.kv_heads, self.capacity, shape.v_dim) for _ in range(num_layers)
        ]
        self._slots: dict[int, int] = {}
        self._lengths: dict[int, int] = {}
        self._free_slots = list(range(max_seqs - 1, -1, -1))  # pop() hands out the lowest row first

    def allocate(self, seq_id: int) -> None:
        """Give `seq_id` an empty cache row (length 0). Re-allocating a live sequence resets it."""
        if seq_id in self._slots:
            self._lengths[seq_id] = 0
            return
        if not self._free_slots:
            raise CacheCapacityError(
                f"KV cache is full: {self.max_seqs} sequences are running; raise max_seqs "
                "(--max-batch) or wait for a sequence to finish"
            )
        self._slots[seq_id] = self._free_slots.pop()
        self._lengths[seq_id] = 0

    def free(self, seq_id: int) -> None:
        """Release the row of `seq_id` (no-op for an unknown id)."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            del self._lengths[seq_id]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slots

    def length(self, seq_id: int) -> int:
        """Number of cached positions of `seq_id`."""
        return self._lengths[self._require(seq_id)]

    def slot(self, seq_id: int) -> int:
        return self._slots[self._require(seq_id)]

    @property
    def num_seqs(self) -> int:
        return len(self._slots)

    def _require(self, seq_id: int) -> int:
        if seq_id not in self._slots:
            raise KeyError(f"sequence {seq_id} has no KV cache; call allocate({seq_id}) first")
        return seq_id

    def begin_chunk(self, seq_id: int, start_pos: int, num_tokens: int) -> None:
        """Declare that positions [start_pos, start_pos + num_tokens) of `seq_id` are being written.

        start_pos may be below the current length (a re-run overwrites) but not above it (no gaps).
        """
        length = self.length(seq_id)
        if not 0 <= start_pos <= length:
            raise ValueError(
                f"sequence {seq_id}: chunk starts at {start_pos} but only {length} positions are cached"
            )
        end = start_pos + num_tokens
        if end > self.max_model_len:
            raise CacheCapacityError(
                f"sequence {seq_id} needs {end} positions, more than max_model_len {self.max_model_len}; "
                "shorten the prompt or lower max_tokens"
            )
        self._grow(end)
        self._lengths[seq_id] = end

    def _grow(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_model_len)
        for layer in range(self.num_layers):
            self.keys[layer] = _grown(self.keys[layer], capacity)
            self.values[layer] = _grown(self.values[layer], capacity)
        self.capacity = capacity

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """slots, positions: [T] int64; k: [T, kv_heads, k_dim]; v: [T, kv_heads, v_dim]."""
        self.keys[layer][slots, :, positions] = k
        self.values[layer][slots, :, positions] = v

    def gather(self, layer: int, slots: list[int], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, kv_heads, max_len, k_dim] and values [B, kv_heads, max_len, v_dim] of rows `slots`.

        Consecutive slots (the usual case: rows are handed out lowest first) are a view, not a copy.
        """
        keys, values = self.keys[layer], self.values[layer]
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            rows = slice(first, first + len(slots))
            return keys[rows, :, :max_len], values[rows, :, :max_len]
        index = torch.tensor(slots, dtype=torch.int64)
        return keys[index, :, :max_len], values[index, :, :max_len]


def _grown(cache: torch.Tensor, capacity: int) -> torch.Tensor:
    """cache [seqs, heads, n, dim] copied into a zeroed [seqs, heads, capacity, dim]."""
    out = huge_zeros(*cache.shape[:2], capacity, cache.shape[3])
    out[:, :, : cache.shape[2]] = cache
    return out
