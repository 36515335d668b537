"""Which backend is a prefix's home, as pure functions over what the backends say they were sent.

Rendezvous hashing alone (router/scoring.py) splits few prefixes unevenly: 8 system prompts
over 4 instances came out 5/2/1/0 in one run, so one instance was given more prompts than its
KV pool caches while another had none. Here a prefix is placed once and then stays:

- Every request carries its affinity key to the backend (`X-Elastic-EP-Prefix-Key`); serve
  counts the requests of each key (serve/prefix_keys.py) and the router reads the counts at
  every poll. A key's home is the ready backend that was sent it most (ties: first in the key's
  rendezvous order), so a request that load moved elsewhere does not move the home, and every
  router reading the same backends finds the same home.
- A key no ready backend reports goes to the backend with the fewest keys at home among those
  seen within `live_s` (SGLang's cache-aware router sends an unmatched prefix to the worker with
  the smallest tree), first in the key's rendezvous order on a tie: two routers that read the
  same backends place it alike. Until a poll reads it back, the router remembers where it put
  it (`Placements`), so the prefix's next requests follow it.
- What two routers can still disagree on: a new key both place within one poll interval while
  their views of the counts differ. Both backends then report it, and at the next poll both
  routers take the one sent it most; the other's copy is a prefill spent once.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic_ep.router.scoring import rendezvous_order

DEFAULT_LIVE_S = 60.0
"""A key seen within this long counts toward its home's share when a new key is placed: one
gone quiet for longer is taken to be on its way out of the instance's LRU cache, not to hold
room there (a count, not a decayed weight, so that two routers polling at different moments
count alike)."""


@dataclass(frozen=True)
class KeySeen:
    """What one backend said of one key: requests it was sent with it, seconds since the last."""

    requests: int
    age_s: float


def homes(reports: Mapping[str, Mapping[bytes, KeySeen]], live_s: float) -> tuple[dict[bytes, str], Counter]:
    """(the home of every reported key, live keys at home per backend) from each ready backend's
    report (url -> key -> KeySeen). The home: the backend sent the key most, first in the key's
    rendezvous order on a tie; a key counts toward its home's share while some backend saw it
    within live_s."""
    holders: dict[bytes, list[tuple[str, KeySeen]]] = {}
    for url, keys in reports.items():
        for key, seen in keys.items():
            holders.setdefault(key, []).append((url, seen))
    home_of, live = {}, Counter()
    for key, held in holders.items():
        if len(held) == 1:
            url = held[0][0]
        else:
            most = max(seen.requests for _, seen in held)
            url = rendezvous_order(key, [u for u, seen in held if seen.requests == most])[0]
        home_of[key] = url
        if min(seen.age_s for _, seen in held) < live_s:
            live[url] += 1
    return home_of, live


def place_new(order: Sequence[str], live: Mapping[str, int]) -> str:
    """The home of a key no backend holds: of `order` (the candidates in the key's rendezvous
    order), the one with the fewest live keys at home, the first on a tie."""
    fewest = min(live.get(url, 0) for url in order)
    return next(url for url in order if live.get(url, 0) == fewest)


class Placements:
    """The keys this router placed that no poll has read back yet (key -> url, when), bounded;
    `forget_reported` drops those the backends now report and those older than `live_s`."""

    def __init__(self, capacity: int = 65536, live_s: float = DEFAULT_LIVE_S, clock=time.monotonic):
        self.capacity = capacity
        self.live_s = live_s
        self.clock = clock
        self._placed: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self.live: Counter = Counter()
        """Keys per url among those placed here and not yet reported."""

    def get(self, key: bytes) -> str | None:
        placed = self._placed.get(key)
        return placed[0] if placed else None

    def put(self, key: bytes, url: str) -> None:
        old = self._placed.pop(key, None)
        if old is not None:
            self.live[old[0]] -= 1
        self._placed[key] = (url, self.clock())
        self.live[url] += 1
        while len(self._placed) > self.capacity:
            gone, _ = self._placed.popitem(last=False)[1]
            self.live[gone] -= 1

    def forget_reported(self, reported: Mapping[bytes, str]) -> None:
        oldest_s = self.clock() - self.live_s
        for key in [k for k, (_, t) in self._placed.items() if k in reported or t < oldest_s]:
            url, _ = self._placed.pop(key)
            self.live[url] -= 1
        self.live = +self.live


def parse_report(body: object) -> dict[bytes, KeySeen]:
    """GET /prefix_keys's answer as key -> KeySeen; entries that are not (hex key, requests,
    age) are skipped, and an answer that is not such a list is no report."""
    keys = body.get("keys") if isinstance(body, dict) else None
    report = {}
    for entry in keys if isinstance(keys, list) else []:
        try:
            key, requests, age_s = entry
            report[bytes.fromhex(key)] = KeySeen(int(requests), float(age_s))
        except (TypeError, ValueError):
            continue
    return report
