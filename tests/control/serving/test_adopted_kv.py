"""A new leader takes over the KV its adopted ranks still hold (control/serving/adopted_kv.py): a
journaled request is placed on the rank holding the most of its tokens, its first chunk starts
past the kept positions (told as a prefix hit's are), only positions whose tokens the journal
confirms are kept, a shared block is never written into, the held blocks are reserved from other
requests until taken or released (all taken, a pool short of blocks, the hold expired)."""

from __future__ import annotations

from elastic_ep.control.api import GenerationRequest
from elastic_ep.control.serving.adopted_kv import reusable
from elastic_ep.control.serving.scheduler import Scheduler, Sequence
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import HeldKV

BS = 4
PROMPT = list(range(100, 110))  # 10 tokens


def journaled(request_id: str, seq_id: int, output: list[int], prompt: list[int] = PROMPT) -> Sequence:
    request = GenerationRequest(request_id, list(prompt), SamplingParams(max_tokens=32), 7, tuple(output))
    return Sequence(seq_id, request, 512, (0,), resumed_output=list(output))


def held(tokens: list[int], blocks: list[int], prompt_len: int = len(PROMPT), seq_id: int = 40) -> HeldKV:
    return HeldKV(seq_id, prompt_len, tokens, blocks)


def scheduler(num_blocks: int = 32, clock=lambda: 0.0) -> Scheduler:
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=num_blocks, block_size=BS, clock=clock)
    s.set_ranks([0, 1])
    return s


def first_chunk(batch, seq_id: int):
    return next(c for cs in batch.chunks.values() for c in cs if c.seq_id == seq_id)


def test_the_kept_positions_are_the_common_prefix_with_one_known_token_left_to_compute():
    known = [1, 2, 3, 4, 5]
    assert reusable(known, [1, 2, 3, 4]) == 4  # the journal one ahead: the KV decodes on
    assert reusable(known, [1, 2, 3, 4, 5, 6, 7]) == 4  # behind: its last token runs again to sample
    assert reusable(known, [1, 2, 9, 4]) == 2  # the KV of unconfirmed tokens is never trusted
    assert reusable(known, [7]) == 0 and reusable([1], [1, 2]) == 0 and reusable([], []) == 0


def test_a_journaled_request_takes_over_the_kv_its_rank_held_and_computes_only_what_it_lacks():
    s = scheduler()
    output = [7, 8, 9]
    s.take_over_kv({1: [held(PROMPT + output[:2], [5, 9, 2])]}, {"r1", "r2"}, hold_s=10)
    assert s.pools[1].num_free_blocks == 32 - 3  # reserved from other requests
    s.add(journaled("r1", 0, output))
    batch = s.schedule()
    chunk = first_chunk(batch, 0)
    assert batch.chunks[0] == []  # rank 0 was as good a choice for a request of its own: the KV decides
    assert (chunk.start_pos, chunk.token_ids, chunk.sample) == (12, [9], True)
    assert chunk.cached_token_ids == PROMPT + output[:2]  # the rank is told what its blocks hold
    assert chunk.block_ids[:3] == [5, 9, 2] and len(chunk.block_ids) == 4
    assert (batch.kv_kept, batch.kv_reprefilled) == (12, 0)
    assert s.kv_offers.view() == {"reused": 12, "reprefilled": 0, "dropped": 0, "requests_kept": 1,
                                  "requests_reprefilled": 0, "held": 0}


def test_a_journal_behind_the_kv_keeps_its_own_length_and_disagreeing_tokens_are_computed_again():
    s = scheduler()
    s.take_over_kv({0: [held(PROMPT + [7, 8, 9, 10], [0, 1, 2, 3], seq_id=1)],
                    1: [held(PROMPT + [7, 3], [4, 5, 6], seq_id=2)]}, {"behind", "other"}, hold_s=10)
    s.add(journaled("behind", 0, [7, 8]))  # the journal lags the KV by two tokens
    s.add(journaled("other", 1, [7, 8]))  # same prompt, another request: its second token disagrees
    batch = s.schedule()
    behind, other = first_chunk(batch, 0), first_chunk(batch, 1)
    assert (behind.start_pos, behind.token_ids) == (11, [8])  # the token the journal has last runs again
    assert behind.block_ids[:3] == [0, 1, 2]
    assert (other.start_pos, other.token_ids) == (11, [8])  # kept up to where the tokens agree
    assert other.block_ids[:3] == [4, 5, 6]
    assert s.kv_offers.counts["reused"] == 22 and s.kv_offers.counts["dropped"] == 3 + 1


def test_the_block_written_next_is_never_one_another_holder_shares():
    s = scheduler()
    prompt = PROMPT[:6]
    # two sequences of one prompt whose first two blocks were shared on the last leader (a prefix hit)
    s.take_over_kv({0: [held(prompt + [106, 107, 1, 2], [0, 1, 2], prompt_len=6, seq_id=1),
                        held(prompt + [106, 107, 3, 4], [0, 1, 3], prompt_len=6, seq_id=2)]}, {"again"}, hold_s=10)
    s.add(journaled("again", 0, [], prompt=prompt))  # 5 positions agree, the fifth in shared block 1
    chunk = first_chunk(s.schedule(), 0)
    assert (chunk.start_pos, chunk.token_ids) == (4, prompt[4:])  # block 1 is not written into
    assert chunk.block_ids[0] == 0 and chunk.block_ids[1] != 1  # a block of its own instead
    assert s.kv_offers.counts["reused"] == 4 and s.kv_offers.counts["reprefilled"] == 1


def test_held_blocks_are_reserved_until_every_journaled_request_is_placed_then_released():
    s = scheduler(num_blocks=8)
    s.take_over_kv({0: [held(PROMPT + [7], [0, 1, 2])], 1: [held(PROMPT + [5], [0, 1, 2], seq_id=41)]},
                   {"a", "b"}, hold_s=10)
    s.add(journaled("a", 0, [7, 8]))
    s.schedule()
    assert s.pools[1].num_free_blocks == 8 - 3  # still held for "b"
    s.add(journaled("b", 1, [6, 2], prompt=[1, 2, 3]))  # another prompt: nothing of it is held
    s.schedule()
    # "b" placed: what nobody took went back (the pools hold "a"'s 3 blocks and "b"'s 2)
    assert sum(p.num_free_blocks for p in s.pools.values()) == 16 - 3 - 2
    assert s.kv_offers.view()["held"] == 0 and s.kv_offers.counts["requests_reprefilled"] == 1


def test_a_request_not_journaled_never_takes_held_kv_and_a_pool_short_of_blocks_releases_it_first():
    s = scheduler(num_blocks=4)
    s.set_ranks([0])
    s.take_over_kv({0: [held(PROMPT + [7], [0, 1, 2])]}, {"j"}, hold_s=10)
    s.add(journaled("new", 0, [7, 8]))  # same tokens, but not the last leader's request
    batch = s.schedule()
    assert first_chunk(batch, 0).start_pos == 0  # it computes everything, in blocks the offer gave back
    assert s.kv_offers.view()["held"] == 0 and s.kv_offers.counts["dropped"] == 11


def test_held_kv_nobody_takes_is_released_when_the_hold_expires():
    now = [0.0]
    s = scheduler(clock=lambda: now[0])
    s.take_over_kv({0: [held(PROMPT + [7], [0, 1, 2])]}, {"never"}, hold_s=10)
    s.schedule()
    assert s.pools[0].num_free_blocks == 32 - 3
    now[0] = 11.0
    s.schedule()
    assert s.pools[0].num_free_blocks == 32 and s.kv_offers.counts["dropped"] == 11
