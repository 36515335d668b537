"""The scheduler: even token counts per rank, chunked prefill, limits, re-prefill after a rank dies."""

from __future__ import annotations

from elastic_ep.control.api import GenerationRequest
from elastic_ep.control.serving.alignment import AlignRule
from elastic_ep.control.serving.sampled import Sampled
from elastic_ep.control.serving.scheduler import Scheduler, Sequence
from elastic_ep.model.sampling import SamplingParams

EOS = 0


def seq(seq_id: int, prompt_len: int, max_tokens: int = 4, max_model_len: int = 512) -> Sequence:
    request = GenerationRequest(str(seq_id), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 7)
    return Sequence(seq_id, request, max_model_len, (EOS,))


def run_step(s: Scheduler, token: int = 5):
    batch = s.schedule()
    sampled = {q: token for r in batch.chunks for q, _, _, sample in batch.runs(r) if sample}
    return batch, s.commit(batch, Sampled.unranked(sampled))


def test_requests_spread_so_token_counts_per_rank_stay_even():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=1024)
    s.set_ranks([0, 1, 2, 3])
    for i, n in enumerate([100, 10, 10, 10, 10, 10, 10, 60]):
        s.add(seq(i, n))
    batch = s.schedule()
    tokens = batch.tokens_per_rank()
    assert sorted(tokens.values()) == [30, 30, 60, 100]


def test_long_prompt_is_prefilled_in_chunks_then_decoded():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    s.set_ranks([0])
    s.add(seq(1, 40, max_tokens=2))
    starts = []
    outputs = []
    rows = []
    for _ in range(6):
        batch, out = run_step(s)
        starts += [(start, n, sample) for _, start, n, sample in batch.runs(0)]
        rows += [batch.decodes[0].positions] if 0 in batch.decodes else []
        outputs += out
    assert starts[:3] == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert starts[3] == (40, 1, True)
    assert rows == [[40]]  # its decode went as a row of the rank's DecodeRows, its chunks' table kept there
    assert outputs == [(1, [5], None, None), (1, [5], "length", None)]
    assert not s.has_work


def test_max_num_seqs_per_rank_is_respected():
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    s.set_ranks([0, 1])
    for i in range(7):
        s.add(seq(i, 4))
    s.schedule()
    assert [s.num_requests(r) for r in (0, 1)] == [2, 2]
    assert len(s.waiting) == 3


def test_eos_stops_and_frees_the_kv_row_next_step():
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    s.set_ranks([0])
    s.add(seq(1, 3, max_tokens=10))
    _, out = run_step(s, token=EOS)
    assert out == [(1, [EOS], "stop", None)]
    assert s.schedule().free[0] == [1]


def test_sequences_of_a_dead_rank_are_re_prefilled_with_their_tokens_so_far():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    s.set_ranks([0, 1])
    s.add(seq(1, 3, max_tokens=10))
    s.add(seq(2, 3, max_tokens=10))
    run_step(s, token=9)
    run_step(s, token=8)
    victim = s.by_id[1].rank
    s.set_ranks([r for r in (0, 1) if r != victim])
    first, _ = run_step(s)  # the survivors' first step after the loss: their decode alone
    survivor = next(iter(first.chunks))
    assert [(q, n) for q, _, n, _ in first.runs(survivor)] == [(2, 1)]
    batch = s.schedule()
    moved = next(c for c in batch.chunks[survivor] if c.seq_id == 1)
    assert moved.start_pos == 0 and moved.token_ids == [1, 2, 3, 9, 8] and moved.sample


def test_abort_frees_a_running_sequence():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    s.set_ranks([0])
    s.add(seq(1, 3, max_tokens=10))
    run_step(s)
    s.abort(1)
    batch = s.schedule()
    assert batch.free[0] == [1] and batch.empty and not s.has_work


def test_a_lost_ranks_requests_are_re_prefilled_a_budget_per_step_while_the_others_decode():
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=256, reprefill_tokens_per_step=8)
    s.set_ranks([0, 1, 2])
    for i in range(6):
        s.add(seq(i, 10, max_tokens=40))
    for _ in range(4):  # prefill, then three decode steps
        run_step(s)
    moved = s.evict_rank(2)
    s.set_ranks([0, 1])
    assert len(moved) == 2 and all(q.pending == 14 for q in moved)  # 10 prompt + 4 generated
    moved_ids = {q.seq_id for q in moved}
    for _ in range(5):
        batch, _ = run_step(s)
        per_seq = {q: n for r in batch.chunks for q, _, n, _ in batch.runs(r)}
        assert [n for i, n in per_seq.items() if i not in moved_ids] == [1, 1, 1, 1]  # the others decode on
        assert sum(n for i, n in per_seq.items() if i in moved_ids and n > 1) <= 8
    assert all(q.pending == 1 and len(q.output) > 4 for q in moved)  # 28 tokens re-run, 8 a step: caught up


def prompt_seq(seq_id: int, prompt: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id, GenerationRequest(str(seq_id), prompt, SamplingParams(max_tokens=max_tokens), 7), 512,
                    (EOS,))


def test_requests_wait_for_free_blocks_and_the_newest_is_preempted_when_a_decode_needs_one():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=6, block_size=4)
    s.set_ranks([0])
    for i in range(3):  # 2 blocks each for the prompt, prompts of their own (no prefix to wait for)
        s.add(prompt_seq(i, list(range(10 * i + 1, 10 * i + 9)), max_tokens=20))
    batch, _ = run_step(s)
    assert [c.seq_id for c in batch.chunks[0]] == [0, 1, 2] and s.pools[0].num_free_blocks == 0
    s.add(seq(3, 4))
    batch, _ = run_step(s)  # the oldest's next token needs a block: the newest running request gives its up
    assert batch.preempted == 1 and batch.seq_ids_on(0) == [0, 1]
    assert [q.seq_id for q in s.waiting] == [2, 3] and s.by_id[2].rank is None
    # decode rows of sequences rank 0 keeps: only the block each grew by goes, not the whole table
    assert batch.free[0] == [2] and not batch.chunks[0] and all(len(s.pools[0].tables[q]) == 3 for q in (0, 1))
    assert batch.decodes[0].new_blocks == [(q, s.pools[0].tables[q][2]) for q in (0, 1)]


def test_a_preempted_request_is_recomputed_with_its_tokens_so_far_once_blocks_free():
    # prefix caching off: its own prompt blocks, still cached, would spare it the prompt's recompute
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=6, block_size=4, enable_prefix_caching=False)
    s.set_ranks([0])
    for i in range(3):
        s.add(seq(i, 8, max_tokens=6))
    preempted_once = False
    recomputed = []
    while s.has_work:
        batch, _ = run_step(s)
        preempted_once |= batch.preempted > 0
        recomputed += [c for c in batch.chunks[0] if c.seq_id == 2 and c.start_pos == 0]
    assert preempted_once
    # its second prefill is the prompt plus the token it had before it was preempted
    assert [len(c.token_ids) for c in recomputed] == [8, 9]


def test_a_new_request_goes_to_the_rank_holding_its_prefix_and_starts_after_the_cached_blocks():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=256, block_size=4)
    s.set_ranks([0, 1])
    shared = list(range(100, 120))
    s.add(prompt_seq(0, shared + [1]))
    batch, _ = run_step(s)
    home = next(r for r, cs in batch.chunks.items() if cs)
    s.add(prompt_seq(1, shared + [2, 3]))
    batch, _ = run_step(s)
    chunk = next(c for c in batch.chunks[home] if c.seq_id == 1)
    assert (chunk.start_pos, chunk.token_ids, chunk.cached_token_ids) == (20, [2, 3], shared)
    assert chunk.block_ids[:5] == s.pools[home].tables[0][:5]
    assert (batch.prefix_queried, batch.prefix_hit) == (22, 20)
    batch, _ = run_step(s)  # the rank now holds those tokens: not sent again, it decodes in a row
    assert batch.seq_ids_on(home) == [0, 1] and not batch.chunks[home]


def test_a_prefix_hit_does_not_outweigh_a_rank_busier_by_more_than_the_hit():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, block_size=4)
    s.set_ranks([0, 1])
    shared = list(range(100, 108))
    s.add(prompt_seq(0, shared + [1]))
    run_step(s)
    run_step(s)
    home = s.by_id[0].rank
    s.add(prompt_seq(1, list(range(200, 240))))  # 40 tokens of prefill ahead wherever it goes
    run_step(s)
    assert s.by_id[1].rank != home
    s.add(prompt_seq(2, shared + [2]))  # an 8-token hit at home, where 1 token is ahead; 32 ahead elsewhere
    run_step(s)
    assert s.by_id[2].rank == home


def prefill_starts(batch, seq_id: int) -> list[int]:
    return [c.start_pos for cs in batch.chunks.values() for c in cs if c.seq_id == seq_id]


def test_a_request_whose_prefix_another_is_computing_waits_for_it_then_hits_it():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, block_size=4)
    s.set_ranks([0])
    shared = list(range(100, 120))  # 5 blocks, computed over 3 steps of 8 tokens
    s.add(prompt_seq(0, shared + [1, 3]))  # the longer is placed first
    s.add(prompt_seq(1, shared + [2]))  # admitted in the same step: it waits while 0 computes the prefix
    starts = []
    for _ in range(3):
        batch, _ = run_step(s)
        starts.append((prefill_starts(batch, 0), prefill_starts(batch, 1)))
        assert s.by_id[1].rank is None and list(s.waiting)[0].seq_id == 1
    assert starts == [([0], []), ([8], []), ([16], [])]
    batch, _ = run_step(s)
    chunk = next(c for c in batch.chunks[0] if c.seq_id == 1)
    assert (chunk.start_pos, chunk.token_ids, chunk.cached_token_ids) == (20, [2], shared)
    assert chunk.block_ids[:5] == s.pools[0].tables[0][:5]
    assert (batch.prefix_queried, batch.prefix_hit) == (21, 20)


def test_a_waiter_goes_to_the_rank_computing_its_prefix_when_that_rank_is_not_busier_by_more():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, block_size=4)
    s.set_ranks([0, 1])
    shared = list(range(100, 132))
    s.add(prompt_seq(0, shared + [1]))
    s.add(prompt_seq(1, list(range(200, 220))))
    run_step(s)
    home = s.by_id[0].rank
    # 25 tokens ahead at home, 12 on the other rank; a 33-token request hits 8 cached tokens at home and
    # 24 more being computed there: 25 + 33 - 32 = 26 against 12 + 33 = 45 (with the cached 8 alone: 50)
    s.add(prompt_seq(2, shared + [2]))
    for _ in range(5):
        run_step(s)
    assert s.by_id[2].rank == home and s.by_id[2].num_cached >= 32


def test_a_waiter_whose_prefix_computer_is_aborted_proceeds_and_computes_it():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, block_size=4)
    s.set_ranks([0])
    shared = list(range(100, 120))
    s.add(prompt_seq(0, shared + [1, 3]))  # the longer is placed first
    s.add(prompt_seq(1, shared + [2]))
    batch = s.schedule()
    assert prefill_starts(batch, 1) == [] and s.by_id[1].prefix_wait == (0, 0)
    s.abort(0)  # its first 8 tokens ran, but it leaves before their blocks are committed
    s.commit(batch, Sampled())
    batch, _ = run_step(s)
    assert prefill_starts(batch, 1) == [0] and (batch.prefix_queried, batch.prefix_hit) == (21, 0)


def test_a_waiter_stops_waiting_when_the_prefix_computer_made_no_progress_or_is_held():
    shared = list(range(100, 120))
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, block_size=4)
    s.set_ranks([0])
    s.add(prompt_seq(0, shared + [1, 3]))  # the longer is placed first
    s.add(prompt_seq(1, shared + [2]))
    s.step_failed(s.schedule())  # 1 waited; the step failed, so 0 computed nothing
    run_step(s)  # placed, behind 0 in the rank's 8 tokens, with nothing cached
    assert (s.by_id[1].rank, s.by_id[1].num_cached, s.by_id[1].prefix_wait) == (0, 0, None)
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, block_size=4)
    s.set_ranks([0])
    s.add(prompt_seq(0, shared + [1, 3]))
    s.add(prompt_seq(1, shared + [2]))
    run_step(s)
    s.hold({0})  # a failed step's suspect, left out of the steps: 1 waits no more, taking what 0 committed
    batch, _ = run_step(s)
    assert prefill_starts(batch, 1) == [8] and prefill_starts(batch, 0) == []


def test_a_waiter_whose_prefix_computer_is_preempted_is_not_stuck_and_every_request_finishes():
    # 7 blocks of 4: the decode of 0 takes the last free block in step 3 and preempts 1, the newest
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=9, num_blocks=7, block_size=4)
    s.set_ranks([0])
    s.add(prompt_seq(0, list(range(200, 207)), max_tokens=3))
    run_step(s)
    shared = list(range(100, 116))
    s.add(prompt_seq(1, shared + [1], max_tokens=2))
    s.add(prompt_seq(2, shared + [2], max_tokens=2))
    batch, _ = run_step(s)
    assert prefill_starts(batch, 1) == [0] and s.by_id[2].prefix_wait == (1, 0)
    batch, _ = run_step(s)
    assert batch.preempted == 1 and s.by_id[1].rank is None
    assert s.pools[0].computing_prefix(s.by_id[2].tokens) == (0, None)  # its claims went with its blocks
    first_chunk = {}
    for _ in range(20):
        if not s.has_work:
            break
        batch, _ = run_step(s)
        for c in batch.chunks[0]:
            first_chunk.setdefault(c.seq_id, c.start_pos)
    assert not s.has_work
    assert first_chunk[1] == 8 and first_chunk[2] == 16  # 1 kept its 2 computed blocks; 2 hit all 4


def test_without_prefix_caching_same_prefix_requests_are_prefilled_together():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, enable_prefix_caching=False)
    s.set_ranks([0])
    shared = list(range(100, 120))
    s.add(prompt_seq(0, shared + [1, 3]))  # the longer is placed first
    s.add(prompt_seq(1, shared + [2]))
    batch, _ = run_step(s)
    assert prefill_starts(batch, 0) == [0] and prefill_starts(batch, 1) == [0]


def test_a_request_placed_again_before_it_ran_counts_its_prefix_lookup_once():
    # --dp-align places unstarted prefills again every step: 1 waits behind 0's 8-token chunks
    # for 3 steps and is placed each time, but is looked up once, from the placement it runs from
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, align=AlignRule(min_chunk=1, migrate="off"),
                  block_size=4)
    s.set_ranks([0])
    shared = list(range(100, 116))
    s.add(prompt_seq(9, shared + [9], max_tokens=1))
    while s.has_work:
        run_step(s)
    s.add(prompt_seq(0, list(range(200, 224)), max_tokens=1))
    s.add(prompt_seq(1, shared + [1], max_tokens=1))
    queried = hit = 0
    for _ in range(10):
        batch, _ = run_step(s)
        queried, hit = queried + batch.prefix_queried, hit + batch.prefix_hit
    assert not s.has_work
    assert (queried, hit) == (24 + 17, 16)


def test_a_wait_is_counted_once_as_it_begins_and_its_steps_as_it_goes_on_and_the_flag_turns_it_off():
    shared = list(range(100, 120))
    waits = []
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=8, block_size=4)
    s.set_ranks([0])
    s.add(prompt_seq(0, shared + [1, 3]))  # the longer is placed first and computes 20 tokens in 3 steps
    s.add(prompt_seq(1, shared + [2]))
    for _ in range(4):
        batch, _ = run_step(s)
        waits.append((batch.prefix_waits, batch.prefix_waiting))
    assert waits == [(1, 1), (0, 1), (0, 1), (0, 0)] and s.by_id[1].num_cached >= 20
    off = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, prefix_wait=False)
    off.set_ranks([0])
    off.add(prompt_seq(0, shared + [1, 3]))
    off.add(prompt_seq(1, shared + [2]))
    batch, _ = run_step(off)  # both prefilled at once: the prefix computed twice, nothing waited
    assert (prefill_starts(batch, 0), prefill_starts(batch, 1)) == ([0], [0])
    assert (batch.prefix_waits, batch.prefix_waiting, batch.prefix_hit) == (0, 0, 0)
