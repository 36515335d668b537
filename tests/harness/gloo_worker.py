"""One rank of a two-host torch.distributed gloo group, for the test bed tests.

    gloo_worker.py RANK WORLD_SIZE HOST_ADDR STORE_ADDR STORE_PORT

The worker binds gloo to HOST_ADDR, its own host's address: it finds the interface that holds
it and sets GLOO_SOCKET_IFNAME before init_process_group (the default device resolves the
machine's hostname, which here means 127.0.0.1, and peers on other hosts cannot reach that).
Rank 0 hosts the TCPStore on STORE_ADDR.

It prints one JSON line once the group formed (the local addresses of its TCP connections and
whether an all_to_all gave the right rows), then for every `run STEPS` line on stdin times STEPS
MoE-shaped steps (dispatch all_to_all, then combine all_to_all of what came back) and prints
{"seconds": ...}; `exit` or end of input leaves the group and exits.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist


def interface_of(addr: str) -> str:
    """The name of the interface that holds IPv4 address `addr` on this host."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return name
    sys.exit(f"no interface of this host has address {addr}: pass an address of this host")


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    host_addr, store_addr, store_port = sys.argv[3], sys.argv[4], int(sys.argv[5])
    os.environ["GLOO_SOCKET_IFNAME"] = interface_of(host_addr)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore(store_addr, store_port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)

    rows = torch.arange(world, dtype=torch.float32) + 100 * rank  # row j goes to rank j
    got = torch.empty(world)
    dist.all_to_all_single(got, rows)
    local = sorted({c.laddr.ip.removeprefix("::ffff:")  # the store listens dual-stack
                    for c in psutil.Process().net_connections("tcp") if c.status == "ESTABLISHED"})
    expected = torch.tensor([100.0 * r + rank for r in range(world)])
    print(json.dumps({"local_addrs": local, "all_to_all_ok": bool(torch.equal(got, expected))}), flush=True)

    tokens = torch.randn(world * 64, 256)
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        start = time.perf_counter()
        for _ in range(int(line.split()[1])):
            dispatched = torch.empty_like(tokens)
            dist.all_to_all_single(dispatched, tokens)
            combined = torch.empty_like(tokens)
            dist.all_to_all_single(combined, dispatched)
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
