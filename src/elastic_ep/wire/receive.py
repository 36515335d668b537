"""Reading a message's frames off a ZeroMQ socket at the cost of its parts, nothing more.

pyzmq's `recv_multipart` asks the socket whether more parts follow (`getsockopt(RCVMORE)`, an
enum conversion in Python per part): at a controller reading thousands of small frames a second
that was half of a frame's cost. Here each part is a `zmq.Frame`, which carries `more` itself,
and a ROUTER's routing identity (always followed by the message) is read as plain bytes.
"""

from __future__ import annotations

import zmq


def recv_parts(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Every part of the next message; raises zmq.Again with `flags=zmq.NOBLOCK` when none waits."""
    frame = sock.recv(flags, copy=False)
    parts = [frame]
    while frame.more:  # the rest of a message is there once its first part is
        frame = sock.recv(copy=False)
        parts.append(frame)
    return parts


def recv_routed(sock: zmq.Socket, flags: int = 0) -> tuple[bytes, list[zmq.Frame]]:
    """(the sender's identity, the message's parts) of the next message on a ROUTER socket."""
    identity = sock.recv(flags)
    return identity, recv_parts(sock)
