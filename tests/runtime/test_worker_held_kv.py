"""What an adopted worker tells a new leader it holds (runtime/held.py `HeldSequences.held_kv`): each sequence's
tokens and the blocks of the positions steps that completed wrote; a step that failed (a takeover
aborts one mid-layer) is forgotten from its chunks' start, so its half-written positions are never
offered. On a real KVCache and the rank's HeldSequences (no process)."""

from __future__ import annotations

from elastic_ep.model.kv_cache import KVCache, KVShape
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.runtime.held import HeldSequences
from elastic_ep.wire import ChunkPlan, DecodeRows, HeldKV, StepPlan

PARAMS = SamplingParams(max_tokens=8)


class Rank:
    """What the worker holds between steps: its KV pool and its HeldSequences."""

    def __init__(self) -> None:
        self.kv: KVCache | None = KVCache(num_layers=1, shape=KVShape(1, 4, 4), num_blocks=8, block_size=4)
        self.held = HeldSequences()

    def held_kv(self) -> list[HeldKV]:
        return self.held.held_kv(self.kv)


def worker() -> Rank:
    return Rank()


def step(w: Rank, chunks: list[ChunkPlan], fails: bool = False, decode: DecodeRows | None = None) -> None:
    """A step's allocation and its forward's writes (begin_chunk, as the model does); `fails`: it
    raised mid-way, as the worker's step handles it."""
    plan = StepPlan(0, 1, chunks, [], decode=decode)
    w.held.allocate(w.kv, plan)
    for run in w.held.runs(plan):
        w.kv.begin_chunk(run.seq_id, run.start_pos, len(run.token_ids))
    if fails:
        w.held.forget_failed(w.kv, plan)


def test_the_held_kv_is_what_completed_steps_wrote_and_a_failed_step_is_forgotten():
    w = worker()
    prompt = [11, 12, 13, 14, 15, 16]
    step(w, [ChunkPlan(3, prompt, 0, True, PARAMS, 7, 6, [5, 2])])
    step(w, [ChunkPlan(3, [40], 6, True, PARAMS, 7, 6, [5, 2])])
    assert w.held_kv() == [HeldKV(3, 6, prompt + [40], [5, 2])]
    step(w, [ChunkPlan(3, [41], 7, True, PARAMS, 7, 6, [5, 2])], fails=True)  # aborted by the takeover
    assert w.held_kv() == [HeldKV(3, 6, prompt + [40], [5, 2])]
    step(w, [ChunkPlan(3, [41], 7, True, PARAMS, 7, 6, [5, 2, 1])])  # a re-run of the failed step goes on
    assert w.held_kv() == [HeldKV(3, 6, prompt + [40, 41], [5, 2])]


def test_a_sequence_whose_first_chunk_failed_and_a_prefix_hit_offer_only_what_they_hold():
    w = worker()
    step(w, [ChunkPlan(1, [1, 2, 3, 4, 5], 0, False, PARAMS, 7, 9, [0, 1, 2])], fails=True)
    # a prefix hit: 4 positions in a shared block, told with the first chunk
    step(w, [ChunkPlan(2, [6, 7], 4, True, PARAMS, 7, 6, [0, 3], cached_token_ids=[1, 2, 3, 4])])
    assert w.held_kv() == [HeldKV(2, 6, [1, 2, 3, 4, 6, 7], [0, 3])]
    w.kv = None  # asleep: nothing held
    assert w.held_kv() == []


def test_a_failed_step_of_decode_rows_is_forgotten_from_each_rows_position():
    w = worker()
    prompt = [11, 12, 13, 14, 15, 16]
    step(w, [ChunkPlan(3, prompt, 0, True, PARAMS, 7, 6, [5, 2])])
    step(w, [], decode=DecodeRows([3], [40], [6]))  # a decode row: the rank keeps the sequence
    assert w.held_kv() == [HeldKV(3, 6, prompt + [40], [5, 2])]
    step(w, [], fails=True, decode=DecodeRows([3], [41], [7]))  # aborted by the takeover
    assert w.held_kv() == [HeldKV(3, 6, prompt + [40], [5, 2])]
    step(w, [], decode=DecodeRows([3], [41], [7]))
    assert w.held_kv() == [HeldKV(3, 6, prompt + [40, 41], [5, 2])]
