"""The scheduler: which tokens of which sequence each rank runs in the next step.

Continuous batching with chunked prefill, per rank (DP attention: a sequence lives on one
rank, whose KV cache holds it). A new sequence goes to the rank with the fewest tokens of work
ahead (planned this step plus prefill still pending), so token counts per rank stay even and
no rank arrives late at the all-to-all; with an `AlignRule` the step is
evened again every step (control/serving/alignment.py: prefill cut to the step's level, unstarted
prefills placed again, a decoding sequence moved off a rank that stays the busiest). Limits:
`max_num_seqs` sequences per rank, `max_num_batched_tokens` tokens per rank per step.

The scheduler holds every sequence's prompt and generated tokens, so a sequence whose rank
died is simply re-prefilled elsewhere (`evict_rank`): prompt plus tokens so far, at most
`reprefill_tokens_per_step` tokens of such sequences per step over all ranks, so the survivors'
decode is not held up by one long step (every rank waits for the slowest in each MoE layer).
Nothing here does I/O; the controller calls `schedule`, runs the step, then `commit`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from elastic_ep.wire import ChunkPlan, KVMove

from ..api import GenerationRequest
from .alignment import AlignRule, DecodeBalance, rank_caps, sequence_to_move


@dataclass
class Sequence:
    """A request in flight. `num_cached`: leading tokens whose KV is on `rank`."""

    seq_id: int
    request: GenerationRequest
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    output: list[int] = field(default_factory=list)
    rank: int | None = None
    num_cached: int = 0
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.output

    @property
    def pending(self) -> int:
        """Tokens still to run before the next token can be sampled."""
        return len(self.request.prompt_token_ids) + len(self.output) - self.num_cached

    @property
    def decoding(self) -> bool:
        """Its next step runs one token on a cache it already holds."""
        return self.num_cached > 0 and self.pending == 1

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return min(self.request.params.max_tokens - len(self.output), self.max_model_len - len(self.tokens))

    def check_finished(self, token: int) -> str | None:
        params = self.request.params
        if token in params.stop_ids(self.eos_token_ids):
            return "stop"
        if len(self.output) >= params.max_tokens or len(self.tokens) >= self.max_model_len:
            return "length"
        return None


@dataclass
class StepBatch:
    """One step's work: chunks per rank, KV rows to free per rank, tokens per rank; `moves`:
    sequences whose KV cache goes to another rank first (their chunks are on the new rank);
    `reprefilled`: sequences moved to another rank to be computed again there;
    `unaligned`: tokens per rank before prefill is cut to the step's level."""

    chunks: dict[int, list[ChunkPlan]]
    free: dict[int, list[int]]
    moves: list[KVMove] = field(default_factory=list)
    reprefilled: list[int] = field(default_factory=list)
    unaligned: dict[int, int] = field(default_factory=dict)

    def tokens_per_rank(self) -> dict[int, int]:
        return {r: sum(len(c.token_ids) for c in cs) for r, cs in self.chunks.items()}

    @property
    def empty(self) -> bool:
        return not any(self.chunks.values())


class Scheduler:
    """align: the per-step DP alignment rule (off by default); reprefill_tokens_per_step: how many
    tokens of re-prefill (a lost rank's requests run again elsewhere) one step may hold, 0 for no
    limit, so that the other requests decode on while a recovery's work is caught up."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, align: AlignRule | None = None,
                 reprefill_tokens_per_step: int = 0):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.align = align or AlignRule(enabled=False, migrate="off")
        self.balance = DecodeBalance(self.align.patience)
        self.reprefill_tokens_per_step = reprefill_tokens_per_step
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, list[Sequence]] = {}
        self.to_free: dict[int, list[int]] = {}
        self.by_id: dict[int, Sequence] = {}
        # ranks leaving on scale-down: they finish what they run but take nothing new
        self.draining: set[int] = set()
        # sequences left out of the next step (suspects of a failed step, control/serving/isolation.py)
        self.held: set[int] = set()

    def drain(self, ranks: list[int]) -> None:
        """`ranks` (leaving with a scale-down) finish what they run but take nothing new."""
        self.draining |= set(ranks)

    def undrain(self, ranks: list[int]) -> None:
        """`ranks` take new sequences again (their scale failed, or they left the cluster)."""
        self.draining -= set(ranks)

    def hold(self, seq_ids: set[int]) -> None:
        """Leave `seq_ids` out of the steps planned from now on (the suspects of a failed step,
        serving/isolation.py); an empty set holds nothing."""
        self.held = set(seq_ids)

    def set_ranks(self, ranks: list[int]) -> None:
        """Serve on `ranks` from now on; sequences of ranks no longer listed go back to the
        front of the queue, to be re-prefilled (prompt plus tokens so far) on another rank."""
        for r in [r for r in self.running if r not in ranks]:
            self.evict_rank(r)
        for r in ranks:
            self.running.setdefault(r, [])
            self.to_free.setdefault(r, [])

    def evict_rank(self, rank: int) -> list[Sequence]:
        moved = self.running.pop(rank, [])
        self.to_free.pop(rank, None)
        for seq in reversed(moved):
            seq.rank, seq.num_cached = None, 0
            self.waiting.appendleft(seq)
        return moved

    def add(self, seq: Sequence) -> None:
        self.by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        seq = self.by_id.pop(seq_id, None)
        if seq is None:
            return
        seq.finish_reason = seq.finish_reason or "abort"
        if seq.rank is None:
            self.waiting.remove(seq)
        else:
            self._release(seq)

    def _rehome(self, move: KVMove) -> None:
        """A step with a KV move completed: the sequence lives on the new rank, the old one frees
        its copy (a sequence aborted meanwhile: the new rank frees the copy it got)."""
        seq = self.by_id.get(move.seq_id)
        if seq is None or seq.rank != move.src_rank or move.dst_rank not in self.running:
            if move.dst_rank in self.to_free:
                self.to_free[move.dst_rank].append(move.seq_id)
            return
        self.running[move.src_rank].remove(seq)
        self.to_free[move.src_rank].append(seq.seq_id)
        seq.rank = move.dst_rank
        self.running[move.dst_rank].append(seq)

    def _release(self, seq: Sequence) -> None:
        self.running[seq.rank].remove(seq)
        self.to_free[seq.rank].append(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.running.values())

    def num_requests(self, rank: int) -> int:
        return len(self.running.get(rank, []))

    def schedule(self) -> StepBatch:
        """Plan the next step over the ranks given to `set_ranks`."""
        budget, align = self.max_num_batched_tokens, self.align
        unstarted = self._take_unstarted() if align.enabled else []
        reprefill_left = self.reprefill_tokens_per_step or budget * max(len(self.running), 1)
        room = sum(max(self.max_num_seqs - len(seqs), 0) for r, seqs in self.running.items() if r not in self.draining)
        admitted = unstarted + [self.waiting.popleft() for _ in range(min(room - len(unstarted), len(self.waiting)))]
        # Longest first onto the least loaded rank: the classic greedy for even sums.
        for seq in sorted(admitted, key=lambda q: -q.pending):
            rank = self._least_loaded()
            if rank is None:  # an unstarted prefill of a draining rank, every other rank full
                self.waiting.appendleft(seq)
                continue
            seq.rank = rank
            self.running[rank].append(seq)
        active = {r: [q for q in seqs if q.seq_id not in self.held] for r, seqs in self.running.items()}
        unaligned = {r: min(sum(q.pending for q in qs), budget) for r, qs in active.items()}
        moved = self._migrate(active) if align.migrate != "off" else None
        caps = dict.fromkeys(active, budget)
        if align.enabled:
            decode = {r: sum(q.decoding for q in qs) for r, qs in active.items()}
            prefill = {r: sum(q.pending for q in qs if not q.decoding) for r, qs in active.items()}
            caps = rank_caps(decode, prefill, budget, align.min_chunk)
        chunks: dict[int, list[ChunkPlan]] = {r: [] for r in self.running}
        for rank, seqs in active.items():
            used = 0
            for seq in sorted(seqs, key=lambda q: not q.decoding) if align.enabled else seqs:
                room = caps[rank] - used
                if seq.output and seq.pending > 1:  # a re-prefill: its rank was lost, or it moved
                    n = self._plan(seq, chunks[rank], min(room, reprefill_left))
                    reprefill_left -= n
                else:
                    n = self._plan(seq, chunks[rank], room)
                used += n
        free = {r: self.to_free[r] for r in self.running}
        self.to_free = {r: [] for r in self.running}
        moves = [moved] if isinstance(moved, KVMove) else []
        reprefilled = [moved.seq_id] if isinstance(moved, Sequence) else []
        return StepBatch(chunks, free, moves, reprefilled, unaligned)

    def _take_unstarted(self) -> list[Sequence]:
        """Sequences placed on a rank that has run none of their tokens: they go back to be
        placed again (their old rank frees any row a failed step gave them)."""
        taken = []
        for rank, seqs in self.running.items():
            for seq in [q for q in seqs if q.num_cached == 0 and q.seq_id not in self.held]:
                seqs.remove(seq)
                self.to_free[rank].append(seq.seq_id)
                seq.rank = None
                taken.append(seq)
        return taken

    def _migrate(self, active: dict[int, list[Sequence]]) -> KVMove | Sequence | None:
        """Move one decoding sequence off a rank that stays the busiest (control/serving/alignment.py).
        A KV move is planned and returned (its chunk goes to the new rank, `commit` re-homes it);
        a re-prefill moves the sequence now, to run from its first token on the new rank, and
        returns it."""
        counts = {r: sum(q.decoding for q in qs) for r, qs in active.items() if r not in self.draining}
        takers = {r for r in counts if len(self.running[r]) < self.max_num_seqs}
        pick = self.balance.observe(counts, takers)
        if pick is None:
            return None
        src, dst = pick
        seq = sequence_to_move([q for q in active[src] if q.decoding])
        active[src].remove(seq)
        active[dst].append(seq)
        if self.align.migrate == "kv":
            return KVMove(seq.seq_id, src, dst, seq.tokens[:seq.num_cached])
        self.running[src].remove(seq)
        self.to_free[src].append(seq.seq_id)
        seq.rank, seq.num_cached = dst, 0
        self.running[dst].append(seq)
        return seq

    def _least_loaded(self) -> int | None:
        """The rank with room for one more sequence and the least work ahead."""
        candidates = [r for r, seqs in self.running.items()
                      if len(seqs) < self.max_num_seqs and r not in self.draining]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (sum(s.pending for s in self.running[r]), len(self.running[r]), r))

    @staticmethod
    def _plan(seq: Sequence, out: list[ChunkPlan], room: int) -> int:
        n = min(seq.pending, room)
        if n <= 0:
            return 0
        tokens = seq.tokens
        start = seq.num_cached
        out.append(
            ChunkPlan(
                seq.seq_id,
                tokens[start : start + n],
                start,
                start + n == len(tokens),
                seq.request.params,
                seq.request.seed,
                len(seq.request.prompt_token_ids),
            )
        )
        return n

    def commit(self, batch: StepBatch, sampled: dict[int, int]) -> list[tuple[Sequence, list[int]]]:
        """Apply a finished step: advance caches, append sampled tokens, retire finished
        sequences. Returns (sequence, new tokens) for every sequence that produced tokens."""
        for move in batch.moves:
            self._rehome(move)
        out = []
        for chunks in batch.chunks.values():
            for c in chunks:
                seq = self.by_id.get(c.seq_id)
                if seq is None or seq.rank is None:
                    continue
                seq.num_cached = c.start_pos + len(c.token_ids)
                if c.seq_id not in sampled:
                    continue
                token = sampled[c.seq_id]
                seq.output.append(token)
                seq.finish_reason = seq.check_finished(token)
                if seq.finish_reason:
                    self.by_id.pop(seq.seq_id)
                    self._release(seq)
                out.append((seq, [token]))
        return out
