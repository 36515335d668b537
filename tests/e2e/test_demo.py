"""`elastic-ep demo` as a user runs it: a real 4-rank server, streams, a rank killed (or hung)
mid-stream. Every request finishes with the fault-free text, a new epoch forms, and nothing the
demo started is left running."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from elastic_ep.demo_view import CURSOR_UP_AND_CLEAR, LiveView, StreamState
from elastic_ep.harness.server_process import running


def run_demo(*args: str, timeout_s: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_ep.cli", "demo", *args],
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("fault, cause", [([], "killed by SIGKILL"), (["--hang"], "no heartbeat")],
                         ids=["kill", "hang"])
def test_demo_survives_the_fault_with_identical_outputs_and_cleans_up(fault, cause):
    done = run_demo("--requests", "4", "--max-tokens", "24", "--kill-after-tokens", "6", "--no-live", "--json",
                    *fault)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert len(report["requests"]) == 4
    assert all(r["finished"] and r["tokens"] == 24 and r["identical"] for r in report["requests"])
    assert report["epoch_after"] > report["epoch_before"]
    recovery = report["recovery"]
    assert recovery["culprits"] == [1] and 1 not in recovery["members"] and cause in recovery["fault_cause"]
    assert sum(t["bytes"] for t in recovery["transfers"].values()) > 0
    assert report["processes_left"] == [] and not [p for p in report["server_pids"] if running(p)]
    assert report["killed_pid"] in report["server_pids"]
    assert "identical" in done.stderr and "kill to serving again" in done.stderr and "OK:" in done.stderr


def test_demo_names_a_rank_that_does_not_exist():
    done = run_demo("--kill-rank", "4", timeout_s=60)
    assert done.returncode == 2
    assert "--kill-rank 4 is not a rank; ranks are 0..3" in done.stderr


def test_live_view_redraws_its_block_in_place_and_plain_view_never_moves_the_cursor():
    states = [StreamState(0, "first prompt", 4), StreamState(1, "second prompt", 4)]
    live = io.StringIO()
    view = LiveView(live, states, live=True)
    view.refresh()
    states[0].add_chunk("x", None, 1.0)
    view.say(">>> an event")
    view.refresh()
    # Each redraw erases exactly the 3 lines drawn before (2 streams + totals), no more.
    assert live.getvalue().count(CURSOR_UP_AND_CLEAR) == 6
    assert live.getvalue().count(">>> an event") == 1 and "  1/4" in live.getvalue().splitlines()[-3]
    plain = io.StringIO()
    view = LiveView(plain, states, live=False)
    view.say(">>> an event")
    view.close()
    assert CURSOR_UP_AND_CLEAR not in plain.getvalue()
    event, totals = plain.getvalue().splitlines()
    assert event == ">>> an event" and "streams done 0/2  tokens 1/8" in totals
