"""The cluster record: what a new leader needs to know of the deployment, in etcd at
`/elastic-ep/<group>/record`, written by the leader (fenced by its term) whenever it changes.

It is taken from the leader's /cluster snapshot (control/api.py `Engine.cluster`): the epoch, its
members, every rank's node, pid and state, the expert placement (phy2log), the agents with their
hosts, fetch sockets and whether they hold a backup (the backup sites), the scale in flight (with
the target size) and whether a rolling restart is.
Standbys read it (`RecordReader`, every 0.2 s, whichever way the journal goes) and show its epoch
in /cluster. A new leader adopts the ranks it names, over its placement
(control/membership/adoption.py), resumes the scale in flight and ends a rolling restart
(membership/scale_driver.py `resume`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from .store import EtcdUnavailable, GroupStore

RANK_FIELDS = ("rank_id", "node", "pid", "state")
AGENT_FIELDS = ("node", "host", "fetch", "backup", "ranks")
ROLLOUT_FIELDS = ("state", "active", "rank_in_flight", "phase")


def cluster_record(view: dict[str, Any], term: int) -> dict[str, Any]:
    """The record of a /cluster snapshot `view` written in `term` (no time: equal records mean
    nothing changed)."""
    return {
        "term": term,
        "epoch": view.get("epoch"),
        "members": view.get("members", []),
        "ranks": [{k: r.get(k) for k in RANK_FIELDS} for r in view.get("ranks", [])],
        "placement": view.get("placement"),
        "agents": [{k: a.get(k) for k in AGENT_FIELDS} for a in view.get("agents", [])],
        "scale": {k: v for k, v in (view.get("scale") or {}).items() if k != "elapsed_s"},
        "rollout": {k: (view.get("rollout") or {}).get(k) for k in ROLLOUT_FIELDS},
    }


def record_key(store: GroupStore) -> str:
    return store.prefix + "record"


def read_record(store: GroupStore) -> dict[str, Any] | None:
    held = store.get(record_key(store))
    return json.loads(held.value) if held is not None else None


class RecordReader:
    """The cluster record as a standby last read it (`record`; None before one), every `interval_s`."""

    def __init__(self, store: GroupStore):
        self.store = store
        self.record: dict[str, Any] | None = None

    def catch_up(self) -> None:
        self.record = read_record(self.store)

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            try:
                self.catch_up()
            except EtcdUnavailable:
                continue


def write_records(store: GroupStore, term: int, snapshot: Callable[[], dict[str, Any]], stop: threading.Event,
                  interval_s: float, on_deposed: Callable[[str], None]) -> None:
    """Until `stop`: every `interval_s`, the record of `snapshot()` to etcd when it changed."""
    last: dict[str, Any] | None = None
    while not stop.wait(interval_s):
        record = cluster_record(snapshot(), term)
        if record == last:
            continue
        try:
            if not store.put_as_leader(record_key(store), json.dumps(record).encode(), term):
                on_deposed(f"etcd refused the cluster record: term {term} no longer leads")
                return
        except EtcdUnavailable:
            continue
        last = record
