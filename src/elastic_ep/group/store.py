"""The group's etcd, through its v3 JSON gateway (the `etcd3gw` client: plain HTTP, no grpc or
protobuf to clash with OpenTelemetry's). Every call is bounded by `timeout_s`; any failure to reach
etcd or an answer it cannot make is `EtcdUnavailable`, which callers treat as "etcd unreachable
now" (the election steps down on it once its lease can have run out).

Keys of group G: `/elastic-ep/G/leader` (the leader's `Seat`, under its lease: the key's create
revision is the leader's term), `/elastic-ep/G/members/<name>` (each controller's `Seat`, under its
own lease)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from urllib.parse import urlsplit

import etcd3gw
import msgspec
import requests
from etcd3gw import exceptions as etcd_errors


class EtcdUnavailable(Exception):
    """etcd could not be reached or did not answer in time; the message says which URL and why."""


class Seat(msgspec.Struct, frozen=True):
    """What a controller of the group says of itself in etcd. name: its --node; http: its HTTP
    URL (clients and the router); controller: its health socket (agents connect there; "" until
    its controller is up); role: leader, standby or starting; journal_seq: the last journal batch
    it holds (standbys) or shipped (the leader); journal: its journal socket, which standbys follow
    while it leads (serve --ha-journal-via direct; "" on the etcd path)."""

    name: str
    http: str
    controller: str = ""
    role: str = "standby"
    journal_seq: int = 0
    journal: str = ""

    @property
    def journal_via(self) -> str:
        """Its --ha-journal-via: direct controllers name their journal socket from the start."""
        return "direct" if self.journal else "etcd"


@dataclass(frozen=True)
class Held:
    """A key as etcd holds it: `create_revision` (never reused: a key deleted and made again gets a
    higher one), `lease` (0: none)."""

    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _held(kv: dict) -> Held:
    return Held(base64.b64decode(kv.get("value", "")), int(kv.get("create_revision", 0)),
                int(kv.get("mod_revision", 0)), int(kv.get("lease", 0)))


def parse_etcd_url(url: str) -> tuple[str, str, int]:
    """(protocol, host, port) of --etcd http://host:port; ValueError naming the problem."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--etcd {url!r} is not an etcd client URL like http://10.0.0.5:2379")
    return parts.scheme, parts.hostname, parts.port or 2379


class GroupStore:
    """The keys of group `group` in the etcd at `url`."""

    def __init__(self, url: str, group: str, timeout_s: float = 1.0):
        protocol, host, port = parse_etcd_url(url)
        if not group or "/" in group:
            raise ValueError(f"--ha-group {group!r}: a group is a non-empty name without '/'")
        self.url, self.group = url, group
        self.prefix = f"/elastic-ep/{group}/"
        self.leader_key = self.prefix + "leader"
        # the JSON gateway's path of etcd >= 3.4; no discovery round trip
        self.client = etcd3gw.Etcd3Client(host=host, port=port, protocol=protocol, timeout=timeout_s,
                                          api_path="/v3/")

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (etcd_errors.Etcd3Exception, requests.RequestException, OSError, ValueError, KeyError) as e:
            raise EtcdUnavailable(f"etcd at {self.url}: {what} failed ({type(e).__name__}: {str(e)[:200]})") from None

    def _post(self, path: str, body: dict) -> dict:
        return self._call(path, self.client.post, self.client.get_url(path), json=body)

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        return int(self._post("/lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew `lease`: its TTL, or -1 once it expired (its keys are gone)."""
        return int(self._post("/lease/keepalive", {"ID": lease}).get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self._post("/kv/lease/revoke", {"ID": lease})

    def campaign(self, seat: Seat, lease: int) -> Held | None:
        """Take the leader key for `seat` under `lease` if nobody holds it; either way the key as
        it is now (None: nobody holds it, which a campaign cannot leave)."""
        key, value = _b64(self.leader_key), _b64(msgspec.json.encode(seat))
        result = self._post("/kv/txn", {
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            "success": [{"request_put": {"key": key, "value": value, "lease": lease}},
                        {"request_range": {"key": key}}],
            "failure": [{"request_range": {"key": key}}],
        })
        kvs = result["responses"][-1]["response_range"].get("kvs", [])
        return _held(kvs[0]) if kvs else None

    def replace_if_held(self, key: str, value: bytes, lease: int, create_revision: int) -> bool:
        """Put `value` at `key` under `lease` only while the key is the one made at `create_revision`
        (the leader updating its own seat: never one a newer leader made)."""
        k = _b64(key)
        result = self._post("/kv/txn", {
            "compare": [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": str(create_revision)}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": lease}}],
            "failure": [],
        })
        return bool(result.get("succeeded"))

    def put_as_leader(self, key: str, value: bytes, term: int) -> bool:
        """Put `value` at `key` only while the leader key is the one of `term`: etcd itself refuses
        the write of a leader that was deposed (False)."""
        result = self._post("/kv/txn", {
            "compare": [{"key": _b64(self.leader_key), "result": "EQUAL", "target": "CREATE",
                         "create_revision": str(term)}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            "failure": [],
        })
        return bool(result.get("succeeded"))

    def get(self, key: str) -> Held | None:
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _held(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, Held]:
        end = prefix.encode()[:-1] + bytes([prefix.encode()[-1] + 1])
        kvs = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(end)}).get("kvs", [])
        return {base64.b64decode(kv["key"]).decode(): _held(kv) for kv in kvs}

    def delete_range(self, start: str, end: str) -> None:
        """Delete the keys in [start, end)."""
        self._post("/kv/deleterange", {"key": _b64(start), "range_end": _b64(end)})

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """The revision of the put."""
        body: dict = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        return int(self._post("/kv/put", body)["header"]["revision"])

    def leader(self) -> tuple[Seat, int] | None:
        """The leader's seat and term, or None while there is none."""
        held = self.get(self.leader_key)
        if held is None:
            return None
        return msgspec.json.decode(held.value, type=Seat), held.create_revision

    def seats(self) -> dict[str, Seat]:
        """Every controller of the group that holds a live lease: name -> seat."""
        out = {}
        for held in self.get_prefix(self.prefix + "members/").values():
            seat = msgspec.json.decode(held.value, type=Seat)
            out[seat.name] = seat
        return out
