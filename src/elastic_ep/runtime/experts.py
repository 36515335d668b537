"""A rank's physical expert slots, and filling them from the sources of a transfer plan.

Per MoE layer (index 0..L-1, not the model's layer id) the rank holds w13 [S, 2I, H] and
w2 [S, H, I] for its S slots. A new epoch rebuilds them from the old contents (keep, local
moves), peers (one all-to-all in the epoch's group), the host-memory backup (same node: read from
the agent's file straight into the slots; other node: the agent over ZeroMQ) or the checkpoint
(only the tensors needed). Every filled slot is then summarised by `expert_checksum`, which the controller
compares with the checksum of that expert's weights as first read from the checkpoint (the
source, reported in `EpochReady.source_checksums`), never with another slot's copy.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.memory import huge_zeros
from elastic_ep.model.moe import grouped_expert_forward
from elastic_ep.node.backup_file import expert_checksum, expert_offsets, read_checked
from elastic_ep.wire import FETCH_REPLY, BackupFetch, BackupSite, ClusterKey, Inbox, SlotSource, TransferStat

from .group import EpochGroup


@dataclass(frozen=True)
class Filled:
    """What filling the slots did: bytes and seconds per source kind; (layer, expert) -> checksum
    of every expert read from disk, taken on the weights as read (the reference for that expert);
    (layer, slot) -> checksum of the slots already checksummed as they were filled (the rest are
    checksummed afterwards)."""

    stats: list[TransferStat]
    source_checksums: dict[tuple[int, int], int]
    checked: dict[tuple[int, int], int]


class ExpertSlots:
    """This rank's expert weights, in `dtype` on `device`: `experts` [L, S] logical id per slot
    (-1 empty)."""

    def __init__(self, moe_layers: list[int], slots_per_rank: int, inter: int, hidden: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.moe_layers = moe_layers
        self.slots_per_rank = slots_per_rank
        self.device = torch.device(device)
        self.inter, self.hidden, self.dtype = inter, hidden, dtype
        self.w13: list[torch.Tensor] = []
        self.w2: list[torch.Tensor] = []
        self._allocate()
        self.experts = np.full((len(moe_layers), slots_per_rank), -1, dtype=np.int64)

    def _allocate(self) -> None:
        shape13 = (self.slots_per_rank, 2 * self.inter, self.hidden)
        shape2 = (self.slots_per_rank, self.hidden, self.inter)
        self.w13 = [huge_zeros(*shape13, dtype=self.dtype, device=self.device) for _ in self.moe_layers]
        self.w2 = [huge_zeros(*shape2, dtype=self.dtype, device=self.device) for _ in self.moe_layers]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w13 + self.w2)

    def release(self) -> int:
        """Drop every slot's weights (sleep level 2); `experts` stays for `reload`. Returns the
        bytes released."""
        freed = self.nbytes
        self.w13, self.w2 = [], []
        return freed

    def reload(self, reader: CheckpointReader) -> None:
        """Read the experts `experts` names back into fresh slots, from the checkpoint."""
        self._allocate()
        for li, layer in enumerate(self.moe_layers):
            held = [(j, int(e)) for j, e in enumerate(self.experts[li]) if e >= 0]
            if not held:
                continue
            w13, w2 = reader.read_experts(layer, [e for _, e in held], self.device)
            for i, (j, _) in enumerate(held):
                self.w13[li][j].copy_(w13[i])
                self.w2[li][j].copy_(w2[i])

    def layer(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13[li], self.w2[li]

    def checksums(self, slots: list[tuple[int, int]] | None = None) -> dict[tuple[int, int], int]:
        """(layer, slot) -> checksum for `slots` (default: every slot), occupied ones only."""
        if slots is None:
            slots = [(li, j) for li in range(len(self.moe_layers)) for j in range(self.slots_per_rank)]
        return {(li, j): expert_checksum(self.w13[li][j], self.w2[li][j])
                for li, j in slots if self.experts[li, j] >= 0}

    def run_each(self, slots: np.ndarray) -> int:
        """One token through the expert of each slot `slots` [L, S] bool marks (warming the slots an
        epoch filled: their weights compute once before a step needs them, as the readiness gate's
        forwards make every slot compute on the first start). Local: no collective, so only the
        ranks that filled slots spend anything. Returns how many slots computed."""
        computed = 0
        for li in np.flatnonzero(slots.any(axis=1)).tolist():
            ids = torch.from_numpy(np.flatnonzero(slots[li])).to(self.device)
            x = torch.ones(len(ids), self.hidden, dtype=self.dtype, device=self.device)
            w13, w2 = self.layer(li)
            grouped_expert_forward(x, ids, w13, w2)
            computed += len(ids)
        return computed

    def corrupt(self, layer: int, slot: int) -> None:
        """Fault injection: flip the sign of the slot's down projection in place."""
        self.w2[layer][slot].neg_()

    def apply(
        self,
        new_experts: np.ndarray,
        sources: list[SlotSource],
        sends: list[tuple[int, int, int]],
        group: EpochGroup,
        reader: CheckpointReader,
        backups: dict[str, BackupSite],
        node: str,
        fetch_timeout_s: float,
        *,
        key: ClusterKey,
    ) -> Filled:
        """Fill every slot for the new epoch.

        new_experts: [L, S] the logical expert each slot must hold afterwards.
        sources: where each changed slot comes from; sends: (dst_rank_id, layer, src_slot)
        this rank sends, in the order the receiver lists its peer sources.
        fetch_timeout_s: how long another node's agent may take to answer a backup fetch;
        key: the cluster key its fetch socket takes.
        """
        # Sources refer to the old contents: copy out every slot read before any is overwritten.
        read = {(src.layer, src.src_slot) for src in sources if src.kind == "local"}
        read |= {(li, slot) for _, li, slot in sends}
        old = {key: (self.w13[key[0]][key[1]].clone(), self.w2[key[0]][key[1]].clone()) for key in read}
        stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        by_kind: dict[str, list[SlotSource]] = defaultdict(list)
        for src in sources:
            by_kind[src.kind].append(src)

        t0 = time.perf_counter()
        for src in by_kind["local"]:
            self._put(src, *old[(src.layer, src.src_slot)], stats["local"])
        stats["local"][1] += time.perf_counter() - t0

        t0 = time.perf_counter()
        self._exchange(by_kind["peer"], sends, group, old, stats["peer"])
        stats["peer"][1] += time.perf_counter() - t0

        # Reported apart: "backup" is this node's shared memory, "backup_remote" another node's agent.
        backup = by_kind["backup"]
        checked: dict[tuple[int, int], int] = {}
        for kind, items in (("backup", [b for b in backup if b.src_node == node]),
                            ("backup_remote", [b for b in backup if b.src_node != node])):
            t0 = time.perf_counter()
            self._from_backup(items, backups, node, fetch_timeout_s, key, stats[kind], checked)
            stats[kind][1] += time.perf_counter() - t0

        t0 = time.perf_counter()
        by_layer: dict[int, list[SlotSource]] = defaultdict(list)
        for src in by_kind["disk"]:
            by_layer[src.layer].append(src)
        source_checksums: dict[tuple[int, int], int] = {}
        for li, items in by_layer.items():
            w13, w2 = reader.read_experts(self.moe_layers[li], [s.expert for s in items], self.device)
            for i, src in enumerate(items):
                source_checksums[(li, src.expert)] = expert_checksum(w13[i], w2[i])
                self._put(src, w13[i], w2[i], stats["disk"])
        stats["disk"][1] += time.perf_counter() - t0

        self.experts = np.array(new_experts, dtype=np.int64)
        stat_list = [TransferStat(kind, int(b), s) for kind, (b, s) in stats.items() if b or kind in by_kind]
        return Filled(stat_list, source_checksums, checked)

    def _put(self, src: SlotSource, w13: torch.Tensor, w2: torch.Tensor, stat: list[float]) -> None:
        self.w13[src.layer][src.slot].copy_(w13)
        self.w2[src.layer][src.slot].copy_(w2)
        stat[0] += w13.numel() * w13.element_size() + w2.numel() * w2.element_size()

    def _exchange(
        self,
        peer_sources: list[SlotSource],
        sends: list[tuple[int, int, int]],
        group: EpochGroup,
        old: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]],
        stat: list[float],
    ) -> None:
        w13_shape, w2_shape = self.w13[0].shape[1:], self.w2[0].shape[1:]
        n13 = w13_shape.numel()
        per_expert = n13 + w2_shape.numel()
        send_parts: dict[int, list[torch.Tensor]] = defaultdict(list)
        for dst, li, src_slot in sends:
            w13, w2 = old[(li, src_slot)]
            send_parts[group.members.index(dst)] += [w13.reshape(-1), w2.reshape(-1)]
        recv_from: dict[int, list[SlotSource]] = defaultdict(list)
        for src in peer_sources:
            recv_from[group.members.index(src.src_rank)].append(src)
        recvs = {peer: torch.empty(len(items) * per_expert, dtype=self.w13[0].dtype, device=self.device)
                 for peer, items in recv_from.items()}
        group.exchange({peer: torch.cat(parts) for peer, parts in send_parts.items()}, recvs, self.w13[0].dtype,
                       self.device)
        for peer, items in recv_from.items():
            for i, src in enumerate(items):
                flat = recvs[peer][i * per_expert : (i + 1) * per_expert]
                self._put(src, flat[:n13].view(w13_shape), flat[n13:].view(w2_shape), stat)

    def _read_local(self, path: str, wanted: list[SlotSource], stat: list[float],
                    checked: dict[tuple[int, int], int]) -> None:
        """Same-node backup: on the CPU straight from the file into the slots, checksummed as they
        land; on an accelerator (or in another dtype) through one host buffer per expert,
        checksummed afterwards."""
        stored, offsets = expert_offsets(path, [(s.layer, s.expert) for s in wanted])
        direct = self.device.type == "cpu" and self.w13[0].dtype == stored
        fd = os.open(path, os.O_RDONLY)
        try:
            for src, ((o13, _), (o2, _)) in zip(wanted, offsets, strict=True):
                w13, w2 = self.w13[src.layer][src.slot], self.w2[src.layer][src.slot]
                if direct:
                    checked[(src.layer, src.slot)] = read_checked(fd, o2, w2, read_checked(fd, o13, w13))
                else:
                    h13 = torch.empty(w13.shape, dtype=stored)
                    h2 = torch.empty(w2.shape, dtype=stored)
                    read_checked(fd, o13, h13)
                    read_checked(fd, o2, h2)
                    w13.copy_(h13)
                    w2.copy_(h2)
                stat[0] += w13.numel() * w13.element_size() + w2.numel() * w2.element_size()
        finally:
            os.close(fd)

    def _from_backup(
        self,
        items: list[SlotSource],
        backups: dict[str, BackupSite],
        node: str,
        timeout_s: float,
        key: ClusterKey,
        stat: list[float],
        checked: dict[tuple[int, int], int],
    ) -> None:
        by_node: dict[str, list[SlotSource]] = defaultdict(list)
        for src in items:
            by_node[src.src_node].append(src)
        for site_node, wanted in by_node.items():
            site = backups[site_node]
            if site_node == node:
                self._read_local(site.path, wanted, stat, checked)
                continue
            try:
                w13, w2 = fetch_backup(site.fetch_addr, [(s.layer, s.expert) for s in wanted], timeout_s, key)
            except TimeoutError as e:
                raise BackupUnreachable(site_node, str(e)) from e
            for i, src in enumerate(wanted):
                self._put(src, w13[i], w2[i], stat)


class BackupUnreachable(Exception):
    """Another node's agent did not answer for its expert backup (`node`)."""

    def __init__(self, node: str, message: str):
        super().__init__(message)
        self.node = node


def fetch_backup(addr: str, items: list[tuple[int, int]], timeout_s: float,
                 key: ClusterKey) -> tuple[torch.Tensor, torch.Tensor]:
    """Ask the agent at `addr` for (layer, expert) items of its backup.

    Returns w13 [n, 2I, H], w2 [n, H, I]. Raises TimeoutError when the agent does not answer
    within timeout_s, RuntimeError when it lacks an item.
    """
    reply = ask_agent(addr, BackupFetch(items), timeout_s, "expert backup", key)
    return reply.w13, reply.w2


def ask_agent(addr: str, message, timeout_s: float, what: str, key: ClusterKey):
    """One request to a node agent's fetch socket; the reply, whose `error` is empty.
    Raises TimeoutError when it does not answer within timeout_s (or its answer was dropped:
    not of the cluster key, not a fetch reply), RuntimeError on an error."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    try:
        sock.send_multipart(key.seal(message))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"{what} agent at {addr} did not answer within {timeout_s}s")
        reply = Inbox("fetch_reply", FETCH_REPLY, key).read(sock.recv_multipart(copy=False))
    finally:
        sock.close()
    if reply is None:
        raise TimeoutError(f"{what} agent at {addr} answered with a frame that was dropped (see the log)")
    if reply.error:
        raise RuntimeError(f"{what} at {addr}: {reply.error}")
    return reply
