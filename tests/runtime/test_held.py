"""Compact decode plans on the rank's side: what a sequence's first `ChunkPlan` left is kept for
its decode rows (params, seed, prompt length, block table grown by the rows' new blocks), dropped
when it is freed, copied in, or the epoch changes; rows that do not fit are errors, not guesses;
the plan crosses the codec typed (a row of the wrong type is a dropped frame, never a crash)."""

from __future__ import annotations

import msgspec
import pytest

from elastic_ep.model.kv_cache import KVCache, KVShape
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.runtime.held import HeldSequences, Kept, StepRun
from elastic_ep.wire import CONTROLLER_TO_WORKER, ChunkPlan, ClusterKey, DecodeRows, Inbox, KVMove, StepPlan

PARAMS = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20)


def kv_cache() -> KVCache:
    return KVCache(1, KVShape(1, 2, 2), num_blocks=8, block_size=4)


def apply(held: HeldSequences, kv: KVCache, plan: StepPlan) -> list[StepRun]:
    """What the worker does with a plan before its forward (runtime/worker.py `_before_forward`)."""
    held.start(plan)
    held.free(kv, plan.free)
    held.moved_in(plan.kv_moves, 0)
    runs = held.runs(plan)
    held.allocate(kv, plan)
    return runs


def first_chunk(seq_id: int = 3, epoch: int = 1) -> StepPlan:
    return StepPlan(epoch, 1, [ChunkPlan(seq_id, [11, 12, 13], 0, True, PARAMS, 7, 3, [2])], [])


def decode(epoch: int, *rows: tuple[int, int, int], new_blocks: list[tuple[int, int]] | None = None) -> StepPlan:
    return StepPlan(epoch, 2, [], [], decode=DecodeRows([q for q, _, _ in rows], [t for _, t, _ in rows],
                                                        [p for _, _, p in rows], new_blocks or []))


def test_decode_rows_run_on_what_the_first_chunk_left_and_grow_the_table_by_their_new_blocks():
    held, kv = HeldSequences(), kv_cache()
    apply(held, kv, first_chunk())
    assert apply(held, kv, decode(1, (3, 21, 3))) == [StepRun(3, [21], 3, True)]
    assert kv.block_table(3) == [2] and held.tokens[3] == [11, 12, 13, 21]
    # position 4 is the first of the second block: the row brings its id, the rest of the table stays
    apply(held, kv, decode(1, (3, 22, 4), new_blocks=[(3, 5)]))
    assert kv.block_table(3) == [2, 5] and held.tokens[3] == [11, 12, 13, 21, 22]
    assert held.kept[3] == Kept(PARAMS, 7, 3)  # the sampler's params, seed and prompt/output split


def test_what_is_kept_goes_with_a_free_a_copy_in_and_a_new_epoch():
    held, kv = HeldSequences(), kv_cache()
    apply(held, kv, first_chunk())
    apply(held, kv, StepPlan(1, 2, [], [3]))  # freed
    with pytest.raises(RuntimeError, match=r"sequences \[3\] this rank does not keep"):
        apply(held, kv, decode(1, (3, 21, 3)))
    apply(held, kv, first_chunk())
    apply(held, kv, StepPlan(1, 2, [], [], kv_moves=[KVMove(3, 1, 0, [11, 12, 13], [4])]))  # a copy arrives
    with pytest.raises(RuntimeError, match="does not keep"):
        apply(held, kv, decode(1, (3, 21, 3)))
    apply(held, kv, first_chunk(epoch=1))
    with pytest.raises(RuntimeError, match="does not keep"):  # a new epoch: the controller sends a chunk first
        apply(held, kv, decode(2, (3, 21, 3)))
    assert held.tokens[3] == [11, 12, 13]  # the KV rows and their tokens stay: only the plan's state goes


@pytest.mark.parametrize("plan, error", [
    (StepPlan(1, 2, [], [], decode=DecodeRows([3], [21, 22], [3])), "1 seq_ids, 2 tokens and 1 positions"),
    (decode(1, (3, 21, 3), (3, 22, 4)), "twice"),
    (StepPlan(1, 2, [ChunkPlan(3, [21], 3, True, PARAMS, 7, 3, [2])], [], decode=DecodeRows([3], [21], [3])),
     "twice"),
    (decode(1, (3, 21, 3), new_blocks=[(4, 5)]), "new blocks for sequence 4"),
    (decode(1, (3, 21, 3), new_blocks=[(3, 99)]), "outside the pool"),
    (decode(1, (3, 21, 9)), "chunk at 9 but 3 tokens held"),
])
def test_decode_rows_that_do_not_fit_are_an_error_of_the_step(plan, error):
    held, kv = HeldSequences(), kv_cache()
    apply(held, kv, first_chunk())
    with pytest.raises((RuntimeError, ValueError), match=error):
        apply(held, kv, plan)


def test_a_compact_plan_crosses_the_codec_typed_and_a_mistyped_row_is_dropped():
    key = ClusterKey.generate()
    inbox = Inbox("worker_step", CONTROLLER_TO_WORKER, key)
    plan = decode(4, (3, 21, 3), (8, 5, 40), new_blocks=[(8, 6)])
    assert inbox.read(key.seal(plan)) == plan
    # the same plan with a token that is not an integer: authenticated, but not a message of this version
    fields = msgspec.to_builtins(plan)
    body = msgspec.msgpack.encode(fields)
    assert inbox.read([key.mac(body, 0), body]) == plan
    fields[-1][1][0] = "21"
    body = msgspec.msgpack.encode(fields)
    assert inbox.read([key.mac(body, 0), body]) is None
