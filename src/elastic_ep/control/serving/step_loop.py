"""The step loop: plan one step, send it to every member, gather the results, deliver the tokens.

Every member runs every step, an empty plan included, because every MoE layer's all-to-all
needs all of them. When a rank dies or hangs mid-step the wait ends as soon as the detector
holds a fault (or a rank reports that its collective raised): the step's frees are asked for
again, the batch stays uncommitted, and `RecoveryNeeded` hands over to recovery. The first step
of the next epoch is the recompute: the scheduler committed nothing of the interrupted batch, so
planning again runs the same tokens (the lost rank's sequences re-prefilled on other ranks), and
a token is a pure function of the sequence, so the same ones are sampled. A step that keeps
failing with every rank alive is recomputed `MAX_RETRIES_WITHOUT_CULPRIT` times, then its
requests end with the error (`after_fault`). When a rank's own computation fails with every rank
alive, the step is dropped and isolation (serving/isolation.py) finds the request at fault, in
the same epoch. A slow rank only makes the step slower; its time shows in the per-rank metrics
and the radar.

Plans go to each rank, or per node through its agent (`NodeStepPlans`, --step-plans-via agent,
which the agent relays to its workers as it came): a plan the agent lost (it died, stalled, or its
link was cut) is a step its rank never ran, which the result deadline below finds (NOT_RUN).
Results come from each rank (`StepResult`) or gathered per node by its agent (`NodeStepResults`,
--step-results-via agent); either way each is one rank's answer. An answer lost on the way (an
agent that died or stalled loses those it held), with every rank alive, would leave the step
waiting for ever: past the result deadline (--result-timeout-floor-s, --result-timeout-multiple) a
member that has not answered and whose heartbeats say it is not inside the step is sent
`ResendResult`. Workers keep their last step's answer and send it again (to the controller
directly, whatever --step-results-via), and the step goes on; a rank that never ran the step
(its plan was lost) says so, an error of the step, recomputed as any other; one that does not
answer within --resend-timeout-s is a fault (its step link is lost) and is replaced.

Overlap scheduling (--async-scheduling, default off; vLLM's name): right after a step's plans are
sent, the next step is planned and sealed while the ranks run, when the scheduler can know it now
(`Scheduler.prepare_decodes`: every sequence in flight decodes once more, each row's token the one
its rank samples in this step). The next `run` sends those sealed plans at once when nothing made
them wrong meanwhile: the scheduler's `revision` is unchanged (nothing added, nothing that sampled
nothing; no hold, no failed step), the step committed, and the epoch, the members, the term and
isolation's hold are as they were. When sequences ended meanwhile (finished in the step, aborted),
the scheduler takes their rows out and puts their frees in, and the plans are built and sealed
again from that batch (still no `schedule`). Otherwise they are dropped and the step is planned the
usual way, so a step sent is always the one `schedule` would have planned. With --step-plans-via
agent each node's `NodeStepPlans` is sealed then too, for the ranks relayed as they are then; at
the send the ranks to relay are worked out again, and a change (an agent gone silent, a rank's
beats late, a `ChaosStep` sent) has the prepared plans sealed again for the nodes of now.

Steps sent ahead (--send-ahead-steps N, with --async-scheduling; vLLM's and SGLang's overlap): the
step prepared while this one runs is sent at once, before this one completes, so each rank finds
its next plan waiting when it answers and goes straight on; the control thread then commits one step
while the ranks run the next, and only its CPU per step, not its turnaround, adds to the ranks' time.
A step sent ahead cannot take out the rows of the requests that end in the step before it: each is
computed once more and its token dropped at the commit (its sequence has left the rank), and its
blocks are freed in the step after. Answers to it that come before the step before completes wait
with it. When the step before fails or is interrupted, the step sent ahead is given up: its number
is spent (its answers match nothing), its batch counts as failed (the next plan is full, its frees
asked again), and the ranks run it and drop it. Up to N steps go ahead in a row; a step that cannot
be prepared (a request arrived, a hold) ends the run, and `run` returns after each step with the
next one still in flight: the controller runs it before the next step boundary, so an epoch change,
a scale or a sleep waits for at most N steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from elastic_ep.policy.straggler_verdict import IntervalRecorder
from elastic_ep.wire import (
    NodeStepResults,
    ResendResult,
    StepErrorKind,
    StepFailed,
    StepPlan,
    StepResult,
    reject_invalid,
)

from ..cluster import ClusterState
from ..config import ServeConfig
from ..control_plane import ControlPlane, plans_by_node
from ..events import EventKind
from ..faults.detector import FaultDetector, RecoveryNeeded
from ..faults.health_rules import resends_unanswered, results_to_ask
from ..metrics import ClusterMetrics
from ..tracing import RequestTraces
from .alignment import imbalance
from .isolation import Isolation
from .load_window import LoadWindow
from .recorder import ExpertRecorder
from .scheduler import Scheduler, StepBatch
from .step_answers import StepAnswers
from .streams import Streams
from .warmup import WarmUpGate, padded_tokens

# A step failing with every rank alive (a collective error no fault explains) is recomputed in a
# re-formed group this many times before its requests end: a deterministic error would otherwise
# loop forever, a transient one passes on the first retry.
MAX_RETRIES_WITHOUT_CULPRIT = 3
# --step-plans-via agent: a rank's heartbeats come through its agent, so a rank last heard more than
# this many heartbeat intervals ago has an agent (or is itself) behind: its plan goes directly, so a
# stalled agent holds up at most the step in flight (asked for as NOT_RUN), not its recompute too;
# well below the heartbeat deadline (1 s) and the result deadline (2 s) at the defaults
RELAY_FRESH_BEATS = 5


@dataclass
class PreparedStep:
    """A step planned and sealed while the one before ran (--async-scheduling), with what it
    assumed: sent only when they all still hold."""

    epoch: int
    step: int
    members: list[int]
    term: int
    batch: StepBatch
    # ControlPlane.seal_for_workers's; None: built from `batch` at the send (sequences ended since),
    # or --step-plans-via agent
    frames: list | None
    micro_batches: int
    # --step-plans-via agent: the plans, the ranks relayed as `_relayed` saw them then, and those
    # nodes' frames (`ControlPlane.seal_for_agents`), sent as sealed when `_relayed` still says so
    plans: list | None = None
    relayed: dict[int, str] | None = None
    node_frames: list | None = None
    # --send-ahead-steps: the answers that came while the step before was in flight
    replies: dict[int, StepResult | StepFailed | NodeStepResults] = field(default_factory=dict)
    answers: StepAnswers = field(default_factory=StepAnswers)
    sent_at: float = 0.0  # perf_counter when it was sent ahead


@dataclass
class CompletedStep:
    """A committed step whose answers the timings, the straggler intervals, the EPLB window and the
    metrics have not taken yet (`StepLoop.observe`)."""

    batch: StepBatch
    answers: StepAnswers
    records: list[int]  # each answering rank's record (RankInfo.record) at the commit
    wall_s: float
    slowest_s: float


class ChaosHook(Protocol):
    """Fault injection, present only with --enable-chaos (control/chaos.py)."""

    def before_step(self, epoch: int, step: int, batch: StepBatch, members: list[int]) -> set[int]: ...


class StepLoop:
    """`pump(timeout_s)` handles input while a step waits (results arrive through `on_reply`);
    `chaos`, when given, is called before each step's plans are sent."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, plane: ControlPlane, scheduler: Scheduler,
                 detector: FaultDetector, metrics: ClusterMetrics, recorder: ExpertRecorder, streams: Streams,
                 isolation: Isolation, top_k: int, pump: Callable[[float], None], chaos: ChaosHook | None = None,
                 traces: RequestTraces | None = None, warmup: WarmUpGate | None = None,
                 during_step: Callable[[], None] | None = None):
        self.cluster = cluster
        self.cfg = cfg
        self.plane = plane
        self.scheduler = scheduler
        self.detector = detector
        self.metrics = metrics
        self.recorder = recorder
        self.streams = streams
        self.isolation = isolation
        self.top_k = top_k
        self.pump = pump
        self.chaos = chaos
        self.traces = traces
        self.warmup = warmup  # the readiness gate: each rank's step padded to a shape it warmed (None: no padding)
        self.during_step = during_step  # the boundary's housekeeping, run once a step after its plans went out
        # rank -> its answer to the step in flight: its own message, or its node's (NodeStepResults)
        self.replies: dict[int, StepResult | StepFailed | NodeStepResults] = {}
        self.answers = StepAnswers()  # the results among them, in columns
        self._links_recorded = 0  # answers whose round trip is in the ranks' timings (_record_links)
        self.in_step: set[int] = set()  # members of the step in flight
        self.asked: dict[int, float] = {}  # members asked to resend their answer to the step in flight -> when
        self._result_deadline_s = 0.0  # of the step in flight (detector.result_deadline_s at its start)
        self.started_at = 0.0  # monotonic time the step in flight was sent
        self.own_time = IntervalRecorder(cfg.straggler_window_s)  # per rank: tokens and own time per step
        self.tokens_run = 0  # tokens (prefill and decode) run, all steps and ranks
        self.tokens_sampled = 0
        self.uncommitted: StepBatch | None = None  # the batch of an interrupted step, until a step commits
        self.retries_without_culprit = 0  # recomputes of a step that failed with every rank alive
        # ranks report their load summed over --load-report-every-steps steps, taking turns: a step
        # holds the reports sent in it, so a window of W >= load_every steps sums about W steps' load
        self.load_every = max(cfg.load_report_every_steps, 1)
        self.load_window = LoadWindow(max(cfg.eplb_interval, 1), cluster.num_layers, cluster.num_experts)
        self._sent_at = 0.0
        self._started_ns = 0  # wall-clock ns the step in flight was sent (request traces)
        self._planned_epoch: int | None = None  # the epoch of the last step planned
        self.prepared: PreparedStep | None = None  # the next step, planned while this one runs
        self.ahead: PreparedStep | None = None  # the next step, sent while this one runs (--send-ahead-steps)
        self._ahead_left = 0  # steps that may still be sent ahead before the next step boundary
        self._links = True  # the step in flight's answers measure a round trip (not one sent ahead)
        self._spent = False  # the next step number went to a step sent ahead and given up: skipped
        self._done_at = 0.0  # perf_counter when the last step completed, 0 after one that did not
        self.completed: CompletedStep | None = None  # the last committed step, until `observe` took it

    def _inbox(self, epoch: int, step: int) -> tuple[dict, StepAnswers, float] | None:
        """Where an answer to (epoch, step) goes: the replies, answers and send time of the step in flight,
        or of the step sent ahead of it; None for any other step."""
        c = self.cluster
        if epoch != c.epoch:
            return None
        if step == c.step:
            return self.replies, self.answers, self._sent_at
        ahead = self.ahead
        if ahead is not None and step == ahead.step:
            return ahead.replies, ahead.answers, ahead.sent_at
        return None

    def on_reply(self, msg: StepResult | StepFailed) -> None:
        inbox = self._inbox(msg.epoch, msg.step)
        if inbox is None or msg.rank_id in inbox[0]:
            return  # of another step, or an answer sent again that came after the first
        replies, answers, sent_at = inbox
        if isinstance(msg, StepResult):
            rank = self.cluster.ranks.get(msg.rank_id)
            if rank is None or not self._load_fits(msg.expert_load, f"rank {msg.rank_id}", "step", rank.node):
                return
            answers.add(msg, time.perf_counter() - sent_at)
        self._answered(replies, msg.rank_id, msg)
        if isinstance(msg, StepFailed) and msg.kind != StepErrorKind.LOCAL:  # the group broke, or a plan was lost
            self.detector.error(f"rank {msg.rank_id}: {msg.error}")

    def _answered(self, replies: dict, rank_id: int, msg: StepResult | StepFailed | NodeStepResults) -> None:
        replies[rank_id] = msg
        if rank_id in self.asked and replies is self.replies:
            not_run = isinstance(msg, StepFailed) and msg.kind == StepErrorKind.NOT_RUN
            self.metrics.lost_results.labels("not_run" if not_run else "resent").inc()

    def _load_fits(self, load: np.ndarray, whose: str, socket: str, node: str) -> bool:
        """Whether an expert load report is empty or of the model's [layers, experts]; one that is not
        is dropped with its frame, counted (it would break the step's sum)."""
        c = self.cluster
        if not load.size or load.shape == (c.num_layers, c.num_experts):
            return True
        reject_invalid(socket, node, whose, f"an expert load of shape {load.shape}, not "
                       f"{(c.num_layers, c.num_experts)}")
        return False

    def on_node_results(self, msg: NodeStepResults) -> None:
        """An agent's gather of its ranks' results (--step-results-via agent): each rank's taken as if it
        had sent it, when the agent's session is the current one (as its heartbeats are). A frame of
        another session or step is dropped; one that names a rank not of its node, or carries an expert
        load not of the model's shape, is dropped and counted (`invalid`). A rank that answered already
        (its answer sent again, directly) is left out. What is dropped is asked for again past the result
        deadline."""
        c = self.cluster
        agent = c.agents.get(msg.node)
        inbox = self._inbox(msg.epoch, msg.step)
        if agent is None or agent.session != msg.session or inbox is None:
            return
        ranks, node = c.ranks, msg.node
        infos = [ranks.get(r) for r in msg.rank_ids]
        if not all(info is not None and info.node == node for info in infos):
            reject_invalid("health", node, f"agent {node}", f"results of ranks {msg.rank_ids}, not all of node {node}")
            return
        if not all(self._load_fits(load, f"agent {node}", "health", node) for load in msg.expert_load.values()):
            return
        replies, answers, sent_at = inbox
        take = [i for i, r in enumerate(msg.rank_ids) if r not in replies]
        answers.add_node(msg, time.perf_counter() - sent_at, None if len(take) == len(msg.rank_ids) else take)
        for i in take:
            self._answered(replies, msg.rank_ids[i], msg)

    def run(self) -> float | None:
        """Run the next step; returns its wall time (s), or None when a rank's own computation
        failed (the step is dropped; isolation decides what runs next). Raises RecoveryNeeded
        on a fault."""
        c, times = self.cluster, self.plane.times
        t0 = time.perf_counter()
        if self._done_at:  # the last step completed: what the control thread did since is this step's
            times.add("between", t0 - self._done_at)
        self._done_at = 0.0
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            self._ahead_left = self.cfg.send_ahead_steps
            prepared = self._take_prepared()
            batch = prepared.batch if prepared is not None else self._plan()
        else:  # sent while the last step ran, which committed: the ranks are running it
            prepared, batch = None, ahead.batch
        self.metrics.kv_step(batch.preempted, batch.prefix_queried, batch.prefix_hit, batch.prefix_waits,
                             batch.kv_kept, batch.kv_reprefilled)
        c.step += 2 if self._spent else 1
        self._spent = False
        self._record_links()  # answers to the last step that came after it ended
        self.asked = {}
        if ahead is None:
            self.replies, self.answers, self._links_recorded, self._links = {}, StepAnswers(), 0, True
        else:  # its answers' times include the step before, which the ranks ran first: no link's round trip
            self.replies, self.answers, self._links = ahead.replies, ahead.answers, False
        self.in_step = set(c.members)
        self._result_deadline_s = self.detector.result_deadline_s()
        self.started_at = time.monotonic()
        self._started_ns = time.time_ns()
        if ahead is None:
            micro_batches, start = self._send(prepared, batch, c.step)
            self._sent_at = start
            times.add("plan", start - t0)
        else:
            micro_batches, start = ahead.micro_batches, time.perf_counter()
            self._sent_at = ahead.sent_at
        if self.cfg.async_scheduling:
            self._prepare(batch)
            if self._ahead_left > 0 and self.prepared is not None:
                self._send_ahead()
        self.observe()  # the last step's, now that this one's plans are out
        if self.during_step is not None:
            self.during_step()
        sent = time.perf_counter()
        while len(self.replies) < len(c.members):
            self.pump(0.002)
            if time.monotonic() - self.started_at > self._result_deadline_s:
                self._chase_answers()
            if self.detector.pending:
                self._record_links()
                self.prepared = None
                self.scheduler.step_failed(batch)
                self._give_up_ahead()
                self.uncommitted = batch
                raise RecoveryNeeded()
        self.in_step = set()
        self._record_links()
        gathered = time.perf_counter()
        wall_s = gathered - start
        self.metrics.prefix_wait_seconds.inc(batch.prefix_waiting * (gathered - t0))  # they waited the whole step
        times.add("gather", gathered - sent)
        failures = {r: m for r, m in self.replies.items() if isinstance(m, StepFailed)}
        if failures:
            self.prepared = None
            self.scheduler.step_failed(batch)
            self.metrics.failed_steps.inc()
            self.isolation.step_failed(c.step, batch, failures)
            self._give_up_ahead()
            return None
        self._finish(batch, wall_s, micro_batches)
        self.isolation.step_passed(batch)
        times.steps += 1
        self._done_at = time.perf_counter()
        times.wall_s += self._done_at - t0
        return wall_s

    def _send(self, prepared: PreparedStep | None, batch: StepBatch, step: int) -> tuple[int, float]:
        """Send `batch` as step `step` of this epoch: `prepared`'s sealed frames or plans when it has
        them, else plans built now; returns its micro-batches and when it went (perf_counter, just
        before the send)."""
        c, times = self.cluster, self.plane.times
        if prepared is not None and prepared.frames is not None:
            plans, micro_batches = None, prepared.micro_batches
        elif prepared is not None and prepared.plans is not None:
            plans, micro_batches = prepared.plans, prepared.micro_batches
        else:
            plans, micro_batches = self._plans(batch, step)
        # the ranks sent a `ChaosStep` get their plan directly, after it on the same socket
        injected = self.chaos.before_step(c.epoch, step, batch, c.members) if self.chaos is not None else set()
        sent_at = time.perf_counter()
        if plans is None:
            send_s, nbytes = self.plane.send_sealed(prepared.frames)
            times.add("send", send_s)
            times.bytes_out += nbytes
            times.plans_out["direct"] += len(prepared.frames)
        else:
            relayed = self._relayed(injected)
            sealed = prepared.node_frames if prepared is not None and prepared.plans is plans \
                and prepared.relayed == relayed else None
            self.plane.plans_to_workers(plans, relayed, sealed)
        return micro_batches, sent_at

    def _send_ahead(self) -> None:
        """--send-ahead-steps: send the step just prepared now, while the one in flight runs (module
        docstring), when it is still the next step."""
        prepared = self._take_prepared(ahead=True)
        if prepared is None:
            return
        prepared.micro_batches, prepared.sent_at = self._send(prepared, prepared.batch, prepared.step)
        self._ahead_left -= 1
        self.ahead = prepared

    def _give_up_ahead(self) -> None:
        """The step before the step sent ahead failed or was interrupted: the ranks run that one and drop
        it (its plans need the tokens of a step that did not commit, or its epoch is over); its number is
        spent, so its answers match no later step (the number of the step in flight stays until the next:
        a recovery gathers that step's answers), and its batch counts as failed (the next plan is full,
        its frees are asked again)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return
        self._spent = True
        self.scheduler.step_failed(ahead.batch)
        self.metrics.prepared_steps.labels("dropped").inc()

    def _record_links(self) -> None:
        """The answers' round trips (`StepAnswers.link_s`) not recorded yet into the ranks' timings: at
        the step's end, and before the next for those that came after it (a rank gone since is left out).
        None for a step sent ahead (`_links`)."""
        a, ranks = self.answers, self.cluster.ranks
        start = self._links_recorded
        if start == len(a.rank_ids):
            return
        self._links_recorded = len(a.rank_ids)
        if not self._links:
            return
        ids, links = a.rank_ids[start:], a.link_s(start)
        kept = [i for i, r in enumerate(ids) if r in ranks]
        if len(kept) < len(ids):
            ids, links = [ids[i] for i in kept], links[kept]
        self.cluster.timings.write("link_s", ids, [ranks[r].record for r in ids], links)

    def _relayed(self, direct: set[int]) -> dict[int, str] | None:
        """rank -> node for the members whose plan goes through their node's agent (--step-plans-via
        agent): those of a node whose agent is registered and not silent, heard from (their
        heartbeats, which the agent brings) within `RELAY_FRESH_BEATS` intervals, and not in
        `direct` (a `ChaosStep` went to them: a relayed plan could overtake it). A rank of a node
        with no such agent gets its plan directly, as does every rank of a node whose agent has no
        plan link up at the send (`ControlPlane.send_to_agents`). None: every plan direct."""
        cfg = self.cfg
        if cfg.step_plans_via != "agent":
            return None
        c = self.cluster
        agents, ranks = c.agents, c.ranks
        beats = cfg.health_checks and cfg.heartbeat_interval_s > 0
        heard_since = self.plane.heard_clock() - RELAY_FRESH_BEATS * cfg.heartbeat_interval_s
        relayed = {}
        for rank_id in c.members:
            if rank_id in direct:
                continue
            rank = ranks[rank_id]
            agent = agents.get(rank.node)
            if agent is not None and not agent.stalled and (not beats or rank.last_heartbeat >= heard_since):
                relayed[rank_id] = rank.node
        return relayed

    def _plans(self, batch: StepBatch, step: int) -> tuple[list[tuple[int, StepPlan]], int]:
        """(rank, its plan) for every member, and the micro-batches, of `batch` as step `step`."""
        c = self.cluster
        tokens = batch.tokens_per_rank()
        pads = self._pads(tokens)
        busiest = max((tokens.get(r, 0) + pads.get(r, 0) for r in c.members), default=0)
        dispatch_rows = busiest * self.top_k if busiest <= self.cfg.padded_dispatch_max_tokens else 0
        micro_batches = 2 if self.cfg.enable_dbo and busiest >= self.cfg.dbo_min_tokens else 1
        # the plan of every rank with nothing to run or free, per report_load: one object, encoded and
        # sealed once for all of them (most ranks at scale: only the busy ones are looked at)
        idle_pad = padded_tokens(0, self.warmup.shapes) if self.warmup is not None else 0
        empty = [StepPlan(c.epoch, step, [], [], dispatch_rows, micro_batches, batch.moves, report_load, idle_pad)
                 for report_load in (False, True)]
        chunks, free, decodes = batch.chunks, batch.free, batch.decodes
        busy = {r for r, cs in chunks.items() if cs} | {r for r, f in free.items() if f} | decodes.keys()
        plans, load_every = [], self.load_every
        for rank_id in c.members:
            report_load = (step + rank_id) % load_every == 0  # ranks take turns
            if rank_id in busy:
                plans.append((rank_id, StepPlan(c.epoch, step, chunks.get(rank_id, []), free.get(rank_id, []),
                                                dispatch_rows, micro_batches, batch.moves, report_load,
                                                pads.get(rank_id, 0), decodes.get(rank_id))))
            else:
                plans.append((rank_id, empty[report_load]))
        return plans, micro_batches

    def _prepare(self, batch: StepBatch) -> None:
        """--async-scheduling: the next step planned and sealed now, while `batch` runs, when the
        scheduler can know it (module docstring)."""
        t0 = time.perf_counter()
        c = self.cluster
        nxt = None if self.isolation.held else self.scheduler.prepare_decodes(batch)
        if nxt is None:
            self.prepared = None
            return
        plans, micro_batches = self._plans(nxt, c.step + 1)
        if self.cfg.step_plans_via == "agent":  # per node, for the agents' links of now: checked at the send
            relayed = self._relayed(set())
            node_frames = self.plane.seal_for_agents(plans_by_node(plans, relayed)[0]) if relayed else None
            self.prepared = PreparedStep(c.epoch, c.step + 1, list(c.members), self.plane.term, nxt, None,
                                         micro_batches, plans, relayed, node_frames)
        else:
            self.prepared = PreparedStep(c.epoch, c.step + 1, list(c.members), self.plane.term, nxt,
                                         self.plane.seal_for_workers(plans), micro_batches)
        self.plane.times.add("prepare", time.perf_counter() - t0)

    def _take_prepared(self, ahead: bool = False) -> PreparedStep | None:
        """The step prepared while the last one ran, when it is still the next step as `schedule`
        would plan it (module docstring), its frames None when sequences ended since (its plans are
        built again); else None, and it is dropped. `ahead`: to be sent before the step in flight
        completes (`Scheduler.take_prepared`)."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return None
        c = self.cluster
        taken = None
        if (prepared.epoch == c.epoch and prepared.step == c.step + 1 and prepared.term == self.plane.term
                and not self.isolation.held and self.uncommitted is None and prepared.members == c.members):
            taken = self.scheduler.take_prepared(ahead)  # when not asked, a stale one stays there: `schedule` drops it
        if taken is None:
            self.metrics.prepared_steps.labels("dropped").inc()
            return None
        prepared.batch, changed = taken
        if changed:
            prepared.frames = prepared.plans = prepared.node_frames = None
        self.metrics.prepared_steps.labels("ahead" if ahead else "rebuilt" if changed else "sent").inc()
        return prepared

    def _chase_answers(self) -> None:
        """Past the result deadline: ask the members whose answer is missing, and which are not inside
        the step, to send it again; name those asked that stayed silent past --resend-timeout-s."""
        c, now = self.cluster, time.monotonic()
        missing = self.unanswered(self.asked)
        progress = {r: c.ranks[r].progress for r in [*missing, *self.asked] if r in c.ranks}
        ask = results_to_ask(missing, progress, c.epoch, c.step, now - self.started_at, self._result_deadline_s)
        for rank_id in ask:
            self.plane.to_worker(rank_id, ResendResult(c.epoch, c.step))
            self.asked[rank_id] = now
        if ask:
            c.events.add(EventKind.RESEND, f"no answer to step {c.step} from ranks {ask} after "
                         f"{now - self.started_at:.2f}s, none of them inside the step: asked to send it again",
                         ranks=ask)
        waiting = {r: at for r, at in self.asked.items() if r not in self.replies}
        for rank_id in resends_unanswered(waiting, progress, c.epoch, c.step, now, self.cfg.resend_timeout_s):
            if self.detector.record(self.detector.resend_unanswered(rank_id, c.epoch, c.step)):
                self.metrics.lost_results.labels("unanswered").inc()

    def _pads(self, tokens: dict[int, int]) -> dict[int, int]:
        """rank -> padding tokens that make its step a warmed shape (nothing without the gate); an idle
        rank's, the same for all, worked out once."""
        if self.warmup is None:
            return {}
        shapes = self.warmup.shapes
        pads = dict.fromkeys(self.cluster.members, padded_tokens(0, shapes))
        for r, n in tokens.items():
            if n and r in pads:
                pads[r] = padded_tokens(n, shapes) - n
        return pads

    def _plan(self) -> StepBatch:
        """The next step's batch, without the sequences isolation holds back. After an interrupted
        step this is its recompute: nothing of that batch was committed, so the same tokens are
        planned again (a lost rank's sequences now on other ranks). In a new epoch the workers
        keep nothing of the last one's sequences (runtime/worker.py): the scheduler forgets what
        they kept, so each sequence goes as a full `ChunkPlan` once more."""
        if self.cluster.epoch != self._planned_epoch:
            self.scheduler.forget_kept()
            self._planned_epoch = self.cluster.epoch
        self.scheduler.hold(self.isolation.held)
        return self.scheduler.schedule()

    def unanswered(self, excluded: set[int] | dict[int, object]) -> list[int]:
        """Members of the step in flight that have not answered it, less `excluded`."""
        return [r for r in self.in_step if r not in self.replies and r not in excluded]

    def abandon(self) -> None:
        """Recovery has every member out of the interrupted step: no step is in flight."""
        self.in_step = set()

    def after_fault(self, culprit_found: bool, error: str) -> None:
        """Recovery took a fault that interrupted the step. With no culprit the step failed with
        every rank alive: it is recomputed, and after `MAX_RETRIES_WITHOUT_CULPRIT` such failures
        in a row its requests end with `error` (a deterministic error, not a fault) and the server
        goes on serving."""
        if culprit_found:
            return
        self.retries_without_culprit += 1
        batch = self.uncommitted
        if self.retries_without_culprit < MAX_RETRIES_WITHOUT_CULPRIT or batch is None:
            return
        for seq_id in batch.seq_ids():
            self.streams.end_with_error(seq_id, error)
        self.cluster.events.add(EventKind.REQUEST_ERROR, f"failed the requests of a step that failed "
                                f"{self.retries_without_culprit} times: {error}")
        self.retries_without_culprit = 0
        self.uncommitted = None

    def _finish(self, batch: StepBatch, wall_s: float, micro_batches: int) -> None:
        """Commit a completed step from its answers' columns and hand its tokens over; what else the
        answers tell is taken by `observe` once the next step's plans went out."""
        c, times, a = self.cluster, self.plane.times, self.answers
        t0 = time.perf_counter()
        for rank_id, seq_id, error in a.errors:
            self.streams.end_with_error(seq_id, f"this request failed on rank {rank_id}: {error}")
        step_s = a.array("step_s")
        slowest = float(step_s.max()) if len(step_s) else 0.0
        if self.warmup is not None:  # the next step's pads read it
            for shape, n in zip(*np.unique(a.array("shape"), return_counts=True), strict=True):
                self.warmup.ran(c.epoch, int(shape), micro_batches, int(n))
        times.slowest_rank_s += slowest
        self.detector.step_done(wall_s)  # the next step's result deadline reads it
        self.uncommitted = None
        self.retries_without_culprit = 0
        ranks = c.ranks
        self.completed = CompletedStep(batch, a, [ranks[r].record for r in a.rank_ids], wall_s, slowest)
        generated: list[tuple[int, int]] | None = [] if self.traces is not None else None
        logprobs = a.logprobs
        # steady ranks' rows as columns, unless an output needs its own (a trace, logprobs)
        columns: list[tuple[int, list[int], list[int]]] | None = [] if generated is None and not logprobs else None
        outputs = self.scheduler.commit(batch, a.sampled, generated, columns)
        if generated is not None:
            self._trace(batch, a.array("compute_s"), generated)
        if logprobs:  # of the few requests that asked for them
            outputs = [(out[0], out[1], out[2], [logprobs[out[0]]]) if out[0] in logprobs else out
                       for out in outputs]
        self.streams.deliver_step(outputs, columns or ())
        times.add("commit", time.perf_counter() - t0)

    def observe(self) -> None:
        """What the last committed step's answers tell, taken from its `CompletedStep`: the ranks'
        timings, the straggler intervals, the EPLB load window and the recorder, the metrics. Nothing
        that plans the next step reads them, so `run` does this after the next step's plans went out
        (the ranks do not wait for it: ~1 ms a step at 256 ranks), and the controller at a boundary
        that runs no step. A rank that left or came back as a new record since the commit is left
        out (its measures were forgotten; a new record's are its own)."""
        done, self.completed = self.completed, None
        if done is None:
            return
        t0 = time.perf_counter()
        c, a, batch = self.cluster, done.answers, done.batch
        ranks = c.ranks
        ids, records = a.rank_ids, done.records
        columns = {name: a.array(name) for name in ("step_s", "wait_s", "compute_s", "slot_tokens",
                                                     "remote_messages", "remote_bytes")}
        kept = [i for i, r in enumerate(ids) if (info := ranks.get(r)) is not None and info.record == records[i]]
        if len(kept) < len(ids):
            ids, records = [ids[i] for i in kept], [records[i] for i in kept]
            columns = {name: values[kept] for name, values in columns.items()}
        for series, name in (("step_s", "step_s"), ("wait_s", "wait_s"), ("own_s", "compute_s"),
                             ("slot_tokens", "slot_tokens")):
            c.timings.write(series, ids, records, columns[name])
        tokens = batch.tokens_per_rank()  # rank -> tokens it ran
        ran = [tokens.get(r, 0) for r in ids]
        self.own_time.add_step(time.monotonic(), ids, ran, columns["compute_s"])
        self.tokens_run += sum(tokens.values())
        self.tokens_sampled += len(a.sampled)
        load: np.ndarray | None = None  # [L, E] the step's reports, None when no rank sent one
        if a.loads:
            load = np.sum(a.loads, axis=0, dtype=np.int64)
        self.load_window.add(load)
        self.recorder.add(load)
        self._metrics(done, tokens, ids, ran, columns)
        self.plane.times.add("metrics", time.perf_counter() - t0)

    def _metrics(self, done: CompletedStep, tokens: dict[int, int], ids: list[int], ran: list[int],
                 columns: dict[str, np.ndarray]) -> None:
        """The step's metrics: per-rank timings and tokens (control/rank_series.py; `ids`, `ran` and
        `columns`' arrays: per answering rank kept), DP balance, KV moves (the expert load balance
        of the last steps is the publisher's, facade/publisher.py)."""
        m, batch, wall_s = self.metrics, done.batch, done.wall_s
        m.step_wall_seconds.observe(wall_s)
        m.controller_overhead_seconds.observe(max(wall_s - done.slowest_s, 0.0))
        m.ranks.step(ids, columns["step_s"], columns["wait_s"], columns["compute_s"], ran, columns["remote_messages"],
                     columns["remote_bytes"])
        for plan, per_rank in (("aligned", tokens), ("unaligned", batch.unaligned)):
            ratio = imbalance(per_rank.values())
            if ratio is None:
                continue
            m.dp_imbalance.labels(plan).observe(ratio)
            m.dp_busiest_tokens.labels(plan).observe(max(per_rank.values()))
            if plan == "aligned":
                m.dp_token_imbalance.set(ratio)
        m.migrations(max(done.answers.kv_move_s, default=0.0), batch.moves, batch.reprefilled)

    def _trace(self, batch: StepBatch, compute_s: np.ndarray, generated: list[tuple[int, int]]) -> None:
        """What the request traces record of a completed step (only with tracing on); `generated`:
        (seq_id, tokens generated so far) of the sequences that sampled one."""
        ids = self.answers.rank_ids
        slowest = ids[int(np.argmax(compute_s))] if ids else None
        moves = [(m.seq_id, "kv", m.src_rank, m.dst_rank) for m in batch.moves]
        moves += [(seq_id, "reprefill", None, self.scheduler.by_id[seq_id].rank)
                  for seq_id in batch.reprefilled if seq_id in self.scheduler.by_id]
        self.traces.step({r: batch.seq_ids_on(r) for r in batch.chunks}, self._started_ns, time.time_ns(), slowest,
                         generated, moves)
