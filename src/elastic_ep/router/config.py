"""`elastic-ep router` settings: every deadline an `_s` field with its default (all shown by
GET /router)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from elastic_ep.router.placement import DEFAULT_LIVE_S
from elastic_ep.router.scoring import DEFAULT_AFFINITY_BLOCKS, DEFAULT_BLOCK_BYTES, Limits


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...] = ()
    backends_file: str | None = None
    api_key: str | None = None
    """Checked as `Authorization: Bearer` on /v1/* when set."""
    backend_api_key: str | None = None
    """Sent to backends as `Authorization: Bearer`; unset, a client's Authorization header is
    passed through when the router checks none of its own."""
    migration_limit: int = 3
    """Times one choice may move to another instance (a stream mid-way, or a request that had
    not started), after which it ends with an error."""
    limits: Limits = field(default_factory=Limits)
    block_bytes: int = DEFAULT_BLOCK_BYTES
    affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS
    prefix_live_s: float = DEFAULT_LIVE_S
    """A prefix key seen within this long counts toward its backend's share when a new prefix is
    placed (router/placement.py)."""
    queue_size: int = 256
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    """Connecting to a backend and sending it a request; a generation may then take any time."""
    request_timeout_s: float = 600.0
    """A non-streaming request's whole answer (and /tokenize, /detokenize, /v1/models)."""
    stream_check_s: float = 0.25
    """A stream waiting for its next chunk checks this often that its instance is still ready."""

    def view(self) -> dict:
        shown = asdict(self)
        for secret in ("api_key", "backend_api_key"):
            shown[secret] = "set" if shown[secret] else None
        return shown
