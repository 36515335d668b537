"""Frames the deployment's sockets dropped (wire/codec.py), as /metrics shows them:
`elastic_ep_control_frames_rejected_total{socket, node, reason}`. This process's sockets (the
controller's, and its in-process agent's) are counted here; an agent of its own process
(`elastic-ep agent`) reports its counts in every `AgentAlive`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from elastic_ep.wire import rejected_counts


class RejectedFrames:
    """Registered on `registry`; `report(node, counts)` takes a standalone agent's counts."""

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

