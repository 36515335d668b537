"""Which KV blocks each sequence holds: a pool of `num_blocks` fixed-size blocks, reference
counts, and prefix caching.

A sequence's block table maps its positions to blocks: position p lies in block
`table[p // block_size]` at offset `p % block_size`. A full block whose tokens have been computed
is keyed by the chained hash of its token prefix (the hash of the previous full block and its own
tokens), so a later sequence with the same prefix takes the block instead of recomputing it
(prefix caching). A block is shared by reference count; a freed block keeps its contents and
its key until the pool needs it, least recently freed first (LRU eviction), so a prefix stays
cached while the pool has room. A full block a sequence holds but has not computed yet is
claimed by it under the key it will get: `computing_prefix` tells a later sequence with that
prefix which running sequence is computing it, so the scheduler can let it wait and hit the
blocks instead of computing them a second time (what SGLang's radix cache and vLLM's prefix
caching aim at for prefixes in flight). Counters follow vLLM's meanings: `queries_tokens` are
the tokens of the sequences looked up, `hit_tokens` those found cached.

Pure bookkeeping, no tensors: the offline engine and the controller's scheduler (one manager per
DP rank) decide with it, and the rank's `KVCache` is told the tables.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    """ref_count: sequences holding it; key: (parent hash, tokens) of a cached full block, with
    `hash` its hash; None while it is not cached."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    key: tuple[int, tuple[int, ...]] | None = None


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens positions."""
    return -(-num_tokens // block_size)


class BlockManager:
    """num_blocks blocks of block_size positions. enable_prefix_caching: full computed blocks
    are keyed and shared; off, every sequence gets fresh blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count 0, oldest first: the next block handed out is the first; cached ones go last
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # hash -> block id
        self.tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its leading keyed blocks
        self._computing: dict[int, int] = {}  # hash -> seq_id holding that block, not yet computed
        self._claims: dict[int, list[int]] = {}  # seq_id -> the hashes it claimed in _computing
        self.queries_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted when needed)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def _chain(self, token_ids: list[int], num_blocks: int, start: int = 0, parent: int = -1):
        """(key, hash) of full blocks start..num_blocks-1 of token_ids, chained from `parent` (the
        hash of block start-1, -1 for none)."""
        bs = self.block_size
        for i in range(start, num_blocks):
            key = (parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            parent = hash(key)
            yield key, parent

    def prefix_chain(self, token_ids: list[int]) -> list[tuple[tuple, int]]:
        """(key, hash) of the full blocks of token_ids a prefix match looks at (all but the last
        token). The same in every pool of one block size: a placement that asks every rank's
        pool computes it once and passes it as `chain` (hashing the prompt once per rank was
        most of a placement's time with a shared prompt prefix at 64 ranks)."""
        if not self.enable_prefix_caching:
            return []
        return list(self._chain(token_ids, (len(token_ids) - 1) // self.block_size))

    def _match(self, token_ids: list[int], chain: list[tuple[tuple, int]] | None = None) -> tuple[list[int], list[int]]:
        """(block ids, hashes) of the longest cached chain of full blocks of token_ids, leaving at
        least one token to compute (its logits give the next token); `chain`: its `prefix_chain`."""
        if not self.enable_prefix_caching:
            return [], []
        found, hashes = [], []
        for key, h in self.prefix_chain(token_ids) if chain is None else chain:
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].key != key:
                break
            found.append(block_id)
            hashes.append(h)
        return found, hashes

    def computing_prefix(self, token_ids: list[int],
                         chain: list[tuple[tuple, int]] | None = None) -> tuple[int, int | None]:
        """(tokens, seq_id): how many leading tokens of token_ids past its cached prefix lie in
        full blocks that running sequences hold but have not computed yet (leaving at least one
        token to compute, as `_match`), and the sequence computing the first of them; (0, None)
        when none. `chain`: its `prefix_chain`, when known."""
        if not self._computing:
            return 0, None
        chain = self.prefix_chain(token_ids) if chain is None else chain
        found, _ = self._match(token_ids, chain)
        holders = []
        for _, h in chain[len(found):]:
            if h not in self._computing:
                break
            holders.append(self._computing[h])
        return len(holders) * self.block_size, holders[0] if holders else None

    def may_hit(self, first_hash: int) -> bool:
        """Whether a prefix whose first full block hashes to `first_hash` may be found here, cached or
        being computed; False: `cached_prefix_tokens` and `computing_prefix` are 0 for it."""
        return first_hash in self._cached or first_hash in self._computing

    def cached_prefix_tokens(self, token_ids: list[int], chain: list[tuple[tuple, int]] | None = None) -> int:
        """Leading tokens of token_ids that `allocate` would find cached; `chain`: its `prefix_chain`."""
        return len(self._match(token_ids, chain)[0]) * self.block_size

    def allocate(self, seq_id: int, token_ids: list[int], num_tokens: int) -> int | None:
        """Give `seq_id` (holding nothing) blocks for its first num_tokens positions, taking the
        cached blocks of its longest cached prefix of token_ids. Returns the number of leading
        tokens already computed (a multiple of block_size), or None, holding nothing, when the
        free blocks do not suffice."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        hits, hashes = self._match(token_ids[:num_tokens])
        fresh = self.blocks_for(num_tokens) - len(hits)
        free_hits = sum(self.blocks[b].ref_count == 0 for b in hits)
        if fresh + free_hits > len(self._free):
            return None
        for b in hits:
            self._hold(b)
        self.tables[seq_id] = hits + [self._take() for _ in range(fresh)]
        self._hashes[seq_id] = hashes
        if self.enable_prefix_caching:
            parent = hashes[-1] if hashes else -1
            claims = [h for _, h in self._chain(token_ids, min(len(token_ids), num_tokens) // self.block_size,
                                                len(hits), parent)
                      if h not in self._cached and h not in self._computing]
            self._computing.update(dict.fromkeys(claims, seq_id))
            self._claims[seq_id] = claims
        cached = len(hits) * self.block_size
        self.queries_tokens += len(token_ids)
        self.hit_tokens += cached
        return cached

    def adopt(self, seq_id: int, block_ids: list[int]) -> None:
        """Give `seq_id` (holding nothing) the table `block_ids`: blocks whose contents the rank held
        before this manager existed (a new leader of a controller group takes over an adopted rank's
        KV, control/serving/adopted_kv.py). A block another holder has is shared; a free one that was
        keyed is no longer (it may be written). `cache_computed` keys its full computed blocks."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0 and block.hash is not None:
                del self._cached[block.hash]
                block.hash = block.key = None
            self._hold(block_id)
        self.tables[seq_id] = list(block_ids)
        self._hashes[seq_id] = []

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Extend the table of `seq_id` to hold num_tokens positions; False, unchanged, when the
        free blocks do not suffice."""
        table = self.tables[seq_id]
        more = self.blocks_for(num_tokens) - len(table)
        if more > len(self._free):
            return False
        table.extend(self._take() for _ in range(more))
        return True

    def cache_computed(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Key the full blocks of `seq_id` among its first num_computed positions (computed,
        holding token_ids) so later sequences can share them. A block whose key another block
        already has stays unkeyed (two sequences computed the same prefix at once)."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.tables[seq_id], self._hashes[seq_id]
        parent = hashes[-1] if hashes else -1
        for i, (key, h) in enumerate(self._chain(token_ids, min(num_computed // self.block_size, len(table)),
                                                 len(hashes), parent), start=len(hashes)):
            block = self.blocks[table[i]]
            if h not in self._cached:
                self._cached[h] = block.block_id
                block.hash, block.key = h, key
            if self._computing.get(h) == seq_id:
                del self._computing[h]
            hashes.append(h)

    def free(self, seq_id: int) -> None:
        """Release the blocks of `seq_id` (no-op for an unknown id). Its last blocks are freed
        first, so they are evicted before the prefix blocks other sequences may share."""
        table = self.tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        for h in self._claims.pop(seq_id, []):
            if self._computing.get(h) == seq_id:
                del self._computing[h]
        for block_id in reversed(table or []):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:  # nothing to keep: handed out before the cached ones
                    self._free.move_to_end(block_id, last=False)

    def _hold(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evicted: its prefix is no longer cached
            del self._cached[block.hash]
            block.hash = block.key = None
        block.ref_count = 1
        return block_id
