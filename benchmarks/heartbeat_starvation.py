"""Why a loading rank went silent: a heartbeat-like thread in each of N processes that fill fresh
memory at once (as ranks allocate and fill their expert slots), at ordinary priority and under the
worker's raised one (node/priority.py); per process the worst gap between ticks and how much of it
the thread spent runnable on the run queue (its /proc schedstat), i.e. waiting for a CPU.

    PYTHONPATH=src .venv/bin/python benchmarks/heartbeat_starvation.py [--procs 4] [--gib 1.5] [--huge]

--huge fills on transparent huge pages (model/memory.py: huge_zeros, as the slots are).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, threading, time, torch
from elastic_ep.model.memory import huge_zeros
from elastic_ep.node.priority import prioritize_this_thread
gib, huge, raise_it = float(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
torch.set_num_threads(1)
worst, stop, got = [0.0, 0.0], threading.Event(), []
def wait_ns(tid):
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[1])
def tick():
    tid = threading.get_native_id()
    got.append(prioritize_this_thread() if raise_it else "")
    last, lw = time.monotonic(), wait_ns(tid)
    while not stop.is_set():
        time.sleep(0.01)
        now, w = time.monotonic(), wait_ns(tid)
        if now - last > worst[0]:
            worst[:] = [now - last, (w - lw) / 1e9]
        last, lw = now, w
t = threading.Thread(target=tick, daemon=True); t.start()
t0 = time.monotonic()
chunks = [(huge_zeros if huge else torch.zeros)(64, 1024, 1024) for _ in range(int(gib * 4))]  # 256 MiB each
stop.set(); t.join()
print(json.dumps({"fill_s": round(time.monotonic() - t0, 2), "worst_gap_s": round(worst[0], 3),
                  "run_queue_s": round(worst[1], 3), "priority": got[0]}))
"""


def run(procs: int, gib: float, huge: bool, raise_it: bool) -> list[dict]:
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(gib), str(int(huge)), str(int(raise_it))],
                                 stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    return [json.loads(c.communicate()[0]) for c in children]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--gib", type=float, default=1.5, help="memory each process fills")
    parser.add_argument("--huge", action="store_true", help="on transparent huge pages")
    args = parser.parse_args(argv)
    print(f"{args.procs} processes each filling {args.gib} GiB{' on huge pages' if args.huge else ''}, "
          "a thread ticking every 10 ms in each")
    for raise_it in (False, True):
        rows = run(args.procs, args.gib, args.huge, raise_it)
        label = rows[0]["priority"] or "ordinary priority"
        worst = max(rows, key=lambda r: r["worst_gap_s"])
        print(f"{label:>18}: worst gap {worst['worst_gap_s']:.3f}s ({worst['run_queue_s']:.3f}s of it runnable on "
              f"the run queue); per process {[r['worst_gap_s'] for r in rows]}; fill {[r['fill_s'] for r in rows]}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
