"""The cluster record through a real etcd: taken from a /cluster snapshot, written when it changes
and only in the leader's term, and at once, before the answer, when an operator's scale, drain,
uncordon or rolling restart is accepted."""

import asyncio
import threading
import time

import pytest

from elastic_ep.group.journal import JournaledEngine
from elastic_ep.group.record import RecordReader, RecordWriter, cluster_record, read_record
from elastic_ep.group.store import GroupStore, Seat

pytestmark = pytest.mark.timeout(60)

VIEW = {"epoch": 3, "members": [0, 1], "time_s": 1.0, "events": [{"id": 1}],
        "ranks": [{"rank_id": 0, "node": "n0", "pid": 11, "state": "serving", "step_ms": {}},
                  {"rank_id": 1, "node": "n1", "pid": 12, "state": "serving"}],
        "placement": {"phy2log": [[0, 1], [2, 3]]},
        "agents": [{"node": "n0", "host": "10.0.0.1", "fetch": "tcp://10.0.0.1:5", "backup": True, "ranks": 1,
                    "cordoned": False}],
        "cordoned": ["n2"],
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
    assert record["cordoned"] == ["n2"]  # a drained node stays cordoned under the next leader
    assert record["scale"] == {"is_scaling_elastic_ep": False, "target_ep_size": 2}
    assert record["rollout"] == {"state": "running", "active": True, "rank_in_flight": 1, "phase": "starting"}
    assert cluster_record({**VIEW, "time_s": 9.0, "scale": {**VIEW["scale"], "elapsed_s": 9}}, 7) == record


def test_the_leader_writes_it_when_it_changes_and_a_reader_sees_it(etcd):
    store = GroupStore(etcd.url, "g")
    term = store.campaign(Seat("a", "http://a:1"), store.grant(30)).create_revision
    view, stop, deposed = dict(VIEW), threading.Event(), []
    writer = RecordWriter(store, term, lambda: view, deposed.append)
    thread = threading.Thread(target=writer.run, args=(stop, 0.05))
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
    stale = RecordWriter(store, term - 1, lambda: {**VIEW, "epoch": 5}, deposed.append)
    stale.run(threading.Event(), 0.01)  # returns once etcd refused it
    assert deposed and "no longer leads" in deposed[0] and read_record(store)["epoch"] == 4


class Operations:
    """The control loop as the HTTP side sees it: an accepted operation changes the published view
    before it is answered (Controller._run_command publishes, then answers)."""

    info = None

    def __init__(self):
        self.view = {**VIEW, "cordoned": []}

    async def scale(self, new_ep_size, ranks=None):
        self.view = {**self.view, "scale": {"is_scaling_elastic_ep": True, "new_ep_size": new_ep_size,
                                            "scale_phase": "pending", "chosen": ranks}}
        return {"old_ep_size": 2, "new_ep_size": new_ep_size}

    async def drain(self, ranks=None, node=None):
        self.view = {**self.view, "cordoned": sorted({*self.view["cordoned"], node})}
        return {"ranks": [], "node": node, "old_ep_size": 2, "new_ep_size": 2}

    async def uncordon(self, node):
        self.view = {**self.view, "cordoned": [n for n in self.view["cordoned"] if n != node]}
        return {"node": node, "cordoned": False}

    async def rolling_restart(self, options):
        self.view = {**self.view, "rollout": {"state": "running", "active": True, "rank_in_flight": 0,
                                              "phase": "draining"}}
        return {"state": "running"}


def test_an_accepted_operation_is_in_the_record_when_it_is_answered(etcd):
    """No periodic write runs here: what the record holds at each answer was written for it (a
    leader killed right after answering leaves the operation to the next one)."""
    store = GroupStore(etcd.url, "g")
    term = store.campaign(Seat("a", "http://a:1"), store.grant(30)).create_revision
    ops = Operations()
    engine = JournaledEngine(ops, record=RecordWriter(store, term, lambda: ops.view, lambda reason: None).write)

    async def operate():
        await engine.scale(3)
        assert read_record(store)["scale"]["new_ep_size"] == 3
        await engine.drain(None, "n1")
        assert read_record(store)["cordoned"] == ["n1"]
        await engine.uncordon("n1")
        assert read_record(store)["cordoned"] == []
        await engine.rolling_restart({})
        assert read_record(store)["rollout"]["active"] is True

    asyncio.run(operate())


def test_an_unreachable_etcd_does_not_fail_an_accepted_operation():
    ops = Operations()
    store = GroupStore("http://127.0.0.1:9", "g", timeout_s=0.2)  # nothing listens there
    engine = JournaledEngine(ops, record=RecordWriter(store, 5, lambda: ops.view, lambda reason: None).write)
    assert asyncio.run(engine.scale(3)) == {"old_ep_size": 2, "new_ep_size": 3}
