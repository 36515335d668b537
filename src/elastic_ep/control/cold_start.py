"""What a start cost: the bytes every node loaded by source, and the time to ready with its parts.

Sources: "storage" (the checkpoint: a rank's own reads, dense weights or experts, and its agent's,
the dense stage and the backup share), "shared_memory" (this node's agent's files in /dev/shm)
and "peer" (another node's agent, or a peer rank's slots in an epoch's exchange). A rank reports
its dense weights when it registers (`WorkerHello`) and the bytes of every epoch's transfer by
source (`EpochReady`); an agent reports what its reader took from storage so far (`AgentAlive`).
/cluster shows them under `cold_start`, /metrics as `elastic_ep_load_bytes_total{node,source}`,
with the time to ready and its parts as `elastic_ep_time_to_ready_seconds{part}`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from elastic_ep.wire import TransferStat

SOURCES = ("storage", "shared_memory", "peer")
DENSE_SOURCE = {"disk": "storage", "host_memory": "shared_memory", "peer": "peer"}  # WorkerHello.dense_source
# TransferStat.source; "local" (a slot of the same rank) and "keep" load nothing
TRANSFER_SOURCE = {"disk": "storage", "backup": "shared_memory", "backup_remote": "peer", "peer": "peer"}
# the parts of the time to ready, in order
PARTS = ("ranks_registered_s", "backup_read_s", "first_epoch_s", "warmup_s")


class LoadLedger:
    """Bytes loaded per node and source since the server started (a Prometheus collector too)."""

    def __init__(self) -> None:
        self._ranks: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(SOURCES, 0))
        self._agents: dict[tuple[str, str], int] = {}  # (node, agent session) -> its reader's storage bytes

    def dense(self, node: str, dense_source: str, nbytes: int) -> None:
        self._ranks[node][DENSE_SOURCE.get(dense_source, "storage")] += nbytes

    def transfers(self, node: str, stats: list[TransferStat]) -> None:
        for st in stats:
            if st.source in TRANSFER_SOURCE:
                self._ranks[node][TRANSFER_SOURCE[st.source]] += st.bytes_moved

    def agent(self, node: str, session: str, storage_bytes: int) -> None:
        """An agent's running total (a new session of the node's agent counts on from its own 0)."""
        self._agents[(node, session)] = storage_bytes

    def by_node(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {node: dict(v) for node, v in self._ranks.items()}
        for (node, _), nbytes in self._agents.items():
            out.setdefault(node, dict.fromkeys(SOURCES, 0))["storage"] += nbytes
        return dict(sorted(out.items()))

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily("elastic_ep_load_bytes", "Bytes of weights loaded, by node and source "
                                    "(storage, shared_memory, peer)", labels=["node", "source"])]

    def collect(self) -> list[Metric]:
        family = self.describe()[0]
        for node, sources in self.by_node().items():
            for source, nbytes in sources.items():
                family.add_metric([node, source], nbytes)
        return [family]


class TimeToReady:
    """The start's clock: `mark(part)` ends a part (PARTS), `ready()` the whole (the first time only)."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.parts: dict[str, float] = {}
        self.total_s: float | None = None

    def mark(self, part: str) -> None:
        now = time.monotonic()
        self.parts[part] = round(now - self._last, 3)
        self._last = now

    def ready(self) -> None:
        if self.total_s is None:
            self.total_s = round(time.monotonic() - self.started, 3)

    def view(self) -> dict[str, Any]:
        return {"time_to_ready_s": self.total_s, "parts": dict(self.parts)}

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily("elastic_ep_time_to_ready_seconds", "Seconds from the server's start to the first "
                                  "/ready (part total) and its parts", labels=["part"])]

    def collect(self) -> list[Metric]:
        family = self.describe()[0]
        if self.total_s is not None:
            family.add_metric(["total"], self.total_s)
        for part, seconds in self.parts.items():
            family.add_metric([part.removesuffix("_s")], seconds)
        return [family]
