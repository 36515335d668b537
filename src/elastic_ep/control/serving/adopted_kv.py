"""The KV an adopted rank still holds at a takeover, taken over by the journaled requests.

A new leader of a controller group (group/, control/membership/adoption.py) adopts the last
leader's ranks as they run; each one's adopt hello names the sequences whose KV it kept
(`HeldKV`: prompt length, the tokens at its first positions, the blocks holding them). The
scheduler reserves those blocks in the rank's pool (`KVOffers`: the rest of the pool is free) and,
when a journaled request is placed, gives it the blocks of the held sequence of the same prompt
whose tokens agree longest with its own (`reusable`): that many positions are kept, the rest are
prefilled again. Tokens are the only evidence: a position is kept only where the journal confirms
the token the KV was computed from, and at least one token is left to compute (its logits give the
next token), so a journal behind the KV keeps its own length less one, a journal ahead of it
(the last leader delivered tokens whose step's KV was not kept) recomputes only what it lacks.
The block where the request writes next is kept only if nothing else holds it (a block shared
by prefix caching is never written into); past the kept positions the table is grown from free
blocks.

Offers not taken are released: all of them once every journaled request was placed (or aborted),
those of a rank whose pool runs short of blocks at once, any left `hold_s` after the takeover.
Counted (`counts`, /cluster `kv_cache.adopted`, elastic_ep_takeover_kv_positions_total): positions
kept, positions the journaled requests prefilled again before their next token (their known
tokens but the last, less what was kept), positions held that nothing took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic_ep.model.block_manager import BlockManager, blocks_for
from elastic_ep.wire import HeldKV

KEY_TOKENS = 16  # a held sequence is indexed by its prompt's length and first tokens
KV_HOLD_S = 10.0  # the journaled requests reach the scheduler within one readiness poll (50 ms) or retry (1 s)


def reusable(known: list[int], held: list[int]) -> int:
    """Leading positions of a request whose tokens are `known` (prompt and output so far) that KV
    computed from the tokens `held` stands for: their common prefix, leaving at least the last
    known token to compute."""
    limit = min(len(known) - 1, len(held))
    if limit <= 0:
        return 0
    if known[:limit] == held[:limit]:
        return limit
    return next(i for i in range(limit) if known[i] != held[i])


def _key(prompt_len: int, tokens: list[int]) -> tuple[int, tuple[int, ...]]:
    return prompt_len, tuple(tokens[:min(prompt_len, KEY_TOKENS)])


@dataclass
class Offer:
    """One held sequence of `rank`, reserved in its pool under `owner` (a negative id)."""

    rank: int
    owner: int
    held: HeldKV


class KVOffers:
    """The held KV of the adopted ranks in `pools` (the scheduler's: rank -> its pool), reserved for
    the requests `journaled` (their ids) until `until_s`."""

    def __init__(self, pools: dict[int, BlockManager], held: dict[int, list[HeldKV]], journaled: set[str],
                 until_s: float):
        """Hold the blocks of every sequence of `held` (rank -> what it named) in its rank's pool. A
        sequence whose table does not fit its positions or names a block outside the pool, or one
        shorter than its index key, is not offered (counted dropped)."""
        self.pools, self.journaled, self.until_s = pools, set(journaled), until_s
        self.offers: dict[int, list[Offer]] = {}
        self.index: dict[tuple[int, tuple[int, ...]], list[Offer]] = {}
        self.counts = dict.fromkeys(("reused", "reprefilled", "dropped", "requests_kept", "requests_reprefilled"), 0)
        owner = -1
        for rank, seqs in held.items():
            pool = pools.get(rank)
            for h in seqs:
                fits = pool is not None and len(h.block_ids) == blocks_for(len(h.token_ids), pool.block_size) \
                    and len(set(h.block_ids)) == len(h.block_ids) and all(0 <= b < pool.num_blocks for b in h.block_ids)
                if not fits or len(h.token_ids) < min(h.prompt_len, KEY_TOKENS) or not self.journaled:
                    self.counts["dropped"] += len(h.token_ids)
                    continue
                pool.adopt(owner, h.block_ids)
                offer = Offer(rank, owner, h)
                self.offers.setdefault(rank, []).append(offer)
                self.index.setdefault(_key(h.prompt_len, h.token_ids), []).append(offer)
                owner -= 1

    def holds(self, rank: int) -> bool:
        return rank in self.offers

    def take(self, request_id: str, prompt_len: int, tokens: list[int], seq_id: int,
             takes: Callable[[int], bool]) -> tuple[int, int] | None:
        """Give the sequence `seq_id` of request `request_id` the held KV that keeps most of its
        `tokens`, on a rank where `takes(rank)`: (rank, positions kept), its table there covering
        every token; None when there is none (it is placed as any request). A journaled request's
        kept and re-prefilled positions are counted, once; the last one to come releases what is left."""
        if request_id not in self.journaled:
            return None
        self.journaled.discard(request_id)
        best, kept = None, 0
        for offer in self.index.get(_key(prompt_len, tokens), []):
            n = reusable(tokens, offer.held.token_ids)
            if n > kept and takes(offer.rank):
                best, kept = offer, n
        placed = self._give(best, kept, seq_id, len(tokens)) if best is not None else None
        kept = placed[1] if placed is not None else 0
        self.counts["reused"] += kept
        self.counts["reprefilled"] += max(len(tokens) - 1 - kept, 0)
        self.counts["requests_kept" if placed is not None else "requests_reprefilled"] += 1
        if not self.journaled:
            self.release()
        return placed

    def _give(self, offer: Offer, kept: int, seq_id: int, num_tokens: int) -> tuple[int, int] | None:
        pool = self.pools[offer.rank]
        table = offer.held.block_ids[:blocks_for(kept, pool.block_size)]
        if kept % pool.block_size and pool.blocks[table[-1]].ref_count > 1:  # written into next: never a shared one
            table, kept = table[:-1], kept - kept % pool.block_size
        if kept:
            pool.adopt(seq_id, table)
        self._drop(offer, used=kept)
        if kept and not pool.grow(seq_id, num_tokens):
            pool.free(seq_id)
            self.counts["dropped"] += kept
            return None
        return (offer.rank, kept) if kept else None

    def _drop(self, offer: Offer, used: int = 0) -> None:
        self.offers[offer.rank].remove(offer)
        if not self.offers[offer.rank]:
            del self.offers[offer.rank]
        self.index[_key(offer.held.prompt_len, offer.held.token_ids)].remove(offer)
        self.counts["dropped"] += len(offer.held.token_ids) - used
        pool = self.pools.get(offer.rank)
        if pool is not None:  # a rank evicted meanwhile took its pool along
            pool.free(offer.owner)

    def release(self, rank: int | None = None) -> None:
        """Give back the blocks of every offer not taken (of `rank` only when given); with no rank
        the journaled requests not placed yet are placed as any request."""
        for r in [rank] if rank is not None else list(self.offers):
            for offer in list(self.offers.get(r, [])):
                self._drop(offer)
        if rank is None:
            self.journaled.clear()

    def left(self, request_id: str) -> None:
        """Request `request_id` ended before it was placed: nothing waits for it any more."""
        if request_id in self.journaled:
            self.journaled.discard(request_id)
            if not self.journaled:
                self.release()

    def expire(self, now_s: float) -> None:
        if self.offers and now_s > self.until_s:
            self.release()

    def view(self) -> dict:
        """The counts, and the positions still held for a request to take."""
        return {**self.counts, "held": sum(len(o.held.token_ids) for offers in self.offers.values() for o in offers)}
