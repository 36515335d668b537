"""Worker <-> another node's agent: the agent's fetch socket (backup experts, dense weights), and
where a node's backup lives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackupSite:
    """A node's expert backup: same-node workers mmap `path`, others ask `fetch_addr`."""

    node: str
    path: str
    fetch_addr: str


@dataclass(frozen=True)
class BackupFetch:
    """Ask a node's agent for experts of its backup: items are (layer, expert)."""

    items: list[tuple[int, int]]


@dataclass(frozen=True)
class DenseFetch:
    """Ask a node's agent for the dense weights it keeps in host memory."""


@dataclass(frozen=True)
class DenseTensors:
    """tensors: name -> CPU torch tensor in the checkpoint's serving dtype (bf16 included, which
    numpy cannot hold); error if the agent holds none."""

    tensors: dict[str, Any]
    error: str = ""


@dataclass(frozen=True)
class BackupTensors:
    """w13: [n, 2I, H], w2: [n, H, I] CPU torch tensors in the serving dtype, in the order asked;
    error if any is missing."""

    w13: Any
    w2: Any
    error: str = ""
