"""Paged key/value cache: a pool of fixed-size blocks allocated once, and a block table per sequence.

Layout per layer: keys [num_blocks * block_size, kv_heads, k_dim], values [num_blocks *
block_size, kv_heads, v_dim]; position p of a sequence is row `table[p // block_size] *
block_size + p % block_size` (its slot). MLA's latent cache is the case kv_heads = 1 with
`values_in_keys`: a key is [latent, rope key] and the value is its latent, a view of the key, so
nothing is stored twice. Which blocks a sequence holds is decided outside (model/block_manager.py:
the offline engine's, or the controller's for a rank) and told with `set_blocks`; blocks may be
shared by sequences with a common prefix. The pool's memory is fixed at construction (its size
comes from a budget, model/kv_budget.py). Every tensor lives on the cache's `device`.

Writing is idempotent: a forward of a chunk at positions [start, start + n) overwrites those
positions and sets the length to start + n, so re-running a step interrupted half-way (some
layers already wrote) gives the same result as running it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_ep.errors import ElasticEPError

from .memory import huge_zeros

DEFAULT_BLOCK_SIZE = 16


class CacheCapacityError(ElasticEPError):
    """A sequence's block table is too short for the positions asked of it."""


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


def bytes_per_token(num_layers: int, shape: KVShape, dtype: torch.dtype) -> int:
    """Bytes one token takes over all layers: layers x kv_heads x (k_dim + v_dim, or k_dim alone
    for values_in_keys) x dtype bytes."""
    return num_layers * shape.elements_per_token * dtype.itemsize


class KVCache:
    """`num_blocks` blocks of `block_size` positions for `num_layers` layers, in `dtype` on `device`."""

    def __init__(
        self,
        num_layers: int,
        shape: KVShape,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.shape = shape
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        rows = num_blocks * block_size
        self.keys = [huge_zeros(rows, shape.kv_heads, shape.k_dim, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [] if shape.values_in_keys else [
            huge_zeros(rows, shape.kv_heads, shape.v_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.shape, self.dtype)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def set_blocks(self, seq_id: int, block_ids: list[int], num_cached: int | None = None) -> None:
        """Give `seq_id` the block table `block_ids`. A new sequence starts with num_cached
        computed positions (0 by default; a prefix hit's shared blocks hold more); a known one
        keeps its length unless num_cached is given."""
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"sequence {seq_id}: block ids {block_ids} outside the pool of {self.num_blocks}")
        self._tables[seq_id] = list(block_ids)
        if num_cached is not None or seq_id not in self._lengths:
            self._lengths[seq_id] = num_cached or 0

    def free(self, seq_id: int) -> None:
        """Forget the table of `seq_id` (no-op for an unknown id); its blocks' contents stay."""
        self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def length(self, seq_id: int) -> int:
        """Number of cached positions of `seq_id`."""
        return self._lengths[self._require(seq_id)]

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[self._require(seq_id)]

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    def _require(self, seq_id: int) -> int:
        if seq_id not in self._tables:
            raise KeyError(f"sequence {seq_id} has no KV cache; give it blocks with set_blocks({seq_id}, ...) first")
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
        held = len(self._tables[seq_id]) * self.block_size
        if end > held:
            raise CacheCapacityError(
                f"sequence {seq_id} needs {end} positions, its block table holds {held} "
                f"({len(self._tables[seq_id])} blocks of {self.block_size})"
            )
        self._lengths[seq_id] = end

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Cache rows [end - start] of positions [start, end) of `seq_id`."""
        positions = torch.arange(start, end, device=self.device)
        table = torch.tensor(self.block_table(seq_id), dtype=torch.int64, device=self.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def read(self, seq_id: int, num_tokens: int) -> torch.Tensor:
        """The first num_tokens positions of `seq_id` in every layer, keys then values (values
        only when stored apart): [layers, kv_heads, num_tokens, k_dim (+ v_dim)], a copy."""
        if num_tokens > self.length(seq_id):
            raise ValueError(f"sequence {seq_id}: {num_tokens} positions asked, {self.length(seq_id)} cached")
        rows = self.slots(seq_id, 0, num_tokens)
        parts = [torch.stack([k[rows] for k in self.keys])]
        if self.values:
            parts.append(torch.stack([v[rows] for v in self.values]))
        return torch.cat(parts, dim=-1).transpose(1, 2)

    def load(self, seq_id: int, rows: torch.Tensor, block_ids: list[int]) -> None:
        """Give `seq_id` the table block_ids and write `rows` ([layers, kv_heads, n, k_dim (+
        v_dim)], as `read` returns them) at its positions [0, n); its length is n."""
        self.set_blocks(seq_id, block_ids, num_cached=0)
        n = rows.shape[2]
        self.begin_chunk(seq_id, 0, n)
        slots = self.slots(seq_id, 0, n)
        for layer in range(self.num_layers):
            per_token = rows[layer].transpose(0, 1)
            self.keys[layer][slots] = per_token[..., : self.shape.k_dim]
            if self.values:
                self.values[layer][slots] = per_token[..., self.shape.k_dim :]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """slots: [T] cache rows; k: [T, kv_heads, k_dim]; v: [T, kv_heads, v_dim], None for
        values_in_keys."""
        self.keys[layer][slots] = k
        if v is not None:
            self.values[layer][slots] = v

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [..., kv_heads, L, k_dim] and values [..., kv_heads, L, v_dim] of cache rows
        slots [..., L] (a copy; values_in_keys values are a view of the keys)."""
        keys = self.keys[layer][slots].transpose(-3, -2)
        if self.shape.values_in_keys:
            return keys, keys[..., : self.shape.v_dim]
        return keys, self.values[layer][slots].transpose(-3, -2)


def pool_num_blocks(bytes_per_block: int, *, override: int = 0, budget_bytes: int = 0,
                    fallback_blocks: int = 0) -> int:
    """Blocks of a rank's KV pool: `override` when given (--num-gpu-blocks-override), else as many
    as `budget_bytes` holds (--kv-cache-memory, or what --gpu-memory-utilization leaves), else
    fallback_blocks. Raises ElasticEPError when that is not one block, naming the sizes."""
    if override > 0:
        num_blocks = override
    elif budget_bytes:
        num_blocks = max(budget_bytes, 0) // bytes_per_block
    else:
        num_blocks = fallback_blocks
    if num_blocks < 1:
        raise ElasticEPError(
            f"the KV cache budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes; give the "
            "cache more memory (--kv-cache-memory, --gpu-memory-utilization) or a smaller model"
        )
    return num_blocks
