"""Fault injection on request (`serve --enable-chaos`): real faults in real processes, for drills
and tests. The loop installs it only with that flag, and the step loop then calls
`before_step`; without it nothing of chaos is in a step plan, a sequence or a request.

A signal goes to the rank's process through its agent (kill, hang, resume), now or right after
the next epoch is announced (a fault that lands during a recovery); slowness is a sleep in every
step of the rank; corruption overwrites an expert slot in place; a poisoned request makes each
step it runs in raise on its rank, as a request that breaks a step would, and a poisoned rank
raises in every step; a cut drops every packet of a rank's process, or of a whole node, in the
kernel (node/netcut.py); a lost answer is one step's `StepResult` the rank keeps but does not
send (the controller's resend finds it). Slowness and a poisoned rank hold for the process they were set on: a
rank fenced and started again comes back clean. They reach the rank as a `ChaosStep` sent just
before the step's plan, only to the ranks that have something injected.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from typing import Protocol

from elastic_ep.wire import ChaosStep, CorruptSlot, CutLinks, HealLinks

from .cluster import ClusterState
from .control_plane import ControlPlane
from .events import EventKind
from .facade.to_loop import (
    ChaosCommand,
    CorruptExpertSlot,
    CutNetwork,
    LoseMessage,
    Lost,
    PoisonRank,
    PoisonRequest,
    SignalRank,
    SlowRank,
)
from .serving.scheduler import Sequence, StepBatch


class Agents(Protocol):
    """The node role, as far as chaos reaches the processes."""

    def send(self, node: str, message: object) -> None: ...
    def signal(self, rank_id: int, sig: int) -> None: ...


class ChaosInjector:
    """Built with the cluster state, the control plane, the node role, `after_next_start(hook)`
    (the epoch change runs the hook once the next epoch is announced), and the sequences in flight
    (seq_id -> Sequence)."""

    def __init__(self, cluster: ClusterState, plane: ControlPlane, agents: Agents,
                 after_next_start: Callable[[Callable[[], None]], None], sequences: Mapping[int, Sequence]):
        self.cluster = cluster
        self.plane = plane
        self.agents = agents
        self.after_next_start = after_next_start
        self.sequences = sequences
        self.poisons: list[PoisonRequest] = []  # also for requests that arrive later
        self._slow: dict[int, tuple[int | None, float]] = {}  # rank -> (pid it was set on, seconds per step)
        self._broken: dict[int, tuple[int | None, str]] = {}  # rank -> (pid, where every step of it raises)
        self._lose: set[tuple[int, Lost]] = set()  # (rank, what) lost of the next step

    def slow_delays(self) -> dict[int, float]:
        """Injected seconds per step of each rank's current process, for /cluster."""
        return {r: d for r, (pid, d) in self._slow.items() if self._current(r, pid)}

    def before_step(self, epoch: int, step: int, batch: StepBatch, members: list[int]) -> set[int]:
        """Send each member with something injected into this step its `ChaosStep`; returns those
        members (nothing to look at while nothing is injected: at 256 ranks x 64 sequences the walk
        over every sequence for poisons was ~20 ms a step)."""
        injected: set[int] = set()
        if not (self._slow or self._broken or self.poisons or self._lose):
            return injected
        for rank_id in members:
            slow = self._slow.get(rank_id)
            broken = self._broken.get(rank_id)
            delay_s = slow[1] if slow is not None and self._current(rank_id, slow[0]) else 0.0
            fail_at = broken[1] if broken is not None and self._current(rank_id, broken[0]) else ""
            poisoned = {seq_id: phase for seq_id in batch.seq_ids_on(rank_id)
                        if (phase := self._poison_of(seq_id))} if self.poisons else {}
            lose = {lost for lost in Lost if (rank_id, lost) in self._lose}
            self._lose -= {(rank_id, lost) for lost in lose}
            if delay_s or fail_at or poisoned or lose:
                self.plane.to_worker(rank_id, ChaosStep(epoch, step, delay_s, fail_at, poisoned, Lost.RESULT in lose,
                                                        Lost.PLAN in lose))
                injected.add(rank_id)
        return injected

    def run(self, cmd: ChaosCommand) -> None:
        c = self.cluster
        if isinstance(cmd, CutNetwork):
            what = f"rank {cmd.rank_id}" if cmd.rank_id is not None else f"node {cmd.node}"
            self.agents.send(cmd.node, HealLinks(cmd.rank_id) if cmd.heal else CutLinks(cmd.rank_id, cmd.duration_s))
            c.events.add(EventKind.CHAOS, f"{'heal' if cmd.heal else 'cut'} the links of {what}"
                         + (f" for {cmd.duration_s:g}s" if cmd.duration_s and not cmd.heal else ""), cmd.rank_id,
                         node=cmd.node)
        elif isinstance(cmd, SignalRank):
            self._signal(cmd)
        elif isinstance(cmd, SlowRank):
            self._slow[cmd.rank_id] = (self._pid(cmd.rank_id), cmd.delay_s)
            c.events.add(EventKind.CHAOS, f"rank {cmd.rank_id} slowed by {cmd.delay_s}s per step", cmd.rank_id)
        elif isinstance(cmd, CorruptExpertSlot):
            self.plane.to_worker(cmd.rank_id, CorruptSlot(c.epoch, cmd.layer, cmd.slot))
            c.events.add(EventKind.CHAOS, f"corrupted layer {cmd.layer} slot {cmd.slot} of rank {cmd.rank_id}",
                         cmd.rank_id, layer=cmd.layer, slot=cmd.slot)
        elif isinstance(cmd, LoseMessage):
            self._lose.add((cmd.rank_id, cmd.lost))
            what = "answer to" if cmd.lost == Lost.RESULT else "plan of"
            c.events.add(EventKind.CHAOS, f"rank {cmd.rank_id}'s {what} the next step will be lost", cmd.rank_id)
        elif isinstance(cmd, PoisonRank):
            self._broken[cmd.rank_id] = (self._pid(cmd.rank_id), cmd.phase)
            c.events.add(EventKind.CHAOS, f"every step of rank {cmd.rank_id} raises in {cmd.phase}", cmd.rank_id)
        else:
            self.poisons.append(cmd)
            poisoned = [seq_id for seq_id in self.sequences if self._poison_of(seq_id)]
            c.events.add(EventKind.CHAOS, f"poisoned requests {cmd.request_id!r}* ({len(poisoned)} running, and any "
                         f"that arrive): their steps raise in {cmd.phase}", None, seq_ids=poisoned)

    def _poison_of(self, seq_id: int) -> str:
        """Where the steps of a sequence raise: the phase of the first poison naming its request."""
        seq = self.sequences.get(seq_id)
        if seq is None or not self.poisons:
            return ""
        return next((p.phase for p in self.poisons if seq.request.request_id.startswith(p.request_id)), "")

    def _pid(self, rank_id: int) -> int | None:
        r = self.cluster.ranks.get(rank_id)
        return r.pid if r is not None else None

    def _current(self, rank_id: int, pid: int | None) -> bool:
        """The process a setting was made for still runs as that rank."""
        r = self.cluster.ranks.get(rank_id)
        return r is not None and r.pid == pid and not r.status.down

    def _signal(self, cmd: SignalRank) -> None:
        name = signal.Signals(cmd.signal).name

        def send() -> None:
            r = self.cluster.ranks.get(cmd.rank_id)
            self.agents.signal(cmd.rank_id, cmd.signal)
            self.cluster.events.add(EventKind.CHAOS, f"{name} to rank {cmd.rank_id} (pid {r.pid if r else None}) in "
                                    f"epoch {self.cluster.epoch}", cmd.rank_id)

        if cmd.at_next_epoch:
            self.after_next_start(send)
            self.cluster.events.add(EventKind.CHAOS, f"armed: {name} to rank {cmd.rank_id} once epoch "
                                    f"{self.cluster.epoch + 1} is announced", cmd.rank_id)
        else:
            send()
