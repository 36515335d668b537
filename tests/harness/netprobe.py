"""Network probes the test bed tests run inside namespace hosts (stdlib only, starts fast).

    netprobe.py serve                     TCP echo :7001, TCP sink :7002, UDP counter :7003 (count on TCP :7004)
    netprobe.py rtt HOST COUNT            COUNT one-byte TCP ping-pongs to HOST; prints the round trips in ms
    netprobe.py udp HOST COUNT            COUNT datagrams to HOST; prints how many HOST received
    netprobe.py send HOST NBYTES          NBYTES over TCP to HOST's sink; prints seconds until HOST had them all
    netprobe.py reach HOST TIMEOUT_S      one TCP connect to HOST's echo port: prints "ok", "timeout" or "refused"

Client commands print one JSON value. Sockets time out after 10 s, so a probe never hangs.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import uuid

ECHO, SINK, UDP, UDP_COUNT = 7001, 7002, 7003, 7004
TIMEOUT_S = 10.0
SO_RCVBUFFORCE = 33


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    return s


def _serve_forever(listener: socket.socket, handle) -> None:
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def _echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _sink(conn: socket.socket) -> None:
    total = 0
    with conn:
        while data := conn.recv(1 << 20):
            total += len(data)
        conn.sendall(str(total).encode())


class UdpCounter:
    """Datagrams received per session tag (the first 32 bytes of each datagram). They wait in a
    16 MiB receive buffer and are counted when asked, so a slow reader loses none."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        self.sock.bind(("0.0.0.0", UDP))
        self.sock.setblocking(False)
        self.counts: dict[bytes, int] = {}
        self.lock = threading.Lock()

    def answer(self, conn: socket.socket) -> None:
        with conn, self.lock:
            tag = conn.recv(32)
            try:
                while True:
                    data = self.sock.recv(2048)
                    self.counts[data[:32]] = self.counts.get(data[:32], 0) + 1
            except BlockingIOError:
                pass
            conn.sendall(str(self.counts.pop(tag, 0)).encode())


def serve() -> None:
    counter = UdpCounter()
    listeners = {ECHO: _echo, SINK: _sink, UDP_COUNT: counter.answer}
    threads = [threading.Thread(target=_serve_forever, args=(_listen(port), handle), daemon=True)
               for port, handle in listeners.items()]
    for t in threads:
        t.start()
    print("ready", flush=True)
    threads[0].join()


def _connect(host: str, port: int) -> socket.socket:
    return socket.create_connection((host, port), timeout=TIMEOUT_S)


def rtt(host: str, count: int) -> list[float]:
    with _connect(host, ECHO) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(count):
            start = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            out.append((time.perf_counter() - start) * 1000)
        return out


def udp(host: str, count: int) -> int:
    tag = uuid.uuid4().hex.encode()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(count):
            s.sendto(tag + b"\0" * 32, (host, UDP))
    with _connect(host, UDP_COUNT) as s:
        s.sendall(tag)
        return int(s.recv(64))


def send(host: str, nbytes: int) -> float:
    chunk = b"\0" * (1 << 16)
    with _connect(host, SINK) as s:
        start = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= s.send(chunk[:left])
        s.shutdown(socket.SHUT_WR)
        assert int(s.recv(64)) == nbytes
        return time.perf_counter() - start


def reach(host: str, timeout_s: int) -> str:
    try:
        socket.create_connection((host, ECHO), timeout=timeout_s).close()
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    return "ok"


def main() -> None:
    command, *args = sys.argv[1:]
    if command == "serve":
        serve()
    else:
        fn = {"rtt": rtt, "udp": udp, "send": send, "reach": reach}[command]
        print(json.dumps(fn(args[0], int(args[1]))))


if __name__ == "__main__":
    main()
