"""Which backend a request goes to, as pure functions: the same request over the same backends
with the same loads gets the same backend in every router, so routers need not talk.

- Prefix affinity by rendezvous hashing of the prompt's prefix blocks: the prompt's bytes are
  cut into blocks of `block_bytes`, each block's hash chains the one before (so a block hash
  names the whole prefix up to it, as the instances' prefix cache keys KV blocks), and the
  hash of the first `affinity_blocks` blocks is the request's key. Each backend's weight for
  a key is a hash of (key, backend url); backends are tried by falling weight, after the key's
  home (router/placement.py: where the backends say it went, or, for a new key, the backend
  with the fewest, which the hash alone splits unevenly when keys are few). Requests that
  share those first blocks (a system prompt) meet on one backend.
- A `user` is a key of its own (a session's turns share their history, and the backend that
  holds it).
- Load moves a request off its prefix's backend only when the load is clearly uneven (SGLang's
  cache-aware rule): the prefix's first backend in key order takes it unless it would hold more
  than `balance_abs` requests above the least loaded backend and more than `balance_rel` times
  as many. A request moved off its prefix's backend costs a full prefill elsewhere and evicts a
  prefix there, so a small imbalance is cheaper to keep. Then the next backend in key order
  that is not over that line takes it (a prefix spills to the same second backend in every
  router), one whose KV cache is at least `kv_high` full passed over while another is not. KV
  usage never moves a request off its prefix's backend (Dynamo's cost ranks prefix overlap
  above usage): a hit needs few new blocks, and a pool that is really full queues requests,
  which the load rule sees. A saturated backend (see `Limits.saturated`) takes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_BLOCK_BYTES = 64
"""About 16 tokens of English text: the granularity at which prefixes are told apart."""
DEFAULT_AFFINITY_BLOCKS = 8
"""The key covers the first 512 bytes: long enough to tell system prompts apart, short enough
that the varied text after a shared system prompt of that size does not enter the key."""


@dataclass(frozen=True)
class Load:
    """What the router knows of one backend's load: from its /metrics (running, waiting, KV
    usage as a fraction) and the requests this router has open on it (`open_here`)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    open_here: int = 0

    @property
    def requests(self) -> float:
        """Requests on the backend: its own count, or this router's when that is larger (the
        metrics lag by one poll)."""
        return max(self.running + self.waiting, float(self.open_here))


@dataclass(frozen=True)
class Limits:
    """max_open: requests this router keeps open on one backend; max_waiting: a backend whose
    queue (elastic_ep_num_requests_waiting) holds this many takes nothing new (0: no limit)."""

    max_open: int = 64
    max_waiting: int = 0
    balance_abs: int = 8
    """Requests a backend may hold above the least loaded one before load sends its prefix's
    requests elsewhere (SGLang's balance_abs_threshold)."""
    balance_rel: float = 1.5
    """... and the ratio to the least loaded it must pass too (SGLang's balance_rel_threshold)."""
    kv_high: float = 0.95

    def saturated(self, load: Load) -> bool:
        return load.open_here >= self.max_open or (self.max_waiting > 0 and load.waiting >= self.max_waiting)


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def block_hashes(material: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES) -> list[bytes]:
    """The chained hash of every full block of `material`: entry i names material[: (i+1) * block_bytes]."""
    assert block_bytes > 0
    hashes, previous = [], b""
    for start in range(0, len(material) - block_bytes + 1, block_bytes):
        previous = _hash(previous, material[start : start + block_bytes])
        hashes.append(previous)
    return hashes


def prefix_key(
    material: bytes, block_bytes: int = DEFAULT_BLOCK_BYTES, affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS
) -> bytes:
    """The affinity key: the chained hash of the first `affinity_blocks` blocks, or of the whole
    material when it has no full block (a short prompt, which has little to reuse anyway)."""
    hashes = block_hashes(material[: block_bytes * affinity_blocks], block_bytes)
    return hashes[-1] if hashes else _hash(b"short", material)


def user_key(user: str) -> bytes:
    return _hash(b"user", user.encode("utf-8", errors="surrogatepass"))


def prompt_material(route: str, body: dict[str, Any]) -> bytes:
    """The bytes whose prefix names a request: the (first) prompt of a completion, text or token
    ids; a chat's messages before the last one when there are several (the system prompt and
    the history, which the next turns share), else its only message."""
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return b""
        shared = messages[:-1] if len(messages) > 1 else messages
        return "".join(
            f"{m.get('role')}\n{_content(m.get('content'))}\n" for m in shared if isinstance(m, dict)
        ).encode(
            "utf-8", errors="surrogatepass"
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode("utf-8", errors="surrogatepass")
    if isinstance(prompt, list):
        return b"ids:" + json.dumps(prompt).encode()
    return b""


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def rendezvous_order(key: bytes, urls: Sequence[str]) -> list[str]:
    """`urls` by falling weight for `key` (highest random weight): the same order in every
    router, and removing a url leaves the others' order as it was."""
    return sorted(urls, key=lambda url: (_hash(key, url.encode()), url), reverse=True)


def choose(order: Sequence[str], loads: dict[str, Load], limits: Limits) -> str | None:
    """The backend for a request whose backends in key order are `order` (all ready), or None
    when every one is saturated.

    The first in order that is not saturated takes it unless it is over the balance line (see
    the module docstring: with this request, more than `balance_abs` requests above the least
    loaded and more than `balance_rel` times as many); then the next one in order under the line
    (with KV room, when one has), else the least loaded (first in order on a tie).
    """
    open_ = [u for u in order if not limits.saturated(loads[u])]
    if not open_:
        return None
    least = min(loads[u].requests for u in open_)

    def over(url: str) -> bool:
        after = loads[url].requests + 1
        return after - least > limits.balance_abs and after > limits.balance_rel * least

    if not over(open_[0]):
        return open_[0]
    under = [u for u in open_[1:] if not over(u)]
    roomy = [u for u in under if loads[u].kv_usage < limits.kv_high] or under
    if roomy:
        return roomy[0]
    return min(open_, key=lambda u: loads[u].requests)
