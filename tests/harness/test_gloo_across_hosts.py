"""torch.distributed crosses the test bed's host boundary: two ranks in two namespace hosts
form a gloo group over a TCPStore on one host's address, bind their own host's address (not
127.0.0.1), exchange with all_to_all, and a delay on one host's link slows every step."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("gloo_worker.py")
STORE_PORT = 29650


def read_json(proc: subprocess.Popen, timeout_s: float = 180.0):
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    assert line, f"worker {proc.args} printed nothing within {timeout_s}s (exit code {proc.poll()})"
    return json.loads(line)


def run_steps(workers: list[subprocess.Popen], steps: int) -> list[float]:
    for w in workers:
        w.stdin.write(f"run {steps}\n")
        w.stdin.flush()
    return [read_json(w)["seconds"] for w in workers]


def test_gloo_group_binds_each_hosts_address_and_feels_its_delay(netbed):
    hosts = netbed(2).hosts
    store_addr = hosts[0].addr
    workers = [h.popen([sys.executable, str(WORKER), str(rank), "2", h.addr, store_addr, str(STORE_PORT)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for rank, h in enumerate(hosts)]
    for h, w in zip(hosts, workers, strict=True):
        formed = read_json(w)
        assert formed == {"local_addrs": [h.addr], "all_to_all_ok": True}

    steps, delay_ms = 10, 20
    clean_s = run_steps(workers, steps)
    hosts[1].set_link(delay_ms=delay_ms)
    delayed_s = run_steps(workers, steps)
    print(f"{steps} dispatch+combine steps: clean {max(clean_s) * 1000:.1f} ms, "
          f"{delay_ms} ms on rank 1's host {max(delayed_s) * 1000:.1f} ms")
    # Whichever rank's messages cross the delay (netem delays what leaves host 1, the userspace
    # path what arrives there), the other starts step j+1 only after the answer to its step-j
    # dispatch came back across it.
    assert max(delayed_s) >= (steps - 1) * delay_ms / 1000
    assert max(delayed_s) > max(clean_s)
    for w in workers:
        w.stdin.close()
        assert w.wait(timeout=60) == 0
