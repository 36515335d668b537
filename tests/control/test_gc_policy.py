"""`elastic-ep serve` tunes the garbage collector before its control loop starts (control/gc_policy.py):
start-up's objects frozen and a large young threshold, so full collections stay off the step path.
Each case runs the real command in a child process up to the moment the control loop (or, in a
controller group, the election) would start, and reads the collector's state there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic_ep.control.gc_policy import GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD
from elastic_ep.harness.server_process import free_port

# the child stops the command where the named method would start the control loop, and prints the
# collector's thresholds and frozen count as JSON
CHILD = """
import gc, json, os, sys
from {module} import {cls}

def report(*args, **kwargs):
    print(json.dumps({{"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}}), flush=True)
    os._exit(0)

{cls}.{method} = report
from elastic_ep.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize(("where", "extra"), [
    (("elastic_ep.control.controller", "Controller", "start"), ["--local-ranks", "0"]),
    (("elastic_ep.group.election", "Election", "run"), ["--etcd", "http://127.0.0.1:9", "--ha-group", "g"]),
], ids=["serve", "serve-in-group"])
def test_serve_tunes_the_collector_before_the_control_loop_starts(where, extra):
    module, cls, method = where
    done = subprocess.run([sys.executable, "-c", CHILD.format(module=module, cls=cls, method=method), "serve",
                           "--model", "tiny-deepseek-v3", "--ep-size", "2", "--port", str(free_port()), *extra],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state["threshold"] == [GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD]
    assert state["frozen"] > 10_000, "start-up's objects (modules, the app) are out of every collection"
