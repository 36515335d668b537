"""The scheduler: which tokens of which sequence each rank runs in the next step.

Continuous batching with chunked prefill, per rank (DP attention: a sequence lives on one
rank, whose KV pool holds it). Each rank's pool is a `BlockManager` here (model/block_manager.py):
the scheduler decides every block table and sends it with the chunks. A new sequence goes to the
rank where it adds the fewest tokens of work: the work ahead there (prefill still pending, one
token per decode) plus its own tokens less those of its prefix already cached there. A prefix
hit of h tokens is worth h tokens of work ahead, the unit the all-to-all wants even, so a rank
with the prefix wins unless it is busier by more than the hit; ties go to the rank with more
free blocks, then fewer sequences. It is admitted when that rank's free blocks hold its tokens
(the first rank that does, in that order); when none does it waits, and so does every request
behind it. A prefix being computed counts as a hit on its rank: a request whose leading full
blocks a running sequence there holds but has not computed yet (the prefix pool claims them,
model/block_manager.py) is not prefilled; it waits at the front of the queue and hits those
blocks once they are committed (two requests with one new system prompt compute it once). It
waits only while that sequence advances: a step in which it computed nothing (held out, cut to
nothing, a failed step), or its end (finished, aborted, preempted, its rank gone), and the
waiter is placed as any request. `prefix_wait=False` (serve --no-prefix-wait) turns the wait
off: such a request is placed at once and computes the prefix a second time. A decoding
sequence that needs a block when none is free takes one from the newest request of its rank,
which is preempted: its blocks freed, back at the front of the queue, to be recomputed (prompt
plus tokens so far); no request is admitted in a step that preempted.
With an `AlignRule` the step is evened again every step (control/serving/alignment.py: prefill cut to
the step's level, unstarted prefills placed again, a decoding sequence moved off a rank that
stays the busiest). Limits: `max_num_seqs` sequences per rank, `max_num_batched_tokens` tokens
per rank per step.

The scheduler holds every sequence's prompt and generated tokens, so a sequence whose rank
died is simply re-prefilled elsewhere (`evict_rank`; the dead rank's blocks, cached ones
included, are gone): prompt plus tokens so far, admitted by free blocks as any request, at most
`reprefill_tokens_per_step` tokens of such sequences per step over all ranks and none in the
first step after the eviction, so the survivors' decode is not held up by one long step (every
rank waits for the slowest in each MoE layer).
A new leader of a controller group takes over the KV its adopted ranks still hold (`take_over_kv`,
control/serving/adopted_kv.py): those blocks are reserved, and a journaled request is placed on the
rank that holds the most of its tokens, with those positions kept (told to the rank as a prefix
hit's are) and only the rest prefilled again.
Compact decode plans: a rank keeps what the first `ChunkPlan` of a sequence on it said (params,
seed, prompt length, block table: runtime/held.py), so a decode step of a sequence the rank is
known to keep goes as one row of its `DecodeRows` (seq_id, token, position, and the block ids
its table grew by since it was last told), not as a `ChunkPlan` with the whole table. Known to
keep: the last step that ran a `ChunkPlan` of it on that rank committed, and so did every step
planned since, with no epoch change between (`forget_kept`, which the step loop calls when the
epoch changes; a batch planned and not committed, a failed or interrupted step, forgets every
sequence's the same way), and it has not left the rank since (freed, preempted, moved, evicted).
Anything else gets a full `ChunkPlan` again: when unsure, the plan is the one that was always sent.
Overlap scheduling (serve --async-scheduling): while a step runs, `prepare_decodes` plans the
next one when it can be known before the results: every sequence in flight decodes in this step,
nothing waits, nothing is held out, no KV offer is open, and no DP move is due. Each then
decodes once more (but those whose length ends them in this step), its row's token `SAMPLED_TOKEN` (the rank puts in
the token it sampled for it in this step), its table grown now as `schedule` would grow it (no
free block: nothing is prepared, since `schedule` would preempt). A rank's first rows that are its
batch's column (`StepBatch.columns`) are prepared from the column, without a look at each
sequence, when its room says none ends by its length in this step; the prepared column keeps the
column's stop tokens and one token less of room, so its commit reads no sequence either
(`_commit_columns`). `revision` counts whatever
else changes what the next step may run (a request added, a sequence that sampled nothing, a
rank set, a hold, a forget, a failed step, any `schedule`): `take_prepared` gives the prepared
batch only while it is the one it was prepared at, less the sequences that ended since (finished
in the step, or aborted: their rows out, their frees in, as `schedule` would plan them), so it is
the step `schedule` would have planned; otherwise it drops it (its grown blocks stay in the
tables, where `schedule` would have put them).
Steady ranks: `commit` keeps each rank's decode rows whose sequences sampled a token and did not
end (`_Steady`). In the next `schedule`, while those sequences are still the first of their
rank's, nothing is held out and no KV offer is open, each of them decodes again: its position + 1,
the token it sampled, and a block only for one whose next position starts a block (a table holds
the position it ran). So the rank's rows come from those lists, and only the sequences placed
since, and those whose block may be full, are looked at: `_make_room`, `_take_unstarted`, the
rank's work sums and its rows skip the rest. Anything else (a preemption or a DP move on the rank,
a failed step, an epoch change: `forget_kept`, caps below the rank's decodes, a sequence without a
block) plans the rank one sequence at a time, as before: the steps are the same either way
(tests/control/serving/test_steady_ranks.py checks them step by step).

Nothing here does I/O; the controller calls `schedule`, runs the step, then `commit`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field

from elastic_ep.model.block_manager import BlockManager
from elastic_ep.model.sampling import TokenLogprobs
from elastic_ep.wire import SAMPLED_TOKEN, ChunkPlan, DecodeRows, HeldKV, KVMove

from ..api import GenerationRequest
from .adopted_kv import KVOffers
from .alignment import AlignRule, DecodeBalance, rank_caps, sequence_to_move
from .rank_order import RankOrder
from .sampled import Sampled

# One sequence's output of a step: (seq_id, new token ids, finish reason (None: still running), one
# TokenLogprobs per new token or None); a plain tuple, cheaper to build than a RequestOutput.
StepTokens = tuple[int, list[int], str | None, list[TokenLogprobs] | None]


@dataclass(slots=True, eq=False)
class Sequence:
    """A request in flight. `num_cached`: leading tokens whose KV is on `rank`; `unsent_prefix`:
    leading tokens a prefix hit found in blocks of `rank` that the rank has not been told of.
    Slotted (a step reads and writes a few fields of every sequence in flight) and compared by
    identity: two sequences are never the same request, and the running lists find theirs by it."""

    seq_id: int
    request: GenerationRequest
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    resumed_output: InitVar[list[int] | None] = None  # tokens generated before it came here (a resume)
    rank: int | None = None
    num_cached: int = 0
    unsent_prefix: int = 0
    finish_reason: str | None = None
    # waiting for a prefix another sequence computes: (its seq_id, its num_cached then)
    prefix_wait: tuple[int, int] | None = None
    # (rank, the scheduler's kept generation) when that rank keeps its params and block table (see the
    # module docstring), and how many blocks of its table the rank was told of
    kept: tuple[int, int] | None = None
    kept_blocks: int = 0
    # prompt + output as one list, kept as tokens are appended (`append`): a step reads it for
    # every sequence, and building it afresh cost O(its length) each time (a 1k-token prompt
    # tripled the scheduler's time per step); the output is its tail (`output`), not a list of its own
    tokens: list[int] = field(init=False, repr=False)
    prompt_len: int = field(init=False, repr=False)
    stop_ids: frozenset[int] = field(init=False, repr=False)  # the tokens that end it, worked out once
    # the length of `tokens` at which it ends ("length": max_tokens generated, or max_model_len held),
    # worked out once: the commit's check of every sequence a step is one comparison
    limit: int = field(init=False, repr=False)

    def __post_init__(self, resumed_output: list[int] | None) -> None:
        self.tokens = self.request.prompt_token_ids + (resumed_output or [])
        self.prompt_len = len(self.request.prompt_token_ids)
        self.stop_ids = self.request.params.stop_ids(self.eos_token_ids)
        self.limit = min(self.prompt_len + self.request.params.max_tokens, self.max_model_len)

    @property
    def output(self) -> list[int]:
        """The tokens generated (a copy)."""
        return self.tokens[self.prompt_len:]

    @property
    def generated(self) -> int:
        """How many tokens were generated."""
        return len(self.tokens) - self.prompt_len

    def append(self, token: int) -> None:
        """A generated token."""
        self.tokens.append(token)

    @property
    def pending(self) -> int:
        """Tokens still to run before the next token can be sampled."""
        return len(self.tokens) - self.num_cached

    @property
    def decoding(self) -> bool:
        """Its next step runs one token on a cache it already holds."""
        return self.num_cached > 0 and self.pending == 1 and not self.unsent_prefix

    def unplace(self) -> None:
        """Off its rank: nothing of it is cached anywhere."""
        self.rank, self.num_cached, self.unsent_prefix, self.kept = None, 0, 0, None

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.limit - len(self.tokens)

    def check_finished(self, token: int) -> str | None:
        """Why `token`, just appended, ends it (None: it does not)."""
        if token in self.stop_ids:
            return "stop"
        return "length" if len(self.tokens) >= self.limit else None


@dataclass
class StepBatch:
    """One step's work: chunks per rank, decode rows per rank (`decodes`: sequences the rank keeps,
    one token each, only ranks with some), KV rows to free per rank, tokens per rank; `moves`:
    sequences whose KV cache goes to another rank first (their chunks are on the new rank);
    `reprefilled`: sequences moved to another rank to be computed again there;
    `unaligned`: tokens per rank before prefill is cut to the step's level; `preempted`:
    requests preempted for blocks; `prefix_queried`, `prefix_hit`: tokens of the requests
    whose first chunk on their rank runs in this step, and of those found in cached blocks (a
    request placed again before it ran, as --dp-align does with unstarted prefills, counts
    once, for the placement it runs from; a recomputed one, and the first chunk of a step
    that failed and is planned again, count again); `prefix_waits`: requests that began to
    wait for a prefix another sequence is computing; `prefix_waiting`: requests that wait
    through this step (those that began included); `kv_kept`, `kv_reprefilled`: of the
    journaled requests a new leader placed in this step, the positions whose KV an adopted rank
    kept and those computed again (control/serving/adopted_kv.py); `columns`: see `commit`."""

    chunks: dict[int, list[ChunkPlan]]
    free: dict[int, list[int]]
    decodes: dict[int, DecodeRows] = field(default_factory=dict)
    moves: list[KVMove] = field(default_factory=list)
    reprefilled: list[int] = field(default_factory=list)
    unaligned: dict[int, int] = field(default_factory=dict)
    preempted: int = 0
    prefix_queried: int = 0
    prefix_hit: int = 0
    prefix_waits: int = 0
    prefix_waiting: int = 0
    kv_kept: int = 0
    kv_reprefilled: int = 0
    # rank -> the sequences of its first decode rows, when they were planned without a look at each
    # (`commit`'s columns); not part of what the step is
    columns: dict[int, _Column] = field(default_factory=dict, compare=False, repr=False)

    def tokens_per_rank(self) -> dict[int, int]:
        """rank -> tokens it runs, every rank of `chunks` (0 for most at scale: summed only where some run)."""
        out = dict.fromkeys(self.chunks, 0)
        for r, cs in self.chunks.items():
            if cs:
                out[r] = sum(len(c.token_ids) for c in cs)
        for r, rows in self.decodes.items():
            if r in out:
                out[r] += len(rows.seq_ids)
        return out

    @property
    def empty(self) -> bool:
        return not any(self.chunks.values()) and not self.decodes

    def seq_ids_on(self, rank: int) -> list[int]:
        """The sequences `rank` runs in this step: its chunks', then its decode rows'."""
        rows = self.decodes.get(rank)
        return [c.seq_id for c in self.chunks.get(rank, [])] + (rows.seq_ids if rows is not None else [])

    def seq_ids(self) -> set[int]:
        """Every sequence the step runs."""
        return {seq_id for rank in self.chunks for seq_id in self.seq_ids_on(rank)}

    def runs(self, rank: int) -> list[tuple[int, int, int, bool]]:
        """(seq_id, start_pos, tokens, samples) of what `rank` runs, chunks then decode rows."""
        rows = self.decodes.get(rank)
        return [(c.seq_id, c.start_pos, len(c.token_ids), c.sample) for c in self.chunks.get(rank, [])] + (
            [(q, p, 1, True) for q, p in zip(rows.seq_ids, rows.positions, strict=True)] if rows is not None else [])


@dataclass(frozen=True)
class _Column:
    """The sequences of a rank's first decode rows (`seqs`, in the rows' order), every token that ends
    one of them (`stops`) and the fewest tokens one of them may still generate before the step
    commits (`room`), both None where not known yet (worked out at the commit that reads them):
    the commit reads a sequence one by one only where a token sampled is in `stops` or `room` is
    below 2 (`Scheduler._commit_columns`)."""

    seqs: list[Sequence]
    stops: frozenset[int] | None = None
    room: int | None = None


@dataclass(frozen=True)
class _Committed:
    """What `_commit_columns` committed of a rank's column: the sequences that go on and their tokens,
    the column's stop tokens (a superset of theirs), the fewest tokens one of them may still generate,
    and whether some of the column ended."""

    seqs: list[Sequence]
    tokens: list[int]
    stops: frozenset[int]
    room: int
    ended: bool


@dataclass
class _Steady:
    """A rank's decode rows of the last committed step, those whose token was sampled and did not
    end them, in the rows' order: `positions` the positions they ran, `tokens` the tokens sampled,
    `column` their sequences as the next step's commit reads them. While these sequences are still
    the first of the rank's (a prefix of its running list: those placed since follow them), and the
    generation of what the ranks keep is the same, each of them decodes again in the next step, at
    its position + 1 with the token it sampled, and only one whose next position starts a block can
    need one: `schedule` plans them from these lists, without a look at each sequence (module
    docstring, "Steady ranks")."""

    generation: int
    seq_ids: list[int]
    positions: list[int]
    tokens: list[int]
    column: _Column
    _boundary: list[int] | None = None

    def boundary(self, block_size: int) -> list[int]:
        """Indices of those whose next position starts a block (their table, which holds the
        position they ran, may be full); worked out once."""
        if self._boundary is None:
            self._boundary = [i for i, p in enumerate(self.positions) if (p + 1) % block_size == 0]
        return self._boundary


class Scheduler:
    """align: the per-step DP alignment rule (off by default); reprefill_tokens_per_step: how many
    tokens of re-prefill (a lost rank's requests run again elsewhere) one step may hold, 0 for no
    limit, so that the other requests decode on while a recovery's work is caught up; num_blocks:
    a rank's KV pool until `set_pool_size` says what the rank has; block_size,
    enable_prefix_caching: the pools' (model/block_manager.py); prefix_wait: a request waits for
    the prefix blocks another sequence of its rank is computing (see the module docstring); clock:
    when the KV offers of a takeover expire."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, align: AlignRule | None = None,
                 reprefill_tokens_per_step: int = 0, num_blocks: int = 4096, block_size: int = 16,
                 enable_prefix_caching: bool = True, prefix_wait: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self.kv_offers: KVOffers | None = None  # a new leader's: the KV its adopted ranks held
        self.prefix_wait = prefix_wait
        self._waits = [0, 0]  # the step being planned: requests that began to wait, that wait
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool_sizes: dict[int, int] = {}
        self.pools: dict[int, BlockManager] = {}
        self._reprefill_held = False  # the first step after an eviction runs no re-prefill
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
        # a sequence's `kept` holds only with this generation: bumped to forget what every rank keeps
        self.kept_generation = 0
        self._uncommitted = False  # a batch was planned and not committed
        # bumped by whatever changes what the next step may run (module docstring, overlap scheduling)
        self.revision = 0
        # batch, revision, `DecodeBalance` state before it and after it
        self._prepared: tuple[StepBatch, int, tuple[int | None, int], tuple[int | None, int]] | None = None
        self._left: list[tuple[int, int]] = []  # (rank, seq_id) released since the last `schedule` or preparation
        self._steady: dict[int, _Steady] = {}  # rank -> its rows of the last commit, for the next `schedule`

    def forget_kept(self) -> None:
        """No rank is known to keep any sequence any more (a new epoch: the workers drop what they
        kept): each running sequence's next chunk is a full `ChunkPlan`."""
        self.kept_generation += 1
        self.revision += 1
        self._steady = {}

    def set_pool_size(self, rank: int, num_blocks: int) -> None:
        """Rank `rank`'s KV pool has num_blocks blocks (it says so when it registers); its pool
        here is made that size when it next joins."""
        self.pool_sizes[rank] = num_blocks

    def take_over_kv(self, held: dict[int, list[HeldKV]], journaled: set[str], hold_s: float) -> None:
        """A new leader's adopted ranks (rank -> the sequences whose KV it holds, from its adopt hello),
        for the last leader's unfinished requests `journaled` (their ids): the blocks are reserved in
        the ranks' pools (`set_ranks` made them) for those requests, for at most `hold_s`."""
        self.kv_offers = KVOffers(self.pools, held, journaled, self.clock() + hold_s)
        self.revision += 1

    def drain(self, ranks: list[int]) -> None:
        """`ranks` (leaving with a scale-down) finish what they run but take nothing new."""
        self.draining |= set(ranks)
        self.revision += 1

    def undrain(self, ranks: list[int]) -> None:
        """`ranks` take new sequences again (their scale failed, or they left the cluster)."""
        self.draining -= set(ranks)
        self.revision += 1

    def hold(self, seq_ids: set[int]) -> None:
        """Leave `seq_ids` out of the steps planned from now on (the suspects of a failed step,
        serving/isolation.py); an empty set holds nothing."""
        if seq_ids != self.held:
            self.held = set(seq_ids)
            self.revision += 1

    def set_ranks(self, ranks: list[int]) -> None:
        """Serve on `ranks` from now on; sequences of ranks no longer listed go back to the
        front of the queue, to be re-prefilled (prompt plus tokens so far) on another rank."""
        self.revision += 1
        for r in [r for r in self.running if r not in ranks]:
            self.evict_rank(r)
        for r in ranks:
            self.running.setdefault(r, [])
            self.to_free.setdefault(r, [])
            if r not in self.pools:
                self.pools[r] = BlockManager(self.pool_sizes.get(r, self.num_blocks), self.block_size,
                                             self.enable_prefix_caching)

    def evict_rank(self, rank: int) -> list[Sequence]:
        self.revision += 1
        moved = self.running.pop(rank, [])
        self.to_free.pop(rank, None)
        self.pools.pop(rank, None)
        if self.kv_offers is not None:
            self.kv_offers.release(rank)
        self._reprefill_held = self._reprefill_held or bool(moved)
        for seq in reversed(moved):
            seq.unplace()
            self.waiting.appendleft(seq)
        return moved

    def add(self, seq: Sequence) -> None:
        self.revision += 1
        self.by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        seq = self.by_id.pop(seq_id, None)
        if seq is None:
            return
        seq.finish_reason = seq.finish_reason or "abort"
        if seq.rank is None:
            self.revision += 1
            self.waiting.remove(seq)
            if self.kv_offers is not None:
                self.kv_offers.left(seq.request.request_id)
        else:
            self._release(seq)

    def _rehome(self, move: KVMove) -> None:
        """A step with a KV move completed: the sequence lives on the new rank, the old one frees
        its copy (a sequence aborted meanwhile: the new rank frees the copy it got)."""
        seq = self.by_id.get(move.seq_id)
        if seq is None or seq.rank != move.src_rank or move.dst_rank not in self.running:
            self._drop_copy(move)
            return
        self.running[move.src_rank].remove(seq)
        self.to_free[move.src_rank].append(seq.seq_id)
        self.pools[move.src_rank].free(seq.seq_id)
        seq.rank = move.dst_rank
        self.running[move.dst_rank].append(seq)

    def _drop_copy(self, move: KVMove) -> None:
        """The destination of a move that did not re-home its sequence frees what it got."""
        if move.dst_rank in self.to_free:
            self.to_free[move.dst_rank].append(move.seq_id)
            self.pools[move.dst_rank].free(move.seq_id)

    def step_failed(self, batch: StepBatch) -> None:
        """A failed step's frees may not have run: ask again in the next step. A KV move may have
        left a copy on its destination: free it there (the sequence stays on its old rank). Its plans
        may have been half run: the next plan forgets what the ranks keep (with --send-ahead-steps a
        later batch's commit may have come between its planning and now)."""
        self.revision += 1
        self._uncommitted = True
        for rank_id, ids in batch.free.items():
            if rank_id in self.to_free:
                self.to_free[rank_id].extend(ids)
        for move in batch.moves:
            self._drop_copy(move)

    def _release(self, seq: Sequence) -> None:
        self._left.append((seq.rank, seq.seq_id))
        seq.kept = None
        self.running[seq.rank].remove(seq)
        self.to_free[seq.rank].append(seq.seq_id)
        self.pools[seq.rank].free(seq.seq_id)

    def pool_view(self, max_model_len: int) -> dict:
        """The KV pools as /cluster shows them: per rank its blocks, tokens, how many requests of
        max_model_len fit, free and cached blocks, usage (0..1); after a takeover `adopted`, what
        became of the KV the adopted ranks held (control/serving/adopted_kv.py)."""
        ranks = {str(r): {"blocks": p.num_blocks, "tokens": p.num_blocks * self.block_size,
                          "max_model_len_requests": p.num_blocks * self.block_size // max_model_len,
                          "free_blocks": p.num_free_blocks, "cached_blocks": p.num_cached_blocks,
                          "usage": round(p.usage, 4)}
                 for r, p in sorted(self.pools.items())}
        adopted = {"adopted": self.kv_offers.view()} if self.kv_offers is not None else {}
        return {"block_size": self.block_size, "enable_prefix_caching": self.enable_prefix_caching, **adopted,
                "ranks": ranks}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(self.running.values())

    def num_requests(self, rank: int) -> int:
        return len(self.running.get(rank, []))

    def schedule(self) -> StepBatch:
        """Plan the next step over the ranks given to `set_ranks`."""
        if self._uncommitted:  # the last batch's plans may have been half run, or not at all
            self.forget_kept()
        steady = self._steady_records()
        self._uncommitted = True
        self.revision += 1
        self._prepared, self._left = None, []
        budget, align = self.max_num_batched_tokens, self.align
        offers = self.kv_offers
        if offers is not None:
            offers.expire(self.clock())
        taken_over = (offers.counts["reused"], offers.counts["reprefilled"]) if offers is not None else (0, 0)
        preempted = self._make_room(steady)
        unstarted = self._take_unstarted(steady) if align.enabled else []
        reprefill_left = 0 if self._reprefill_held else self.reprefill_tokens_per_step or budget * max(
            len(self.running), 1)
        self._reprefill_held = False
        room = sum(max(self.max_num_seqs - len(seqs), 0) for r, seqs in self.running.items() if r not in self.draining)
        taken = 0 if preempted else min(room - len(unstarted), len(self.waiting))
        admitted = unstarted + [self.waiting.popleft() for _ in range(taken)]
        self._waits = [0, 0]
        unplaced = []
        ahead = _pending_of(self.running, steady) if admitted else {}
        order = self._rank_order(ahead) if admitted else None
        # Longest first onto the rank where it adds least: the classic greedy for even sums.
        for seq in sorted(admitted, key=lambda q: -q.pending):
            if not self._place(seq, ahead, order):  # no rank has room or blocks for it: it waits, in its place
                unplaced.append(seq)
        queued = {seq.seq_id: i for i, seq in enumerate(admitted)}
        self.waiting.extendleft(sorted(unplaced, key=lambda q: -queued[q.seq_id]))
        held = self.held  # a copy per rank either way: a migration changes `active`, never `running`
        active = {r: [q for q in seqs if q.seq_id not in held] if held else seqs[:] for r, seqs in self.running.items()}
        # one pass over each rank's sequences; sums over the busy ranks only: idle ranks count 0
        work, steady_n = _work_of(active, steady)
        unaligned = _per_rank(active, {r: min(w[0], budget) for r, w in work.items()})
        moved = self._migrate(active, {r: len(w[1]) for r, w in work.items()}) if align.migrate != "off" else None
        if moved is not None:  # again: the moved sequence's ranks changed (an idle one may have got it)
            work, steady_n = _work_of(active, steady)
        caps = dict.fromkeys(active, budget)
        if align.enabled:
            decode = _per_rank(active, {r: len(w[1]) for r, w in work.items()})
            prefill = _per_rank(active, {r: w[0] - len(w[1]) for r, w in work.items()})  # a decode's pending is 1
            caps = rank_caps(decode, prefill, budget, align.min_chunk)
        chunks: dict[int, list[ChunkPlan]] = {r: [] for r in self.running}
        decodes: dict[int, DecodeRows] = {}
        columns: dict[int, _Column] = {}
        queried = hit = 0
        block_size, generation = self.block_size, self.kept_generation
        for rank, seqs in active.items():  # not `busy`: a migration may have given an idle rank a sequence
            if not seqs:
                continue
            used, cap = 0, caps[rank]
            kept, rows, tables = (rank, generation), None, self.pools[rank].tables
            n = steady_n.get(rank, 0)
            if n and cap >= n and (rows := _steady_rows(steady[rank], tables, block_size)) is not None:
                decodes[rank], columns[rank], used = rows, steady[rank].column, n
            else:
                n = 0
            for seq in (work[rank][1] + work[rank][2] if align.enabled else seqs)[n:]:  # decodes first
                room = cap - used
                table, tokens, position = tables[seq.seq_id], seq.tokens, seq.num_cached
                if len(table) * block_size < len(tokens):  # no block for its next token this step
                    continue
                # one row, the rank keeping the rest, for a kept sequence decoding (`Sequence.decoding`,
                # written out: this runs for every sequence in flight)
                if seq.kept == kept and room > 0 and position == len(tokens) - 1 and position \
                        and not seq.unsent_prefix:
                    if rows is None:
                        rows = decodes[rank] = DecodeRows()
                    rows.seq_ids.append(seq.seq_id)
                    rows.tokens.append(tokens[position])
                    rows.positions.append(position)
                    if len(table) > seq.kept_blocks:
                        rows.new_blocks.extend((seq.seq_id, b) for b in table[seq.kept_blocks:])
                        seq.kept_blocks = len(table)
                    used += 1
                    continue
                starts = seq.num_cached == seq.unsent_prefix  # nothing of it computed on this rank yet
                if seq.generated and seq.pending > 1:  # a re-prefill: its rank was lost, it moved or was preempted
                    n = self._plan(seq, chunks[rank], min(room, reprefill_left), table)
                    reprefill_left -= n
                else:
                    n = self._plan(seq, chunks[rank], room, table)
                if starts and n:  # its prefix lookup counts once, for the placement it runs from
                    queried, hit = queried + len(seq.tokens), hit + seq.num_cached
                used += n
        free = {r: self.to_free[r] for r in self.running}
        self.to_free = {r: [] for r in self.running}
        moves = [moved] if isinstance(moved, KVMove) else []
        reprefilled = [moved.seq_id] if isinstance(moved, Sequence) else []
        kv_kept, kv_reprefilled = ((offers.counts["reused"] - taken_over[0],
                                    offers.counts["reprefilled"] - taken_over[1]) if offers is not None else (0, 0))
        return StepBatch(chunks, free, decodes, moves, reprefilled, unaligned, preempted, queried, hit, *self._waits,
                         kv_kept, kv_reprefilled, columns)

    def _steady_records(self) -> dict[int, _Steady]:
        """The last commit's `_Steady` records that still hold: of this generation, their sequences
        the first of their rank's. None while sequences are held out or a takeover's KV offers are
        open. Taken once: a record is of the step just committed."""
        records, self._steady = self._steady, {}
        if self.held or self.kv_offers is not None:
            return {}
        generation, running = self.kept_generation, self.running
        return {r: rec for r, rec in records.items()
                if rec.generation == generation and _steady_prefix(rec, running.get(r, []))}

    def _make_room(self, steady: dict[int, _Steady]) -> int:
        """Give every decoding sequence the block of its next token, oldest first on each rank;
        while none is free, preempt the newest request of the rank (one a failed step holds out
        stays). Of a steady rank's sequences only those whose next position starts a block are
        looked at (`_Steady`). Returns how many were preempted."""
        preempted = 0
        for rank, seqs in self.running.items():
            if not seqs:
                continue
            pool = self.pools[rank]
            tables, size, held = pool.tables, self.block_size, self.held
            rec = steady.get(rank)
            if rec is not None:
                steady_seqs = rec.column.seqs
                check = [steady_seqs[i] for i in rec.boundary(size)] + seqs[len(steady_seqs):]
            else:
                check = list(seqs)
            for seq in check:
                if seq.rank != rank or len(tables[seq.seq_id]) * size >= len(seq.tokens) or seq.seq_id in held:
                    continue  # its table holds its next token already, or it is held out
                while not pool.grow(seq.seq_id, len(seq.tokens)):
                    if self.kv_offers is not None and self.kv_offers.holds(rank):  # held KV goes first
                        self.kv_offers.release(rank)
                        continue
                    victims = [q for q in seqs if q.seq_id not in self.held]
                    if not victims:
                        break
                    self._preempt(victims[-1])
                    preempted += 1
                    if victims[-1] is seq:
                        break
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks of `seq` and put it at the front of the queue, to be recomputed."""
        self._release(seq)
        seq.unplace()
        self.waiting.appendleft(seq)

    def _take_unstarted(self, steady: dict[int, _Steady]) -> list[Sequence]:
        """Sequences placed on a rank that has run none of their tokens: they go back to be
        placed again (their old rank frees any row a failed step gave them). A steady rank's
        first sequences all ran (`_Steady`): only those after them are looked at."""
        taken = []
        for rank, seqs in self.running.items():
            if not seqs:
                continue
            tail = seqs[_steady_prefix(steady.get(rank), seqs):]
            for seq in [q for q in tail if q.num_cached == q.unsent_prefix and q.seq_id not in self.held]:
                self._release(seq)
                seq.unplace()
                taken.append(seq)
        return taken

    def _migrate(self, active: dict[int, list[Sequence]], decoding: dict[int, int]) -> KVMove | Sequence | None:
        """Move one decoding sequence off a rank that stays the busiest (control/serving/alignment.py).
        A KV move is planned and returned (its chunk goes to the new rank, `commit` re-homes it);
        a re-prefill moves the sequence now, to run from its first token on the new rank, and
        returns it. `decoding`: decoding sequences of each rank of `active` with sequences."""
        pick = self.balance.observe(*self._balance_inputs(active, decoding))
        if pick is None:
            return None
        src, dst = pick
        seq = sequence_to_move([q for q in active[src] if q.decoding])
        if self.align.migrate == "kv":
            # its own blocks, never shared ones: the move writes every position it holds
            if self.pools[dst].allocate(seq.seq_id, [], len(seq.tokens)) is None:
                return None
            active[src].remove(seq)
            active[dst].append(seq)
            return KVMove(seq.seq_id, src, dst, seq.tokens[:seq.num_cached], list(self.pools[dst].tables[seq.seq_id]))
        cached = self.pools[dst].allocate(seq.seq_id, seq.tokens, len(seq.tokens))
        if cached is None:
            return None
        active[src].remove(seq)
        active[dst].append(seq)
        self._release(seq)
        seq.rank, seq.num_cached, seq.unsent_prefix = dst, cached, cached
        self.running[dst].append(seq)
        return seq

    def _balance_inputs(self, active: dict[int, object], decoding: dict[int, int]) -> tuple[dict[int, int], set[int]]:
        """`DecodeBalance.observe`'s decoding sequences per rank (draining ranks left out) and the ranks
        with room for one more."""
        counts = _per_rank({r: None for r in active if r not in self.draining},
                           {r: n for r, n in decoding.items() if r not in self.draining})
        return counts, {r for r in counts if len(self.running[r]) < self.max_num_seqs}

    def prepare_decodes(self, batch: StepBatch) -> StepBatch | None:
        """While `batch` (just planned by `schedule`) runs: plan the next step now when it is one more
        decode of every sequence in flight (module docstring, overlap scheduling); `take_prepared` gives it
        once `batch` committed if nothing changed meanwhile. None when it cannot be known now."""
        # the sequences that left a rank since `batch` was planned, and their ranks: with --send-ahead-steps
        # `batch` went out before the step before it committed, so it may still have rows of sequences that
        # ended there; they are not planned again
        gone = {q for _, q in self._left}
        released = {r for r, _ in self._left}
        self._prepared, self._left = None, []
        if self.waiting or self.held or self.kv_offers is not None or batch.moves or any(batch.chunks.values()):
            return None
        decodes, by_id = batch.decodes, self.by_id
        rows_of_gone = sum(q in gone for r in released if r in decodes for q in decodes[r].seq_ids)
        if not decodes or sum(len(r.seq_ids) for r in decodes.values()) - rows_of_gone != sum(
                map(len, self.running.values())):
            return None  # some sequence in flight does not decode in this step
        prepared: dict[int, DecodeRows] = {}
        columns: dict[int, _Column] = {}
        block_size = self.block_size
        for rank, rows in decodes.items():
            pool, kept = self.pools[rank], (rank, self.kept_generation)
            tables = pool.tables
            # The rows of the batch's column (`StepBatch.columns`, its first) whose room says none ends by
            # its length in this step: each decodes again at its position + 1, read in one pass. Each was
            # kept on the rank when the batch was planned (`schedule` plans a decode row for no other), and
            # that changes only as a sequence leaves the rank (`_release`) or at `forget_kept`, which only
            # a `schedule` calls: where none left the rank since, no sequence object is read (16,384 at
            # 256 x 64: reading each one's `kept` took ~10% of the control thread, out of cache).
            lead = batch.columns.get(rank)
            n = len(lead.seqs) if lead is not None and lead.room is not None and lead.room >= 2 \
                and rank not in released else 0
            seq_ids, positions = rows.seq_ids[:n], [p + 1 for p in rows.positions[:n]]
            seqs, new_blocks = list(lead.seqs) if n else [], []
            at_block_end = [(seq_ids[i], positions[i] - 1) for i, p in enumerate(positions) if p % block_size == 0]
            for seq_id, position in zip(rows.seq_ids[n:], rows.positions[n:], strict=True):
                if seq_id in gone:
                    continue
                seq = by_id[seq_id]
                if seq.kept != kept:
                    return None
                if seq.limit - len(seq.tokens) < 2:  # its length ends it in this step: `take_prepared` frees it
                    continue
                seq_ids.append(seq_id)
                positions.append(position + 1)
                seqs.append(seq)
                if (position + 1) % block_size == 0:
                    at_block_end.append((seq_id, position))
            # a table holds its position + 1 tokens, so only one that ends a block can be full
            for seq_id, position in at_block_end:
                table = tables[seq_id]  # as long as `schedule` left it (`kept_blocks`): it grows only here
                if len(table) * block_size < position + 2:
                    if not pool.grow(seq_id, position + 2):  # `schedule` would preempt for its block
                        return None
                    new_blocks.extend((seq_id, b) for b in table[by_id[seq_id].kept_blocks:])
            if seq_ids:
                prepared[rank] = DecodeRows(seq_ids, [SAMPLED_TOKEN] * len(seq_ids), positions, new_blocks)
                # the same sequences as the column's: its stop tokens, and one token less of room
                columns[rank] = (_Column(seqs, lead.stops, lead.room - 1) if n == len(seqs) and lead.stops is not None
                                 else _Column(seqs))
        before = (self.balance.busiest, self.balance.streak)
        after = self._balance_after(before, prepared) if prepared else None
        if after is None:
            return None
        tokens = {r: len(q.seq_ids) for r, q in prepared.items()}
        nxt = StepBatch({r: [] for r in self.running}, {r: [] for r in self.running}, prepared,
                        unaligned=_per_rank(self.running, tokens), columns=columns)
        self._prepared = (nxt, self.revision, before, after)
        return nxt

    def _balance_after(self, before: tuple[int | None, int], decodes: dict[int, DecodeRows]
                       ) -> tuple[int | None, int] | None:
        """`DecodeBalance`'s state after it observed a step of `decodes` from state `before`; None when
        it would name a move there (the move `schedule` would plan is not prepared: it plans it)."""
        if self.align.migrate == "off":
            return before
        probe = DecodeBalance(self.balance.patience)
        probe.busiest, probe.streak = before
        if probe.observe(*self._balance_inputs(self.running, {r: len(q.seq_ids) for r, q in decodes.items()})):
            return None
        return probe.busiest, probe.streak

    def take_prepared(self, ahead: bool = False) -> tuple[StepBatch, bool] | None:
        """The batch `prepare_decodes` planned, now the next step's, when nothing but sequences ending
        changed since (else None, and `schedule` plans the step), and whether some did: their rows
        are taken out of it and their frees put in (so its plans are built again). Dropped either way.
        `ahead`: it is sent before the step it was prepared during commits (--send-ahead-steps): every
        free pending goes in with it (those of the sequences that ended in the step before that, whose
        rows `prepare_decodes` left out), and its columns keep the room `prepare_decodes` gave them
        (the last commit's record is a step behind it)."""
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[1] != self.revision:
            return None
        batch, _, before, after = prepared
        left, self._left = self._left, []
        if left:
            decodes = _without(batch.decodes, left)
            after = self._balance_after(before, decodes) if decodes else None
            if after is None:
                return None
            for rank in {r for r, _ in left}:  # their frees: nothing else was released since
                batch.free[rank], self.to_free[rank] = self.to_free[rank], []
                batch.unaligned[rank] = len(decodes[rank].seq_ids) if rank in decodes else 0
                batch.columns.pop(rank, None)  # no longer its first rows: committed row by row
            batch.decodes = decodes
        freed = False
        if ahead:
            for rank, ids in self.to_free.items():
                if ids:
                    batch.free[rank], self.to_free[rank], freed = batch.free.get(rank, []) + ids, [], True
        self.balance.busiest, self.balance.streak = after
        self.revision += 1
        self._uncommitted = True
        self._reprefill_held = False
        by_id = self.by_id
        for rank, rows in batch.decodes.items():
            if rows.new_blocks:
                tables = self.pools[rank].tables
                for seq_id in {q for q, _ in rows.new_blocks}:
                    by_id[seq_id].kept_blocks = len(tables[seq_id])
        # a column prepared without its stop tokens and room takes those of the same sequences'
        # column the last commit worked out (`_Steady`), so neither its commit nor the next
        # preparation reads each sequence for them
        if not ahead:
            for rank, column in batch.columns.items():
                if column.stops is None and (rec := self._steady.get(rank)) is not None \
                        and rec.column.seqs == column.seqs:
                    batch.columns[rank] = rec.column
        return batch, bool(left) or freed

    def _rank_order(self, ahead: dict[int, int]) -> RankOrder:
        """The ranks that take new sequences (room for one more, not draining) by what a sequence
        without a prefix hit costs there (control/serving/rank_order.py); `ahead` as `_place`'s."""
        running, pools, takes_new = self.running, self.pools, self._takes_new

        def key(r: int) -> tuple[int, int, int, int] | None:
            return (ahead[r], -pools[r].num_free_blocks, len(running[r]), r) if takes_new(r) else None

        return RankOrder(running, key)

    def _takes_new(self, rank: int) -> bool:
        """Whether `rank` may take a new sequence: room for one more, not draining."""
        return len(self.running[rank]) < self.max_num_seqs and rank not in self.draining

    def _place(self, seq: Sequence, ahead: dict[int, int], order: RankOrder) -> bool:
        """Put `seq` on the rank where it adds the fewest tokens of work (see the module
        docstring) whose free blocks hold it, taking its cached prefix there; False when no
        rank with room for one more sequence has the blocks, or it waits for a prefix being
        computed there. `ahead`: rank -> tokens pending there, kept up to date as sequences are
        placed (summing every rank's sequences for every new one was quadratic in the requests
        in flight: 16,384 at 256 ranks x 64); `order`: the ranks by cost (`_rank_order`), whose
        full cost is worked out only where the prefix may hit."""
        tokens = seq.tokens
        if self.kv_offers is not None:  # a takeover's placements change other ranks too: the order afresh
            order = self._rank_order(ahead)
            if self._take_held_kv(seq, {r for r in self.running if self._takes_new(r)}, ahead):
                return True
        pools = self.pools
        chain = next(iter(pools.values())).prefix_chain(tokens) if pools else []  # hashed once, not per rank
        costs = {}
        if chain:
            first = chain[0][1]
            for r, pool in pools.items():
                if pool.may_hit(first) and self._takes_new(r):
                    hit = pool.cached_prefix_tokens(tokens, chain) + (
                        pool.computing_prefix(tokens, chain)[0] if self.prefix_wait else 0)
                    costs[r] = (ahead[r] + len(tokens) - hit, -pool.num_free_blocks, len(self.running[r]), r)
        ranks = order.ranks(len(tokens), costs)
        try:
            for rank in ranks:
                if self.prefix_wait and self._waits_for_prefix(seq, rank):
                    return False
                cached = pools[rank].allocate(seq.seq_id, tokens, len(tokens))
                if cached is None and self.kv_offers is not None and self.kv_offers.holds(rank):  # held KV goes first
                    self.kv_offers.release(rank)
                    cached = pools[rank].allocate(seq.seq_id, tokens, len(tokens))
                if cached is not None:
                    seq.rank, seq.num_cached, seq.unsent_prefix, seq.prefix_wait = rank, cached, cached, None
                    self.running[rank].append(seq)
                    ahead[rank] += seq.pending
                    return True
            return False
        finally:
            ranks.close()

    def _take_held_kv(self, seq: Sequence, candidates: set[int], ahead: dict[int, int]) -> bool:
        """Place a journaled `seq` on the KV an adopted rank among `candidates` held for its tokens
        (control/serving/adopted_kv.py), the kept positions told to the rank with its first chunk
        and keyed for prefix hits; False when there is none."""
        placed = self.kv_offers.take(seq.request.request_id, len(seq.request.prompt_token_ids), seq.tokens,
                                     seq.seq_id, candidates.__contains__)
        if placed is None:
            return False
        rank, kept = placed
        seq.rank, seq.num_cached, seq.unsent_prefix, seq.prefix_wait = rank, kept, kept, None
        self.pools[rank].cache_computed(seq.seq_id, seq.tokens, kept)
        self.running[rank].append(seq)
        ahead[rank] += seq.pending
        return True

    def _waits_for_prefix(self, seq: Sequence, rank: int) -> bool:
        """Whether `seq` waits for a sequence on `rank` that is computing its next uncached
        prefix blocks (see the module docstring): yes while that sequence is running there, not
        held, and has advanced since `seq` last waited for it."""
        _, holder_id = self.pools[rank].computing_prefix(seq.tokens)
        holder = self.by_id.get(holder_id)
        if holder is None or holder.rank != rank or holder_id in self.held:
            return False
        if seq.prefix_wait is not None and seq.prefix_wait[0] == holder_id and holder.num_cached <= seq.prefix_wait[1]:
            return False
        began = seq.prefix_wait is None or seq.prefix_wait[0] != holder_id
        seq.prefix_wait = (holder_id, holder.num_cached)
        self._waits = [self._waits[0] + began, self._waits[1] + 1]
        return True

    @staticmethod
    def _plan(seq: Sequence, out: list[ChunkPlan], room: int, table: list[int]) -> int:
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
                list(table),
                tokens[:start] if seq.unsent_prefix else [],
            )
        )
        return n

    def commit(self, batch: StepBatch, sampled: Sampled, generated: list[tuple[int, int]] | None = None,
               columns: list[tuple[int, list[int], list[int]]] | None = None) -> list[StepTokens]:
        """Apply a finished step: advance caches, append sampled tokens (`sampled`: each rank's
        answer; a row's token is looked for in its rank's), retire finished sequences. Returns
        (seq_id, [its new token], finish reason, None) of every sequence that sampled one, as the
        streams take them (the step loop puts in the logprobs); with `generated`, (seq_id, tokens
        generated so far) of each is appended to it (the request traces). A sequence whose
        `ChunkPlan` ran on its rank is kept there from now on (module docstring). With `columns`
        (and no `generated`), a rank whose first decode rows were planned without a look at each
        (`StepBatch.columns`: from its `_Steady` record, or prepared), none of whose sequences left
        it since and each of which sampled a token, has those rows committed as a column: (rank,
        the seq_ids and tokens of those that go on) is appended to `columns` instead of a tuple per
        row to the list returned; those that end in the step still get theirs (`_commit_columns`)."""
        self._uncommitted = False
        for move in batch.moves:
            self._rehome(move)
        out: list[StepTokens] = []
        generation, by_id = self.kept_generation, self.by_id
        for rank, chunks in batch.chunks.items():
            if not chunks:  # a rank that only decodes: its answer is not looked into
                continue
            answered = sampled.lookup(rank)
            for c in chunks:
                seq = by_id.get(c.seq_id)
                if seq is None or seq.rank is None:
                    continue
                if seq.rank == rank:
                    seq.kept, seq.kept_blocks = (rank, generation), len(c.block_ids)
                self._advance(seq, c.start_pos + len(c.token_ids), answered, out, generated)
        # The decode rows, a step's bulk (16,384 at 256 ranks x 64): `_advance` and the sequence's
        # `append` and `check_finished` written out here, at ~1 us of Python a row less. Each rank's
        # rows that go on decoding are its `_Steady` record for the next `schedule`.
        block_size, steady = self.block_size, {}
        by_columns = columns is not None and generated is None
        for rank, rows in batch.decodes.items():
            pool = self.pools[rank]
            row_tokens, whole = sampled.row_tokens(rank, rows.seq_ids)
            lead = batch.columns.get(rank) if by_columns else None
            done = self._commit_columns(rank, rows, lead, row_tokens, whole, columns, out) if lead is not None else None
            n = len(lead.seqs) if done is not None else 0
            seqs, sampled_tokens, left = [], [], False
            for seq_id, position, token in zip(rows.seq_ids[n:] if n else rows.seq_ids,
                                               rows.positions[n:] if n else rows.positions,
                                               row_tokens[n:] if n else row_tokens, strict=True):
                seq = by_id.get(seq_id)
                if seq is None or seq.rank != rank:
                    left = True
                    continue
                num_cached = seq.num_cached = position + 1  # a decode row's sequence has no unsent prefix
                if num_cached % block_size == 0:  # it filled a block, to be keyed for prefix hits
                    pool.cache_computed(seq_id, seq.tokens, num_cached)
                if token is None:  # an error of its sampling: a prepared next step is not it
                    self.revision += 1
                    left = True
                    continue
                tokens = seq.tokens
                tokens.append(token)
                reason = "stop" if token in seq.stop_ids else "length" if len(tokens) >= seq.limit else None
                if reason is not None:
                    self._finished(seq, reason)
                    left = True
                else:
                    seqs.append(seq)
                    sampled_tokens.append(token)
                out.append((seq_id, [token], reason, None))
                if generated is not None:
                    generated.append((seq_id, len(tokens) - seq.prompt_len))
            # the next record's column: the column's stop tokens and fewest tokens left carried on where
            # nothing else joined it, else worked out at the next commit that reads them
            column = _Column(seqs)
            if done is not None:
                column = _Column(done.seqs + seqs) if seqs else _Column(done.seqs, done.stops, done.room)
                seqs, sampled_tokens, left = column.seqs, done.tokens + sampled_tokens, left or done.ended
            if seqs:
                steady[rank] = _Steady(generation, [q.seq_id for q in seqs] if left else rows.seq_ids,
                                       [q.num_cached - 1 for q in seqs] if left else rows.positions, sampled_tokens,
                                       column)
        self._steady = steady
        return out

    def _commit_columns(self, rank: int, rows: DecodeRows, lead: _Column, row_tokens: list[int | None], whole: bool,
                        columns: list[tuple[int, list[int], list[int]]], out: list[StepTokens]) -> _Committed | None:
        """Commit the first decode rows of `rank`, those of `lead`, as a column, when every one of
        `lead`'s sequences is still the first of the rank's (none left it since the step was planned:
        aborted, moved, ended before a prepared step was taken) and each sampled a token (`row_tokens`:
        each row's, None where none; `whole`: none is None); else do nothing and return None
        (`commit` looks at each row). Each sequence's position and token are advanced in one pass (a
        full block keyed for prefix hits). Only where a token sampled is one of `lead.stops`, or
        `lead.room` says one may reach its length, are the sequences read one by one to find those
        that end: each ends as `commit` ends it, with its output appended to `out`.
        (rank, the seq_ids and tokens of those that go on) is appended to `columns`."""
        seqs = lead.seqs
        n = len(seqs)
        if self.running[rank][:n] != seqs:
            return None
        ids = rows.seq_ids if n == len(rows.seq_ids) else rows.seq_ids[:n]
        tokens = row_tokens if n == len(row_tokens) else row_tokens[:n]
        if not whole and None in tokens:  # one of them sampled nothing (an error of its sampling)
            return None
        stops, room = lead.stops, lead.room
        if stops is None or room is None:  # a column new since the last commit: its sequences read once
            stops = frozenset().union(*[seq.stop_ids for seq in seqs])
            room = min(seq.limit - len(seq.tokens) for seq in seqs)
        ends: dict[int, str] = {}  # index -> why it ends
        if stops and not stops.isdisjoint(tokens):
            ends = {i: "stop" for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)) if token in seq.stop_ids}
        room -= 1  # this step appends one to each
        if room < 1:  # some may reach their length: each one's tokens left after this step, read
            left = [seq.limit - len(seq.tokens) - 1 for seq in seqs]
            for i, more in enumerate(left):
                if more <= 0:
                    ends.setdefault(i, "length")
            room = min((more for i, more in enumerate(left) if i not in ends), default=0)
        pool, block_size = self.pools[rank], self.block_size
        for seq, token, position in zip(seqs, tokens, rows.positions, strict=False):  # rows after `seqs`: `commit`'s
            num_cached = seq.num_cached = position + 1
            if num_cached % block_size == 0:  # it filled a block, to be keyed for prefix hits
                pool.cache_computed(seq.seq_id, seq.tokens, num_cached)
            seq.tokens.append(token)
        if ends:
            for i in sorted(ends):  # in the rows' order, as `commit` ends them: their blocks freed in that order
                self._finished(seqs[i], ends[i])
                out.append((ids[i], [tokens[i]], ends[i], None))
            on = [i for i in range(n) if i not in ends]
            seqs, ids, tokens = [seqs[i] for i in on], [ids[i] for i in on], [tokens[i] for i in on]
        columns.append((rank, ids, tokens))
        return _Committed(seqs, tokens, stops, room, bool(ends))

    def _advance(self, seq: Sequence, num_cached: int, sampled: Mapping[int, int], out: list[StepTokens],
                 generated: list[tuple[int, int]] | None) -> None:
        """`seq`'s chunk computed its first num_cached tokens; its sampled token (`sampled`: the
        tokens its rank answered), if any, is appended to it (and to `out`, as `commit` says), and
        it ends when that token finishes it."""
        seq.num_cached = num_cached
        seq.unsent_prefix = 0
        self.pools[seq.rank].cache_computed(seq.seq_id, seq.tokens, num_cached)
        token = sampled.get(seq.seq_id)
        if token is None:  # nothing sampled (not its last chunk, or an error): a prepared next step is not it
            self.revision += 1
            return
        seq.append(token)
        reason = seq.check_finished(token)
        if reason is not None:
            self._finished(seq, reason)
        out.append((seq.seq_id, [token], reason, None))
        if generated is not None:
            generated.append((seq.seq_id, seq.generated))

    def _finished(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        del self.by_id[seq.seq_id]
        self._release(seq)


def _without(decodes: dict[int, DecodeRows], left: list[tuple[int, int]]) -> dict[int, DecodeRows]:
    """`decodes` less the rows (and new blocks) of the sequences of `left` (rank, seq_id); a rank
    left with no row has none."""
    gone, out = {q for _, q in left}, dict(decodes)
    for rank in {r for r, _ in left}:
        rows = out.pop(rank, None)
        kept = [i for i, q in enumerate(rows.seq_ids) if q not in gone] if rows is not None else []
        if kept:
            out[rank] = DecodeRows([rows.seq_ids[i] for i in kept], [rows.tokens[i] for i in kept],
                                   [rows.positions[i] for i in kept],
                                   [(q, b) for q, b in rows.new_blocks if q not in gone])
    return out


def _steady_prefix(rec: _Steady | None, seqs: list[Sequence]) -> int:
    """How many of `seqs` (a rank's, in order) are its `_Steady` record's: all of the record's when
    they are the first of `seqs`, else 0 (or no record)."""
    if rec is None:
        return 0
    steady_seqs = rec.column.seqs
    return len(steady_seqs) if seqs[:len(steady_seqs)] == steady_seqs else 0


def _work_of(active: dict[int, list[Sequence]], steady: dict[int, _Steady]
             ) -> tuple[dict[int, tuple[int, list[Sequence], list[Sequence]]], dict[int, int]]:
    """`_rank_work` of each rank of `active` with sequences, and rank -> how many of its first
    sequences are those of its `_Steady` record (each decoding, one token pending: not looked at)."""
    work, steady_n = {}, {}
    for r, qs in active.items():
        if not qs:
            continue
        n = _steady_prefix(steady.get(r), qs)
        if n:
            pending, decoding, others = _rank_work(qs[n:])
            work[r], steady_n[r] = (n + pending, qs[:n] + decoding, others), n
        else:
            work[r] = _rank_work(qs)
    return work, steady_n


def _pending_of(running: dict[int, list[Sequence]], steady: dict[int, _Steady]) -> dict[int, int]:
    """rank -> tokens pending on it (the work ahead a new sequence's placement weighs): a steady
    rank's first sequences one each (`_Steady`), the others' counted."""
    ahead = {}
    for r, seqs in running.items():
        n = _steady_prefix(steady.get(r), seqs)
        ahead[r] = n + sum(len(q.tokens) - q.num_cached for q in seqs[n:])  # `Sequence.pending`, written out
    return ahead


def _steady_rows(rec: _Steady, tables: dict[int, list[int]], block_size: int) -> DecodeRows | None:
    """A steady rank's next decode rows (`_Steady`): each of its record's sequences at its position +
    1 with the token it sampled, and the blocks the tables of those whose next position starts a
    block grew by. None when one of those has no block for its next token (its pool was full): the
    rank's sequences are then planned one by one."""
    seqs, positions = rec.column.seqs, rec.positions
    ends = [(seqs[i], positions[i]) for i in rec.boundary(block_size)]
    if any(len(tables[seq.seq_id]) * block_size < position + 2 for seq, position in ends):
        return None
    new_blocks = []
    for seq, _ in ends:
        table = tables[seq.seq_id]
        if len(table) > seq.kept_blocks:
            new_blocks.extend((seq.seq_id, b) for b in table[seq.kept_blocks:])
            seq.kept_blocks = len(table)
    return DecodeRows(list(rec.seq_ids), rec.tokens, [p + 1 for p in rec.positions], new_blocks)


def _rank_work(seqs: list[Sequence]) -> tuple[int, list[Sequence], list[Sequence]]:
    """A rank's sequences in one pass: their pending tokens in all, those decoding, the others
    (each in its order)."""
    pending, decoding, others = 0, [], []
    for q in seqs:  # `Sequence.pending` and `.decoding` written out: this runs for every sequence in flight
        n = len(q.tokens) - q.num_cached
        pending += n
        (decoding if n == 1 and q.num_cached and not q.unsent_prefix else others).append(q)
    return pending, decoding, others


def _per_rank(ranks: dict[int, object], counts: dict[int, int]) -> dict[int, int]:
    """`counts` over every rank of `ranks`, in its order, 0 where it has none: a step's sums are
    worked out over the ranks that run something, not every rank (1,024 at scale, most idle)."""
    out = dict.fromkeys(ranks, 0)
    out.update(counts)
    return out
