"""Recovery in two steps, end to end: 4 real ranks with 8 redundant experts (3 ranks hold every
expert, so losing a rank takes the only copy of some) under streaming load.

The epoch after a kill fills only the slots of the experts that lost every copy, from the node's
host-memory backup (nothing from disk, nothing moved between survivors), and checksums only
those; then the background rebalance reaches the balance of a placement computed from scratch,
a few experts per step boundary in epochs that keep the process group. The killed rank comes
back empty (its rejoin moves nothing) and the background rebalance fills it. No request fails
and every output equals the fault-free run.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.placement.location import ExpertLocation

from .conftest import reference_load

MODEL = "tiny-deepseek-v3"
EXPERT_BYTES = CheckpointReader(resolve_model(MODEL)).expert_nbytes
VICTIM = 1
# The rank restarts once the recovery's rebalance is long done (it takes well under a second);
# the second test looks for its rejoin from the end of that rebalance, so it may come before the
# first test ends. No readiness gate: each of the rebalance's epochs would run its warm-up first
# (test_recovery.py keeps the gate through recoveries).
RESTART_DELAY_S = 8
SERVE_ARGS = ("--model", MODEL, "--ep-size", "4", "--redundant-experts", "8", "--restart-delay-s",
              str(RESTART_DELAY_S), "--rebalance-move-bytes", str(2 * EXPERT_BYTES), "--no-warmup-gate")


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(*SERVE_ARGS)


def all_events(server) -> list[dict]:
    return server.http.get("/cluster", params={"events": 0}).json()["events"]


def only_on(placement: dict, rank: int) -> int:
    """How many (layer, expert) have every replica on `rank`."""
    location = ExpertLocation.from_json(json.dumps(placement))  # /cluster sends the slot map alone
    s = location.slots_per_rank
    return sum({slot // s for slot in slots if slot >= 0} == {rank}
               for layer in location.log2phy.tolist() for slots in layer)


def epochs(events: list[dict], reason: str, moves: bool = False) -> list[dict]:
    """The epochs formed for `reason`, or (moves) the background moves that followed it."""
    return [e for e in events if e["kind"] == "epoch" and (str(e.get("reason", "")).startswith(f"{reason}: move")
                                                          if moves else e.get("reason") == reason)]


def test_a_loss_restores_only_the_lost_experts_from_the_backup_then_rebalances_in_the_background(server):
    before = server.wait_for(lambda c: c["ready"] and any(e["kind"] == "backup" and "holds" in e["message"]
                                                        for e in c["events"]), what="the complete backup")
    lost = only_on(before["placement"], VICTIM)
    assert lost > 0
    last_id = before["events"][-1]["id"]
    with reference_load(server, MODEL, threads=3) as load:
        server.wait_for(lambda c: load.done >= 3, what="requests before the kill")
        os.kill(server.pids()[VICTIM], signal.SIGKILL)
        server.wait_for(lambda c: any(e["kind"] == "rebalanced" and e["id"] > last_id for e in c["events"]),
                        timeout_s=60, what="the background rebalance after the recovery")
        done_then = load.done
        server.wait_for(lambda c: load.done >= done_then + 3, what="requests after the rebalance")
    assert load.failures == []
    events = [e for e in all_events(server) if e["id"] > last_id]

    (restore,) = epochs(events, "recovery")  # the epoch the group serves again with
    moved = {source: stat["bytes"] for source, stat in restore["transfers"].items()}
    assert moved["backup"] == lost * EXPERT_BYTES, moved
    assert moved.get("disk", 0) == moved.get("peer", 0) == moved.get("local", 0) == 0, moved
    assert restore["verified_slots"] == lost  # of 3 ranks x 6 slots x 3 layers, only the filled ones

    moves = epochs(events, "recovery", moves=True)
    (done,) = [e for e in events if e["kind"] == "rebalanced" and e["reason"] == "recovery"]
    assert done["moves"] == len(moves) >= 2
    assert not [e for e in events if e["kind"] == "epoch" and e["id"] < done["id"] and e["reason"] == "rejoin"]
    assert all(m["rendezvous_s"] == 0 and m["members"] == restore["members"] for m in moves)  # the group was kept
    assert done["balancedness"] >= done["scratch_balancedness"] - 0.02, done


def test_the_restarted_rank_joins_empty_and_the_background_rebalance_fills_it(server):
    # from the end of the first test's rebalance: the rank restarts --restart-delay-s after its kill
    last_id = [e for e in all_events(server) if e["kind"] == "rebalanced" and e["reason"] == "recovery"][-1]["id"]
    with reference_load(server, MODEL, threads=2) as load:
        server.wait_for(lambda c: any(e["kind"] == "rebalanced" and e["reason"] == "rejoin" and e["id"] > last_id
                                      for e in c["events"]), timeout_s=RESTART_DELAY_S + 60, what="the rejoin")
    assert load.failures == []
    events = [e for e in all_events(server) if e["id"] > last_id]
    (rejoin,) = epochs(events, "rejoin")
    assert sum(stat["bytes"] for stat in rejoin["transfers"].values()) == 0 and rejoin["verified_slots"] == 0
    assert len(epochs(events, "rejoin", moves=True)) >= 1
    placement = server.cluster()["placement"]
    s = placement["slots_per_rank"]
    assert all(e >= 0 for layer in placement["phy2log"] for e in layer[VICTIM * s : (VICTIM + 1) * s])
