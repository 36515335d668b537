"""The planner: seed 001 exercise 2 and the recommendation's rules."""

import numpy as np
import pytest

from elastic_ep.errors import SimulationError
from elastic_ep.sim.planner import PlanInputs, make_plan


def _plan(inputs=None, ep=(32, 64, 128, 256), redundant=(0, 32, 256), backup=(False, True)):
    return make_plan(
        inputs or PlanInputs(), list(ep), list(redundant), list(backup), np.random.default_rng(0)
    )


def test_exercise_2_every_expert_twice_costs_about_650_gb():
    plan = _plan(ep=[64], redundant=[256])
    (opt, _) = plan.options
    assert opt.redundancy_gb_per_group == pytest.approx(256 * 58 * 44 / 1000)
    assert round(opt.redundancy_gb_per_group, -1) == 650
    assert opt.slots_per_rank == 8 and opt.expert_gb_per_gpu == pytest.approx(8 * 58 * 44 / 1000)


def test_loss_probability_follows_the_redundancy():
    by_r = {o.redundant: o for o in _plan(ep=[64], backup=[True]).options}
    assert by_r[0].loss_p_rank == 1.0 and by_r[32].loss_p_rank == pytest.approx(1.0)
    assert by_r[256].loss_p_rank == 0 and by_r[256].loss_p_node == 0  # replicas on distinct nodes


def test_losses_scale_with_ep_size_and_backup_cuts_the_reload():
    plan = _plan(redundant=[0])
    lost = {(o.ep_size, o.backup): o for o in plan.options}
    assert lost[(256, False)].gpu_hours_lost_restart == pytest.approx(
        4 * lost[(64, False)].gpu_hours_lost_restart
    )
    for ep in (32, 64, 128, 256):
        assert lost[(ep, True)].gpu_hours_lost_elastic < lost[(ep, False)].gpu_hours_lost_elastic
        assert lost[(ep, False)].gpu_hours_lost_elastic < lost[(ep, False)].gpu_hours_lost_restart


def test_recommendation_fits_in_memory_and_says_why():
    plan = _plan(PlanInputs(gpu_mem_gb=80))
    best = plan.recommended
    assert best is not None and best.fits
    fitting = [o for o in plan.options if o.fits]
    assert best.gpu_hours_lost_elastic <= 1.25 * min(o.gpu_hours_lost_elastic for o in fitting)
    assert f"EP{best.ep_size}" in plan.reason and "GB" in plan.reason
    assert not any(o.fits for o in plan.options if o.ep_size == 32)  # 20.4 GB of experts + 60 > 80


def test_nothing_fits_is_said_plainly():
    plan = _plan(PlanInputs(gpu_mem_gb=50), ep=[8], redundant=[0])
    assert plan.recommended is None
    assert "no option fits" in plan.reason


@pytest.mark.parametrize(
    "ep, redundant, message",
    [
        ([4096], [0], "between 1 and --gpus"),
        ([2], [512], "more replicas of an expert than EP2"),
        ([64], [-1], ">= 0"),
    ],
)
def test_impossible_options_are_refused(ep, redundant, message):
    with pytest.raises(SimulationError, match=message):
        _plan(ep=ep, redundant=redundant)
