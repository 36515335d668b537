"""Sealed frames over a pipe: how an agent speaks to the workers it started (their stdin).

Each frame is its length (4 bytes, big-endian) then its bytes; a message is its two frames
[head, body] as `ClusterKey.seal` makes them, read back through an `Inbox` like a socket's. Only
the agent holds the pipe's other end, yet what comes out of it is checked the same way.
"""

from __future__ import annotations

from typing import BinaryIO

MAX_PIPE_FRAME_BYTES = 1 << 20  # a launch spec is a few hundred bytes: anything bigger is not ours


def write_message(pipe: BinaryIO, frames: list[bytes]) -> None:
    """Write `frames` (a sealed message) and flush. Raises OSError when the reader is gone."""
    pipe.write(b"".join(len(f).to_bytes(4, "big") + f for f in frames))
    pipe.flush()


def read_message(pipe: BinaryIO, count: int = 2) -> list[bytes] | None:
    """The next `count` frames, or None at the end of the pipe (the agent closed it, or it sent a
    frame over MAX_PIPE_FRAME_BYTES, after which nothing on the pipe can be framed again)."""
    frames = []
    for _ in range(count):
        head = pipe.read(4)
        if len(head) < 4:
            return None
        size = int.from_bytes(head, "big")
        if size > MAX_PIPE_FRAME_BYTES:
            return None
        body = pipe.read(size)
        if len(body) < size:
            return None
        frames.append(body)
    return frames
