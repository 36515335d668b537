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

`fuzz_forged` goes further, as a peer holding the key but sending nonsense would (a bug, an old
version): authenticated messages of the socket's own types, every field drawn at random from
values that stress handlers (negative and huge ids, NaN, empty and long strings, real node names).
Some are acted on by design (a hello from a new node registers it; one naming a real node under a
new session takes the node over); the deployment must never stop, and serves again once they end.
"""

from __future__ import annotations

import math
import os
import pickle
import random
import typing
from collections import Counter
from collections.abc import Iterator

import msgspec.inspect as mi
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


_INTS = (-1, 0, 1, 2, 3, 5, 7, 255, 2**31, -(2**40), 10**12)
_FLOATS = (0.0, -1.0, 1e-9, 1e9, math.nan, math.inf, -math.inf, 0.5)
_STRS = ("", "node0", "n1", "x" * 300, "\x00", "tcp://127.0.0.1:1", "initial", "recover", "adopt", "cpu", "cuda:0")


def _random_value(t: mi.Type, rng: random.Random, depth: int = 0) -> object:
    """A value of msgspec type `t` (msgspec.inspect), drawn from values that stress handlers."""
    if isinstance(t, mi.IntType):
        return rng.choice(_INTS)
    if isinstance(t, mi.FloatType):
        return rng.choice(_FLOATS)
    if isinstance(t, mi.StrType):
        return rng.choice(_STRS)
    if isinstance(t, mi.BoolType):
        return rng.random() < 0.5
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.UnionType):
        return _random_value(rng.choice(t.types), rng, depth)
    if isinstance(t, mi.LiteralType):
        return rng.choice(t.values)
    if isinstance(t, mi.EnumType):
        return rng.choice(list(t.cls))
    if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        return [_random_value(t.item_type, rng, depth + 1) for _ in range(0 if depth > 2 else rng.choice((0, 1, 2, 5)))]
    if isinstance(t, mi.TupleType):
        return tuple(_random_value(item, rng, depth + 1) for item in t.item_types)
    if isinstance(t, mi.DictType):
        return {_random_value(t.key_type, rng, depth + 1): _random_value(t.value_type, rng, depth + 1)
                for _ in range(0 if depth > 2 else rng.choice((0, 1, 2)))}
    if isinstance(t, mi.StructType):
        return t.cls(**{f.name: _random_value(f.type, rng, depth + 1) for f in t.fields})
    if isinstance(t, mi.CustomType) and t.cls is np.ndarray:
        return np.zeros(rng.choice(((0,), (1,), (2, 3), (3, 2, 1))), dtype=rng.choice((np.int64, np.int32)))
    raise TypeError(f"no random value for {t}")


def random_message(union: object, rng: random.Random) -> object | None:
    """A message of one of the types of `union` with random fields; None when 100 draws of the type
    picked all fail its own checks (`__post_init__`)."""
    info = mi.type_info(rng.choice(typing.get_args(union)))
    for _ in range(100):
        try:
            return info.cls(**{f.name: _random_value(f.type, rng) for f in info.fields})
        except (ValueError, TypeError):
            continue
    return None


def fuzz_forged(addr: str, union: object, key: ClusterKey, count: int, seed: int = 0) -> Counter[str]:
    """`count` authenticated messages of `union`'s types with random fields (`random_message`) to
    the socket at `addr`, each from a peer of its own. Returns messages sent per type."""
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sent: Counter[str] = Counter()
    for _ in range(count):
        message = random_message(union, rng)
        if message is None:
            continue
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(addr)
        sock.send_multipart(key.seal(message))
        sock.close()
        sent[type(message).__name__] += 1
    return sent

