"""The data plane of one epoch: a torch.distributed group of that epoch's members only.

Each epoch rendezvouses under its own `PrefixStore("epoch/<n>/", store)`, so keys of an old
epoch (a fenced rank still trying, a late message) can never mix with a new one. Before the
group is built, members meet at a store barrier that polls, so a rendezvous whose epoch was
superseded (a second fault during recovery) is abandoned at once instead of waiting out a
timeout.

What happens when a peer dies: gloo raises on the next read or write to that peer's socket
(milliseconds after the process exits), which surfaces here as `CollectiveError`. A peer that
is hung or cut off (no reset ever comes) blocks the collective until the controller aborts the
epoch (`abort`, called from the worker's heartbeat thread on the controller's `AbortEpoch`:
the waiting collective gives up within `ABORT_POLL_S`) or `collective_timeout_s` passes. NCCL
raises only where it notices a peer's error; otherwise the same
abort applies, and aborts the communicator (`ncclCommAbort`) under the waiting collective. A
broken epoch's group is left behind, never torn down in the step loop: teardown could wait on
the failed peer. An error in this rank's own computation is not a collective error: the rank
finishes the step's collectives and the group stays whole.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist
from msgspec.structs import replace

from elastic_ep.wire import Progress


class EpochSuperseded(Exception):
    """A newer epoch was announced while this one was still forming."""


class CollectiveError(RuntimeError):
    """A collective of the epoch's group failed (a peer died, the group was destroyed)."""


class AddressNotLocal(ValueError):
    """The address a node advertises is not on any of its interfaces."""


def interface_of(address: str, interfaces: Mapping[str, list] | None = None) -> str:
    """The name of the network interface that holds `address` (IPv4 or IPv6).
    Raises AddressNotLocal naming the address and the flag to fix when none does."""
    interfaces = psutil.net_if_addrs() if interfaces is None else interfaces
    for name, addrs in interfaces.items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address for a in addrs):
            return name
    held = sorted(a.address for addrs in interfaces.values() for a in addrs if a.family == socket.AF_INET)
    raise AddressNotLocal(f"no interface of this host holds {address}; pass this host's own address with "
                     f"--advertise-host (its IPv4 addresses: {', '.join(held)})")


def bind_data_plane(host: str) -> str:
    """Make this process's gloo (and NCCL bootstrap) sockets use the interface of `host`, the
    address its node advertises, instead of whatever the host name resolves to (often
    127.0.0.1, which peers on other hosts cannot reach). Returns the interface name."""
    name = interface_of(host)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    os.environ["NCCL_SOCKET_IFNAME"] = name
    return name


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


ABORT_POLL_S = 0.05  # how often a waiting collective looks whether its epoch was aborted
NCCL_POLL_S = 0.0002  # how often an NCCL collective's completion is queried (a cheap CUDA event query)
_ABANDONED: list = []  # process groups of broken epochs, kept so nothing waits on their teardown


# ProcessGroupNCCL's own error handling, left to itself, takes the whole process down: its
# watchdog rethrows a peer's error (TORCH_NCCL_ASYNC_ERROR_HANDLING's default, 3) and its heartbeat
# monitor kills the process a while after any rank reported one. Here a survivor must live on and
# leave the broken epoch on the controller's order, so errors only reach this module's polls.
# Set before the first communicator, unless the operator set them (read once per process).
NCCL_FAIL_SOFT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # the watchdog neither aborts nor tears down on an error
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # no heartbeat monitor that kills the process
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # no debug dump (and its sleeps) on an error
}
NCCL_ABORT_WAIT_S = 5.0  # ncclCommAbort should return at once; past this the process is wedged
WEDGED = threading.Event()  # an NCCL abort never returned: this process's GPU collectives are not to be trusted


def new_backend(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta,
                device: torch.device):
    """A process group of its own for one epoch (not torch.distributed's global default group,
    so a broken epoch's group can be left behind while the next one forms), connected before it
    returns: NCCL's communicator is made here, on the calling thread, not lazily inside the
    first collective (where a member dead before it joined would hold the step loop forever)."""
    if backend == "nccl":
        for name, value in NCCL_FAIL_SOFT.items():
            os.environ.setdefault(name, value)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        pg.eager_connect_single_device(device)
        return pg
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def start_abort(pg) -> threading.Thread:
    """ncclCommAbort of `pg` on a thread of its own (NCCL has had aborts that hang on a stopped
    peer of the same node); the thread holds `pg` until the abort returns, then drops it there."""
    thread = threading.Thread(target=pg.abort, name="nccl-abort", daemon=True)
    thread.start()
    return thread


def abort_communicator(pg, wait_s: float) -> bool:
    """`start_abort`, waited for at most `wait_s`. Returns whether the abort returned in time."""
    thread = start_abort(pg)
    thread.join(wait_s)
    return not thread.is_alive()


@dataclass
class Posted:
    """An all-to-all in flight on `group`; `wait()` blocks until `output` holds the result
    (raising CollectiveError as `EpochGroup.all_to_all` does). `inputs` are kept alive until then."""

    group: EpochGroup
    work: Any
    output: torch.Tensor
    staged: torch.Tensor | None
    inputs: torch.Tensor

    def wait(self) -> None:
        self.group._wait(self.work, "all_to_all")
        if self.staged is not None:
            self.output.copy_(self.staged)


class EpochGroup:
    """This rank's membership in one epoch's process group.

    members: rank_ids of the epoch; a rank's index in it is its torch.distributed rank.
    device: where collective buffers live ("cpu" for gloo, "cuda:<i>" for nccl).
    timeout_s: the longest any collective may wait (set when the group forms).
    A subgroup (`subgroup`: a host's ranks, the hosts' leaders) is an EpochGroup of some members
    with a process group of its own, aborted and left together with the epoch's.
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
        self.timeout_s = 60.0
        self.pg = None  # this epoch's own process group (no global torch.distributed state)
        self.broken = False
        self._aborted = threading.Event()
        self._prefix: dist.Store | None = None
        self._subgroups: list[EpochGroup] = []

    def abort(self) -> None:
        """Make every collective of this group in flight or to come raise CollectiveError (any
        thread): the controller gave up on this epoch."""
        self._aborted.set()

    def _wait(self, work, what: str) -> None:
        """Wait for an async collective, giving up when the epoch is aborted or timeout_s passes.
        A collective given up on stays posted in the backend; the group is destroyed next."""
        deadline = time.monotonic() + self.timeout_s
        if self.backend == "nccl":
            self._wait_nccl(work, what, deadline)
            return
        while True:
            try:
                work.wait(timedelta(seconds=ABORT_POLL_S))
                return
            except RuntimeError:
                if work.is_completed():  # done meanwhile: fine, or it ended with the error of a peer that died
                    try:
                        work.wait()
                        return
                    except RuntimeError as e:
                        raise self._broke(f"{what} in epoch {self.epoch}: {e}") from e
            if self._aborted.is_set():
                raise self._broke(f"{what} in epoch {self.epoch}: the controller aborted the epoch")
            if time.monotonic() > deadline:
                raise self._broke(f"{what} in epoch {self.epoch}: no answer within {self.timeout_s:g}s")

    def _wait_nccl(self, work, what: str, deadline: float) -> None:
        """NCCL runs the collective on a CUDA stream: poll it. A peer's error (NCCL reports it
        when a remote peer's connection breaks) is read from the work, never waited on; on the
        controller's abort or past the deadline the communicator itself is aborted (ncclCommAbort),
        which frees the stream a dead or stopped peer would hold forever (NCCL is fail-stop
        otherwise). When that abort does not return, `WEDGED` is set."""
        while not work.is_completed():
            if self._aborted.is_set() or time.monotonic() > deadline:
                if not abort_communicator(self.pg, NCCL_ABORT_WAIT_S):
                    WEDGED.set()
                raise self._broke(f"{what} in epoch {self.epoch}: aborted (the controller gave up on the epoch, "
                                  f"or no answer within {self.timeout_s:g}s)")
            time.sleep(NCCL_POLL_S)
        with warnings.catch_warnings():  # Work.exception() warns that it is deprecated; it is the only probe
            warnings.simplefilter("ignore")
            error = work.exception()
        if error is not None:
            raise self._broke(f"{what} in epoch {self.epoch}: {error}")
        work.wait()  # done: only orders the current CUDA stream after the collective's

    def _broke(self, message: str) -> CollectiveError:
        self.broken = True
        return CollectiveError(message)

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
        prefix = self._prefix = dist.PrefixStore(f"epoch/{self.epoch}/", store)
        prefix.set(f"arrived/{self.rank_id}", "1")
        keys = [f"arrived/{r}" for r in self.members]
        while not prefix.check(keys):
            if superseded():
                raise EpochSuperseded(f"epoch {self.epoch} was superseded while forming")
            if time.perf_counter() - start > timeout_s:
                missing = [r for r in self.members if not prefix.check([f"arrived/{r}"])]
                raise TimeoutError(f"epoch {self.epoch}: ranks {missing} did not arrive within {timeout_s:.1f}s")
            time.sleep(poll_s)
        # The group connects through a store client of its own: a connect left behind (the epoch
        # was superseded while a member was dead) blocks in the store until its timeout, and must
        # not hold the client the next epoch's barrier uses meanwhile.
        own = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s))
        pg_store = dist.PrefixStore("pg/", dist.PrefixStore(f"epoch/{self.epoch}/", own))
        self.pg = self._connect(pg_store, timedelta(seconds=timeout_s), superseded)
        self.alive = True
        self.timeout_s = timeout_s
        return time.perf_counter() - start

    def subgroup(self, name: str, members: list[int], superseded: Callable[[], bool]) -> EpochGroup:
        """Form a process group of `members` (rank_ids, this rank among them; every one of them
        calls this with the same name) under this formed epoch's store prefix. Its collectives
        give up when this epoch is aborted; `destroy` leaves it with the epoch. Raises as `form`."""
        assert self._prefix is not None, "form the epoch's group first"
        sub = EpochGroup(self.epoch, members, self.rank_id, self.backend, self.device)
        sub._aborted = self._aborted
        sub.pg = sub._connect(dist.PrefixStore(f"sub/{name}/", self._prefix), timedelta(seconds=self.timeout_s),
                              superseded)
        sub.alive, sub.timeout_s = True, self.timeout_s
        self._subgroups.append(sub)
        return sub

    def _connect(self, store: dist.Store, timeout: timedelta, superseded: Callable[[], bool]):
        """Build this epoch's process group on a helper thread, so that a member dying or cut off
        while the others connect to it (gloo retries a refused connection until the timeout)
        cannot hold this rank: it leaves when the epoch is superseded or aborted."""
        built: dict = {}

        def connect() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)  # a thread's current GPU is its own
                built["pg"] = new_backend(self.backend, store, self.index, self.size, timeout, self.device)
            except RuntimeError as e:
                built["error"] = e

        thread = threading.Thread(target=connect, name=f"connect-epoch-{self.epoch}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(ABORT_POLL_S)
            if thread.is_alive() and superseded():
                raise EpochSuperseded(f"epoch {self.epoch} was superseded while its group connected")
            if thread.is_alive() and self._aborted.is_set():
                raise CollectiveError(f"epoch {self.epoch} was aborted while its group connected")
        if "error" in built:
            interface = os.environ.get("GLOO_SOCKET_IFNAME", "the host name's address")
            raise CollectiveError(
                f"rank {self.rank_id} (bound to {interface}) could not connect to the other members of epoch "
                f"{self.epoch} {self.members}: {built['error']}; every node must reach every other node's "
                "--advertise-host address on any TCP port") from built["error"]
        return built["pg"]

    def destroy(self) -> None:
        """Leave the group and its subgroups, never waiting on a peer. A gloo group whose
        collectives (or a subgroup's) failed or were given up on is kept, never torn down: a
        collective may still wait inside it on a peer that will not answer (cut off), and tearing
        it down would wait with it. An NCCL communicator is aborted on a thread of its own, which
        drops it afterwards (its teardown joins threads that may wait on a failed peer)."""
        family = [self, *self._subgroups]
        broken = any(g.broken for g in family)
        for g in family:
            if g.pg is not None and self.backend == "nccl":
                start_abort(g.pg)
            elif g.pg is not None and broken:
                _ABANDONED.append(g.pg)
            g.pg = None
            g.alive = False
        self._subgroups = []

    def all_to_all(self, output: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        """all_to_all_single over this group, on the group's device. Raises CollectiveError when
        it fails."""
        self.post_all_to_all(output, inp, out_splits, in_splits).wait()

    def post_all_to_all(self, output: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> Posted:
        """Start all_to_all_single over this group and return at once; `Posted.wait()` finishes
        it. Every member must post this group's collectives in the same order. Raises
        CollectiveError when the backend refuses it."""
        staged = output.device != self.device  # gloo with the model on a GPU: through the host
        out_dev = torch.empty(output.shape, dtype=output.dtype, device=self.device) if staged else output
        sent = inp.to(self.device).contiguous()
        try:
            work = self.pg.alltoall_base(out_dev, sent, out_splits or [], in_splits or [], dist.AllToAllOptions())
        except RuntimeError as e:
            raise self._broke(f"all_to_all in epoch {self.epoch}: {e}") from e
        return Posted(self, work, output, out_dev if staged else None, sent)

    def exchange(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        """Send sends[i] to member index i and receive recvs[j] from member j (1-D buffers of
        `dtype` on `device`) as one all-to-all of the group: every member calls it, with empty
        dicts when it moves nothing, and the same `dtype`. Not gloo's point-to-point operations: a
        wait on one of those that times out closes every pair of the group ("Application timeout
        caused pair closure"), so they cannot be waited on in short polls that an abort can
        interrupt; a collective can. Raises CollectiveError when it fails."""
        if self.size == 1:
            return
        out_splits = [recvs[p].numel() if p in recvs else 0 for p in range(self.size)]
        in_splits = [sends[p].numel() if p in sends else 0 for p in range(self.size)]
        inp = torch.cat([sends[p].reshape(-1) for p in sorted(sends)]) if sends else \
            torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(out_splits), dtype=dtype, device=device)
        self.all_to_all(out, inp, out_splits, in_splits)
        for peer, at in zip(range(self.size), itertools.accumulate([0, *out_splits]), strict=False):
            if peer in recvs:
                recvs[peer].copy_(out[at : at + out_splits[peer]])
