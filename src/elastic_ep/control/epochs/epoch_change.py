"""The epoch change: a new membership with a placement, the transfer plan that fills its slots,
and the verification of the slots that changed, ending in a typed outcome.

Every placement change goes through `EpochChanger.change`, asked by a typed request
(epochs/requests.py): start, recovery, rejoin, the moves of a background rebalance (EPLB
included), a straggler's reweighting, scale-up and -down, and the refill of slots that failed a
check. Recovery and rejoin use the restore placement (`placement/restore.py`): every expert
stays where it is and only the experts no live rank holds are filled, so the group serves again
after moving only those; other changes compute a balanced placement over the live ranks that
keeps experts where balance allows, or take the one given. It plans each changed slot's source
(a local copy, a surviving replica on a peer, a node's host-memory backup, else disk), announces
the epoch and waits for every member to form the group (or keep it, for the same members),
fill its slots and report their checksums.

When a rank dies or hangs while the epoch forms, the wait ends with `Interrupted` (the detector
holds the fault) or, for a member that never answers, `NotFormed` naming it; a slot whose
checksum differs from its expert's reference (taken from the weights as first read from the
checkpoint, never from another copy) ends with `VerifyFailed`. After any of these, every slot
the epoch was to fill is suspect (it may hold the old expert, the new one or parts of both) and
the next epoch fills it again: only filled slots are verified, so what the controller believes a
slot holds must be what it holds. The caller decides what each outcome means: this module calls no recovery.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from elastic_ep.errors import PlacementError
from elastic_ep.placement.fault_aware import fault_aware_placement
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.restore import restore_placement
from elastic_ep.placement.transfer import plan_transfers
from elastic_ep.wire import EpochFailed, EpochReady, EpochStart, Membership, SlotMap, SlotSource, slot_map_for_wire

from ..cluster import ClusterState
from ..config import ServeConfig
from ..control_plane import ControlPlane
from ..ranks import RankStatus
from .epoch_plan import held_placement, split_by_rank
from .requests import Adopt, EpochRequest, Recover, Refill, Slot, holding_of, keeps_group, restores, same_members
from .restore_ahead import RestoresAhead
from .slot_maps import ConfirmedSlotMaps


@dataclass(frozen=True)
class EpochReport:
    """How a formed epoch went (seconds; bytes and seconds moved per source kind)."""

    epoch: int
    members: list[int]
    placement_s: float
    rendezvous_s: float
    transfer_s: float
    verify_s: float
    transfers: dict[str, dict[str, float]]
    epoch_change_s: float
    verified_slots: int  # slots filled, hence checksummed, in this epoch (the others were kept)
    disk_reason: str  # why experts came from disk ("" when none did)
    restore: str = ""  # a recovery's placement: "looked up" (restore_ahead.py), else why it was computed

    def fields(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Formed:
    report: EpochReport


@dataclass(frozen=True)
class NoPlacement:
    """The live ranks cannot hold every expert (or the placement failed): `reason` says why."""

    reason: str


@dataclass(frozen=True)
class NotFormed:
    """The epoch did not form: `errors` reported by ranks, or `missing` ranks that never answered
    within --epoch-timeout-s (when no rank reported an error)."""

    detail: str
    missing: list[int]


@dataclass(frozen=True)
class VerifyFailed:
    bad: set[Slot]


@dataclass(frozen=True)
class Interrupted:
    """A member was named by a fault while the epoch formed."""


EpochOutcome = Formed | NoPlacement | NotFormed | VerifyFailed | Interrupted


def copied_from(slots: set[Slot], sources: dict[int, list[SlotSource]]) -> set[Slot]:
    """The slots that `slots` (rank, layer, slot) were copied from, where they were copied from a
    slot (a peer's or the rank's own)."""
    out = set()
    for rank, filled in sources.items():
        for src in filled:
            if (rank, src.layer, src.slot) in slots and src.kind in ("peer", "local"):
                out.add((src.src_rank if src.kind == "peer" else rank, src.layer, src.src_slot))
    return out


class EpochChanger:
    """`pump(timeout_s)` handles input while the change waits (replies arrive through `on_reply`);
    `faulted(rank_ids)` tells whether any of them has a pending fault."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, plane: ControlPlane, store: dist.Store,
                 expert_nbytes: int, pump: Callable[[float], None], faulted: Callable[[list[int]], bool],
                 ahead: RestoresAhead | None = None):
        self.cluster = cluster
        self.ahead = ahead or RestoresAhead()  # the restores of the likely losses, computed off this thread
        self.cfg = cfg
        self.plane = plane
        self.store = store
        self.expert_nbytes = expert_nbytes
        self.pump = pump
        self.faulted = faulted
        self.replies: dict[int, EpochReady | EpochFailed] = {}
        self._asked: set[int] = set()  # the members of the epoch being formed: only their replies count
        self.filled: dict[int, int] = {}  # the current epoch's slots filled per rank (the gate checks each ran)
        self.reference_checksums: dict[tuple[int, int], int] = {}  # (layer, expert) -> as read from disk
        self.suspect_slots: set[Slot] = set()
        self.slot_maps = ConfirmedSlotMaps()  # what each rank holds, so an epoch sends it the changes
        self._after_start: list[Callable[[], None]] = []  # one-shot hooks (chaos: a fault mid-change)

    def on_reply(self, msg: EpochReady | EpochFailed) -> None:
        c = self.cluster
        if msg.epoch != c.epoch or msg.rank_id not in self._asked:  # of another epoch, or not a member of it
            return
        self.replies[msg.rank_id] = msg
        if isinstance(msg, EpochFailed):
            self.slot_maps.failed(msg.rank_id)
        elif (r := c.ranks.get(msg.rank_id)) is not None:
            self.slot_maps.confirmed(msg.rank_id, r.record, msg.epoch)

    def mark_suspect(self, slots: set[Slot]) -> bool:
        """Slots (rank, layer, slot) a check found wrong: the next epoch fills them again.
        False when every one of them was suspect already."""
        new = slots - self.suspect_slots
        self.suspect_slots |= new
        return bool(new)

    def after_next_start(self, hook: Callable[[], None]) -> None:
        """Run `hook` once, right after the next epoch is announced (fault injection: a fault that
        lands while that epoch forms)."""
        self._after_start.append(hook)

    def leave(self, live: list[int]) -> None:
        """Members not in `live` leave the group without a new epoch (the cluster degraded: it
        serves again once an epoch forms over enough ranks)."""
        c = self.cluster
        c.members = [r for r in c.members if r in live]

    def change(self, request: EpochRequest, load: np.ndarray) -> EpochOutcome:
        """Form the epoch `request` asks for (epochs/requests.py) with a placement for `load`
        [L, E] where it computes one, move the experts, verify the slots that changed. Members
        not in the request's `holding` only send what they hold (scale-down). Returns the
        outcome; on any outcome but `Formed` the slots it was to fill are suspect."""
        c = self.cluster
        live = list(c.members) if same_members(request) else list(request.live)
        if not live:  # every rank it was for faulted first (before the first epoch: no member either)
            return NoPlacement("no live rank to form an epoch over")
        holding = holding_of(request, live)
        new = c.location if isinstance(request, Refill) else getattr(request, "target", None)
        t0 = time.monotonic()
        rank_nodes = c.rank_nodes()
        num_ranks = max(self.cfg.ep_size, max(live) + 1)
        s = c.slots_per_rank
        if isinstance(request, Adopt):  # what the adopted ranks hold is the last leader's placement
            c.epoch = max(c.epoch, request.after_epoch)
            old = held_placement(request.placement, c.num_layers, c.num_experts, s, num_ranks, request.whole)
        else:
            serving = [r for r in live if c.ranks[r].status in (RankStatus.SERVING, RankStatus.DRAINING)]
            old = held_placement(c.location, c.num_layers, c.num_experts, s, num_ranks, serving, self.suspect_slots)
        backup = c.backup_map()
        restore = ""
        try:
            if restores(request):
                if isinstance(request, Recover):
                    new = self.ahead.lookup(c.epoch, c.location, old, holding, serving, rank_nodes, backup,
                                            bool(self.suspect_slots))
                    restore = self.ahead.last
                if new is None:
                    new = restore_placement(old, load, holding, rank_nodes, backup)
            elif new is None:
                new = self.balanced(holding, load, num_ranks)
        except PlacementError as e:
            return NoPlacement(f"no placement over ranks {live}: {e}")
        placement_s = time.monotonic() - t0
        plan = plan_transfers(old, new, live, rank_nodes, backup, self.expert_nbytes)
        sources, sends = split_by_rank(plan, s)
        backups = c.backup_sites()
        c.epoch += 1
        c.members = list(live)
        self.replies, self._asked = {}, set(live)
        self.filled = {r: len(v) for r, v in sources.items()}
        self.store.set(f"epoch/{c.epoch}/members", json.dumps(live))
        maps = self.slot_maps.forms(c.epoch, slot_map_for_wire(new.phy2log, c.num_experts), live,
                                    {r: c.ranks[r].record for r in live if r in c.ranks})
        membership = Membership.of(live, [rank_nodes[r] for r in live])

        def start(slot_map: SlotMap, fill: list[SlotSource], send: list[tuple[int, int, int]]) -> EpochStart:
            return EpochStart(c.epoch, membership, slot_map, s, fill, send, backups, self.cfg.collective_timeout_s,
                              self.cfg.backup_fetch_timeout_s, self.cfg.all2all_backend, keeps_group(request))

        # the members with nothing to fill or send (most, after a loss) that hold the same map share
        # one message, encoded and sealed once
        idle: dict[int, EpochStart] = {}  # id(SlotMap) -> the message of the members that hold its base
        messages = []
        for r in live:
            if sources.get(r) or sends.get(r):
                messages.append((r, start(maps[r], sources[r], sends[r])))
            else:
                if id(maps[r]) not in idle:
                    idle[id(maps[r])] = start(maps[r], [], [])
                messages.append((r, idle[id(maps[r])]))
        self.plane.messages_to_workers(messages)
        while self._after_start:
            self._after_start.pop()()
        failure = self._wait(live)
        replies: dict[int, EpochReady] = self.replies  # type: ignore[assignment]
        if failure is None and (bad := self._verify(sources, replies)):
            failure = VerifyFailed(bad)
        if failure is not None:
            # A slot this epoch was to fill may now hold the old expert, the new one or parts of
            # both: suspect until an epoch fills it again (held_placement leaves it out). A copy
            # that came out wrong may have a corrupted source: that slot is suspect too, or every
            # retry would copy it again.
            self.suspect_slots |= {(r, src.layer, src.slot) for r, filled in sources.items() for src in filled}
            if isinstance(failure, VerifyFailed):
                self.suspect_slots |= copied_from(failure.bad, sources)
            return failure
        c.location = new
        self.suspect_slots.clear()
        self.ahead.prepare(c.epoch, new, holding, rank_nodes, backup, load)
        for r in live:
            c.ranks[r].status = RankStatus.SERVING if r in holding else RankStatus.DRAINING
        by_source: dict[str, dict[str, float]] = defaultdict(lambda: {"bytes": 0, "seconds": 0.0})
        for rep in replies.values():
            for st in rep.transfers:
                by_source[st.source]["bytes"] += st.bytes_moved
                by_source[st.source]["seconds"] = max(by_source[st.source]["seconds"], round(st.seconds, 4))
        return Formed(EpochReport(
            c.epoch, list(live), round(placement_s, 4),
            round(max(r.rendezvous_s for r in replies.values()), 4),
            round(max(r.transfer_s for r in replies.values()), 4),
            round(max(r.verify_s for r in replies.values()), 4),
            dict(by_source), round(time.monotonic() - t0, 4), sum(len(v) for v in sources.values()),
            c.why_disk() if plan.bytes_by_source["disk"] else "", restore,
        ))

    def balanced(self, holding: list[int], load: np.ndarray, num_ranks: int | None = None) -> ExpertLocation:
        """The placement a change computes over `holding` for `load` [L, E] when it is given none
        (num_ranks: the placement's width, default --ep-size or past the highest rank). Raises PlacementError."""
        c = self.cluster
        num_ranks = num_ranks or max(self.cfg.ep_size, max(holding) + 1)
        return fault_aware_placement(load, holding, c.rank_nodes(), None, c.slots_per_rank, num_ranks,
                                     current=c.location)

    def add_references(self, experts: list[tuple[int, int]], checksums: list[int]) -> None:
        """Checksums of (layer, expert) as an agent read them from the checkpoint (its backup)."""
        for item, checksum in zip(experts, checksums, strict=False):
            self.reference_checksums.setdefault(tuple(item), checksum)

    def _wait(self, live: list[int]) -> Interrupted | NotFormed | None:
        """Until every member answered; None when all did with EpochReady."""
        deadline = time.monotonic() + self.cfg.epoch_timeout_s
        while len(self.replies) < len(live):
            self.pump(0.002)
            if self.faulted(live):
                return Interrupted()
            failed = [m for m in self.replies.values() if isinstance(m, EpochFailed)]
            if failed or time.monotonic() > deadline:
                missing = [r for r in live if r not in self.replies]
                detail = "; ".join(f"rank {m.rank_id}: {m.error}" for m in failed) or f"ranks {missing} timed out"
                return NotFormed(detail, [] if failed else missing)
        return None

    def _verify(self, filled: dict[int, list[SlotSource]], replies: dict[int, EpochReady]) -> set[Slot]:
        """(rank, layer, slot) of every slot filled in this epoch whose checksum differs from its
        expert's reference or that reports none. Slots kept as they were are not read again here:
        the background check (slot_check.py) sweeps them while serving."""
        for rep in replies.values():
            for key, checksum in rep.source_checksums.items():
                self.reference_checksums.setdefault(key, checksum)
        bad = set()
        for rank_id, rep in replies.items():
            for src in filled.get(rank_id, []):
                if not self.matches(src.layer, src.expert, rep.checksums.get((src.layer, src.slot))):
                    bad.add((rank_id, src.layer, src.slot))
        return bad

    def matches(self, layer: int, expert: int, checksum: int | None) -> bool:
        """Whether `checksum` of a slot holding (layer, expert) equals that expert's reference."""
        return checksum is not None and self.reference_checksums.get((layer, expert)) == checksum
