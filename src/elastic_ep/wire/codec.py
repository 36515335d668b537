"""The codec of every socket: typed msgpack (msgspec), every frame authenticated by the
deployment's cluster key.

A message is two ZeroMQ frames, `[head, body]`: `body` is the msgpack of one `Message` (a msgspec
struct tagged with its class name), `head` the HMAC-SHA256 under the cluster key of the sender's
term and the body, followed by that term (8 bytes, big-endian). The term is the fencing token of a
controller group (serve --etcd, group/election.py): a controller seals with the term it leads in (0
outside a group), agents and workers with the highest they have seen. The receiving side of a socket
is an `Inbox` that accepts one union of messages: the MAC is checked before the body is read at all,
then the body decodes into exactly one of the union's types (field types checked; numpy arrays and
torch tensors as raw bytes with dtype and shape, never pickled objects). Anything else is dropped
and counted by (socket, node, reason), and logged once per peer address: a stray or hostile frame
never raises into the loop that reads it.

Reasons: `unauthenticated` (not two frames, or a MAC that is not the cluster key's: a peer
without the key, another deployment, a port scanner), `undecodable` (authenticated, but not a
message of this version), `unexpected` (a valid message that this socket does not take: the
wrong direction or the wrong socket), `stale_term` (authenticated, from a controller whose term
is below the highest this process has seen: a deposed or partitioned old leader; only on the
sockets of agents and workers, whose Inboxes share one `TermFence` per process), `invalid` (a
message that decodes but that its reader cannot take: a node's results of a rank not of that node,
an expert load not of the model's shape; counted by the reader, `reject_invalid`).
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import secrets
import stat
import threading
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import torch

logger = logging.getLogger(__name__)

KEY_ENV = "ELASTIC_EP_CLUSTER_KEY"  # hex; how an agent hands the key to the workers it starts
KEY_BYTES = 32
HMAC_BYTES = 32
TERM_BYTES = 8
MAC_BYTES = HMAC_BYTES + TERM_BYTES  # the head frame: HMAC, then the sender's term
REASONS = ("unauthenticated", "undecodable", "unexpected", "stale_term", "invalid")

# Field types whose domain the decoder checks: a frame with a value outside it is undecodable,
# dropped and counted, before any handler sees it (a registration naming rank -1 had made a rank
# of it; the stand-in ranks' pids are as positive as real ones).
RankId = Annotated[int, msgspec.Meta(ge=0)]
Pid = Annotated[int, msgspec.Meta(ge=1)]
Count = Annotated[int, msgspec.Meta(ge=0)]
JoinMode = Literal["initial", "recover", "adopt"]
StartedBy = Literal["exec", "fork"]  # a worker's process: a new Python, or forked from its node's zygote
# an agent's zygote (node/zygote.py): ready (ranks fork), starting (importing; ranks start by exec
# meanwhile), down (it died or could not start; by exec until a new one is ready), off (--worker-start exec)
ZygoteState = Literal["ready", "starting", "down", "off"]


class Message(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A message of one socket; its tag on the wire is its class name."""


class Record(msgspec.Struct, frozen=True, array_like=True):
    """A typed part of a message (untagged)."""


class ClusterKeyError(ValueError):
    """A cluster key file that cannot be used; the message says what to do."""


class ClusterKey:
    """The secret every controller, agent and worker of one deployment shares."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ClusterKeyError(f"a cluster key needs at least 16 bytes, got {len(secret)}")
        self._secret = secret
        self._keyed = hmac.new(secret, digestmod="sha256")  # copied per frame: the key is not scheduled again

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> ClusterKey:
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError:
            raise ClusterKeyError("a cluster key is hex digits (as `elastic-ep serve` writes it)") from None

    @classmethod
    def read(cls, path: str | Path) -> ClusterKey:
        """The key in file `path`, which only its owner may read (like an ssh key)."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
            text = path.read_text()
        except OSError as e:
            raise ClusterKeyError(f"cannot read the cluster key file {path}: {e.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ClusterKeyError(f"the cluster key file {path} is open to other users (mode {stat.S_IMODE(mode):o}); "
                                  f"run `chmod 600 {path}`")
        try:
            return cls.from_hex(text)
        except ClusterKeyError as e:
            raise ClusterKeyError(f"{path}: {e}") from None

    def write(self, path: str | Path) -> None:
        """Write the key to a new file only its owner can read (mode 0600)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._secret.hex() + "\n")

    def hex(self) -> str:
        return self._secret.hex()

    def mac(self, body: bytes | memoryview, term: int = 0) -> bytes:
        """The head frame of `body` sent in `term`: HMAC(term, body), then the term."""
        t = term.to_bytes(TERM_BYTES, "big")
        h = self._keyed.copy()  # thread-safe: the keyed state is only read
        h.update(t)
        h.update(body)
        return h.digest() + t

    def seal(self, message: Message, term: int = 0) -> list[bytes]:
        """The two frames of `message` sent in `term`: [head, body]."""
        body = encode(message)
        return [self.mac(body, term), body]

    def __repr__(self) -> str:  # never the secret itself, in a log or a traceback
        return "ClusterKey(...)"


class TermFence:
    """The highest controller term this process has seen; a frame of a lower term is stale. Shared by
    every Inbox of an agent or a worker (their threads read concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.highest = 0

    def admit(self, term: int) -> bool:
        """Whether a frame of `term` may be acted on; a higher term becomes the highest."""
        with self._lock:
            if term < self.highest:
                return False
            self.highest = term
            return True


def key_from_env(environ: dict[str, str] | None = None) -> ClusterKey:
    """The key an agent handed this worker (`KEY_ENV`), removed from the environment so that
    nothing this process starts inherits it."""
    environ = os.environ if environ is None else environ
    text = environ.pop(KEY_ENV, "")
    if not text:
        raise ClusterKeyError(f"no cluster key in ${KEY_ENV}: a worker is started by its node's agent")
    return ClusterKey.from_hex(text)


# ---- tensors as raw bytes --------------------------------------------------------------

_NUMPY_DTYPES = {name: np.dtype(name) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64")}
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16,
    torch.float32, torch.float64)}


def narrow_int(largest: int) -> np.dtype:
    """The integer type an array travels in when its values are at most `largest`: int16 where they
    fit (a quarter of int64's bytes), else int32."""
    return np.dtype(np.int16 if largest <= np.iinfo(np.int16).max else np.int32)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return (a.dtype.name, list(a.shape), a.data.cast("B") if a.size else b"")
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
        return (str(t.dtype).removeprefix("torch."), list(t.shape), data)
    raise NotImplementedError(f"{type(obj).__name__} has no wire form")


def _raw_tensor(obj: Any, dtypes: dict) -> tuple[Any, list[int], bytes]:
    """(dtype, shape, data) of an encoded array, checked: a known dtype, and exactly the bytes
    the shape needs."""
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ValueError("an array is [dtype, shape, data]")
    name, shape, data = obj
    if name not in dtypes or not isinstance(data, bytes) or not isinstance(shape, list) \
            or not all(isinstance(n, int) and 0 <= n for n in shape):
        raise ValueError("an array needs a known dtype, a shape of counts and its bytes")
    dtype = dtypes[name]
    itemsize = dtype.itemsize
    if math.prod(shape) * itemsize != len(data):
        raise ValueError(f"shape {shape} of {name} needs {math.prod(shape) * itemsize} bytes, got {len(data)}")
    return dtype, shape, data


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = _raw_tensor(obj, _NUMPY_DTYPES)
        if not data:  # most ranks' expert load in most steps: no buffer to read or copy
            return np.empty(tuple(shape), dtype)
        return np.frombuffer(data, dtype).reshape(shape).copy()
    if kind is torch.Tensor:
        dtype, shape, data = _raw_tensor(obj, _TORCH_DTYPES)
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    raise NotImplementedError(f"no wire form for {kind.__name__}")


def encode(message: Message) -> bytes:
    """The msgpack body of `message` (no MAC: `ClusterKey.seal` makes the frames)."""
    return msgspec.msgpack.encode(message, enc_hook=_enc_hook)


def decoder(accepts: Any) -> msgspec.msgpack.Decoder:
    """A decoder of exactly the messages of `accepts` (a Message type or a union of them)."""
    return msgspec.msgpack.Decoder(accepts, dec_hook=_dec_hook)


# ---- rejected frames -------------------------------------------------------------------

_lock = threading.Lock()
_rejected: Counter[tuple[str, str, str]] = Counter()  # (socket, node, reason) -> frames
_logged: set[tuple[str, str, str]] = set()
_MAX_LOGGED_PEERS = 256  # past this many peers, rejections are only counted


def rejected_counts() -> dict[tuple[str, str, str], int]:
    """Frames this process dropped: (socket, node, reason) -> count."""
    with _lock:
        return dict(_rejected)


def _reject(socket: str, node: str, reason: str, peer: str, detail: str) -> None:
    with _lock:
        _rejected[socket, node, reason] += 1
        first = (socket, node, peer) not in _logged and len(_logged) < _MAX_LOGGED_PEERS
        if first:
            _logged.add((socket, node, peer))
    if first:
        logger.warning("%s socket%s: dropped a frame from %s: %s (%s); further frames of this peer are only "
                       "counted (elastic_ep_control_frames_rejected_total)", socket,
                       f" of node {node}" if node else "", peer, reason, detail)


def reject_invalid(socket: str, node: str, sender: str, detail: str) -> None:
    """A message read from `socket` was dropped by its reader (`detail` says why), counted as
    `invalid` under `node`; `sender` names the peer in the log (once)."""
    _reject(socket, node, "invalid", sender, detail)


def peer_address(frame: Any) -> str:
    """The IP address of the peer that sent `frame` (a zmq.Frame), or "unknown"."""
    try:
        return frame.get("Peer-Address") or "unknown"
    except Exception:  # bytes, or a transport without the property (inproc)
        return "unknown"


def _message_type(tag: str) -> type | None:
    """The Message class whose tag is `tag`, among every one defined."""
    todo, seen = [Message], {}
    while todo:
        for cls in todo.pop().__subclasses__():
            seen[cls.__name__] = cls
            todo.append(cls)
    return seen.get(tag)


def _decodes_as_any(body: Any) -> str | None:
    """The type name of `body` if it is a valid message of some socket (any error: None)."""
    try:
        raw = msgspec.msgpack.decode(body)
        cls = _message_type(raw[0]) if isinstance(raw, list) and raw and isinstance(raw[0], str) else None
        return type(decoder(cls).decode(body)).__name__ if cls is not None else None
    except Exception:  # noqa: BLE001 - whatever fails to decode is not a message
        return None


class Inbox:
    """The receiving side of one socket: `read(frames)` is the message, or None for a frame
    that was dropped (counted under `socket` and `node`, logged once per peer). `fence`: on the
    sockets of agents and workers, the process's TermFence (frames of a lower term are dropped);
    `term` is the term of the last frame read."""

    def __init__(self, socket: str, accepts: Any, key: ClusterKey, node: str = "", fence: TermFence | None = None):
        self.socket = socket
        self.node = node
        self.key = key
        self.fence = fence
        self.term = 0
        self._decoder = decoder(accepts)

    def read(self, frames: list[Any]) -> Any | None:
        """`frames`: the message's frames after any routing envelope (bytes or zmq.Frame)."""
        body = self.admit(frames)
        if body is None:
            return None
        try:
            return self._decoder.decode(body)
        except Exception as e:  # noqa: BLE001 - a frame that fails to decode, however, is dropped
            other = _decodes_as_any(body)
            if other is not None:
                self._reject(frames, "unexpected", f"{other} is not a message of this socket")
            else:
                self._reject(frames, "undecodable", str(e)[:200])
            return None

    def admit(self, frames: list[Any]) -> Any | None:
        """The body of `frames` when they carry a valid MAC of the cluster key and a term the fence
        admits, else None (dropped and counted): what a relay checks before passing frames on as
        they came, without decoding them."""
        if len(frames) != 2:
            self._reject(frames, "unauthenticated", f"{len(frames)} frames, not [mac, body]")
            return None
        head, body = (f.buffer if hasattr(f, "buffer") else f for f in frames)
        term = int.from_bytes(head[HMAC_BYTES:], "big") if len(head) == MAC_BYTES else 0
        if len(head) != MAC_BYTES or not hmac.compare_digest(self.key.mac(body, term), head):
            self._reject(frames, "unauthenticated", "no valid MAC of this deployment's cluster key")
            return None
        if self.fence is not None and not self.fence.admit(term):
            self._reject(frames, "stale_term", f"term {term} is below {self.fence.highest}: a deposed controller")
            return None
        self.term = term
        return body

    def _reject(self, frames: list[Any], reason: str, detail: str) -> None:
        count_dropped(self.socket, self.node, reason, frames, detail)


def count_dropped(socket: str, node: str, reason: str, frames: list[Any], detail: str) -> None:
    """A frame of `socket` dropped for `reason` (one of REASONS): counted, logged once per peer."""
    _reject(socket, node, reason, peer_address(frames[-1]) if frames else "unknown", detail)
