"""The fleet simulation against the closed forms it must agree with, and its policies' order."""

from dataclasses import fields

import numpy as np
import pytest

from elastic_ep.errors import SimulationError
from elastic_ep.policy.straggler_policy import StragglerAction, StragglerPolicy
from elastic_ep.sim.blast_radius import blast_radius
from elastic_ep.sim.fleet import FleetConfig, simulate_fleet


def _policy(report, name):
    return next(p for p in report.policies if p.policy == name)


@pytest.fixture(scope="module")
def no_stragglers():
    # plenty of spares so a restart never waits: the restart policy is then seed 001's model;
    # EP64 x 5 slots (64 redundant, hot experts only): a failure loses experts as in seed 001
    cfg = FleetConfig(
        gpus=2048, days=120, slots_per_rank=5, spare_fraction=0.2, straggler_rate_per_gpu_hour=0.0
    )
    return simulate_fleet(cfg, replications=8, seed=3)


def test_failure_count_matches_the_rate(no_stragglers):
    cfg = no_stragglers.config
    expected = cfg.rate_per_gpu_hour * cfg.groups * cfg.ep_size * cfg.hours
    f = no_stragglers.failures
    assert abs(f.mean - expected) <= f.half_width


def test_restart_policy_loses_what_the_blast_radius_table_says(no_stragglers):
    cfg = no_stragglers.config
    table = blast_radius(cfg.gpus, [cfg.ep_size], cfg.rate_per_gpu_hour, cfg.restart_min).rows[0]
    months = cfg.days / 30
    restart = _policy(no_stragglers, "restart")
    # within the 95% interval over replications (overlapping restarts of a group count once)
    lost = restart.gpu_hours_lost
    assert abs(lost.mean / months - table.gpu_hours_lost_restart) <= lost.half_width / months
    assert restart.expert_loss_events.mean == 0


def test_elastic_recovery_loses_a_fraction_and_backup_beats_disk(no_stragglers):
    restart, disk, backup = (_policy(no_stragglers, p) for p in ("restart", "elastic-disk", "elastic-backup"))
    assert disk.gpu_hours_lost.mean < 0.5 * restart.gpu_hours_lost.mean
    assert disk.expert_loss_events.mean > 0
    assert backup.expert_loss_events.mean == disk.expert_loss_events.mean  # the same failures
    assert backup.stopped_gpu_h.mean < disk.stopped_gpu_h.mean
    assert backup.availability.mean > restart.availability.mean
    for p in no_stragglers.policies:
        assert 0.99 < p.goodput.mean <= 1
        assert p.capacity_min.mean <= p.capacity_quantiles["p1"].mean <= p.capacity_quantiles["p50"].mean <= 1


def test_stragglers_slow_restart_groups_and_are_evicted_by_elastic_ones():
    cfg = FleetConfig(gpus=1024, days=60, rate_per_gpu_hour=0.0, straggler_rate_per_gpu_hour=5e-5)
    report = simulate_fleet(cfg, replications=4, seed=1)
    restart, elastic = _policy(report, "restart"), _policy(report, "elastic-backup")
    stragglers = cfg.straggler_rate_per_gpu_hour * cfg.gpus * cfg.hours
    slow_h = stragglers * cfg.ep_size * cfg.straggler_h * (1 - cfg.straggler_speed)
    # a Poisson count over 4 replications: relative standard error 1 / sqrt(4 * stragglers); 4 of them
    assert restart.slow_gpu_h.mean == pytest.approx(slow_h, rel=4 / (4 * stragglers) ** 0.5)
    assert elastic.slow_gpu_h.mean < 0.05 * restart.slow_gpu_h.mean
    assert elastic.degraded_gpu_h.mean > 0  # the evicted rank is missing until it returns


def test_same_seed_same_answer_other_seed_other_answer():
    cfg = FleetConfig(gpus=512, days=30)
    a, b, c = (simulate_fleet(cfg, 2, seed) for seed in (7, 7, 8))
    assert a.policies == b.policies
    assert a.policies != c.policies


def test_capacity_series_is_a_fraction_over_time():
    report = simulate_fleet(FleetConfig(gpus=512, days=30), 1, 0)
    for run in report.example_runs:
        assert run.capacity_t[0] == 0 and np.all(np.diff(run.capacity_t) >= 0)
        assert np.all((run.capacity >= 0) & (run.capacity <= 1))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"gpus": 32}, "cannot hold one EP group"),
        ({"ep_size": 12}, "one must divide the other"),
        ({"slots_per_rank": 2}, "cannot hold 256 experts"),
        ({"straggler_speed": 0.0}, "must be in"),
    ],
)
def test_impossible_fleets_are_refused(changes, message):
    with pytest.raises(SimulationError, match=message):
        simulate_fleet(FleetConfig(**changes), 1)


def test_the_straggler_policy_serve_runs_decides_what_elastic_groups_lose_to_stragglers():
    """The same trace under --straggler-policy off, derate and evict: off loses what restart loses
    to stragglers, derate about half of that (the attention half cannot move), evict almost
    nothing; only evict evicts, and never more than the cap."""
    def run(**policy):
        cfg = FleetConfig(gpus=1024, days=60, rate_per_gpu_hour=0.0, straggler_rate_per_gpu_hour=5e-5,
                          straggler_policy=StragglerPolicy(**policy))
        report = simulate_fleet(cfg, replications=2, seed=1)
        return report, _policy(report, "elastic-backup")

    (off_report, off), (_, derate), (evict_report, evict) = (
        run(action=a) for a in (StragglerAction.OFF, StragglerAction.DERATE, StragglerAction.EVICT))
    restart = _policy(off_report, "restart")
    assert off.slow_gpu_h.mean == pytest.approx(restart.slow_gpu_h.mean)
    assert 0.3 * off.slow_gpu_h.mean < derate.slow_gpu_h.mean < 0.8 * off.slow_gpu_h.mean
    assert evict.slow_gpu_h.mean < 0.05 * off.slow_gpu_h.mean
    assert off.evictions.mean == derate.evictions.mean == 0 < evict.evictions.mean
    assert off_report.straggler_policy.startswith("off") and evict_report.straggler_policy.startswith("evict")
    _, capped = run(action=StragglerAction.EVICT, max_evictions=0)
    assert capped.evictions.mean == 0 and capped.slow_gpu_h.mean == pytest.approx(derate.slow_gpu_h.mean)


def test_the_fast_loss_check_agrees_with_removing_the_dead_ranks():
    """The loss test reads each expert's lowest and highest holder (`_Holders`); removing the dead
    ranks and counting the experts left (the reference, `lost_with`) says the same for every rank
    and every node of placements with and without redundancy."""
    from elastic_ep.sim.fleet import _Holders
    from elastic_ep.sim.placements import random_placement, replica_counts

    rng = np.random.default_rng(0)
    for live, slots, spread in ((32, 8, 8), (40, 7, 1), (64, 4, 8), (61, 5, 1)):
        for _ in range(3):
            placement = random_placement(replica_counts(256, live * slots - 256), live, slots, rng, spread)
            holders = _Holders.of(placement, live, slots, 256)
            for r in range(live):
                assert holders.lost_with_rank(r) == holders.lost_with(np.array([r]))
            for first in range(0, live, 8):
                count = min(8, live - first)
                assert holders.lost_with_range(first, count) == holders.lost_with(np.arange(first, first + count))


def test_the_simulation_gives_what_it_gave_before_it_was_made_fast():
    """The same seed gives the numbers the simulator gave before the loss check was vectorised
    (recorded from that code: 7 slots per rank, so losses happen)."""
    report = simulate_fleet(FleetConfig(gpus=2048, slots_per_rank=7), 1, seed=3)
    got = [(r.policy, r.failures, r.expert_loss_events, r.evictions, r.serving_gpu_h) for r in report.example_runs]
    assert got == [("restart", 323, 0, 0, 17895124.142531425), ("elastic-disk", 323, 236, 372, 17938206.321869142),
                   ("elastic-backup", 323, 236, 372, 17939365.66353581)]


def _same_report(a, b) -> bool:
    """Whether two reports hold the same numbers, bit for bit (their runs' capacity series too)."""
    def run_fields(r):
        return [getattr(r, f.name) for f in fields(r) if f.name not in ("capacity_t", "capacity")]

    return a.failures == b.failures and a.policies == b.policies and all(
        run_fields(x) == run_fields(y) and np.array_equal(x.capacity_t, y.capacity_t)
        and np.array_equal(x.capacity, y.capacity) for x, y in zip(a.example_runs, b.example_runs, strict=True))


def test_runs_in_parallel_processes_give_the_serial_numbers_bit_for_bit():
    """--jobs only says how many processes run the (replication, policy) pairs. Few spares and slow
    repairs, so groups wait and shrink and each replication asks for placements over rank counts of
    its own, in an order of its own: a pool shared across the serial runs would give other numbers."""
    cfg = FleetConfig(gpus=4096, days=200, spare_fraction=0.0005, gpu_repair_h=200, node_repair_h=100)
    serial = simulate_fleet(cfg, 3, seed=5, jobs=1)
    assert serial.policies[1].expert_loss_events.mean > 0 and serial.policies[1].evictions.mean > 0
    for jobs in (2, 4):
        assert _same_report(simulate_fleet(cfg, 3, seed=5, jobs=jobs), serial), jobs
    assert not _same_report(simulate_fleet(cfg, 3, seed=6, jobs=2), serial)  # the comparison can fail


def test_jobs_must_be_positive():
    with pytest.raises(SimulationError, match="--jobs 0 must be > 0"):
        simulate_fleet(FleetConfig(gpus=512, days=10), 1, jobs=0)
