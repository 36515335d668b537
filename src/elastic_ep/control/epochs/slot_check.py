"""The background check of expert slots: a few slots of every member at a time, round robin, so
a slot whose weights changed in place (memory corruption, a bad copy) is found while serving.

Every --expert-sweep-interval-s each member checksums its next --expert-sweep-slots slots
between steps (`SweepSlots`; the members asked in turn over the interval, not all at once) and
answers `SlotChecksums`; a checksum that differs from the expert's reference (taken from the
weights as first read from the checkpoint) makes the slot suspect, and the control loop refills
it from a clean copy in a new epoch. A dead, hung or slow rank simply answers late or never: the
sweep waits for nothing.

The requests a second are at most `MAX_REQUESTS_PER_S` in all, each for proportionally more slots:
past 64 members a member is asked every `members / MAX_REQUESTS_PER_S` seconds for that many
intervals' worth of slots, so every slot is checked as often as at the flags' rate, and the
control thread reads and sends no more sweep frames at 1,024 ranks than at 64 (one request and
one answer per member every 0.5 s was ~4,100 frames a second at 1,024, a third of its frames).
"""

from __future__ import annotations

import time

import numpy as np

from elastic_ep.wire import SlotChecksums, SweepSlots, reject_invalid

from ..cluster import ClusterState
from ..config import ServeConfig
from ..control_plane import ControlPlane
from ..events import EventKind
from .epoch_change import EpochChanger

# A gap between two calls counts as at most this long: after a pause (a stall, a recovery, the
# start) the sweep goes on at its pace instead of asking every member at once before the first
# step, which a recovery's pause waits for (254 requests, ~20 ms of the control thread at 256 ranks).
MAX_GAP_S = 0.1
MAX_REQUESTS_PER_S = 128  # sweep requests a second, all members together (as many answers come back)


class SlotSweeper:
    def __init__(self, cluster: ClusterState, cfg: ServeConfig, plane: ControlPlane, changer: EpochChanger):
        self.cluster = cluster
        self.cfg = cfg
        self.plane = plane
        self.changer = changer
        self._swept_at = 0.0
        self._due = 0.0  # members owed a sweep since the last call (a fraction carries over)
        self._turn = 0  # index into the members of the next one to ask
        self._next: dict[int, int] = {}  # rank -> index of its next occupied slot to check
        self._occupied: dict[int, np.ndarray] = {}  # rank -> its [n, 2] occupied (layer, slot), for `_location`
        self._location = None

    def sweep(self) -> None:
        """Ask the members whose turn has come for their next slots' checksums: each member once
        per --expert-sweep-interval-s, dealt round robin over the calls in between (between steps),
        so no step pays for asking every member at once (at 256 ranks that was one burst of 256
        requests and 256 answers every interval); a longer gap than MAX_GAP_S owes no more. Past
        MAX_REQUESTS_PER_S a second in all, each member is asked less often for more slots."""
        c, cfg = self.cluster, self.cfg
        now = time.monotonic()
        if not cfg.expert_sweep_slots or c.location is None or not c.members:
            return
        if c.location is not self._location:  # a new placement: its occupied slots, once per rank
            self._location, self._occupied = c.location, {}
        members = c.members
        period_s = max(cfg.expert_sweep_interval_s, len(members) / MAX_REQUESTS_PER_S)  # each member's
        per_request = round(cfg.expert_sweep_slots * period_s / cfg.expert_sweep_interval_s)
        gap = min(now - self._swept_at, MAX_GAP_S)
        self._due = min(self._due + len(members) * gap / period_s, len(members))
        self._swept_at = now
        for _ in range(int(self._due)):
            self._due -= 1
            rank_id = members[self._turn % len(members)]
            self._turn = (self._turn + 1) % len(members)
            occupied = self._occupied.get(rank_id)
            if occupied is None:  # [n, 2] (layer, slot), row-major
                occupied = self._occupied[rank_id] = np.argwhere(c.location.experts_of_rank(rank_id) >= 0)
            n = len(occupied)
            if not n:
                continue
            start = self._next.get(rank_id, 0)
            picked = occupied[(start + np.arange(min(per_request, n))) % n].tolist()
            self._next[rank_id] = (start + len(picked)) % n
            self.plane.to_worker(rank_id, SweepSlots(c.epoch, [(li, j) for li, j in picked]))

    def on_checksums(self, msg: SlotChecksums) -> None:
        """Mark the slots whose checksum is not their expert's reference as suspect. An answer that
        names a slot the rank does not have, or an empty one (none is ever asked for), is dropped
        and counted: it had stopped the control loop (an index past the slot map)."""
        c = self.cluster
        if msg.epoch != c.epoch or c.location is None or msg.rank_id not in c.members:
            return
        experts = c.location.experts_of_rank(msg.rank_id)
        layers, slots = experts.shape
        if not all(0 <= li < layers and 0 <= j < slots and experts[li, j] >= 0 for li, j in msg.checksums):
            reject_invalid("step", c.ranks[msg.rank_id].node, f"rank {msg.rank_id}",
                           f"checksums of slots it does not hold (of {layers} layers x {slots} slots)")
            return
        bad = {(msg.rank_id, li, j) for (li, j), checksum in msg.checksums.items()
               if not self.changer.matches(li, int(experts[li, j]), checksum)}
        if self.changer.mark_suspect(bad):
            c.events.add(EventKind.VERIFY_FAILED, f"background check: slots (rank, layer, slot) {sorted(bad)} hold "
                         "the wrong weights; refilling them from a clean copy", msg.rank_id,
                         slots=[list(b) for b in sorted(bad)])
