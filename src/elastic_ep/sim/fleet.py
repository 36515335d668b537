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
  on with its live ranks while replacements join online. A straggler is evicted after
  `straggler_detect_min`. A group whose live slots cannot hold every expert stops.
Whether a failure loses an expert is drawn from random placements of the group's experts on
its live ranks (replicas on distinct nodes where possible), as in `redundancy`.
Assumptions with a default are parameters; repair times and spares are guesses to replace
with a deployment's own figures.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from elastic_ep.errors import SimulationError
from elastic_ep.sim.assumptions import BACKUP_RELOAD_S, DISK_RELOAD_MIN, PAUSE_MIN, RESTART_MIN
from elastic_ep.sim.failure_rates import FAILURE_CLASSES, load_llama3
from elastic_ep.sim.placements import random_placement, replica_counts
from elastic_ep.sim.stats import mean_interval, weighted_quantiles

POLICIES = ("restart", "elastic-disk", "elastic-backup")
DURATIONS_AND_RATES = (
    "gpu_repair_h", "node_repair_h", "software_restart_min", "restart_min", "pause_min", "join_min",
    "disk_reload_min", "backup_reload_s", "straggler_h", "straggler_detect_min", "rate_per_gpu_hour",
    "straggler_rate_per_gpu_hour",
)  # fmt: skip
CAPACITY_QUANTILES = (0.01, 0.05, 0.5)


@dataclass(frozen=True)
class FleetConfig:
    """One fleet and its assumptions; times carry their unit in the name."""

    gpus: int = 2048
    days: float = 365.0
    gpus_per_node: int = 8
    ep_size: int = 64
    experts: int = 256
    slots_per_rank: int = 8
    rate_per_gpu_hour: float = field(default_factory=lambda: load_llama3().rate_per_gpu_hour)
    class_shares: dict[str, float] = field(default_factory=lambda: load_llama3().class_shares())
    gpu_repair_h: float = 48.0
    node_repair_h: float = 24.0
    software_restart_min: float = 5.0
    spare_fraction: float = 0.01
    restart_min: float = RESTART_MIN
    pause_min: float = PAUSE_MIN
    join_min: float = 10.0
    disk_reload_min: float = DISK_RELOAD_MIN
    backup_reload_s: float = BACKUP_RELOAD_S
    straggler_rate_per_gpu_hour: float = field(default_factory=lambda: load_llama3().rate_per_gpu_hour)
    straggler_speed: float = 0.6
    straggler_h: float = 4.0
    straggler_detect_min: float = 5.0

    def validate(self) -> None:
        if self.gpus <= 0 or not 0 < self.days < np.inf:
            raise SimulationError(f"--gpus ({self.gpus}) and --days ({self.days}) must be > 0")
        if self.gpus_per_node <= 0 or self.ep_size <= 0:
            raise SimulationError("--gpus-per-node and --ep-size must be > 0")
        if self.ep_size % self.gpus_per_node and self.gpus_per_node % self.ep_size:
            raise SimulationError(
                f"--ep-size {self.ep_size} and --gpus-per-node {self.gpus_per_node}: one must divide the other"
            )
        if self.gpus < self.ep_size:
            raise SimulationError(f"--gpus {self.gpus} cannot hold one EP group of {self.ep_size}")
        if self.experts <= 0 or self.slots_per_rank <= 0:
            raise SimulationError(f"--experts ({self.experts}) and --slots-per-rank ({self.slots_per_rank}) must be > 0")
        if self.ep_size * self.slots_per_rank < self.experts:
            raise SimulationError(
                f"{self.ep_size} ranks x {self.slots_per_rank} slots cannot hold {self.experts} experts: "
                f"give more --slots or a larger --ep-size"
            )
        if not 0 < self.straggler_speed <= 1:
            raise SimulationError(f"--straggler-speed {self.straggler_speed} must be in (0, 1]")
        if not 0 <= self.spare_fraction <= 1:
            raise SimulationError(
                f"--spare-fraction {self.spare_fraction} must be between 0 and 1 (a fraction of --gpus: 0.01 is 1%)"
            )
        for name in DURATIONS_AND_RATES:
            value = getattr(self, name)
            if not 0 <= value < np.inf:
                flag = "--" + name.replace("_per_gpu_hour", "").replace("_", "-")
                raise SimulationError(f"{flag} {value} must be a number >= 0")

    @property
    def groups(self) -> int:
        return self.gpus // self.ep_size

    @property
    def spare_gpus(self) -> int:
        return int(np.ceil(self.gpus * self.spare_fraction))

    @property
    def hours(self) -> float:
        return self.days * 24


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


@dataclass
class _Group:
    live: int
    down_until: float = 0.0
    waiting: int = 0
    slow: int = 0
    capacity: float = 0.0
    last_t: float = 0.0
    serving_gpu_h: float = 0.0
    stopped_gpu_h: float = 0.0
    degraded_gpu_h: float = 0.0
    slow_gpu_h: float = 0.0
    serving_h: float = 0.0


@dataclass(frozen=True)
class RunResult:
    """One policy over one replication. capacity_t/capacity: [n] breakpoints of the fleet's
    serving capacity as a fraction of its active GPUs."""

    policy: str
    failures: int
    expert_loss_events: int
    serving_gpu_h: float
    stopped_gpu_h: float
    degraded_gpu_h: float
    slow_gpu_h: float
    availability: float
    goodput: float
    capacity_t: np.ndarray
    capacity: np.ndarray


class _Simulation:
    """One policy on one trace: a heap of timed events over groups and the spare pool."""

    def __init__(self, cfg: FleetConfig, policy: str, trace: Trace, placement_pool: _PlacementPool):
        self.cfg, self.policy, self.trace = cfg, policy, trace
        self.elastic = policy != "restart"
        self.groups = [_Group(live=cfg.ep_size, capacity=cfg.ep_size) for _ in range(cfg.groups)]
        self.spares = cfg.spare_gpus
        self.spare_queue: list[int] = []
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.loss_rng = np.random.default_rng(trace.loss_seed)
        self.pool = placement_pool
        self.expert_losses = 0
        total = cfg.groups * cfg.ep_size
        self.capacity = float(total)
        self.cap_t: list[float] = [0.0]
        self.cap: list[float] = [1.0]
        self.total = total

    def push(self, t: float, kind: str, group: int, count: int = 1) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, group, count))

    def run(self) -> RunResult:
        cfg, tr = self.cfg, self.trace
        for t, g, c in zip(tr.fail_t, tr.fail_group, tr.fail_class, strict=True):
            self.push(float(t), "fail", int(g), int(c))
        for t, g in zip(tr.slow_t, tr.slow_group, strict=True):
            self.push(float(t), "slow", int(g))
        handlers = {
            "fail": self.on_failure,
            "slow": self.on_straggler,
            "slow_end": self.on_straggler_end,
            "evict": self.on_evict,
            "join": self.on_join,
            "repaired": self.on_repaired,
            "wake": lambda t, g, n: None,
        }
        while self.heap and self.heap[0][0] < cfg.hours:
            t, _, kind, g, n = heapq.heappop(self.heap)
            self.integrate(g, t)
            handlers[kind](t, g, n)
            self.refresh(g, t)
        for g in range(len(self.groups)):
            self.integrate(g, cfg.hours)
        return self.result()

    def group_capacity(self, grp: _Group, t: float) -> float:
        """Serving GPUs of a group at time t (live ranks, slowed by any straggler)."""
        if (
            t < grp.down_until
            or (grp.waiting and not self.elastic)
            or grp.live * self.cfg.slots_per_rank < self.cfg.experts
        ):
            return 0.0
        ranks = grp.live if self.elastic else self.cfg.ep_size
        return ranks * (self.cfg.straggler_speed if grp.slow else 1.0)

    def integrate(self, g: int, t: float) -> None:
        grp = self.groups[g]
        dt = t - grp.last_t
        if dt <= 0:
            return
        capacity = grp.capacity
        if capacity == 0:
            grp.stopped_gpu_h += self.cfg.ep_size * dt
        else:
            ranks = grp.live if self.elastic else self.cfg.ep_size
            grp.serving_h += dt
            grp.serving_gpu_h += capacity * dt
            grp.degraded_gpu_h += (self.cfg.ep_size - ranks) * dt
            grp.slow_gpu_h += (ranks - capacity) * dt
        grp.last_t = t

    def refresh(self, g: int, t: float) -> None:
        """Recompute group g's capacity after a change at t (integrated up to t already)."""
        grp = self.groups[g]
        capacity = self.group_capacity(grp, t)
        if capacity != grp.capacity:
            self.capacity += capacity - grp.capacity
            grp.capacity = capacity
            self.cap_t.append(t)
            self.cap.append(self.capacity / self.total)

    def stop(self, t: float, g: int, minutes: float) -> None:
        grp = self.groups[g]
        grp.down_until = max(grp.down_until, t + minutes / 60)
        self.push(grp.down_until, "wake", g)

    def on_failure(self, t: float, g: int, class_index: int) -> None:
        cfg, grp = self.cfg, self.groups[g]
        cls = FAILURE_CLASSES[class_index]
        hit = min(cfg.gpus_per_node if cls == "node" else 1, grp.live)
        if hit == 0:
            return
        if cls != "software":
            repair_h = cfg.node_repair_h if cls == "node" else cfg.gpu_repair_h
            self.push(t + repair_h, "repaired", g, hit)
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
            self.push(t + cfg.software_restart_min / 60, "join", g, hit)
        else:
            self.take_spares(t, g, hit)

    def loses_expert(self, live: int, dead: int, whole_node: bool) -> bool:
        """Whether `dead` of `live` ranks dying at once (one random rank, or the ranks of one
        random node of the live ranks laid out node by node) takes every replica of an expert."""
        if live * self.cfg.slots_per_rank < self.cfg.experts:
            return False  # the group already stopped: nothing is served, nothing more to lose
        placement = self.pool.sample(live, self.loss_rng)
        if whole_node:
            first = int(self.loss_rng.integers(-(-live // self.cfg.gpus_per_node))) * self.cfg.gpus_per_node
            first = min(first, live - dead)
            ranks_dead = np.arange(first, first + dead)
        else:
            ranks_dead = self.loss_rng.choice(live, size=dead, replace=False)
        grid = placement.reshape(live, self.cfg.slots_per_rank)
        alive = np.delete(grid, ranks_dead, axis=0)
        return len(np.unique(alive[alive >= 0])) < self.cfg.experts

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
            self.push(t + self.cfg.join_min / 60, "join", g, got)

    def on_repaired(self, t: float, g: int, count: int) -> None:
        self.spares += count
        while self.spares and self.spare_queue:
            waiting_group = self.spare_queue.pop(0)
            self.spares -= 1
            grp = self.groups[waiting_group]
            self.integrate(waiting_group, t)
            grp.waiting -= 1
            if self.elastic:
                self.push(t + self.cfg.join_min / 60, "join", waiting_group, 1)
            elif grp.waiting == 0:
                self.stop(t, waiting_group, self.cfg.restart_min)
            self.refresh(waiting_group, t)

    def on_join(self, t: float, g: int, count: int) -> None:
        self.groups[g].live += count

    def on_straggler(self, t: float, g: int, _: int) -> None:
        grp = self.groups[g]
        if grp.live == 0:
            return
        grp.slow += 1
        if self.elastic:
            self.push(t + self.cfg.straggler_detect_min / 60, "evict", g)
        else:
            self.push(t + self.cfg.straggler_h, "slow_end", g)

    def on_straggler_end(self, t: float, g: int, _: int) -> None:
        self.groups[g].slow -= 1

    def on_evict(self, t: float, g: int, _: int) -> None:
        """The slow rank leaves while alive, so its experts are copied out first: no loss."""
        grp = self.groups[g]
        grp.slow -= 1
        if grp.live == 0:
            return
        grp.live -= 1
        self.stop(t, g, self.cfg.pause_min)
        self.push(t + self.cfg.straggler_h, "join", g)

    def result(self) -> RunResult:
        hours = self.cfg.hours
        grps = self.groups
        return RunResult(
            policy=self.policy,
            failures=len(self.trace.fail_t),
            expert_loss_events=self.expert_losses,
            serving_gpu_h=sum(x.serving_gpu_h for x in grps),
            stopped_gpu_h=sum(x.stopped_gpu_h for x in grps),
            degraded_gpu_h=sum(x.degraded_gpu_h for x in grps),
            slow_gpu_h=sum(x.slow_gpu_h for x in grps),
            availability=sum(x.serving_h for x in grps) / (len(grps) * hours),
            goodput=sum(x.serving_gpu_h for x in grps) / (self.total * hours),
            capacity_t=np.array(self.cap_t),
            capacity=np.array(self.cap),
        )


class _PlacementPool:
    """A few random placements per live-rank count, drawn once and reused (placing is slow).
    Replicas of an expert go to distinct nodes where there are enough nodes, else distinct ranks."""

    def __init__(self, cfg: FleetConfig, rng: np.random.Generator, size: int = 4):
        self.cfg, self.rng, self.size = cfg, rng, size
        self.by_live: dict[int, list[np.ndarray]] = {}

    def sample(self, live: int, rng: np.random.Generator) -> np.ndarray:
        if live not in self.by_live:
            slots = live * self.cfg.slots_per_rank
            replicas = replica_counts(self.cfg.experts, slots - self.cfg.experts)
            per_node = min(self.cfg.gpus_per_node, live)
            spread = per_node if int(replicas.max()) <= -(-live // per_node) else 1
            self.by_live[live] = [
                random_placement(replicas, live, self.cfg.slots_per_rank, self.rng, spread)
                for _ in range(self.size)
            ]
        pool = self.by_live[live]
        return pool[int(rng.integers(len(pool)))]


@dataclass(frozen=True)
class Metric:
    """A mean over replications and the half-width of its 95% interval (None from one replication)."""

    mean: float
    half_width: float | None


@dataclass(frozen=True)
class PolicySummary:
    """A policy over all replications: each metric with its 95% interval."""

    policy: str
    gpu_hours_lost: Metric
    stopped_gpu_h: Metric
    degraded_gpu_h: Metric
    slow_gpu_h: Metric
    availability: Metric
    goodput: Metric
    expert_loss_events: Metric
    capacity_quantiles: dict[str, Metric]
    capacity_min: Metric


@dataclass(frozen=True)
class FleetReport:
    config: FleetConfig
    replications: int
    failures: Metric
    policies: list[PolicySummary]
    example_runs: list[RunResult]


def simulate_fleet(cfg: FleetConfig, replications: int = 10, seed: int = 0) -> FleetReport:
    """Every policy over `replications` independent traces; 95% intervals across them."""
    cfg.validate()
    if replications <= 0:
        raise SimulationError(f"--replications {replications} must be > 0")
    rng = np.random.default_rng(seed)
    pool = _PlacementPool(cfg, np.random.default_rng(seed + 1))
    runs: dict[str, list[RunResult]] = {p: [] for p in POLICIES}
    failures = []
    for _ in range(replications):
        trace = draw_trace(cfg, rng)
        failures.append(len(trace.fail_t))
        for policy in POLICIES:
            runs[policy].append(_Simulation(cfg, policy, trace, pool).run())
    return FleetReport(
        config=cfg,
        replications=replications,
        failures=_metric(failures),
        policies=[_summarise(cfg, p, runs[p]) for p in POLICIES],
        example_runs=[runs[p][0] for p in POLICIES],
    )


def _metric(values: list[float]) -> Metric:
    return Metric(*mean_interval(np.asarray(values, dtype=np.float64)))


def _summarise(cfg: FleetConfig, policy: str, runs: list[RunResult]) -> PolicySummary:
    total = cfg.groups * cfg.ep_size * cfg.hours
    quantiles = [_capacity_quantiles(r, cfg.hours) for r in runs]
    return PolicySummary(
        policy=policy,
        gpu_hours_lost=_metric([total - r.serving_gpu_h for r in runs]),
        stopped_gpu_h=_metric([r.stopped_gpu_h for r in runs]),
        degraded_gpu_h=_metric([r.degraded_gpu_h for r in runs]),
        slow_gpu_h=_metric([r.slow_gpu_h for r in runs]),
        availability=_metric([r.availability for r in runs]),
        goodput=_metric([r.goodput for r in runs]),
        expert_loss_events=_metric([r.expert_loss_events for r in runs]),
        capacity_quantiles={
            f"p{round(q * 100)}": _metric([qs[i] for qs in quantiles])
            for i, q in enumerate(CAPACITY_QUANTILES)
        },
        capacity_min=_metric([float(r.capacity.min()) for r in runs]),
    )


def _capacity_quantiles(run: RunResult, hours: float) -> list[float]:
    """Time-weighted quantiles of the fleet's serving capacity fraction."""
    durations = np.diff(np.append(run.capacity_t, hours))
    return weighted_quantiles(run.capacity, durations, list(CAPACITY_QUANTILES))
