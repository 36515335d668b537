"""The controller's receive over real ZeroMQ sockets: a sealed message arrives with its sender's
identity whatever comes around it; a message of one part, or of more parts than [mac, body], is
dropped and counted, and the messages after it are still read whole (no part of one is taken
for another's)."""

from __future__ import annotations

import time

import zmq

from elastic_ep.control.control_plane import ControlPlane
from elastic_ep.wire import ClusterKey, NodeHeartbeat, Progress, RankBeat, rejected_counts


def _receive_all(plane: ControlPlane, n: int, timeout_s: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += plane.receive(0.05)
    return got


def test_odd_frame_counts_are_dropped_and_the_next_message_read_whole():
    key = ClusterKey.generate()
    plane = ControlPlane("127.0.0.1", key)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"an7")
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(plane.health_addr)
    try:
        beat = NodeHeartbeat("n7", "s", [RankBeat(7, 1234, Progress(epoch=1, step=2), 0.05)])
        mac, body = key.seal(beat)
        before = rejected_counts().get(("health", "", "unauthenticated"), 0)
        peer.send_multipart([mac, body])
        peer.send_multipart([body])  # one part
        peer.send_multipart([mac, body, body])  # three parts
        peer.send_multipart([mac, body])
        got = _receive_all(plane, 2)
        time.sleep(0.1)
        got += plane.receive(0.05)
        assert [(g.identity, g.message) for g in got] == [(b"an7", beat), (b"an7", beat)]
        assert rejected_counts().get(("health", "", "unauthenticated"), 0) - before == 2
        assert plane.times.frames_in["health"] == 4
    finally:
        peer.close()
        plane.step_sock.close()
        plane.health_sock.close()
