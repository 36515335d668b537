"""The group as GET /cluster shows it (`group_view`), and what a standby answers in its place."""

from __future__ import annotations

from typing import Any

from .election import ElectionState, Role


def group_view(group: str, etcd_url: str, me: str, state: ElectionState,
               record: dict[str, Any] | None = None) -> dict[str, Any]:
    """name, etcd, self (this controller), role (its), leader (name, http URL, controller address,
    or None), term (the leader's), etcd_reachable (this controller's last call), members: each
    controller with a live lease, its role and `lag` (journal batches it lacks behind the
    leader's; None where no leader is known); on a standby `record`: the epoch, term and members
    of the cluster record it last read (group/record.py; None before one)."""
    leader = state.leader
    lead_seq = next((s.journal_seq for s in state.seats if leader and s.name == leader.name), None)
    return {
        "name": group,
        "etcd": etcd_url,
        "self": me,
        "role": state.role.value,
        "term": state.term,
        "leader": None if leader is None else {"name": leader.name, "http": leader.http,
                                               "controller": leader.controller},
        "etcd_reachable": not state.etcd_error,
        "etcd_error": state.etcd_error,
        "deposed_reason": state.deposed_reason,
        "members": [{"name": s.name, "http": s.http, "role": s.role, "journal_seq": s.journal_seq,
                     "lag": None if lead_seq is None else max(0, lead_seq - s.journal_seq)} for s in state.seats],
        **({} if state.role == Role.LEADER else {"record": None if record is None else {
            k: record.get(k) for k in ("epoch", "term", "members")}}),
    }


def standby_reason(group: str, state: ElectionState) -> str:
    """Why this controller takes no requests, and where to go instead."""
    if state.role == Role.DEPOSED:
        return f"no longer the leader of group {group}: {state.deposed_reason}"
    if state.role == Role.LEADER:
        return f"leader of group {group} (term {state.term}), its controller is starting"
    if state.leader is None:
        return f"standby of group {group}; no leader now ({state.etcd_error or 'an election is under way'})"
    return (f"standby of group {group}; the leader is {state.leader.name} at {state.leader.http} "
            f"(term {state.term})")
