"""The heartbeat thread's priority: raised for that thread alone, so a saturated CPU cannot keep it waiting."""

from __future__ import annotations

import os
import threading

import pytest

from elastic_ep.node.priority import prioritize_this_thread


def test_only_the_calling_thread_is_raised():
    got: dict[str, object] = {}

    def beat() -> None:
        tid = threading.get_native_id()
        got["result"] = prioritize_this_thread()
        got["policy"], got["nice"] = os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)

    before = os.sched_getscheduler(threading.get_native_id())
    thread = threading.Thread(target=beat)
    thread.start()
    thread.join()
    if got["result"] == "":
        pytest.skip("this machine permits neither SCHED_RR nor a negative nice (no CAP_SYS_NICE)")
    if got["result"] == "SCHED_RR":  # and a process it starts begins at the ordinary policy
        assert got["policy"] == os.SCHED_RR | os.SCHED_RESET_ON_FORK
    else:
        assert got["nice"] == -10
    assert os.sched_getscheduler(threading.get_native_id()) == before  # the caller's main thread is as it was
