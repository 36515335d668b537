"""The cluster record through a real etcd: taken from a /cluster snapshot, written when it changes
and only in the leader's term."""

import threading
import time

import pytest

from elastic_ep.group.record import RecordReader, cluster_record, read_record, write_records
from elastic_ep.group.store import GroupStore, Seat

pytestmark = pytest.mark.timeout(60)

VIEW = {"epoch": 3, "members": [0, 1], "time_s": 1.0, "events": [{"id": 1}],
        "ranks": [{"rank_id": 0, "node": "n0", "pid": 11, "state": "serving", "step_ms": {}},
                  {"rank_id": 1, "node": "n1", "pid": 12, "state": "serving"}],
        "placement": {"phy2log": [[0, 1], [2, 3]]},
        "agents": [{"node": "n0", "host": "10.0.0.1", "fetch": "tcp://10.0.0.1:5", "backup": True, "ranks": 1,
                    "cordoned": False}],
        "scale": {"is_scaling_elastic_ep": False, "elapsed_s": 4.2, "target_ep_size": 2},
        "rollout": {"state": "running", "active": True, "rank_in_flight": 1, "phase": "starting", "elapsed_s": 2.0,
                    "options": {"model_dir": "/m"}}}


def test_the_record_keeps_what_a_new_leader_needs_and_nothing_that_changes_by_itself():
    record = cluster_record(VIEW, 7)
    assert record["term"] == 7 and record["epoch"] == 3 and record["members"] == [0, 1]
    assert record["ranks"][0] == {"rank_id": 0, "node": "n0", "pid": 11, "state": "serving"}
    assert record["placement"] == VIEW["placement"]
    assert record["agents"] == [{"node": "n0", "host": "10.0.0.1", "fetch": "tcp://10.0.0.1:5", "backup": True,
                                 "ranks": 1}]
    assert record["scale"] == {"is_scaling_elastic_ep": False, "target_ep_size": 2}
    assert record["rollout"] == {"state": "running", "active": True, "rank_in_flight": 1, "phase": "starting"}
    assert cluster_record({**VIEW, "time_s": 9.0, "scale": {**VIEW["scale"], "elapsed_s": 9}}, 7) == record


def test_the_leader_writes_it_when_it_changes_and_a_reader_sees_it(etcd):
    store = GroupStore(etcd.url, "g")
    term = store.campaign(Seat("a", "http://a:1"), store.grant(30)).create_revision
    view, stop, deposed = dict(VIEW), threading.Event(), []
    thread = threading.Thread(target=write_records, args=(store, term, lambda: view, stop, 0.05, deposed.append))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while read_record(store) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        first = store.get(store.prefix + "record").mod_revision
        time.sleep(0.3)
        assert store.get(store.prefix + "record").mod_revision == first  # unchanged: not written again
        view = {**VIEW, "epoch": 4}
        while read_record(store)["epoch"] != 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        reader = RecordReader(GroupStore(etcd.url, "g"))
        reader.catch_up()
        assert reader.record["epoch"] == 4 and reader.record["term"] == term
    finally:
        stop.set()
        thread.join(5)
    stale = threading.Event()
    write_records(store, term - 1, lambda: {**VIEW, "epoch": 5}, stale, 0.01, deposed.append)
    assert deposed and "no longer leads" in deposed[0] and read_record(store)["epoch"] == 4
