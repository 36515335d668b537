"""The prefix keys this instance was sent: each router in front of it names a request's prefix
(router/scoring.py's affinity key, hex) in the `X-Elastic-EP-Prefix-Key` header, this instance
counts the requests of each key, and GET /prefix_keys (serve/admin.py) lists them, so that
every router reads where each prefix went and places it alike (router/placement.py). The
router imports the header's name from here: nothing here loads torch.

Bounded: the `capacity` most recently seen keys are kept, least recently seen forgotten first.
A header that is not a key (a client's own, malformed) is ignored: it names no prefix and
changes nothing but its own entry.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

HEADER = "x-elastic-ep-prefix-key"
DEFAULT_CAPACITY = 4096
_KEY = re.compile(r"[0-9a-f]{32}")


@dataclass
class _Seen:
    requests: int
    last_s: float


def is_prefix_key(key: str | None) -> bool:
    """Whether a header value is a prefix key (others are not counted)."""
    return key is not None and _KEY.fullmatch(key) is not None


class KeyRecorder(Protocol):
    def record(self, key: str | None) -> None:
        """A generation request sent with this header value (None: without one)."""


class PrefixKeys:
    """Requests and last time seen (monotonic) per key, the `capacity` most recent keys."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock=time.monotonic):
        self.capacity = capacity
        self.clock = clock
        self._keys: OrderedDict[str, _Seen] = OrderedDict()
        self._lock = threading.Lock()  # behind API server processes the bridge's thread records them

    def record(self, key: str | None) -> None:
        if not is_prefix_key(key):
            return
        with self._lock:
            now = self.clock()
            seen = self._keys.pop(key, None) or _Seen(0, now)
            seen.requests, seen.last_s = seen.requests + 1, now
            self._keys[key] = seen
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def view(self) -> list[tuple[str, int, float]]:
        """(key, requests, seconds since the last), most recent last."""
        with self._lock:
            now = self.clock()
            return [(k, s.requests, round(now - s.last_s, 3)) for k, s in self._keys.items()]


class PrefixKeysResponse(BaseModel):
    keys: list[tuple[str, int, float]]
    """(key in hex, requests sent with it, seconds since the last one), most recent last."""
    capacity: int
