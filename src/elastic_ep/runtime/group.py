"""The data plane of one epoch: a torch.distributed group of that epoch's members only.

Each epoch rendezvouses under its own `PrefixStore("epoch/<n>/", store)`, so keys of an old
epoch (a fenced rank still trying, a late message) can never mix with a new one. Before the
group is built, members meet at a store barrier that polls, so a rendezvous whose epoch was
superseded (a second fault during recovery) is abandoned at once instead of waiting out a
timeout.

What happens when a peer dies: gloo raises on the next read or write to that peer's socket
(milliseconds after the process exits), which surfaces here as `CollectiveError`. A hung peer
blocks the collective until it is killed (fenced) or `collective_timeout_s` passes. After a
collective error the group is destroyed, which closes this rank's sockets, so ranks waiting on
it fail fast too instead of hanging. An error in this rank's own computation is not a
collective error: the rank finishes the step's collectives and the group stays whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_ep.wire import Progress


class EpochSuperseded(Exception):
    """A newer epoch was announced while this one was still forming."""


class CollectiveError(RuntimeError):
    """A collective of the epoch's group failed (a peer died, the group was destroyed)."""


class ProgressBoard:
    """The main thread's position, read by the heartbeat thread. Attribute assignment of a
    frozen dataclass is atomic under the GIL, so no lock is needed."""

    def __init__(self) -> None:
        self.current = Progress()

    def enter(self, phase: str, layer: int = -1, step: int | None = None) -> None:
        p = self.current
        self.current = Progress(
            epoch=p.epoch,
            step=p.step if step is None else step,
            layer=layer,
            phase=phase,
            seq=p.seq + (1 if phase in ("dispatch", "combine") else 0),
            since=time.time(),
        )

    def new_epoch(self, epoch: int) -> None:
        self.current = Progress(epoch=epoch, phase="rendezvous", since=time.time())

    def idle(self) -> None:
        self.current = replace(self.current, phase="idle", layer=-1, since=time.time())


class EpochGroup:
    """This rank's membership in one epoch's process group.

    members: rank_ids of the epoch; a rank's index in it is its torch.distributed rank.
    device: where collective buffers live ("cpu" for gloo, "cuda:<i>" for nccl).
    """

    def __init__(self, epoch: int, members: list[int], rank_id: int, backend: str, device: torch.device):
        self.epoch = epoch
        self.members = list(members)
        self.rank_id = rank_id
        self.index = self.members.index(rank_id)
        self.size = len(self.members)
        self.backend = backend
        self.device = device
        self.alive = False

    def form(
        self,
        store: dist.Store,
        timeout_s: float,
        superseded: Callable[[], bool],
        poll_s: float = 0.002,
    ) -> float:
        """Barrier then init_process_group; returns seconds spent.

        Raises EpochSuperseded when `superseded()` turns true during the barrier, TimeoutError
        when not every member arrives within timeout_s.
        """
        start = time.perf_counter()
        prefix = dist.PrefixStore(f"epoch/{self.epoch}/", store)
        prefix.set(f"arrived/{self.rank_id}", "1")
        keys = [f"arrived/{r}" for r in self.members]
        while not prefix.check(keys):
            if superseded():
                raise EpochSuperseded(f"epoch {self.epoch} was superseded while forming")
            if time.perf_counter() - start > timeout_s:
                missing = [r for r in self.members if not prefix.check([f"arrived/{r}"])]
                raise TimeoutError(f"epoch {self.epoch}: ranks {missing} did not arrive within {timeout_s:.1f}s")
            time.sleep(poll_s)
        if dist.is_initialized():
            dist.destroy_process_group()
        kwargs = {"device_id": self.device} if self.backend == "nccl" else {}
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore("pg/", prefix),
            rank=self.index,
            world_size=self.size,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
        self.alive = True
        return time.perf_counter() - start

    def destroy(self) -> None:
        """Leave the group, closing this rank's connections (peers blocked on us then fail)."""
        if self.alive and dist.is_initialized():
            dist.destroy_process_group()
        self.alive = False

    def all_to_all(self, output: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """all_to_all_single over this epoch's group, on the group's device. Raises
        CollectiveError when it fails."""
        try:
            if self.device.type == "cpu":
                dist.all_to_all_single(output, inp, out_splits, in_splits)
                return
            out_dev = torch.empty(output.shape, dtype=output.dtype, device=self.device)
            dist.all_to_all_single(out_dev, inp.to(self.device), out_splits, in_splits)
            output.copy_(out_dev.cpu())
        except RuntimeError as e:
            raise CollectiveError(f"all_to_all in epoch {self.epoch}: {e}") from e

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> None:
        """Point-to-point: send sends[i] to member index i and receive recvs[j] from member j,
        all posted at once so no pair order can deadlock. Buffers are 1-D and on the CPU."""
        works = []
        staged = {}
        for peer, buf in recvs.items():
            staged[peer] = buf if self.device.type == "cpu" else torch.empty_like(buf, device=self.device)
            works.append(dist.irecv(staged[peer], src=peer))
        for peer, buf in sends.items():
            works.append(dist.isend(buf.to(self.device), dst=peer))
        for w in works:
            w.wait()
        for peer, buf in recvs.items():
            if staged[peer] is not buf:
                buf.copy_(staged[peer].cpu())
