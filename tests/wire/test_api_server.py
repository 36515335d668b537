"""The frames between API server processes and the controller's (wire/api_server.py): a step's
outputs for one server in columns, sent by the control thread's `ServerSockets` and read back
whole; columns that do not line up are named by `check`."""

from __future__ import annotations

import zmq

from elastic_ep.control.facade import api_bridge
from elastic_ep.control.facade.api_bridge import ServerSockets
from elastic_ep.model.sampling import TokenLogprobs
from elastic_ep.wire import ClusterKey, Inbox
from elastic_ep.wire.api_server import StreamOutputs, tokens_address


def test_a_steps_outputs_reach_their_server_in_one_frame(tmp_path):
    key = ClusterKey.generate()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(tokens_address(tmp_path, 1))
    sockets = ServerSockets(ctx, key, tmp_path, count=2)
    lps = [TokenLogprobs(-0.5, ((9, -0.5), (3, -1.0)))]
    frame = StreamOutputs([50, 60, 70], [2, 1, 0], [7, 8, 9], [(1, "stop"), (2, "error")], [(2, "rank 2 failed")],
                          [(1, lps)])
    try:
        assert sockets.send(1, frame)
        assert not sockets.send(2, StreamOutputs([80], [1], [1]))  # no such server
        assert pull.poll(5000)
        msg = Inbox("api_tokens", StreamOutputs, key).read(pull.recv_multipart(copy=False))
    finally:
        sockets.close()
        pull.close(0)
        ctx.term()
    assert msg == frame
    assert msg.check() is None


def test_columns_that_do_not_line_up_are_named():
    assert StreamOutputs([1, 2], [1], [5]).check() == "counts do not match the keys and tokens"
    assert StreamOutputs([1], [2], [5]).check() == "counts do not match the keys and tokens"
    assert StreamOutputs([1], [-1], []).check() == "counts do not match the keys and tokens"
    assert StreamOutputs([1], [1], [5], finished=[(1, "stop")]).check() == "an index past the keys"
    assert StreamOutputs([], [], []).check() is None


def test_a_server_that_reads_nothing_is_given_up_at_the_high_water_mark(tmp_path, monkeypatch):
    """The control thread never blocks on a server: past TOKEN_HWM unread steps a send fails
    (the streams then abort that server's requests)."""
    monkeypatch.setattr(api_bridge, "TOKEN_HWM", 100)
    ctx = zmq.Context()
    sockets = ServerSockets(ctx, ClusterKey.generate(), tmp_path, count=1)  # nobody binds tokens-0.sock
    try:
        sent = 0
        while sent < 1000 and sockets.send(0, StreamOutputs([10], [1], [7])):
            sent += 1
    finally:
        sockets.close()
        ctx.term()
    assert 100 <= sent < 1000
