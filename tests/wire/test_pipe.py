"""The agent's channel to its workers (wire/pipe.py): a sealed `NewLeader` written to a pipe is read
back through an Inbox and raises the reader's term fence, so an older leader's frames are dropped
from then on; a frame past the size limit, a truncated one or the pipe's end reads as the end."""

from __future__ import annotations

import io
import os

from elastic_ep.wire import AGENT_TO_WORKER, ClusterKey, Inbox, NewLeader, TermFence, WorkerLaunch, rejected_counts
from elastic_ep.wire.pipe import MAX_PIPE_FRAME_BYTES, read_message, write_message

KEY = ClusterKey.generate()
LAUNCH = WorkerLaunch("/m", "tcp://10.0.0.2:1", "tcp://10.0.0.2:2", "10.0.0.2", 3, "gloo", 4, 64, 0.1)


def test_a_new_leader_read_from_the_pipe_raises_the_term_fence():
    r, w = os.pipe()
    with os.fdopen(r, "rb") as reader, os.fdopen(w, "wb") as writer:
        fence = TermFence()
        inbox = Inbox("worker_agent", AGENT_TO_WORKER, KEY, "pipe-node", fence)
        write_message(writer, KEY.seal(NewLeader(LAUNCH), 9))
        write_message(writer, KEY.seal(NewLeader(LAUNCH), 8))  # an older leader's, late
        msg = inbox.read(read_message(reader))
        assert msg == NewLeader(LAUNCH) and fence.highest == 9
        assert inbox.read(read_message(reader)) is None
        assert rejected_counts()[("worker_agent", "pipe-node", "stale_term")] == 1
        writer.close()
        assert read_message(reader) is None  # the agent closed it


def test_an_oversized_or_truncated_frame_ends_the_pipe():
    assert read_message(io.BytesIO((MAX_PIPE_FRAME_BYTES + 1).to_bytes(4, "big") + b"x" * 10)) is None
    assert read_message(io.BytesIO((10).to_bytes(4, "big") + b"short")) is None
    assert read_message(io.BytesIO(b"\x00\x00")) is None
