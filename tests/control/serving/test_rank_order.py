"""The order in which a new sequence tries the ranks (control/serving/rank_order.py): the heap of
keys merged with the full costs of the ranks a prefix may hit gives the order of sorting every
rank's full cost, and the scheduler places every request where it did when it worked out each
rank's cost at every placement (the reference below, kept as the definition), over a random
workload with shared prompt prefixes (hits and waits), pools that run out of blocks, full ranks,
draining ranks, bursts of arrivals and ends."""

from __future__ import annotations

import random
import types

from test_scheduler import EOS, prompt_seq

from elastic_ep.control.serving.rank_order import RankOrder
from elastic_ep.control.serving.sampled import Sampled
from elastic_ep.control.serving.scheduler import Scheduler, Sequence


def test_the_heap_and_the_costs_apart_give_the_order_of_every_cost_sorted():
    rng = random.Random(1)
    for _ in range(200):
        state = {r: [rng.randrange(0, 50), -rng.randrange(0, 20), rng.randrange(0, 4)]
                 for r in range(rng.randrange(1, 30))}
        full = {r for r in state if rng.random() < 0.1}

        def key(r: int, state=state, full=full) -> tuple[int, int, int, int] | None:
            return None if r in full else (state[r][0], state[r][1], state[r][2], r)

        order = RankOrder(state, key)
        for _ in range(6):  # placements: each grows the key of the rank it took
            length = rng.randrange(1, 30)
            costs = {r: (state[r][0] + length - rng.randrange(0, 20), state[r][1], state[r][2], r)
                     for r in state if r not in full and rng.random() < 0.2}
            expected = sorted(costs.get(r, (state[r][0] + length, state[r][1], state[r][2], r)) for r in state
                               if r not in full)
            ranks = order.ranks(length, costs)
            got = []
            for rank in ranks:
                got.append(rank)
                if rng.random() < 0.3:
                    break
            ranks.close()
            assert got == [k[3] for k in expected][:len(got)]
            placed = got[-1] if got else None
            if placed is not None:
                state[placed][0] += length
                state[placed][1] += rng.randrange(0, 3)
                state[placed][2] += 1
                if state[placed][2] >= 4:
                    full.add(placed)
            if rng.random() < 0.2:  # a key that falls is told
                r = rng.choice(list(state))
                state[r][1] -= 2
                order.renew(r)


def reference_place(self: Scheduler, seq: Sequence, ahead: dict[int, int], order=None) -> bool:
    """`Scheduler._place` as it was: every rank's cost worked out, all sorted."""
    tokens = seq.tokens
    candidates = [r for r, seqs in self.running.items() if len(seqs) < self.max_num_seqs and r not in self.draining]
    if self.kv_offers is not None and self._take_held_kv(seq, set(candidates), ahead):
        return True
    chain = self.pools[candidates[0]].prefix_chain(tokens) if candidates else []

    def cost(r: int) -> tuple[int, int, int, int]:
        pool = self.pools[r]
        hit = pool.cached_prefix_tokens(tokens, chain) + (
            pool.computing_prefix(tokens, chain)[0] if self.prefix_wait else 0)
        return ahead[r] + len(tokens) - hit, -pool.num_free_blocks, len(self.running[r]), r

    for rank in sorted(candidates, key=cost):
        if self.prefix_wait and self._waits_for_prefix(seq, rank):
            return False
        cached = self.pools[rank].allocate(seq.seq_id, tokens, len(tokens))
        if cached is not None:
            seq.rank, seq.num_cached, seq.unsent_prefix, seq.prefix_wait = rank, cached, cached, None
            self.running[rank].append(seq)
            ahead[rank] += seq.pending
            return True
    return False


def test_requests_are_placed_where_every_ranks_cost_sorted_placed_them():
    rng = random.Random(7)
    ranks = list(range(8))
    fast, each = (Scheduler(max_num_seqs=4, max_num_batched_tokens=12, block_size=4, num_blocks=30) for _ in range(2))
    each._place = types.MethodType(reference_place, each)
    for s in (fast, each):
        s.set_ranks(ranks)
    systems = [[rng.randrange(1, 500) for _ in range(rng.randrange(20, 40))] for _ in range(3)]
    next_id, placed, hits, waits, drains, backlog = 0, 0, 0, 0, 0, 0
    for step in range(400):
        for _ in range(rng.choice([0, 0, 1, 4, 8])):  # bursts: several placements in one schedule
            prompt = rng.choice(systems) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 6))]
            max_tokens = rng.randrange(1, 20)
            for s in (fast, each):
                s.add(prompt_seq(next_id, prompt, max_tokens=max_tokens))
            next_id += 1
        if rng.random() < 0.05:
            drained = rng.sample(ranks, 2) if not fast.draining else []
            for s in (fast, each):
                s.undrain(sorted(s.draining))
                s.drain(drained)
            drains += bool(drained)
        batch = fast.schedule()
        assert batch == each.schedule(), step
        assert {q: s.rank for q, s in fast.by_id.items()} == {q: s.rank for q, s in each.by_id.items()}, step
        placed += sum(1 for cs in batch.chunks.values() for c in cs if c.start_pos == c.prompt_len - len(c.token_ids)
                      or c.cached_token_ids)
        hits, waits, backlog = hits + batch.prefix_hit, waits + batch.prefix_waits, backlog + bool(fast.waiting)
        sampled = {q: (EOS if (q * 13 + p) % 11 == 0 else 100 + (q + p) % 50)
                   for r in batch.chunks for q, p, n, sample in batch.runs(r) if sample for p in (p + n,)}
        assert fast.commit(batch, Sampled.unranked(sampled)) == each.commit(batch, Sampled.unranked(sampled))
    # the workload reached every case: placements in bursts, prefix hits and waits, draining ranks, steps
    # that left requests waiting (no rank with room or blocks for them)
    assert placed > 300 and hits > 100 and waits > 5 and drains > 3 and backlog > 3


def test_a_prefix_another_request_began_computing_in_the_same_step_counts_as_a_hit():
    """The ranks a prefix may hit include those where it is only being computed: the second of two
    requests with one new prefix goes to the rank computing it (and waits there), not to a rank
    with less work ahead that would compute it again."""
    prefix = list(range(1, 25))  # six full blocks of 4
    for place in ("heap", "reference"):
        s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_blocks=64)
        if place == "reference":
            s._place = types.MethodType(reference_place, s)
        s.set_ranks([0, 1])
        s.add(prompt_seq(0, list(range(100, 110))))  # 10 tokens of work on rank 0
        s.schedule()
        s.add(prompt_seq(1, prefix + [201, 202, 203]))
        s.add(prompt_seq(2, prefix + [301, 302]))
        batch = s.schedule()
        assert [s.by_id[q].rank for q in (0, 1, 2)] == [0, 1, None], place  # 2 waits for rank 1's prefix
        assert batch.prefix_waits == 1
