"""The restores of an epoch's likely losses, computed ahead: the looked-up placement is the one
the epoch change would compute, and anything not prepared falls back to computing it."""

import os
import subprocess
import sys
from unittest.mock import patch

import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import elastic_ep.placement.restore_ahead as restore_ahead_module
from elastic_ep.control.epochs.rebalance_rules import rebalance_targets
from elastic_ep.control.epochs.restore_ahead import RestoresAhead, process_worker, thread_worker
from elastic_ep.errors import PlacementError
from elastic_ep.harness.server_process import processes_left
from elastic_ep.placement import fault_aware_placement
from elastic_ep.placement.restore import restore_placement
from elastic_ep.placement.restore_ahead import apply_fills, likely_losses, restores_ahead

RANKS, SLOTS, EXPERTS, LAYERS = 8, 6, 22, 4
NODES = {r: f"n{r // 4}" for r in range(RANKS)}


@pytest.fixture
def epoch():
    return epoch_of()


def epoch_of():
    rng = np.random.default_rng(3)
    load = rng.random((LAYERS, EXPERTS)) * 100
    # placed as if on one node, so that a node's loss takes experts with it
    location = fault_aware_placement(load, range(RANKS), dict.fromkeys(range(RANKS), "n"), None, SLOTS, RANKS)
    backup = {(layer, e): f"n{e % 2}" for layer in range(LAYERS) for e in range(EXPERTS)}
    return location, load, backup


def prepared(ahead, location, load, backup):
    ahead.prepare(7, location, list(range(RANKS)), NODES, backup, load)
    ahead.prepared.result.result(timeout=60)
    return ahead


def lookup(ahead, location, backup, lost, suspect=False, epoch=7, nodes=NODES):
    holding = [r for r in range(RANKS) if r not in lost]
    held = location.restricted_to(holding)
    return held, holding, ahead.lookup(epoch, location, held, holding, holding, nodes, backup, suspect)


def test_likely_losses_are_each_member_then_each_node():
    assert likely_losses([3, 0, 1, 2], {0: "a", 1: "a", 2: "b", 3: "c"}) == [
        frozenset([0]), frozenset([1]), frozenset([2]), frozenset([3]), frozenset([0, 1])]


@pytest.mark.parametrize("lost", [{2}, {4, 5, 6, 7}])
def test_the_looked_up_restore_is_the_computed_one(epoch, lost):
    location, load, backup = epoch
    ahead = prepared(RestoresAhead(thread_worker, min_ranks=2), location, load, backup)
    held, holding, found = lookup(ahead, location, backup, lost)
    assert ahead.last == "looked up"
    expected = restore_placement(held, load, holding, NODES, backup)
    assert found.phy2log.tolist() == expected.phy2log.tolist()
    assert (held.logcnt == 0).any()  # the loss took experts that the lookup gave a slot again
    found.validate(holding)
    ahead.close()


def test_what_was_not_prepared_falls_back_to_computing(epoch):
    location, load, backup = epoch
    ahead = prepared(RestoresAhead(thread_worker, min_ranks=2), location, load, backup)
    assert lookup(ahead, location, backup, {1, 6})[2] is None  # two ranks of two nodes: not a likely loss
    assert "this loss" in ahead.last
    assert lookup(ahead, location, backup, {2}, epoch=8)[2] is None  # another epoch
    assert lookup(ahead, location, backup, {2}, suspect=True)[2] is None  # a slot failed its check
    assert "not as prepared" in ahead.last
    assert lookup(ahead, location, {}, {2})[2] is None  # the backups changed
    assert lookup(ahead, location, backup, {2})[2] is not None
    ahead.close()


def test_a_small_group_prepares_nothing(epoch):
    location, load, backup = epoch
    ahead = RestoresAhead(thread_worker, min_ranks=RANKS + 1)
    ahead.prepare(7, location, list(range(RANKS)), NODES, backup, load)
    assert lookup(ahead, location, backup, {2})[2] is None and "no restores prepared" in ahead.last


def test_the_computation_stops_when_its_epoch_is_over(epoch):
    location, load, backup = epoch
    calls = iter([True, True, False])
    out = restores_ahead(location.phy2log, SLOTS, EXPERTS, load, list(range(RANKS)), NODES, backup,
                         likely_losses(range(RANKS), NODES), wanted=lambda: next(calls))
    assert list(out) == [frozenset([0]), frozenset([1])]


def test_the_restores_are_computed_in_a_process_of_their_own(epoch):
    location, load, backup = epoch
    ahead = prepared(RestoresAhead(process_worker, min_ranks=2), location, load, backup)
    workers = list(ahead._executor._processes.values())
    assert len(workers) == 1 and workers[0].pid != os.getpid(), workers
    held, holding, found = lookup(ahead, location, backup, {4, 5, 6, 7})
    assert found is not None, ahead.last
    assert found.phy2log.tolist() == restore_placement(held, load, holding, NODES, backup).phy2log.tolist()
    # a background rebalance's target, computed by the same process after the restores
    args = (load, list(range(RANKS)), NODES, None, SLOTS, RANKS, location)
    target, scratch = ahead.submit(rebalance_targets, *args).result(timeout=60)
    assert list(ahead._executor._processes.values()) == workers
    assert (target, scratch) == rebalance_targets(*args)
    ahead.close()
    assert not processes_left({workers[0].pid}, 60), "the worker outlived close()"  # no process left behind


def test_the_worker_process_ends_when_the_controller_is_killed(tmp_path):
    """kill -9 of the controller's process: its restores' worker, idle on its queue, exits too."""
    script = tmp_path / "controller.py"
    script.write_text(
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_restore_ahead import epoch_of, prepared\n"
        "from elastic_ep.control.epochs.restore_ahead import RestoresAhead, process_worker\n"
        "if __name__ == '__main__':\n"
        "    ahead = prepared(RestoresAhead(process_worker, min_ranks=2), *epoch_of())\n"
        "    print([p.pid for p in ahead._executor._processes.values()][0], flush=True)\n"
        "    import time; time.sleep(120)\n")
    controller = subprocess.Popen([sys.executable, str(script), os.path.dirname(__file__)], stdout=subprocess.PIPE,
                                  text=True)
    try:
        worker = int(controller.stdout.readline())
        controller.kill()
        controller.wait()
        if processes_left({worker}, 30):
            psutil.Process(worker).kill()
            pytest.fail(f"the restores' worker {worker} outlived its controller by 30 s")
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 5), st.integers(1, 3))
def test_a_loss_that_keeps_a_copy_of_every_expert_fills_nothing_without_a_restore(seed, slots, per_node):
    """Each fill is the restore's own (`restore_placement` over the other members); a loss after
    which every expert keeps a copy (and the rest have slots for all) is known to fill nothing
    from the copy counts alone, and no restore placement is built for it (two placements per
    loss were ~10 ms of the ~11 s the 1,152 likely losses of 1,024 ranks took)."""
    rng = np.random.default_rng(seed)
    ranks, layers = 6, 2
    experts = int(rng.integers(1, slots * (ranks - 2) + 1))
    nodes = {r: f"n{r // per_node}" for r in range(ranks)}
    load = rng.random((layers, experts)) * 100
    location = fault_aware_placement(load, range(ranks), nodes, None, slots, ranks)
    members = sorted(rng.choice(ranks, int(rng.integers(2, ranks + 1)), replace=False).tolist())
    losses = likely_losses(members, nodes) + [frozenset(members)]
    calls = []

    def counted(*args):
        calls.append(args)
        return restore_placement(*args)

    with patch.object(restore_ahead_module, "restore_placement", counted):
        got = restores_ahead(location.phy2log, slots, experts, load, members, nodes, {}, losses)
    for loss in losses:
        holding = [r for r in members if r not in loss]
        held = location.restricted_to(holding)
        try:
            expected = restore_placement(held, load, holding, nodes, {}).phy2log
        except PlacementError:
            assert got[loss] is None
            continue
        assert apply_fills(held, got[loss]).phy2log.tolist() == expected.tolist()
    keeps_all = [loss for loss in losses
                 if (location.restricted_to([r for r in members if r not in loss]).logcnt > 0).all()
                 and (len(members) - len(loss & set(members))) * slots >= experts]
    assert len(calls) == len(losses) - len(keeps_all)
