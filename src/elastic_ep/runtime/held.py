"""What a rank holds of each of its sequences between steps, and the step plan applied to it.

Per sequence: the tokens whose KV the rank holds, at the same positions (the sampler's history),
and what its first `ChunkPlan` on the rank said that its decode rows (`DecodeRows`: seq_id,
token, position, new block ids) leave out: its sampling params, seed and prompt length (`Kept`;
its block table is the KV cache's). The controller sends a sequence's decode as a row only while
it knows the rank keeps it (control/serving/scheduler.py); the rank drops what it kept when the
sequence is freed, when a KV copy of it arrives, when the epoch changes, and when it sleeps or
follows a new leader (`clear`). A row naming a sequence that is not kept is an error of the
step (RuntimeError, which the worker reports as a LOCAL `StepFailed`), never a guess. So is a row
whose token is `SAMPLED_TOKEN` (a step the controller planned while the one before ran) for a
sequence this rank did not sample in the step before, of the same epoch (`fill_sampled`).
"""

from __future__ import annotations

from typing import NamedTuple

from elastic_ep.model.block_manager import blocks_for
from elastic_ep.model.kv_cache import KVCache
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import SAMPLED_TOKEN, HeldKV, KVMove, StepFailed, StepPlan, StepResult


class Kept(NamedTuple):
    """What a sequence's decode rows leave out, from its last `ChunkPlan` on this rank."""

    params: SamplingParams
    seed: int
    prompt_len: int


class StepRun(NamedTuple):
    """One sequence's tokens in a step, from a `ChunkPlan` or a decode row."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    sample: bool


class HeldSequences:
    """`tokens`: seq_id -> the tokens whose KV this rank holds; `prompt_lens`: seq_id -> its
    prompt's length, while its tokens are held (a new leader of a controller group matches held KV
    on the prompt, control/serving/adopted_kv.py); `kept`: seq_id -> `Kept`, for the sequences
    given a `ChunkPlan` in epoch `epoch` and not dropped since."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.prompt_lens: dict[int, int] = {}
        self.kept: dict[int, Kept] = {}
        self.epoch = -1

    def clear(self) -> None:
        """Nothing held (the KV cache freed, or a new leader that numbers its own sequences)."""
        self.tokens, self.prompt_lens, self.kept = {}, {}, {}

    def start(self, plan: StepPlan) -> None:
        """A step of `plan.epoch` begins: nothing is kept of another epoch's sequences (the
        controller forgets in a new epoch what the ranks kept)."""
        if plan.epoch != self.epoch:
            self.kept, self.epoch = {}, plan.epoch

    def free(self, kv: KVCache, seq_ids: list[int]) -> None:
        """Finished (or moved away) sequences: their KV rows, tokens and what was kept go."""
        for seq_id in seq_ids:
            kv.free(seq_id)
            self.tokens.pop(seq_id, None)
            self.prompt_lens.pop(seq_id, None)
            self.kept.pop(seq_id, None)

    def moved_in(self, moves: list[KVMove], rank_id: int) -> None:
        """KV copies arrived on `rank_id` (their tokens set by the move): each is known from its
        first chunk here on, not from what may have been kept of it before."""
        for move in moves:
            if move.dst_rank == rank_id:
                self.kept.pop(move.seq_id, None)

    def held_kv(self, kv: KVCache | None) -> list[HeldKV]:
        """Every sequence whose KV this rank holds in `kv` (None: asleep, nothing): the positions
        written whole (a failed step's were forgotten, `forget_failed`), their tokens and blocks."""
        if kv is None:
            return []
        held = []
        for seq_id, tokens in self.tokens.items():
            if seq_id < 0 or seq_id not in kv or seq_id not in self.prompt_lens:
                continue
            n = min(len(tokens), kv.length(seq_id))
            if n:
                held.append(HeldKV(seq_id, self.prompt_lens[seq_id], tokens[:n],
                                   kv.block_table(seq_id)[:blocks_for(n, kv.block_size)]))
        return held

    def forget_failed(self, kv: KVCache, plan: StepPlan) -> None:
        """A step that failed may have written its chunks' and decode rows' positions in some layers
        only: each of its sequences holds KV up to its chunk's (row's) start from now on (a re-run
        writes the rest again; a new leader is not offered those positions)."""
        starts = [(c.seq_id, c.start_pos) for c in plan.chunks]
        if plan.decode is not None:
            starts += zip(plan.decode.seq_ids, plan.decode.positions, strict=False)
        for seq_id, start_pos in starts:
            tokens = self.tokens.get(seq_id)
            if tokens is None or seq_id not in kv:
                continue
            del tokens[start_pos:]
            kv.set_blocks(seq_id, kv.block_table(seq_id), num_cached=min(start_pos, kv.length(seq_id)))

    @staticmethod
    def fill_sampled(plan: StepPlan, last: StepResult | StepFailed | None) -> dict[int, str]:
        """Put in each decode row's token that is `SAMPLED_TOKEN` the token this rank sampled for its
        sequence in `last`, its answer to the step before. A row whose sequence's sampling failed there
        (`last.errors`; a step sent before that one completed, serve --send-ahead-steps) is taken out of
        the plan: returns seq_id -> why, the errors of this step for those. RuntimeError naming the
        sequences it did not sample there for any other reason (or when `last` is not the step before
        of the same epoch)."""
        rows = plan.decode
        if rows is None or SAMPLED_TOKEN not in rows.tokens or len(rows.tokens) != len(rows.seq_ids):
            return {}  # nothing to fill in (rows of unequal lengths fail in `runs`)
        before = isinstance(last, StepResult) and (last.epoch, last.step) == (plan.epoch, plan.step - 1)
        sampled = last.tokens if before else {}
        failed = last.errors if before else {}
        tokens, missing, dropped = rows.tokens, [], {}
        for i, (seq_id, token) in enumerate(zip(rows.seq_ids, tokens, strict=True)):
            if token == SAMPLED_TOKEN:
                if seq_id in sampled:
                    tokens[i] = sampled[seq_id]
                elif seq_id in failed:
                    dropped[seq_id] = f"no token to run: sampling it failed in step {plan.step - 1} ({failed[seq_id]})"
                else:
                    missing.append(seq_id)
        if missing:
            raise RuntimeError(f"decode rows for sequences {missing[:5]} take the token this rank sampled in step "
                               f"{plan.step - 1} of epoch {plan.epoch}, and it sampled none for them there")
        if dropped:  # the plan is frozen, its lists are not: the rows go from each
            keep = [i for i, q in enumerate(rows.seq_ids) if q not in dropped]
            for column in (rows.seq_ids, rows.tokens, rows.positions):
                column[:] = [column[i] for i in keep]
            rows.new_blocks[:] = [(q, b) for q, b in rows.new_blocks if q not in dropped]
        return dropped

    def runs(self, plan: StepPlan) -> list[StepRun]:
        """The plan's chunks, then its decode rows, as the forward runs them. Raises RuntimeError
        for decode rows that do not fit together (lists of different lengths, a sequence twice in
        the step) or that name a sequence not kept."""
        runs = [StepRun(c.seq_id, c.token_ids, c.start_pos, c.sample) for c in plan.chunks]
        rows = plan.decode
        if rows is None:
            return runs
        if not len(rows.seq_ids) == len(rows.tokens) == len(rows.positions):
            raise RuntimeError(f"decode rows of {len(rows.seq_ids)} seq_ids, {len(rows.tokens)} tokens and "
                               f"{len(rows.positions)} positions")
        unknown = [q for q in rows.seq_ids if q not in self.kept]
        if unknown:
            raise RuntimeError(f"decode rows for sequences {unknown[:5]} this rank does not keep")
        runs += [StepRun(q, [t], p, True) for q, t, p in zip(rows.seq_ids, rows.tokens, rows.positions, strict=True)]
        if len({r.seq_id for r in runs}) != len(runs):
            raise RuntimeError("a sequence appears twice in the step's plan")
        return runs

    def allocate(self, kv: KVCache, plan: StepPlan) -> None:
        """Give every sequence of a chunk its block table (a new one starts with the positions
        its shared prefix blocks hold) and keep what its decode rows will leave out; grow the
        tables of the decode rows' sequences by their new blocks; track every sequence's tokens.
        Call after `runs`, which checks that every decode row's sequence is kept."""
        for c in plan.chunks:
            if c.start_pos == 0 or c.seq_id not in kv:
                kv.set_blocks(c.seq_id, c.block_ids, num_cached=len(c.cached_token_ids))
                self.tokens[c.seq_id] = list(c.cached_token_ids)
            else:
                kv.set_blocks(c.seq_id, c.block_ids)
            self.kept[c.seq_id] = Kept(c.params, c.seed, c.prompt_len)
            self.prompt_lens[c.seq_id] = c.prompt_len
            _extend(self.tokens[c.seq_id], c.seq_id, c.start_pos, c.token_ids)
        rows = plan.decode
        if rows is None:
            return
        if rows.new_blocks:
            grown: dict[int, list[int]] = {}
            for seq_id, block_id in rows.new_blocks:
                grown.setdefault(seq_id, []).append(block_id)
            decoded = set(rows.seq_ids)
            for seq_id, block_ids in grown.items():
                if seq_id not in decoded:
                    raise RuntimeError(f"new blocks for sequence {seq_id}, which has no decode row in the step")
                kv.set_blocks(seq_id, kv.block_table(seq_id) + block_ids)
        for seq_id, token, position in zip(rows.seq_ids, rows.tokens, rows.positions, strict=True):
            _extend(self.tokens[seq_id], seq_id, position, [token])


def _extend(held: list[int], seq_id: int, start_pos: int, token_ids: list[int]) -> None:
    """`token_ids` at `start_pos` of the tokens held for `seq_id` (a re-run step overwrites, as the
    KV cache does); RuntimeError when positions before start_pos are missing."""
    if len(held) < start_pos:
        raise RuntimeError(f"sequence {seq_id}: chunk at {start_pos} but {len(held)} tokens held")
    held[start_pos:] = token_ids
