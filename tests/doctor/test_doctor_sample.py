"""One report, one moment: the doctor pairs a /cluster snapshot with the process states read
between two /cluster reads that agree, so a fence in between cannot give `ready True` beside
"its process is gone"."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from elastic_ep.commands.doctor import consistent_sample
from elastic_ep.doctor.diagnose import ProcessInfo, diagnose_processes

BUSY = json.loads((Path(__file__).parent / "data" / "busy.json").read_text())


def test_a_fence_between_the_reads_is_sampled_again():
    suspect = copy.deepcopy(BUSY)
    suspect["ranks"][1]["liveness"] = {"state": "suspect", "stalled_s": None, "reason": "heartbeat 0.6s old"}
    fenced = copy.deepcopy(BUSY)
    fenced["ready"], fenced["ranks"][1]["state"] = False, "fenced"
    clusters = iter([suspect, fenced, fenced, fenced])
    processes = iter([{1: ProcessInfo("gone")}, {1: ProcessInfo("gone")}])
    cluster, seen = consistent_sample(lambda: next(clusters), lambda: next(processes))
    assert cluster["ranks"][1]["state"] == "fenced" and not cluster["ready"]
    assert diagnose_processes(cluster, seen) == [], "a fenced rank's gone process is no finding"


def test_a_quiet_cluster_is_read_once():
    reads = []

    def read():
        reads.append(1)
        return BUSY

    cluster, seen = consistent_sample(read, lambda: {0: ProcessInfo("running", 90.0)})
    assert (len(reads), cluster, seen) == (2, BUSY, {0: ProcessInfo("running", 90.0)})
