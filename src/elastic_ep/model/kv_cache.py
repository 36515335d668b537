"""Per-sequence key/value cache, padded so a batch of sequences is attended in one call.

Layout per layer: keys [max_seqs, kv_heads, capacity, k_dim], values [max_seqs, kv_heads,
capacity, v_dim]: heads before positions, so the keys of a batch are a [B * heads, len, dim]
batch of matrices for attention without a copy. MLA's latent cache is the case kv_heads = 1
with `values_in_keys`: a key is [latent, rope key] and the value is its latent, a view of the
key, so nothing is stored twice. A sequence owns one row (its slot) while allocated.
`capacity` grows by doubling up to `max_model_len`, so a cache sized for long contexts costs
memory only once a sequence is that long. Every tensor lives on the cache's `device`.

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
    """Per-token cache shape of one layer: kv_heads heads of k_dim keys and v_dim values.

    values_in_keys: the value is the first v_dim entries of the key and is not stored apart
    (MLA's latent cache).
    """

    kv_heads: int
    k_dim: int
    v_dim: int
    values_in_keys: bool = False

    @property
    def elements_per_token(self) -> int:
        """Numbers stored per token of one layer."""
        return self.kv_heads * (self.k_dim + (0 if self.values_in_keys else self.v_dim))


class KVCache:
    """KV cache of up to `max_seqs` sequences of up to `max_model_len` tokens each, in `dtype` on `device`."""

    def __init__(
        self,
        num_layers: int,
        shape: KVShape,
        max_seqs: int,
        max_model_len: int,
        initial_capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if max_seqs < 1 or max_model_len < 1:
            raise ValueError(f"max_seqs and max_model_len must be >= 1, got {max_seqs}, {max_model_len}")
        self.shape = shape
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.num_layers = num_layers
        self.dtype = dtype
        self.capacity = min(initial_capacity, max_model_len)
        self.keys = [self._zeros(shape.k_dim, device) for _ in range(num_layers)]
        self.values = (
            [] if shape.values_in_keys else [self._zeros(shape.v_dim, device) for _ in range(num_layers)]
        )
        self._slots: dict[int, int] = {}
        self._lengths: dict[int, int] = {}
        self._free_slots = list(range(max_seqs - 1, -1, -1))  # pop() hands out the lowest row first

    def _zeros(self, dim: int, device: torch.device | str) -> torch.Tensor:
        return huge_zeros(self.max_seqs, self.shape.kv_heads, self.capacity, dim, dtype=self.dtype, device=device)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence takes, over all layers:
        layers x kv_heads x (k_dim + v_dim, or k_dim alone for values_in_keys) x dtype bytes."""
        return self.num_layers * self.shape.elements_per_token * self.dtype.itemsize

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

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
        self.keys = [_grown(k, capacity) for k in self.keys]
        self.values = [_grown(v, capacity) for v in self.values]
        self.capacity = capacity

    def read(self, seq_id: int, num_tokens: int) -> torch.Tensor:
        """The first num_tokens positions of `seq_id` in every layer, keys then values (values
        only when stored apart): [layers, kv_heads, num_tokens, k_dim (+ v_dim)], a copy."""
        row = self.slot(seq_id)
        if num_tokens > self.length(seq_id):
            raise ValueError(f"sequence {seq_id}: {num_tokens} positions asked, {self.length(seq_id)} cached")
        parts = [torch.stack([k[row, :, :num_tokens] for k in self.keys])]
        if self.values:
            parts.append(torch.stack([v[row, :, :num_tokens] for v in self.values]))
        return torch.cat(parts, dim=-1)

    def load(self, seq_id: int, rows: torch.Tensor) -> None:
        """Give `seq_id` a row holding `rows` ([layers, kv_heads, n, k_dim (+ v_dim)], as `read`
        returns them) at positions [0, n); its length is n."""
        self.allocate(seq_id)
        n = rows.shape[2]
        self.begin_chunk(seq_id, 0, n)
        row = self.slot(seq_id)
        for layer in range(self.num_layers):
            self.keys[layer][row, :, :n] = rows[layer, :, :, : self.shape.k_dim]
            if self.values:
                self.values[layer][row, :, :n] = rows[layer, :, :, self.shape.k_dim :]

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
    ):
        """slots, positions: [T] int64; k: [T, kv_heads, k_dim]; v: [T, kv_heads, v_dim], None
        for values_in_keys."""
        self.keys[layer][slots, :, positions] = k
        if v is not None:
            self.values[layer][slots, :, positions] = v

    def gather(self, layer: int, slots: list[int], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, kv_heads, max_len, k_dim] and values [B, kv_heads, max_len, v_dim] of rows `slots`.

        Consecutive slots (the usual case: rows are handed out lowest first) are a view, not a
        copy; values_in_keys values are a view of the keys.
        """
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            rows: slice | torch.Tensor = slice(first, first + len(slots))
        else:
            rows = torch.tensor(slots, dtype=torch.int64, device=self.device)
        keys = self.keys[layer][rows, :, :max_len]
        if self.shape.values_in_keys:
            return keys, keys[..., : self.shape.v_dim]
        return keys, self.values[layer][rows, :, :max_len]


def _grown(cache: torch.Tensor, capacity: int) -> torch.Tensor:
    """cache [seqs, heads, n, dim] copied into a zeroed [seqs, heads, capacity, dim]."""
    out = huge_zeros(*cache.shape[:2], capacity, cache.shape[3], dtype=cache.dtype, device=cache.device)
    out[:, :, : cache.shape[2]] = cache
    return out
