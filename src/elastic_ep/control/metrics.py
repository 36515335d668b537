"""Cluster metrics, registered on the HTTP app's CollectorRegistry.

Per-rank series (label `rank`), so one slow rank shows as itself and is not hidden in a mean:
step time, collective wait, tokens, expert load relative to the
mean, and liveness (up, heartbeat age, last progress), set each time the control thread publishes.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from elastic_ep.wire import KVMove, StepResult, rejected_counts

from .rank_metrics import RankCounter, RankGauge, RankHistogram

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
IMBALANCE_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)


class ClusterMetrics:
    def __init__(self, registry: CollectorRegistry):
        # the series every step updates for every rank (control/rank_metrics.py)
        self.step_seconds = RankHistogram(
            "elastic_ep_rank_step_seconds", "Step time per rank (worker side)", STEP_BUCKETS, registry,
        )
        self.collective_wait_seconds = RankHistogram(
            "elastic_ep_rank_collective_wait_seconds",
            "Time per step a rank spent in the dispatch and combine all-to-alls", STEP_BUCKETS, registry,
        )
        self.rank_tokens = RankGauge(
            "elastic_ep_rank_step_tokens", "Tokens a rank ran in the last step (DP attention)", registry,
        )
        self.rank_tokens_total = RankCounter(
            "elastic_ep_rank_tokens", "Tokens a rank ran (prefill and decode), for tokens per step over a window",
            registry,
        )
        self.rank_up = Gauge(
            "elastic_ep_rank_up", "1 while a rank serves and is not stalled (liveness in /cluster), else 0",
            ["rank"], registry=registry,
        )
        self.rank_heartbeat_age_seconds = Gauge(
            "elastic_ep_rank_heartbeat_age_seconds", "Time since the rank's last heartbeat", ["rank"],
            registry=registry,
        )
        self.rank_last_progress_seconds = Gauge(
            "elastic_ep_rank_last_progress_timestamp_seconds",
            "Unix time the rank last moved (entered a collective or phase); alert on time() minus this",
            ["rank"], registry=registry,
        )
        self.rank_stalled_seconds = Gauge(
            "elastic_ep_rank_stalled_seconds", "How long the rank has been stalled or waiting in a stalled step "
            "(0 when live)", ["rank"], registry=registry,
        )
        self.requests_running = Gauge(
            "elastic_ep_num_requests_running", "Requests placed on a rank (running or being prefilled)",
            registry=registry,
        )
        self.requests_waiting = Gauge(
            "elastic_ep_num_requests_waiting", "Requests admitted but not yet placed on a rank", registry=registry,
        )
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
        self.remote_messages = RankCounter(
            "elastic_ep_all2all_remote_messages", "Point-to-point sends of the MoE all-to-alls to a rank on another "
            "node, per sending rank (gloo sends one per peer per collective, empty ones included)", registry,
        )
        self.remote_bytes = RankCounter(
            "elastic_ep_all2all_remote_bytes", "Bytes the MoE all-to-alls of a rank sent to ranks on other nodes",
            registry,
        )
        self.dp_migrations = Counter(
            "elastic_ep_dp_migrations", "Decoding sequences moved off a rank that stayed the busiest", ["mode"],
            registry=registry,
        )
        self.kv_move_seconds = Histogram(
            "elastic_ep_kv_move_seconds", "Per step with a KV move: the longest any rank spent sending or receiving",
            buckets=STEP_BUCKETS, registry=registry,
        )
        self.expert_load_imbalance = Gauge(
            "elastic_ep_expert_load_imbalance",
            "Tokens computed by a rank's expert slots over the mean across ranks, recent window (1.0 = even)",
            ["rank"], registry=registry,
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
        self.recovery_seconds = Histogram(
            "elastic_ep_recovery_seconds", "From fault detection to serving again", buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.failed_steps = Counter(
            "elastic_ep_failed_steps", "Steps dropped because a rank's own computation failed (ranks alive)",
            registry=registry,
        )
        self.epoch = Gauge("elastic_ep_epoch", "Current membership epoch", registry=registry)
        self.live_ranks = Gauge("elastic_ep_live_ranks", "Ranks serving in the current epoch", registry=registry)
        self.eplb_rebalances = Counter(
            "elastic_ep_eplb_rebalances", "Expert placements changed for load balance", registry=registry
        )

    def data_plane_step(self, results: Mapping[int, StepResult], moves: list[KVMove], reprefilled: list[int]) -> None:
        """What a completed step's all-to-alls sent across nodes, and its migrations."""
        ranks = list(results)
        self.remote_messages.inc(ranks, [res.remote_messages for res in results.values()])
        self.remote_bytes.inc(ranks, [res.remote_bytes for res in results.values()])
        if moves:
            self.dp_migrations.labels("kv").inc(len(moves))
            self.kv_move_seconds.observe(max(res.kv_move_s for res in results.values()))
        if reprefilled:
            self.dp_migrations.labels("reprefill").inc(len(reprefilled))

    def forget_rank(self, rank: int) -> None:
        """Drop a rank's series when it leaves (its last values would read as current)."""
        for metric in (self.expert_load_imbalance, self.rank_up, self.rank_heartbeat_age_seconds,
                       self.rank_last_progress_seconds, self.rank_stalled_seconds):
            try:
                metric.remove(str(rank))
            except KeyError:
                pass
        self.rank_tokens.remove(rank)


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
            "cluster key (unauthenticated), not a message (undecodable), or not of that socket (unexpected)",
            labels=["socket", "node", "reason"])
        for (socket, node, reason), n in sorted(self.totals().items()):
            family.add_metric([socket, node, reason], n)
        yield family

