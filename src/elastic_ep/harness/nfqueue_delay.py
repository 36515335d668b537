"""Link delay without the kernel's netem: hold every packet of one NFQUEUE queue for a fixed
time, then accept it.

Run inside a host's network namespace (NFQUEUE queues are per namespace) while an xtables rule
sends the packets to delay to the queue (the test bed sends those arriving on the host's link):

    python nfqueue_delay.py --queue 0 --delay-ms 20

It speaks the nfnetlink_queue protocol over a raw AF_NETLINK socket (no library): it binds the
queue in metadata-only copy mode (payloads stay in the kernel) with whole GSO packets, prints
`ready` once bound, and gives one batch verdict for every run of packets that has come due. The
delay is constant, so packets leave in the order they came.

stdin is the control channel: a line with a number sets a new delay in ms (packets already held
keep the delay they were given). End of file (the test bed closing it, or the test process
dying) makes it release what it holds, each at its time, and exit 0.

On failure: a queue that cannot be bound (no CAP_NET_ADMIN, queue taken by another listener) or a
verdict the kernel refuses exits non-zero with the kernel's errno on stderr. While no process
listens on the queue, the kernel drops the queued packets: a dead delayer looks like a cut link,
never like a fast one. More than `--max-queued` packets held at once are dropped, like a full
router buffer.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import struct
import sys
import time
from collections import deque

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
SO_RCVBUFFORCE = 33
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFNL_SUBSYS_QUEUE = 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 0x4
NF_ACCEPT = 1
NLMSG_HDR = struct.Struct("=IHHII")


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, 0, 0) + body


def _messages(data: bytes):
    """(type, payload after the nlmsghdr) for every netlink message in one datagram."""
    offset = 0
    while offset + NLMSG_HDR.size <= len(data):
        length, kind, _, _, _ = NLMSG_HDR.unpack_from(data, offset)
        yield kind, data[offset + NLMSG_HDR.size:offset + length]
        offset += (length + 3) & ~3


def _errno(payload: bytes) -> int:
    return -struct.unpack_from("=i", payload)[0]


def _configure(sock: socket.socket, queue: int, attrs: bytes) -> None:
    """Send one config request and wait for its ack; raises OSError with the kernel's errno."""
    sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
    while True:
        for kind, payload in _messages(sock.recv(65536)):
            if kind == NLMSG_ERROR:
                err = _errno(payload)
                if err:
                    raise OSError(err, f"nfqueue {queue}: config refused: {os.strerror(err)}")
                return


def bind_queue(queue: int, max_queued: int) -> socket.socket:
    """A netlink socket bound to NFQUEUE `queue` of this namespace, metadata-only, GSO whole."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    sock.bind((0, 0))
    _configure(sock, queue, _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)))
    _configure(sock, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
               + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", max_queued))
               + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
               + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
    return sock


def _packet_id(payload: bytes) -> int | None:
    """The packet id of an NFQNL_MSG_PACKET payload (nfgenmsg then attributes)."""
    offset = 4
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if kind & 0x3FFF == NFQA_PACKET_HDR:
            return struct.unpack_from("!I", payload, offset + 4)[0]
        offset += (length + 3) & ~3
    return None


class Delayer:
    """Packets held in arrival order with the time each is due."""

    def __init__(self, sock: socket.socket, queue: int, delay_s: float):
        self.sock, self.queue, self.delay_s = sock, queue, delay_s
        self.held: deque[tuple[float, int]] = deque()

    def receive(self) -> None:
        """Take every message waiting on the socket; raises OSError on a netlink error."""
        while True:
            try:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            now = time.monotonic()
            for kind, payload in _messages(data):
                if kind == NLMSG_ERROR and (err := _errno(payload)):
                    raise OSError(err, f"nfqueue {self.queue}: verdict refused: {os.strerror(err)}")
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    packet_id = _packet_id(payload)
                    if packet_id is not None:
                        self.held.append((now + self.delay_s, packet_id))

    def release_due(self) -> float | None:
        """Accept every packet now due (one batch verdict); seconds until the next is due."""
        now = time.monotonic()
        last = None
        while self.held and self.held[0][0] <= now:
            last = self.held.popleft()[1]
        if last is not None:
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue, verdict, NLM_F_REQUEST))
        return self.held[0][0] - now if self.held else None


def run(queue: int, delay_ms: float, max_queued: int) -> None:
    """Serve the queue until stdin ends and every packet held by then is released; raises
    OSError when the kernel refuses the queue or a verdict."""
    sock = bind_queue(queue, max_queued)
    delayer = Delayer(sock, queue, delay_ms / 1000)
    print("ready", flush=True)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(sys.stdin.fileno(), select.POLLIN)
    stdin_open = True
    while True:
        wait_s = delayer.release_due()
        if wait_s is None and not stdin_open:
            return
        for fd, _ in poller.poll(None if wait_s is None else max(wait_s, 0.0) * 1000):
            if fd == sock.fileno():
                delayer.receive()
            elif stdin_open:
                data = os.read(fd, 4096)
                if data.split():
                    delayer.delay_s = float(data.split()[-1]) / 1000
                elif not data:
                    # The rule that feeds the queue is gone (or its owner is): take what is
                    # already queued, then stop listening.
                    delayer.receive()
                    poller.unregister(sock)
                    poller.unregister(fd)
                    stdin_open = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0, help="NFQUEUE number in this namespace")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--max-queued", type=int, default=16384,
                        help="packets held at once; more are dropped by the kernel")
    args = parser.parse_args()
    try:
        run(args.queue, args.delay_ms, args.max_queued)
    except OSError as e:
        sys.exit(f"nfqueue_delay: {e}")


if __name__ == "__main__":
    main()
