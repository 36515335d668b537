"""Fault injection on request (`serve --enable-chaos`): real faults in real processes, for drills
and tests. A signal goes to the rank's process through its agent (kill, hang, resume), now or
right after the next epoch is announced (a fault that lands during a recovery); slowness is a
sleep in every step of the rank; corruption overwrites an expert slot in place; a poisoned
request makes each step it runs in raise on its rank, as a request that breaks a step would; a
cut drops every packet of a rank's process, or of a whole node, in the kernel (node/netcut.py).
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from elastic_ep.wire import CorruptSlot, CutLinks, HealLinks

from .events import EventKind
from .facade.to_loop import CorruptExpertSlot, CutNetwork, PoisonRank, PoisonRequest, SignalRank, SlowRank
from .serving.scheduler import Sequence

if TYPE_CHECKING:
    from .controller import Controller


class ChaosInjector:
    def __init__(self, ctl: Controller):
        self.ctl = ctl
        self.cluster = ctl.cluster
        self.poisons: list[PoisonRequest] = []  # also for requests that arrive later

    def on_add(self, seq: Sequence) -> None:
        """A new request is poisoned when an earlier order named its id."""
        for poison in self.poisons:
            if seq.request.request_id.startswith(poison.request_id):
                seq.fail_at = poison.phase

    def run(self, cmd: SignalRank | SlowRank | CorruptExpertSlot | PoisonRequest | PoisonRank | CutNetwork) -> None:
        c = self.cluster
        if isinstance(cmd, CutNetwork):
            what = f"rank {cmd.rank_id}" if cmd.rank_id is not None else f"node {cmd.node}"
            self.ctl.nodes.send(cmd.node, HealLinks(cmd.rank_id) if cmd.heal else CutLinks(cmd.rank_id, cmd.duration_s))
            c.events.add(EventKind.CHAOS, f"{'heal' if cmd.heal else 'cut'} the links of {what}"
                         + (f" for {cmd.duration_s:g}s" if cmd.duration_s and not cmd.heal else ""), cmd.rank_id,
                         node=cmd.node)
        elif isinstance(cmd, SignalRank):
            self._signal(cmd)
        elif isinstance(cmd, SlowRank):
            c.delay_s[cmd.rank_id] = cmd.delay_s
            c.events.add(EventKind.CHAOS, f"rank {cmd.rank_id} slowed by {cmd.delay_s}s per step", cmd.rank_id)
        elif isinstance(cmd, CorruptExpertSlot):
            self.ctl.plane.to_worker(cmd.rank_id, CorruptSlot(c.epoch, cmd.layer, cmd.slot))
            c.events.add(EventKind.CHAOS, f"corrupted layer {cmd.layer} slot {cmd.slot} of rank {cmd.rank_id}",
                         cmd.rank_id, layer=cmd.layer, slot=cmd.slot)
        elif isinstance(cmd, PoisonRank):
            c.broken[cmd.rank_id] = cmd.phase
            c.events.add(EventKind.CHAOS, f"every step of rank {cmd.rank_id} raises in {cmd.phase}", cmd.rank_id)
        else:
            self.poisons.append(cmd)
            poisoned = list(self.ctl.scheduler.by_id.values())
            for seq in poisoned:
                self.on_add(seq)
            poisoned = [seq.seq_id for seq in poisoned if seq.fail_at]
            c.events.add(EventKind.CHAOS, f"poisoned requests {cmd.request_id!r}* ({len(poisoned)} running, and any "
                         f"that arrive): their steps raise in {cmd.phase}", None, seq_ids=poisoned)

    def _signal(self, cmd: SignalRank) -> None:
        name = signal.Signals(cmd.signal).name

        def send() -> None:
            r = self.cluster.ranks.get(cmd.rank_id)
            self.ctl.nodes.signal(cmd.rank_id, cmd.signal)
            self.cluster.events.add(EventKind.CHAOS, f"{name} to rank {cmd.rank_id} (pid {r.pid if r else None}) in "
                                    f"epoch {self.cluster.epoch}", cmd.rank_id)

        if cmd.at_next_epoch:
            self.ctl.changer.after_start.append(send)
            self.cluster.events.add(EventKind.CHAOS, f"armed: {name} to rank {cmd.rank_id} once epoch "
                                    f"{self.cluster.epoch + 1} is announced", cmd.rank_id)
        else:
            send()
