"""Leader <-> standby controllers of a group: the request journal streamed directly
(`serve --ha-journal-via direct`, group/journal_stream.py). The sender's term is in every frame's
head (codec.py), so a standby tells a deposed leader's frames apart."""

from __future__ import annotations

from .codec import Message


class JournalFollow(Message):
    """A standby asks the leader for its journal: its whole state now, then every batch. Sent on
    connecting and again when a batch is missing."""

    node: str


class JournalState(Message):
    """The leader's journal as of batch `seq`: `snapshot` is the msgpack of group/journal.py's
    `Snapshot` (every unfinished request, and the finished ones kept)."""

    seq: int
    snapshot: bytes


class JournalBatch(Message):
    """Batch `seq` of the journal: `entries` is the msgpack of a list of group/journal.py's entries,
    the bytes the etcd path stores under `journal/<seq>`."""

    seq: int
    entries: bytes
