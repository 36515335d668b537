"""What a small frame left queued in a ROUTER costs this process's memory (libzmq, RCVHWM 0).

The controller's health socket is a ROUTER without a receive high-water mark
(control/control_plane.py says why); while its control thread reads slower than the agents
send (a loaded machine, or a long computation on that thread), their frames wait in ZeroMQ's
pipes in the controller's process. Here `--peers` DEALERs send a two-part message (a 32-byte
part and `--body-bytes`, a `NodeHeartbeat`'s size) `--rate` times a second each for
`--seconds`, nobody reading, then everything is read:

    PYTHONPATH=src .venv/bin/python benchmarks/zmq_queue_cost.py --peers 128 --rate 10 --seconds 10

prints the messages queued, glibc's heap in use and the RSS they added, per queued message, and
both again after reading them all (what the heap gave back; what the RSS kept). `--rcvhwm N`
gives the ROUTER a receive high-water mark instead and sends without blocking: a ROUTER at its
mark stops reading the peer, and `sender_blocked` says whether a sender's send would have blocked
(its own queue and the kernel's buffers full) and after how many messages; `--zmq-heartbeat-ms`
turns ZeroMQ's heartbeat on at both ends (timeout 10x), as the controller's sockets have it
(with a mark, whether the process survives heartbeats on a connection stopped at a full pipe).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import psutil
import zmq


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_in_use_bytes() -> int:
    """glibc's heap in use in this process, every thread's arena and mmap'd chunks (mallinfo2)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def measure(peers: int, rate: float, seconds: float, body_bytes: int, rcvhwm: int = 0,
            heartbeat_ms: int = 0) -> dict:
    ctx = zmq.Context()
    ctx.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)  # every socket made after this
    ctx.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10 * heartbeat_ms)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, rcvhwm)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    for i in range(peers):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, b"n%d" % i)
        d.connect(f"tcp://127.0.0.1:{port}")
        dealers.append(d)
    time.sleep(1)  # every connection up before the baseline
    me = psutil.Process()
    heap0, rss0, sent, t0 = malloc_in_use_bytes(), me.memory_info().rss, 0, time.monotonic()
    blocked = None
    while time.monotonic() - t0 < seconds and blocked is None:
        for d in dealers:
            try:
                d.send_multipart([b"m" * 32, b"b" * body_bytes], zmq.NOBLOCK)
            except zmq.Again:
                blocked = sent // peers  # messages each sender had sent
                break
            sent += 1
        time.sleep(1 / rate)
    time.sleep(1)  # the last ones through the I/O threads
    heap1, rss1 = malloc_in_use_bytes(), me.memory_info().rss
    queued = 0
    while True:
        try:
            router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        queued += 1
    heap2, rss2 = malloc_in_use_bytes(), me.memory_info().rss
    for s in (*dealers, router):
        s.close(0)
    ctx.term()
    return {"peers": peers, "rate_per_s": rate, "message_bytes": 32 + body_bytes, "rcvhwm": rcvhwm,
            "zmq_heartbeat_ms": heartbeat_ms, "seconds": round(time.monotonic() - t0, 1),
            "sent": sent, "queued": queued, "sender_blocked": blocked is not None, "blocked_after": blocked,
            "heap_mib": round((heap1 - heap0) / 2**20, 1), "rss_mib": round((rss1 - rss0) / 2**20, 1),
            "heap_bytes_per_message": round((heap1 - heap0) / max(queued, 1)),
            "rss_bytes_per_message": round((rss1 - rss0) / max(queued, 1)),
            "heap_mib_after_reading": round((heap2 - heap0) / 2**20, 1),
            "rss_mib_after_reading": round((rss2 - rss0) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=128, help="senders (the agents of 1,024 ranks, 8 a node)")
    parser.add_argument("--rate", type=float, default=10.0, help="messages a second per sender")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--body-bytes", type=int, default=160, help="a NodeHeartbeat of 8 ranks is ~160-200 bytes")
    parser.add_argument("--rcvhwm", type=int, default=0, help="the ROUTER's receive high-water mark (0: none)")
    parser.add_argument("--zmq-heartbeat-ms", type=int, default=0, help="ZeroMQ's heartbeat interval (0: off)")
    args = parser.parse_args()
    print(json.dumps(measure(args.peers, args.rate, args.seconds, args.body_bytes, args.rcvhwm,
                             args.zmq_heartbeat_ms)))


if __name__ == "__main__":
    main()
