"""The cluster record: what a new leader needs to know of the deployment, in etcd at
`/elastic-ep/<group>/record`, written by the leader (fenced by its term) whenever it changes.

It is taken from the leader's /cluster snapshot (control/api.py `Engine.cluster`): the epoch, its
members, every rank's node, pid and state, the expert placement (phy2log), the agents with their
hosts, fetch sockets and whether they hold a backup (the backup sites), the cordoned nodes, the scale
in flight (with the target size) and whether a rolling restart is. It is written every 0.5 s when it
changed, and at once when an operator's scale, drain, uncordon or rolling restart is accepted, before
its 2xx answer (`RecordWriter.write`): an operation answered is in the record a new leader reads.
Standbys read it (`RecordReader`, every 0.2 s, whichever way the journal goes) and show its epoch
in /cluster. A new leader adopts the ranks it names, over its placement
(control/membership/adoption.py), keeps its nodes cordoned, resumes the scale in flight and ends a
rolling restart (membership/scale_driver.py `resume`)."""

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
        "cordoned": sorted(view.get("cordoned", [])),
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


class RecordWriter:
    """The leader's writes of the record of `snapshot()` in `term`: `run` every `interval_s` (the
    control thread publishes the snapshot; this thread only reads it), `write` at once from any
    thread. Both write only a record that changed since the last written, one at a time, and each
    call to etcd is bounded by the store's timeout; etcd's refusal (another term leads) is
    `on_deposed`."""

    def __init__(self, store: GroupStore, term: int, snapshot: Callable[[], dict[str, Any]],
                 on_deposed: Callable[[str], None]):
        self.store, self.term, self.snapshot, self.on_deposed = store, term, snapshot, on_deposed
        self._lock = threading.Lock()
        self._last: dict[str, Any] | None = None
        self.refused = False  # etcd refused a write: this term no longer leads, nothing more is written

    def write(self) -> bool:
        """Write the record of the snapshot as it is now, unless it is the one written last; False
        when etcd could not be reached (the next periodic write tries again) or refused it."""
        with self._lock:  # one write at a time: a later snapshot never lands before an earlier one
            if self.refused:
                return False
            record = cluster_record(self.snapshot(), self.term)
            if record == self._last:
                return True
            try:
                if not self.store.put_as_leader(record_key(self.store), json.dumps(record).encode(), self.term):
                    self.refused = True
                    self.on_deposed(f"etcd refused the cluster record: term {self.term} no longer leads")
                    return False
            except EtcdUnavailable:
                return False
            self._last = record
            return True

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s) and not self.refused:
            self.write()
