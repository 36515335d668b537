"""Worker <-> another node's agent: the agent's fetch socket (backup experts, dense weights), and
where a node's backup lives."""

from __future__ import annotations

import torch

from .codec import Message, Record


class BackupSite(Record):
    """A node's expert backup: same-node workers mmap `path`, others ask `fetch_addr`."""

    node: str
    path: str
    fetch_addr: str


class BackupFetch(Message):
    """Ask a node's agent for experts of its backup: items are (layer, expert)."""

    items: list[tuple[int, int]]


class DenseFetch(Message):
    """Ask a node's agent for the dense weights it keeps in host memory."""


class DenseTensors(Message):
    """tensors: name -> CPU torch tensor in the checkpoint's serving dtype (bf16 included, which
    numpy cannot hold); error if the agent holds none."""

    tensors: dict[str, torch.Tensor]
    error: str = ""


class BackupTensors(Message):
    """w13: [n, 2I, H], w2: [n, H, I] CPU torch tensors in the serving dtype, in the order asked;
    error if any is missing."""

    w13: torch.Tensor | None
    w2: torch.Tensor | None
    error: str = ""
