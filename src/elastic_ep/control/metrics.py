"""Cluster metrics, registered on the HTTP app's CollectorRegistry.

Group series (no `rank` label): the distributions of every rank's step, wait and own time, DP
imbalance, recoveries, counts of ranks up, stalled, straggling, derated. Per-rank series (label
`rank`: step time, collective wait, tokens, expert load relative to the mean, liveness) for at
most `--metrics-top-k` ranks, the ones in trouble and the slowest (control/rank_series.py), so
one slow rank shows as itself and the series count does not grow with the group.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from elastic_ep.wire import KVMove, rejected_counts

from .rank_series import RankSeries

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
IMBALANCE_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)


class KVCacheUsage:
    """`elastic_ep_kv_cache_usage_perc`: the fraction (0..1) of KV blocks that requests hold,
    vLLM's kv_cache_usage_perc; one sample without labels for the whole group (what a router
    compares between instances), one per rank with `rank` for the ranks `exported()` names (the
    --metrics-top-k bound, control/rank_series.py). Cached blocks no request holds count as free,
    as in vLLM."""

    NAME = "elastic_ep_kv_cache_usage_perc"

    def __init__(self, exported: Callable[[], Collection[int]] = lambda: ()) -> None:
        self.exported = exported
        self.group = 0.0
        self.per_rank: dict[int, float] = {}

    def set(self, per_rank: Mapping[int, tuple[int, int]]) -> None:
        """per_rank: rank -> (blocks held, blocks in its pool)."""
        self.per_rank = {r: held / total for r, (held, total) in per_rank.items()}
        total = sum(t for _, t in per_rank.values())
        self.group = sum(h for h, _ in per_rank.values()) / total if total else 0.0

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.NAME, "Fraction of KV cache blocks in use (0..1)", labels=["rank"])]

    def collect(self) -> list[Metric]:
        family = GaugeMetricFamily(self.NAME, "Fraction of KV cache blocks in use (0..1)", labels=["rank"])
        family.add_sample(self.NAME, {}, self.group)
        exported = set(self.exported())
        for rank, usage in sorted(self.per_rank.items()):
            if rank in exported:
                family.add_metric([str(rank)], usage)
        return [family]


class ClusterMetrics:
    """`model_name` labels the request metrics as vLLM's (its dashboards key on it); `top_k`: ranks
    exported with a rank label (--metrics-top-k, control/rank_series.py)."""

    def __init__(self, registry: CollectorRegistry, model_name: str = "", top_k: int = 16):
        self.ranks = RankSeries(registry, top_k, STEP_BUCKETS)
        self.ranks_up = Gauge("elastic_ep_ranks_up", "Members serving and not stalled (every rank, exported or not)",
                              registry=registry)
        self.ranks_stalled = Gauge("elastic_ep_ranks_stalled", "Ranks stalled now (no heartbeat, or holding up a "
                                   "stalled step)", registry=registry)
        self.straggler_ranks = Gauge("elastic_ep_straggler_ranks", "Members whose straggler verdict is straggler",
                                     registry=registry)
        self.derated_ranks = Gauge("elastic_ep_derated_ranks", "Members the straggler policy has derated",
                                   registry=registry)
        self.engine_sleep_state = Gauge(
            "elastic_ep_engine_sleep_state", "0 awake; 1 asleep at level 1 (KV cache freed); 2 asleep at level 2 "
            "(weights dropped too); vLLM's vllm:engine_sleep_state", registry=registry,
        )
        self.requests_running = Gauge(
            "elastic_ep_num_requests_running", "Requests holding KV blocks on a rank, decoding or being prefilled "
            "(vLLM's num_requests_running)",
            ["model_name"], registry=registry,
        ).labels(model_name)
        self.requests_waiting = Gauge(
            "elastic_ep_num_requests_waiting", "Requests queued for a rank and its KV blocks, preempted ones "
            "included (vLLM's num_requests_waiting)", ["model_name"], registry=registry,
        ).labels(model_name)
        self.num_preemptions = Counter(
            "elastic_ep_num_preemptions", "Requests preempted because their rank's KV pool had no free block "
            "(recomputed later; vLLM's num_preemptions)", registry=registry,
        )
        self.prefix_cache_queries = Counter(
            "elastic_ep_prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission (vLLM's "
            "prefix_cache_queries, in tokens)", registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "elastic_ep_prefix_cache_hits", "Prompt tokens found in cached KV blocks at admission (vLLM's "
            "prefix_cache_hits, in tokens)", registry=registry,
        )
        self.takeover_kv_positions = Counter(
            "elastic_ep_takeover_kv_positions", "Positions of the journaled requests a new leader of a controller "
            "group placed: kept (the KV an adopted rank still held for their tokens) or reprefilled (computed again "
            "before their next token)", ["fate"], registry=registry,
        )
        self.prefix_waits = Counter(
            "elastic_ep_prefix_waits", "Requests that waited for the prefix blocks another request of their rank was "
            "computing, instead of computing them again (serve --no-prefix-wait turns the wait off)", registry=registry,
        )
        self.prefix_wait_seconds = Counter(
            "elastic_ep_prefix_wait_seconds", "Time requests waited for a prefix in flight, summed over them (each "
            "waiting request counts each step it waited, planning to results)", registry=registry,
        )
        self.prefix_cached_blocks = Gauge(
            "elastic_ep_prefix_cache_blocks", "KV blocks keyed by their token prefix, all ranks (held or evictable)",
            registry=registry,
        )
        self.kv_cache_usage = KVCacheUsage(lambda: self.ranks.exported)
        registry.register(self.kv_cache_usage)
        self.ready = Gauge("elastic_ep_ready", "1 while GET /ready is true", registry=registry)
        self.dp_token_imbalance = Gauge(
            "elastic_ep_dp_token_imbalance",
            "Max over mean of tokens per rank in the last non-empty step (1.0 = even)",
            registry=registry,
        )
        self.dp_imbalance = Histogram(
            "elastic_ep_dp_imbalance", "Per step: max over mean of tokens per rank, as planned before the prefill "
            "was cut to the step's level (plan=unaligned) and as run (plan=aligned)", ["plan"],
            buckets=IMBALANCE_BUCKETS, registry=registry,
        )
        self.dp_busiest_tokens = Histogram(
            "elastic_ep_dp_busiest_tokens", "Per step: tokens of the busiest rank, which the others wait for at the "
            "all-to-all, before the prefill was cut to the step's level (plan=unaligned) and as run (plan=aligned)",
            ["plan"], buckets=TOKEN_BUCKETS, registry=registry,
        )
        self.dp_migrations = Counter(
            "elastic_ep_dp_migrations", "Decoding sequences moved off a rank that stayed the busiest", ["mode"],
            registry=registry,
        )
        self.kv_move_seconds = Histogram(
            "elastic_ep_kv_move_seconds", "Per step with a KV move: the longest any rank spent sending or receiving",
            buckets=STEP_BUCKETS, registry=registry,
        )
        self.step_wall_seconds = Histogram(
            "elastic_ep_step_wall_seconds", "Wall time of a step at the controller, plan sent to last result",
            buckets=STEP_BUCKETS, registry=registry,
        )
        self.controller_overhead_seconds = Histogram(
            "elastic_ep_controller_round_trip_seconds",
            "Per step: wall time of the step at the controller minus the slowest rank's step time",
            buckets=STEP_BUCKETS, registry=registry,
        )
        self.recoveries = Counter(
            "elastic_ep_recoveries", "Membership changes after a fault", ["cause"], registry=registry
        )
        self.rank_heartbeats = Counter(
            "elastic_ep_rank_heartbeats", "Rank heartbeats taken from the NodeHeartbeat of each node's agent (one "
            "message per node per --heartbeat-interval-s; a stopped rank's last one again, its age growing)",
            ["node"], registry=registry,
        )
        self.recovery_seconds = Histogram(
            "elastic_ep_recovery_seconds", "From fault detection to serving again", buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.failed_steps = Counter(
            "elastic_ep_failed_steps", "Steps dropped because a rank's own computation failed (ranks alive)",
            registry=registry,
        )
        self.lost_results = Counter(
            "elastic_ep_lost_step_results", "Step answers missing past the result deadline with the rank not "
            "inside the step, by outcome: resent (an answer came after the ask: the kept one sent again, or the "
            "first one late), not_run (its plan was lost: the step is run again), unanswered (no answer to the "
            "resend either: a fault of the rank)",
            ["outcome"], registry=registry,
        )
        self.prepared_steps = Counter(
            "elastic_ep_prepared_steps", "Steps planned while the one before ran (serve --async-scheduling), by "
            "outcome: sent (as sealed, the moment the next step began), rebuilt (sent with the rows of requests "
            "that ended meanwhile taken out, its plans built again), ahead (sent before the step it was planned "
            "during completed, --send-ahead-steps), dropped (something else changed: planned again; or sent ahead "
            "and given up, the step before it having failed or been interrupted)",
            ["outcome"], registry=registry,
        )
        self.epoch = Gauge("elastic_ep_epoch", "Current membership epoch", registry=registry)
        self.live_ranks = Gauge("elastic_ep_live_ranks", "Ranks serving in the current epoch", registry=registry)
        self.eplb_rebalances = Counter(
            "elastic_ep_eplb_rebalances", "Expert placements changed for load balance", registry=registry
        )
        self.degraded = Gauge("elastic_ep_degraded", "1 while GET /health says degraded (not ready, or a rank "
                              "stalled, suspect or down) and the control loop runs", registry=registry)
        self.scale_operations = Counter(
            "elastic_ep_scale_operations", "Online scale operations that ended, by result (succeeded, failed)",
            ["result"], registry=registry,
        )
        # every known label value has a sample from the start: increase() and absent() see the first event
        # (the recoveries' causes: faults/recovery.py)
        for mode in ("kv", "reprefill"):
            self.dp_migrations.labels(mode)
        for plan in ("aligned", "unaligned"):
            self.dp_imbalance.labels(plan)
            self.dp_busiest_tokens.labels(plan)
        for result in ("succeeded", "failed"):
            self.scale_operations.labels(result)

    def migrations(self, kv_move_s: float, moves: list[KVMove], reprefilled: list[int]) -> None:
        """A completed step's sequence migrations; `kv_move_s`: the longest any rank spent in its KV moves."""
        if moves:
            self.dp_migrations.labels("kv").inc(len(moves))
            self.kv_move_seconds.observe(kv_move_s)
        if reprefilled:
            self.dp_migrations.labels("reprefill").inc(len(reprefilled))

    def kv_step(self, preempted: int, prefix_queried: int, prefix_hit: int, prefix_waits: int, kv_kept: int = 0,
                kv_reprefilled: int = 0) -> None:
        """What one step's scheduling did to the KV pools."""
        if kv_kept or kv_reprefilled:
            self.takeover_kv_positions.labels("kept").inc(kv_kept)
            self.takeover_kv_positions.labels("reprefilled").inc(kv_reprefilled)
        self.num_preemptions.inc(preempted)
        self.prefix_waits.inc(prefix_waits)
        self.prefix_cache_queries.inc(prefix_queried)
        self.prefix_cache_hits.inc(prefix_hit)

    def forget_rank(self, rank: int) -> None:
        """Drop a rank's series when it leaves (its last values would read as current)."""
        self.ranks.forget(rank)


class RejectedFrames:
    """Frames the deployment's sockets dropped (wire/codec.py), as
    `elastic_ep_control_frames_rejected_total{socket, node, reason}`: this process's sockets (the
    controller's and its in-process agent's) counted here, a standalone agent's (`elastic-ep
    agent`) from its `AgentAlive` through `report(node, counts)`. Registered on `registry`."""

    def __init__(self, registry: CollectorRegistry):
        self._remote: dict[str, list[tuple[str, str, int]]] = {}
        registry.register(self)

    def report(self, node: str, counts: list[tuple[str, str, int]]) -> None:
        """The counts of node's agent process so far (they only grow while that process runs)."""
        self._remote[node] = list(counts)

    def totals(self) -> dict[tuple[str, str, str], int]:
        """(socket, node, reason) -> frames dropped, this process and the agents that reported."""
        totals = rejected_counts()
        for node, counts in list(self._remote.items()):
            for socket, reason, n in counts:
                totals[socket, node, reason] = totals.get((socket, node, reason), 0) + n
        return totals

    def collect(self):
        family = CounterMetricFamily(
            "elastic_ep_control_frames_rejected", "Frames a control-plane or fetch socket dropped: without the "
            "cluster key (unauthenticated), not a message (undecodable), not of that socket (unexpected), from a "
            "deposed controller (stale_term), or a message its reader could not take (invalid)",
            labels=["socket", "node", "reason"])
        for (socket, node, reason), n in sorted(self.totals().items()):
            family.add_metric([socket, node, reason], n)
        yield family

