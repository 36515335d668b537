"""Worker <-> another node's agent: the agent's fetch socket (backup experts, dense weights), and
where a node's backup lives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    """tensors: name -> numpy float32 array; error if the agent holds none."""

    tensors: dict[str, np.ndarray]
    error: str = ""


@dataclass(frozen=True)
class BackupTensors:
    """w13: [n, 2I, H], w2: [n, H, I] as numpy float32, in the order asked; error if any is missing."""

    w13: np.ndarray | None
    w2: np.ndarray | None
    error: str = ""
