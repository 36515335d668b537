"""What the doctor reports: findings in the runbook's shape (symptom -> suspicion ->
check -> action), each naming the ranks it is about by rank_id, node and pid."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("critical", "warning", "info")


@dataclass(frozen=True)
class RankRef:
    rank_id: int
    node: str
    pid: int | None

    def __str__(self) -> str:
        return f"rank {self.rank_id} ({self.node}, pid {self.pid})"


@dataclass(frozen=True)
class Finding:
    """kind: hang, path, process, straggler, dp-imbalance, expert-imbalance, not-ready,
    recovery-failed, start-failed, faults. `evidence` holds the numbers the finding rests on (JSON-able)."""

    kind: str
    severity: str
    symptom: str
    suspicion: str
    check: str
    action: str
    ranks: tuple[RankRef, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def rank_refs(cluster: dict[str, Any], rank_ids) -> tuple[RankRef, ...]:
    """RankRefs of `rank_ids` as /cluster lists them (node "?" and pid None if unknown)."""
    by_id = {r["rank_id"]: r for r in cluster.get("ranks", [])}
    return tuple(
        RankRef(int(r), by_id.get(r, {}).get("node", "?"), by_id.get(r, {}).get("pid")) for r in sorted(rank_ids)
    )


def render(finding: Finding) -> str:
    """The finding as an operator reads it in a terminal."""
    lines = [f"[{finding.severity.upper()}] {finding.kind}: {finding.symptom}"]
    if finding.ranks:
        lines.append("  ranks:     " + "; ".join(str(r) for r in finding.ranks))
    lines += [
        f"  suspicion: {finding.suspicion}",
        f"  check:     {finding.check}",
        f"  action:    {finding.action}",
    ]
    return "\n".join(lines)
