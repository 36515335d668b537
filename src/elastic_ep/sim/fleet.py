"""Discrete-event simulation of a serving fleet over time, under three recovery policies.

The fleet is `gpus` GPUs in EP groups of `ep_size` ranks (nodes of `gpus_per_node`), plus a
pool of spare GPUs. Failures arrive as a Poisson process at `rate_per_gpu_hour` per GPU with
the cause mix of the Llama 3 counts: a `gpu` failure takes one rank's GPU to repair, a `node`
failure takes the live ranks of a node (up to `gpus_per_node`), a `software` failure kills one
rank's process and leaves its hardware good. Stragglers arrive the same way and slow their
whole group to `straggler_speed` (the slowest rank sets every step).

Policies, all run on the same trace of events (common random numbers):
- `restart`: any failure stops the group for `restart_min`; it comes back whole on spare GPUs,
  or stays down until spares are repaired. Stragglers are not seen and slow the group until
  they clear.
- `elastic-disk` / `elastic-backup`: a failure pauses the group for `pause_min`, plus the time
  to reload the experts it lost (from disk, or from the host-memory backup); the group serves
  on with its live ranks while replacements join online. A straggler gets the straggler policy
  `serve` runs (`straggler_policy`, the same flags; the times to derate and to evict come from
  the server's verdict and policy replayed on per-rank timings, `straggler_episode.py`). A group
  whose live slots cannot hold every expert stops.
Whether a failure loses an expert is drawn from random placements of the group's experts on
its live ranks (replicas on distinct nodes where possible), as in `redundancy`.
Each (replication, policy) run stands alone: the traces are drawn in order from the seed and
each run draws its own placements, so the runs go to worker processes (`jobs`) and give the
numbers one process gives.
Assumptions with a default are parameters; repair times and spares are guesses to replace
with a deployment's own figures.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from heapq import heappop, heappush
from itertools import count
from math import inf

import numpy as np

from elastic_ep.errors import SimulationError
from elastic_ep.policy.straggler_policy import StragglerAction, eviction_refusal
from elastic_ep.sim.failure_rates import FAILURE_CLASSES
from elastic_ep.sim.fleet_config import FleetConfig
from elastic_ep.sim.fleet_report import FleetReport, RunResult, metric, summarise
from elastic_ep.sim.placements import random_placement, replica_counts
from elastic_ep.sim.straggler_episode import derated_group_speed, episode_times

POLICIES = ("restart", "elastic-disk", "elastic-backup")
__all__ = ["FleetConfig", "FleetReport", "POLICIES", "RunResult", "draw_trace", "run_policy", "simulate_fleet"]


@dataclass(frozen=True)
class Trace:
    """Events of one replication, shared by every policy.

    fail_t: [F] hours; fail_group: [F]; fail_class: [F] index into FAILURE_CLASSES;
    slow_t: [S] hours; slow_group: [S]; loss_seed: seed of the expert-loss draws.
    """

    fail_t: np.ndarray
    fail_group: np.ndarray
    fail_class: np.ndarray
    slow_t: np.ndarray
    slow_group: np.ndarray
    loss_seed: int


def draw_trace(cfg: FleetConfig, rng: np.random.Generator) -> Trace:
    active = cfg.groups * cfg.ep_size
    n_fail = rng.poisson(cfg.rate_per_gpu_hour * active * cfg.hours)
    shares = np.array([cfg.class_shares.get(c, 0.0) for c in FAILURE_CLASSES])
    n_slow = rng.poisson(cfg.straggler_rate_per_gpu_hour * active * cfg.hours)
    return Trace(
        fail_t=np.sort(rng.uniform(0, cfg.hours, n_fail)),
        fail_group=rng.integers(cfg.groups, size=n_fail),
        fail_class=rng.choice(len(FAILURE_CLASSES), size=n_fail, p=shares / shares.sum()),
        slow_t=np.sort(rng.uniform(0, cfg.hours, n_slow)),
        slow_group=rng.integers(cfg.groups, size=n_slow),
        loss_seed=int(rng.integers(2**63)),
    )


@dataclass(slots=True)
class _Group:
    live: int
    down_until: float = 0.0
    waiting: int = 0
    stragglers: dict[int, bool] = field(default_factory=dict)  # straggler id -> derated
    evictions_s: list[float] = field(default_factory=list)
    capacity: float = 0.0
    last_t: float = 0.0
    serving_gpu_h: float = 0.0
    stopped_gpu_h: float = 0.0
    degraded_gpu_h: float = 0.0
    slow_gpu_h: float = 0.0
    serving_h: float = 0.0


_Handler = Callable[[float, int, int], None] | None  # (t, group, count or straggler id); None: a wake
_Event = tuple[float, int, _Handler, int, int]  # (hours, seq: ties go in push order, handler, group, count)


class _Simulation:
    """One policy on one trace: a heap of timed events over groups and the spare pool.

    Every event integrates its group up to the event's time, runs its handler and recomputes the
    group's capacity; a wake (handler None) does only that, when a pause ends. The loop runs
    ~150,000 events per policy at 100,000 GPUs x 365 days, so the config is read into attributes
    once and the derate and evict delays are timed once, not per straggler."""

    def __init__(self, cfg: FleetConfig, policy: str, trace: Trace, placement_pool: _PlacementPool):
        self.cfg, self.policy, self.trace = cfg, policy, trace
        self.elastic = policy != "restart"
        self.ep_size = cfg.ep_size
        self.min_live = -(-cfg.experts // cfg.slots_per_rank)  # the fewest ranks whose slots hold every expert
        self.straggler_speed = cfg.straggler_speed
        self.derated_speed = derated_group_speed(cfg.straggler_speed, cfg.attention_share)
        self.groups = [_Group(live=cfg.ep_size, capacity=cfg.ep_size) for _ in range(cfg.groups)]
        self.spares = cfg.spare_gpus
        self.spare_queue: deque[int] = deque()
        self.heap: list[_Event] = []
        self.seq = count(1)
        self.loss_rng = np.random.default_rng(trace.loss_seed)
        self.pool = placement_pool
        self.expert_losses = 0
        self.evictions = 0
        self.stragglers_seen = 0
        self.straggler_actions: list[tuple[_Handler, float]] = []  # (derate or evict, hours after it turns slow)
        if self.elastic and cfg.straggler_policy.action != StragglerAction.OFF:
            times = episode_times(cfg.straggler_rule, cfg.straggler_policy, cfg.straggler_speed)
            for handler, after_s in ((self.on_derate, times.derate_s), (self.on_evict, times.evict_s)):
                if after_s is not None and after_s / 3600 < cfg.straggler_h:
                    self.straggler_actions.append((handler, after_s / 3600))
        total = cfg.groups * cfg.ep_size
        self.capacity = float(total)
        self.cap_t: list[float] = [0.0]
        self.cap: list[float] = [1.0]
        self.total = total

    def push(self, t: float, handler: _Handler, group: int, count: int = 1) -> None:
        heappush(self.heap, (t, next(self.seq), handler, group, count))

    def run(self) -> RunResult:
        cfg, tr = self.cfg, self.trace
        # the trace's own events, in the order the heap would give them (time, then as pushed: the
        # failures first); only the events they cause go through the heap, which stays small
        fixed: list[_Event] = [(t, seq, self.on_failure, g, c) for seq, (t, g, c) in enumerate(
            zip(tr.fail_t.tolist(), tr.fail_group.tolist(), tr.fail_class.tolist(), strict=True), 1)]
        fixed += [(t, seq, self.on_straggler, g, 1) for seq, (t, g) in enumerate(
            zip(tr.slow_t.tolist(), tr.slow_group.tolist(), strict=True), len(fixed) + 1)]
        fixed.sort()
        self.seq = count(len(fixed) + 1)
        # an end to each: at equal times a trace event goes first (lower seq), so the trace's end is
        # reached first and stops the loop
        fixed.append((inf, 0, None, 0, 0))
        heap, hours, groups, i = self.heap, cfg.hours, self.groups, 0
        heap.append((inf, 0, None, 0, 0))
        integrate, refresh = self.integrate, self.refresh
        while True:
            if fixed[i][0] <= heap[0][0]:
                t, _, handler, g, n = fixed[i]
                i += 1
            else:
                t, _, handler, g, n = heappop(heap)
            if t >= hours:
                break
            grp = groups[g]
            integrate(grp, t)
            if handler is not None:
                handler(t, g, n)
            refresh(grp, t)
        for grp in groups:
            integrate(grp, hours)
        return self.result()

    def integrate(self, grp: _Group, t: float) -> None:
        """Add the group's GPU-hours since it was last integrated, at the capacity it had."""
        dt = t - grp.last_t
        if dt <= 0:
            return
        capacity = grp.capacity
        if capacity == 0:
            grp.stopped_gpu_h += self.ep_size * dt
        else:
            ranks = grp.live if self.elastic else self.ep_size
            grp.serving_h += dt
            grp.serving_gpu_h += capacity * dt
            grp.degraded_gpu_h += (self.ep_size - ranks) * dt
            grp.slow_gpu_h += (ranks - capacity) * dt
        grp.last_t = t

    def refresh(self, grp: _Group, t: float) -> None:
        """Recompute a group's capacity after a change at t (integrated up to t already): its serving
        GPUs, the live ranks slowed by any straggler (the slowest rank sets every step: a
        straggler's speed, better once every straggler is derated)."""
        if t < grp.down_until or (grp.waiting and not self.elastic) or grp.live < self.min_live:
            capacity = 0.0
        else:
            ranks = grp.live if self.elastic else self.ep_size
            if not grp.stragglers:
                capacity = float(ranks)
            elif all(grp.stragglers.values()):
                capacity = ranks * self.derated_speed
            else:
                capacity = ranks * self.straggler_speed
        if capacity != grp.capacity:
            self.capacity += capacity - grp.capacity
            grp.capacity = capacity
            self.cap_t.append(t)
            self.cap.append(self.capacity / self.total)

    def stop(self, t: float, g: int, minutes: float) -> None:
        grp = self.groups[g]
        grp.down_until = max(grp.down_until, t + minutes / 60)
        self.push(grp.down_until, None, g)

    def on_failure(self, t: float, g: int, class_index: int) -> None:
        cfg, grp = self.cfg, self.groups[g]
        cls = FAILURE_CLASSES[class_index]
        hit = min(cfg.gpus_per_node if cls == "node" else 1, grp.live)
        if hit == 0:
            return
        if cls != "software":
            repair_h = cfg.node_repair_h if cls == "node" else cfg.gpu_repair_h
            self.push(t + repair_h, self.on_repaired, g, hit)
        if not self.elastic:
            if cls != "software":
                self.take_spares(t, g, hit)
            self.stop(t, g, cfg.restart_min)
            return
        reload_min = 0.0
        if self.loses_expert(grp.live, hit, cls == "node"):
            self.expert_losses += 1
            reload_min = cfg.backup_reload_s / 60 if self.policy == "elastic-backup" else cfg.disk_reload_min
        grp.live -= hit
        self.stop(t, g, cfg.pause_min + reload_min)
        if cls == "software":
            self.push(t + cfg.software_restart_min / 60, self.on_join, g, hit)
        else:
            self.take_spares(t, g, hit)

    def loses_expert(self, live: int, dead: int, whole_node: bool) -> bool:
        """Whether `dead` of `live` ranks dying at once (one random rank, or the ranks of one
        random node of the live ranks laid out node by node) takes every replica of an expert."""
        if live < self.min_live:
            return False  # the group already stopped: nothing is served, nothing more to lose
        holders = self.pool.sample(live, self.loss_rng)
        if whole_node:
            first = int(self.loss_rng.integers(-(-live // self.cfg.gpus_per_node))) * self.cfg.gpus_per_node
            return holders.lost_with_range(min(first, live - dead), dead)
        if dead == 1:  # the same draw as choice(live, size=1, replace=False), without its cost
            return holders.lost_with_rank(int(self.loss_rng.integers(live)))
        return holders.lost_with(self.loss_rng.choice(live, size=dead, replace=False))

    def take_spares(self, t: float, g: int, needed: int) -> None:
        """Give group g up to `needed` spare GPUs; queue it for the rest."""
        grp = self.groups[g]
        got = min(needed, self.spares)
        self.spares -= got
        short = needed - got
        if short:
            grp.waiting += short
            self.spare_queue.extend([g] * short)
        if self.elastic and got:
            self.push(t + self.cfg.join_min / 60, self.on_join, g, got)

    def on_repaired(self, t: float, g: int, count: int) -> None:
        self.spares += count
        while self.spares and self.spare_queue:
            waiting_group = self.spare_queue.popleft()
            self.spares -= 1
            grp = self.groups[waiting_group]
            self.integrate(grp, t)
            grp.waiting -= 1
            if self.elastic:
                self.push(t + self.cfg.join_min / 60, self.on_join, waiting_group, 1)
            elif grp.waiting == 0:
                self.stop(t, waiting_group, self.cfg.restart_min)
            self.refresh(grp, t)

    def on_join(self, t: float, g: int, count: int) -> None:
        self.groups[g].live += count

    def on_straggler(self, t: float, g: int, _: int) -> None:
        """A rank of group g turns slow for `straggler_h`. The elastic policies run the server's
        straggler policy on it (`straggler_episode`: the same verdict, policy and flags); the
        restart policy does not see it."""
        grp = self.groups[g]
        if grp.live == 0:
            return
        self.stragglers_seen += 1
        sid = self.stragglers_seen
        grp.stragglers[sid] = False
        self.push(t + self.cfg.straggler_h, self.on_straggler_end, g, sid)
        for handler, after_h in self.straggler_actions:
            self.push(t + after_h, handler, g, sid)

    def on_derate(self, t: float, g: int, sid: int) -> None:
        if sid in self.groups[g].stragglers:
            self.groups[g].stragglers[sid] = True

    def on_straggler_end(self, t: float, g: int, sid: int) -> None:
        self.groups[g].stragglers.pop(sid, None)

    def on_evict(self, t: float, g: int, sid: int) -> None:
        """The slow rank leaves while alive, so its experts are copied out first: no loss. As on
        the server, the cap and the floor may refuse (it then stays derated until it clears); a
        spare GPU replaces it after `join_min`, and its card returns to the spares once it clears."""
        cfg, grp = self.cfg, self.groups[g]
        if sid not in grp.stragglers:
            return
        if eviction_refusal(cfg.straggler_policy, grp.evictions_s, t * 3600, grp.live, self.min_live, 0) is not None:
            return
        del grp.stragglers[sid]
        grp.evictions_s.append(t * 3600)
        self.evictions += 1
        grp.live -= 1
        self.stop(t, g, cfg.pause_min)
        self.take_spares(t, g, 1)
        self.push(t + cfg.straggler_h, self.on_repaired, g, 1)

    def result(self) -> RunResult:
        hours = self.cfg.hours
        grps = self.groups
        return RunResult(
            policy=self.policy,
            failures=len(self.trace.fail_t),
            expert_loss_events=self.expert_losses,
            evictions=self.evictions,
            serving_gpu_h=sum(x.serving_gpu_h for x in grps),
            stopped_gpu_h=sum(x.stopped_gpu_h for x in grps),
            degraded_gpu_h=sum(x.degraded_gpu_h for x in grps),
            slow_gpu_h=sum(x.slow_gpu_h for x in grps),
            availability=sum(x.serving_h for x in grps) / (len(grps) * hours),
            goodput=sum(x.serving_gpu_h for x in grps) / (self.total * hours),
            capacity_t=np.array(self.cap_t),
            capacity=np.array(self.cap),
        )


@dataclass(frozen=True)
class _Holders:
    """Who holds each expert in one placement, for the loss test: `placement` [live * slots]
    (expert per slot, negative when empty), `lowest` and `highest` [E]: the lowest and highest rank
    holding each expert (an expert no slot holds: lowest +inf, highest -inf: lost whatever dies),
    `sole` [live]: whether the rank is the only holder of some expert."""

    placement: np.ndarray
    slots_per_rank: int
    lowest: np.ndarray
    highest: np.ndarray
    sole: np.ndarray

    @classmethod
    def of(cls, placement: np.ndarray, live: int, slots_per_rank: int, experts: int) -> _Holders:
        rank = np.repeat(np.arange(live), slots_per_rank)
        held = placement >= 0
        lowest = np.full(experts, np.inf)
        highest = np.full(experts, -np.inf)
        np.minimum.at(lowest, placement[held], rank[held])
        np.maximum.at(highest, placement[held], rank[held])
        sole = np.zeros(live, dtype=bool)
        alone = lowest == highest
        sole[lowest[alone].astype(np.int64)] = True
        if np.isinf(lowest).any():
            sole[:] = True
        return cls(placement, slots_per_rank, lowest, highest, sole)

    def lost_with_rank(self, rank: int) -> bool:
        """Whether rank `rank` dying takes every replica of an expert."""
        return bool(self.sole[rank])

    def lost_with_range(self, first: int, count: int) -> bool:
        """Whether ranks [first, first + count) dying at once take every replica of an expert."""
        return bool(np.any((self.lowest >= first) & (self.highest < first + count)))

    def lost_with(self, ranks_dead: np.ndarray) -> bool:
        """Whether the ranks `ranks_dead` dying at once take every replica of an expert."""
        alive = np.delete(self.placement.reshape(-1, self.slots_per_rank), ranks_dead, axis=0)
        return len(np.unique(alive[alive >= 0])) < len(self.lowest)


class _PlacementPool:
    """A few random placements per live-rank count, drawn once in a run and reused (placing is slow).
    Replicas of an expert go to distinct nodes where there are enough nodes, else distinct ranks."""

    def __init__(self, cfg: FleetConfig, rng: np.random.Generator, size: int = 4):
        self.cfg, self.rng, self.size = cfg, rng, size
        self.by_live: dict[int, list[_Holders]] = {}

    def sample(self, live: int, rng: np.random.Generator) -> _Holders:
        """One of the placements over `live` ranks, drawn with `rng`."""
        if live not in self.by_live:
            cfg = self.cfg
            slots = live * cfg.slots_per_rank
            replicas = replica_counts(cfg.experts, slots - cfg.experts)
            per_node = min(cfg.gpus_per_node, live)
            spread = per_node if int(replicas.max()) <= -(-live // per_node) else 1
            self.by_live[live] = [
                _Holders.of(random_placement(replicas, live, cfg.slots_per_rank, self.rng, spread), live,
                            cfg.slots_per_rank, cfg.experts)
                for _ in range(self.size)
            ]
        pool = self.by_live[live]
        return pool[int(rng.integers(len(pool)))]


def describe_straggler_policy(cfg: FleetConfig) -> str:
    """Which straggler policy the elastic policies ran, with what it does to a straggler here."""
    p = cfg.straggler_policy
    if p.action == StragglerAction.OFF:
        return "off (stragglers are seen, nothing is done)"
    times = episode_times(cfg.straggler_rule, p, cfg.straggler_speed)
    derate = (f"derated {times.derate_s:.1f} s after it turns slow (group at "
              f"{derated_group_speed(cfg.straggler_speed, cfg.attention_share):.0%} speed)")
    evict = (f", evicted after {times.evict_s:.1f} s (--straggler-evict-after-s {p.evict_after_s:g}, at most "
             f"{p.max_evictions} per {p.eviction_window_s:g} s per group)" if times.evict_s is not None else "")
    return f"{p.action.value}: {derate}{evict}"


def run_policy(cfg: FleetConfig, policy: str, trace: Trace, placement_seed: int) -> RunResult:
    """One policy on one trace, its placements drawn afresh from `placement_seed`: what it gives
    does not depend on which runs went before it, or in which process. The elastic policies still
    meet the same placements on a trace: a lost expert only lengthens a pause and changes no group's
    live ranks, so both ask for placements over the same rank counts in the same order."""
    return _Simulation(cfg, policy, trace, _PlacementPool(cfg, np.random.default_rng(placement_seed))).run()


def simulate_fleet(cfg: FleetConfig, replications: int = 10, seed: int = 0, jobs: int = 1) -> FleetReport:
    """Every policy over `replications` independent traces; 95% intervals across them. `jobs`
    processes run the (replication, policy) pairs; any `jobs` gives the same numbers, bit for bit:
    the parent draws every trace, in order, from `seed`, and each run its own placements."""
    cfg.validate()
    if replications <= 0:
        raise SimulationError(f"--replications {replications} must be > 0")
    if jobs <= 0:
        raise SimulationError(f"--jobs {jobs} must be > 0")
    rng = np.random.default_rng(seed)
    traces = [draw_trace(cfg, rng) for _ in range(replications)]
    straggler_policy = describe_straggler_policy(cfg)  # replays the episode before any fork: workers inherit it
    pairs = [(policy, trace) for trace in traces for policy in POLICIES]
    results = _in_processes(partial(run_policy, cfg, placement_seed=seed + 1), pairs, jobs)
    runs: dict[str, list[RunResult]] = {p: [] for p in POLICIES}
    for (policy, _), result in zip(pairs, results, strict=True):
        runs[policy].append(result)
    return FleetReport(
        config=cfg,
        straggler_policy=straggler_policy,
        replications=replications,
        failures=metric([len(trace.fail_t) for trace in traces]),
        policies=[summarise(cfg, p, runs[p]) for p in POLICIES],
        example_runs=[runs[p][0] for p in POLICIES],
    )


def _in_processes(fn: Callable[..., RunResult], args: list[tuple], jobs: int) -> list[RunResult]:
    """`fn(*a)` for each of `args`, in order, in up to `jobs` worker processes (1: in this one)."""
    if jobs == 1:
        return [fn(*a) for a in args]
    # forked, a worker starts with this process's imports (no re-import, ~0.2 s a worker); frozen,
    # what it inherited is left out of its garbage collections (not walked, its pages not copied)
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(min(jobs, len(args)), mp_context=context, initializer=gc.freeze) as executor:
        return list(executor.map(fn, *zip(*args, strict=True)))
