"""A fuzzer of the control plane: hostile frames sent to every socket a deployment binds (the
controller's step and health sockets, each agent's fetch socket), as `harness/fuzz.py` does
for the HTTP API. Each kind of frame is one a socket must drop without harm:

- `junk`: random bytes, one or several frames, and the bytes `b"\\x00\\x01not a pickle"`;
- `pickle`: a pickle whose `__reduce__` runs `os.system` (writes `marker` if it ever runs);
- `truncated`: a valid frame of a message of that socket, cut short (MAC of the cut body);
- `wrong_type`: a valid, authenticated message of another socket or direction;
- `unauthenticated`: a valid message of that socket under another key, or without a MAC;
- `huge`: a frame of `huge_bytes` random bytes;
- `flood`: `flood_frames` junk frames as fast as the socket takes them.

The frames with a valid MAC need the deployment's key (`key`); none of them is a message the
socket acts on, so a deployment that drops them serves on exactly as before.
"""

from __future__ import annotations

import os
import pickle
import random
from collections import Counter
from collections.abc import Iterator

import numpy as np
import zmq

from elastic_ep.model.sampling import SamplingParams
from elastic_ep.wire import (
    AbortEpoch,
    AgentAlive,
    BackupFetch,
    ChunkPlan,
    ClusterKey,
    DenseTensors,
    EpochReady,
    Heartbeat,
    NodeHeartbeat,
    NodeStepResults,
    Progress,
    RankBeat,
    Shutdown,
    StepPlan,
    StepResult,
    encode,
)

JUNK = b"\x00\x01not a pickle"
KINDS = ("junk", "pickle", "truncated", "wrong_type", "unauthenticated", "huge", "flood")


class _RunsCode:
    """Unpickled, it runs a shell command: what a crafted frame did to the pickle codec."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def evil_pickle(marker: str) -> bytes:
    return pickle.dumps(_RunsCode(marker))


def _valid_of(socket: str) -> object:
    """A message that `socket` takes (truncated or sealed under another key, it must still be dropped)."""
    if socket == "step":
        return StepResult(0, 0, 0, {}, 0.0, 0.0, 0.0, 0.0, np.zeros((2, 4), np.int64), 0, {})
    if socket == "health":
        return NodeHeartbeat("x", "y", [RankBeat(0, 1, Progress(), 0.0)])
    return BackupFetch([(0, 0)])


def _wrong_for(socket: str) -> list[object]:
    """Valid messages that `socket` does not take: other directions and other sockets."""
    plan = StepPlan(0, 0, [ChunkPlan(0, [1, 2, 3], 0, True, SamplingParams(), 0, 3)], [])
    common = [plan, Shutdown(), AbortEpoch(0), DenseTensors({})]
    if socket == "step":
        return [*common, Heartbeat(0, 1, Progress()), AgentAlive("x", "y"), BackupFetch([(0, 0)]),
                NodeStepResults("x", "y", 0, 0, *[[]] * 12)]
    if socket == "health":  # a worker's heartbeat goes to its agent, never here
        return [*common, Heartbeat(0, 1, Progress()), EpochReady(0, 0, {}, {}, [], 0.0, 0.0, 0.0),
                BackupFetch([(0, 0)])]
    return [*common, Heartbeat(0, 1, Progress()), EpochReady(0, 0, {}, {}, [], 0.0, 0.0, 0.0)]


def frames(kind: str, socket: str, key: ClusterKey, marker: str, rng: random.Random,
           huge_bytes: int = 4 << 20, flood_frames: int = 2000) -> Iterator[list[bytes]]:
    """The messages (each a list of ZeroMQ frames, after any envelope) of one `kind` for `socket`
    ("step", "health" or "fetch")."""
    if kind == "junk":
        yield [JUNK]
        yield [key.mac(JUNK), JUNK]
        for _ in range(20):
            yield [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 4))]
    elif kind == "pickle":
        body = evil_pickle(marker)
        yield [body]
        yield [key.mac(body), body]  # even with the key, a pickle is not a message
    elif kind == "truncated":
        body = encode(_valid_of(socket))
        for cut in sorted({1, len(body) // 2, len(body) - 1}):
            yield [key.mac(body[:cut]), body[:cut]]
    elif kind == "wrong_type":
        for message in _wrong_for(socket):
            yield key.seal(message)
    elif kind == "unauthenticated":
        body = encode(_valid_of(socket))
        yield ClusterKey.generate().seal(_valid_of(socket))
        yield [body]
        yield [b"\x00" * 32, body]
    elif kind == "huge":
        body = rng.randbytes(huge_bytes)
        yield [key.mac(body), body]
        yield [body]
    elif kind == "flood":
        for _ in range(flood_frames):
            yield [JUNK]
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def fuzz_socket(addr: str, socket: str, key: ClusterKey, marker: str, seed: int = 0,
                kinds: tuple[str, ...] = KINDS, timeout_s: float = 30.0) -> Counter[str]:
    """Send every kind of frame to the socket at `addr` (tcp://HOST:PORT), each kind from its own
    DEALER (a peer of its own), as a REQ would for the fetch socket (an empty delimiter first).
    A kind stops once the socket takes nothing for `timeout_s` (it disconnected the peer: a
    frame over its size limit). Returns messages sent per kind, and `blocked` per kind stopped so."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sent: Counter[str] = Counter()
    for kind in kinds:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.connect(addr)
        try:
            for message in frames(kind, socket, key, marker, rng):
                sock.send_multipart([b"", *message] if socket == "fetch" else message)
                sent[kind] += 1
        except zmq.Again:
            sent["blocked"] += 1
        finally:
            sock.close()
    return sent


def fuzz_deployment(cluster: dict, key: ClusterKey, marker: str, seed: int = 0,
                    kinds: tuple[str, ...] = KINDS) -> dict[str, Counter[str]]:
    """Every socket of a deployment, from its /cluster JSON (`listening`, `agents[].fetch`):
    socket name -> messages sent per kind."""
    targets = {"step": cluster["listening"]["step"], "health": cluster["listening"]["health"]}
    targets |= {f"fetch:{a['node']}": a["fetch"] for a in cluster["agents"]}
    return {name: fuzz_socket(addr, name.split(":")[0], key, marker, seed, kinds)
            for name, addr in targets.items()}
