"""The order in which a new sequence tries the ranks (control/serving/scheduler.py `_place`): by what
it costs on each, (tokens of work ahead there + its tokens - its prefix hit there, -free blocks,
sequences, rank id), the cheapest first.

Worked out for every rank at every placement, that order was the scheduler's largest cost under
arrivals (a cost tuple and two prefix lookups per rank for each new request: 256 ranks x ~100
arrivals a step). Almost every rank's cost is its key here, (tokens ahead + length, -free blocks,
sequences, rank): a prefix hit needs the first full block of the prompt cached or being computed in
that rank's pool (`BlockManager.may_hit`), which few are. So the ranks sit in a heap by that key,
built once per `schedule`, and a placement merges it with the full costs of the few ranks its prefix
may hit: the order `sorted` gives over every rank's cost, without computing each.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

Key = tuple[int, int, int, int]  # (tokens ahead, -free blocks, sequences, rank)


class RankOrder:
    """The ranks of one `schedule` that may take new sequences, in a heap by `key(rank)` ((tokens
    ahead, -free blocks, sequences, rank); None for a rank that takes none: full, draining). A key
    only grows as sequences are placed (more work ahead, fewer free blocks, more sequences), and an
    entry that grew is found stale and put back with its key of now when it comes up; a change that
    lowers one must be told with `renew` (or the order built afresh, as the scheduler does while a
    takeover's held KV can be released)."""

    def __init__(self, ranks: Iterable[int], key: Callable[[int], Key | None]):
        self._key = key
        self._heap = [k for k in map(key, ranks) if k is not None]
        heapq.heapify(self._heap)

    def renew(self, rank: int) -> None:
        """`rank`'s key may have fallen: its entry of now goes in (the old one is found stale)."""
        key = self._key(rank)
        if key is not None:
            heapq.heappush(self._heap, key)

    def ranks(self, length: int, costs: dict[int, Key]) -> Iterator[int]:
        """The ranks that take new sequences in the order of a sequence's cost on each: `costs[rank]`
        for the ranks in `costs` (those its prefix may hit: (tokens ahead + length - hit, -free
        blocks, sequences, rank)), (tokens ahead + `length`, -free blocks, sequences, rank) for the
        others. The keys are read as the iteration reaches them; a placement changes only the rank
        it placed on, after which nothing more is asked. Close the iterator when done: the entries it
        took from the heap go back."""
        extra = sorted(costs.values())
        heap, key = self._heap, self._key
        taken: list[Key] = []
        seen: set[int] = set()
        i = 0
        try:
            while True:
                top = None
                while heap:
                    k = heap[0]
                    rank = k[3]
                    if rank in costs or rank in seen:  # costed apart, or a second entry of one already given
                        taken.append(heapq.heappop(heap))
                        continue
                    now = key(rank)
                    if now != k:  # stale: it grew since
                        heapq.heappop(heap)
                        if now is not None:
                            heapq.heappush(heap, now)
                        continue
                    top = (k[0] + length, k[1], k[2], rank)
                    break
                if i < len(extra) and (top is None or extra[i] < top):
                    rank = extra[i][3]
                    i += 1
                elif top is not None:
                    taken.append(heapq.heappop(heap))
                else:
                    return
                seen.add(rank)
                yield rank
        finally:
            for k in taken:
                self.renew(k[3])
