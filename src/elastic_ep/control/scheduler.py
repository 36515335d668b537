"""The scheduler: which tokens of which sequence each rank runs in the next step.

Continuous batching with chunked prefill, per rank (DP attention: a sequence lives on one
rank, whose KV cache holds it). A new sequence goes to the rank with the fewest tokens of work
ahead (planned this step plus prefill still pending), so token counts per rank stay even and
no rank arrives late at the all-to-all (seed 000, section 3). Limits: `max_num_seqs` sequences
per rank, `max_num_batched_tokens` tokens per rank per step.

The scheduler holds every sequence's prompt and generated tokens, so a sequence whose rank
died is simply re-prefilled elsewhere (`evict_rank`): prompt plus tokens so far, at most
`reprefill_tokens_per_step` tokens of such sequences per step over all ranks, so the survivors'
decode is not held up by one long step (every rank waits for the slowest in each MoE layer).
Nothing here does I/O; the controller calls `schedule`, runs the step, then `commit`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from elastic_ep.wire import ChunkPlan

from .api import GenerationRequest


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
    fail_at: str = ""  # fault injection (chaos poison): where its steps raise, see wire.ChunkPlan

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.output

    @property
    def pending(self) -> int:
        """Tokens still to run before the next token can be sampled."""
        return len(self.request.prompt_token_ids) + len(self.output) - self.num_cached

    def check_finished(self, token: int) -> str | None:
        params = self.request.params
        if token in params.stop_ids(self.eos_token_ids):
            return "stop"
        if len(self.output) >= params.max_tokens or len(self.tokens) >= self.max_model_len:
            return "length"
        return None


@dataclass
class StepBatch:
    """One step's work: chunks per rank, KV rows to free per rank, tokens per rank."""

    chunks: dict[int, list[ChunkPlan]]
    free: dict[int, list[int]]

    def tokens_per_rank(self) -> dict[int, int]:
        return {r: sum(len(c.token_ids) for c in cs) for r, cs in self.chunks.items()}

    @property
    def empty(self) -> bool:
        return not any(self.chunks.values())


class Scheduler:
    """reprefill_tokens_per_step: 0 for no limit."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, reprefill_tokens_per_step: int = 0):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.reprefill_tokens_per_step = reprefill_tokens_per_step
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, list[Sequence]] = {}
        self.to_free: dict[int, list[int]] = {}
        self.by_id: dict[int, Sequence] = {}
        # ranks leaving on scale-down: they finish what they run but take nothing new
        self.draining: set[int] = set()
        # sequences left out of the next step (suspects of a failed step, control/isolation.py)
        self.held: set[int] = set()

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
        budget = self.max_num_batched_tokens
        moved_left = self.reprefill_tokens_per_step or budget * max(len(self.running), 1)

        def plan(seq: Sequence, out: list[ChunkPlan], room: int) -> int:
            nonlocal moved_left
            if not (seq.output and seq.pending > 1):  # not a re-prefill after its rank was lost
                return self._plan(seq, out, room)
            n = self._plan(seq, out, min(room, moved_left))
            moved_left -= n
            return n

        chunks: dict[int, list[ChunkPlan]] = {r: [] for r in self.running}
        used = dict.fromkeys(self.running, 0)
        for rank, seqs in self.running.items():
            for seq in seqs:
                if seq.seq_id not in self.held:
                    used[rank] += plan(seq, chunks[rank], budget - used[rank])
        room = sum(max(self.max_num_seqs - len(seqs), 0) for r, seqs in self.running.items() if r not in self.draining)
        admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        # Longest first onto the least loaded rank: the classic greedy for even sums.
        for seq in sorted(admitted, key=lambda q: -q.pending):
            rank = self._least_loaded(used)
            assert rank is not None
            seq.rank = rank
            self.running[rank].append(seq)
            used[rank] += plan(seq, chunks[rank], budget - used[rank])
        free = {r: self.to_free[r] for r in self.running}
        self.to_free = {r: [] for r in self.running}
        return StepBatch(chunks, free)

    def _least_loaded(self, used: dict[int, int]) -> int | None:
        """The rank with room for one more sequence and the least work ahead."""
        candidates = [r for r, seqs in self.running.items()
                      if len(seqs) < self.max_num_seqs and r not in self.draining]
        if not candidates:
            return None

        def work(r: int) -> tuple[int, int, int]:
            pending = sum(s.pending for s in self.running[r])
            return (max(used[r], pending), len(self.running[r]), r)

        return min(candidates, key=work)

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
                seq.fail_at,
            )
        )
        return n

    def commit(self, batch: StepBatch, sampled: dict[int, int]) -> list[tuple[Sequence, list[int]]]:
        """Apply a finished step: advance caches, append sampled tokens, retire finished
        sequences. Returns (sequence, new tokens) for every sequence that produced tokens."""
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
