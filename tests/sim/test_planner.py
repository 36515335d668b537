"""The planner: seed 001 exercise 2 and the recommendation's rules."""

import numpy as np
import pytest

from elastic_ep.errors import SimulationError
from elastic_ep.placement import choose_redundant_experts
from elastic_ep.sim.planner import AUTO, PlanInputs, make_plan


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
    by_r = {o.redundant: o for o in _plan(ep=[64], redundant=[0, 64, 256], backup=[True]).options}
    assert by_r[0].loss_p_rank == 1.0 and by_r[64].loss_p_rank == pytest.approx(1.0)
    assert by_r[256].loss_p_rank == 0 and by_r[256].loss_p_node == 0  # replicas on distinct nodes


def test_losses_scale_with_ep_size_and_backup_cuts_the_reload():
    plan = _plan(redundant=[AUTO])
    lost = {(o.ep_size, o.backup): o for o in plan.options}
    assert lost[(256, False)].gpu_hours_lost_restart == pytest.approx(
        4 * lost[(64, False)].gpu_hours_lost_restart
    )
    for ep in (32, 64, 128):
        assert lost[(ep, True)].gpu_hours_lost_elastic < lost[(ep, False)].gpu_hours_lost_elastic
        assert lost[(ep, False)].gpu_hours_lost_elastic < lost[(ep, False)].gpu_hours_lost_restart
    # EP256's auto count holds every expert twice on distinct nodes: nothing to reload, backup or not.
    assert lost[(256, True)].loss_p_failure == 0
    assert lost[(256, True)].gpu_hours_lost_elastic == lost[(256, False)].gpu_hours_lost_elastic


def test_issue_17_only_counts_serve_accepts_are_listed_and_the_rest_are_named():
    # 256 experts do not split over 48 ranks: 0 becomes 32, 256 becomes 272, each with a note.
    plan = _plan(ep=[48, 96], redundant=[0, AUTO, 256], backup=[True])
    for o in plan.options:
        assert (256 + o.redundant) % o.ep_size == 0
        assert o.slots_per_rank * o.ep_size == 256 + o.redundant
    assert {(o.ep_size, o.redundant) for o in plan.options} == {(48, 32), (48, 80), (48, 272), (96, 32), (96, 320)}
    assert any("EP48: 256 experts + 0 redundant do not split evenly" in n and "listed 32" in n for n in plan.notes)
    assert len(plan.notes) == 4
    assert plan.recommended is not None and (256 + plan.recommended.redundant) % plan.recommended.ep_size == 0


def test_auto_is_the_placement_rule_and_a_count_that_dies_with_a_rank_costs_a_restart():
    plan = _plan(ep=[64], redundant=[0, AUTO], backup=[True])
    by_r = {o.redundant: o for o in plan.options}
    auto = choose_redundant_experts(256, 64, 58, 44_000_000, ranks_per_node=8)
    assert by_r[auto.redundant_experts].requested == (AUTO,)
    assert (by_r[64].survives_rank_losses, by_r[64].survives_node_losses) == (12, 1)
    # 64 ranks x 4 slots: one dead rank leaves 252 slots for 256 experts, so the group stops.
    zero = by_r[0]
    assert (zero.survives_rank_losses, zero.survives_node_losses) == (0, 0)
    assert zero.gpu_hours_lost_elastic == pytest.approx(zero.gpu_hours_lost_restart)
    assert by_r[64].gpu_hours_lost_elastic < zero.gpu_hours_lost_elastic / 5


def test_an_auto_count_equal_to_a_requested_one_is_one_row():
    plan = _plan(ep=[256], redundant=[AUTO, 256], backup=[True])
    (option,) = plan.options
    assert option.redundant == 256 and option.requested == (AUTO, "256")


def test_the_commands_run_the_recommendation_on_its_nodes():
    plan = _plan(ep=[48], redundant=[AUTO], backup=[True])
    serve, *agents = plan.commands
    assert serve == (
        "elastic-ep serve --model CHECKPOINT_DIR --ep-size 48 --redundant-experts 80 --expert-backup "
        "--local-ranks 8 --host NODE0_IP --cluster-key-file CLUSTER_KEY"
    )
    assert agents == [
        f"elastic-ep agent --controller CONTROLLER_ADDR --node node{i} --ranks 8 --advertise-host NODE{i}_IP "
        "--cluster-key-file CLUSTER_KEY"
        for i in range(1, 6)
    ]
    one_node = _plan(PlanInputs(gpus_per_node=16), ep=[16], redundant=[0], backup=[False])
    assert one_node.commands == [
        "elastic-ep serve --model CHECKPOINT_DIR --ep-size 16 --redundant-experts 0 --no-expert-backup"
    ]


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
        ([64], ["two"], "a count >= 0 or auto"),
    ],
)
def test_impossible_options_are_refused(ep, redundant, message):
    with pytest.raises(SimulationError, match=message):
        _plan(ep=ep, redundant=redundant)


@pytest.mark.parametrize(
    "inputs, message",
    [
        (PlanInputs(gpus=-5), "--gpus -5 must be > 0"),
        (PlanInputs(gpus_per_node=0), "--gpus-per-node 0 must be > 0"),
        (PlanInputs(gpu_mem_gb=0), "--gpu-mem-gb"),
        (PlanInputs(other_gb=-1), "--other-gb -1"),
        (PlanInputs(pause_min=float("nan")), "--pause-min nan"),
        (PlanInputs(node_share=1.5), "--node-share 1.5 must be between 0 and 1"),
    ],
)
def test_impossible_inputs_are_refused(inputs, message):
    with pytest.raises(SimulationError, match=message):
        _plan(inputs, ep=[64], redundant=[0])
