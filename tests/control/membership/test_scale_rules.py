import pytest

from elastic_ep.control.api import ScaleRejected
from elastic_ep.control.epochs.epoch_plan import trimmed
from elastic_ep.control.membership.scale_rules import (
    ScaleOp,
    agent_for_new_rank,
    check_target,
    new_rank_ids,
    ranks_to_retire,
    scale_limits,
    status_view,
)
from elastic_ep.placement.location import ExpertLocation


def test_limits_are_the_fewest_ranks_holding_every_expert_and_max_ep_size():
    assert scale_limits(16, 8, 6) == (2, 6)
    assert scale_limits(16, 6, 8) == (3, 8)


@pytest.mark.parametrize("target,status,needle", [(1, 400, "2..6"), (7, 400, "--max-ep-size 6"), (4, 400, "already")])
def test_invalid_targets_are_400_with_the_limits(target, status, needle):
    with pytest.raises(ScaleRejected, match=needle) as e:
        check_target(target, 4, (2, 6), None)
    assert e.value.status == status


def test_a_scale_in_flight_is_409_and_a_finished_one_is_not():
    op = ScaleOp(4, 6)
    with pytest.raises(ScaleRejected, match="in flight") as e:
        check_target(5, 4, (2, 6), op)
    assert e.value.status == 409
    op.finish("failed", "joiner died")
    check_target(5, 4, (2, 6), op)


def test_new_ranks_fill_the_gaps_and_scale_down_retires_the_highest():
    assert new_rank_ids([0, 1, 3], 2) == [2, 4]
    assert ranks_to_retire([0, 1, 2, 3, 4, 5], 3) == [3, 4, 5]
    assert ranks_to_retire([0, 1], 0) == []


def test_new_ranks_go_to_the_least_loaded_node():
    assert agent_for_new_rank(["b", "a"], {0: "a", 1: "a", 2: "b"}) == "b"
    assert agent_for_new_rank(["b", "a"], {}) == "a"


def test_status_uses_sglang_fields_and_keeps_the_old_ones():
    idle = status_view(None, 4)
    assert idle["is_scaling_elastic_ep"] is False and idle["scale_phase"] == "serving" and idle["ep_size"] == 4
    op = ScaleOp(4, 6)
    op.phase = "joining"
    busy = status_view(op, 4)
    assert busy["is_scaling_elastic_ep"] and busy["scale_phase"] == "joining" and busy["is_scaling"]
    op.finish("serving_expanded")
    assert status_view(op, 6)["elapsed_s"] is not None and not status_view(op, 6)["is_scaling_elastic_ep"]


def test_trimmed_drops_empty_trailing_ranks_only():
    loc = ExpertLocation.from_phy2log([[0, 1, 2, 3, -1, -1]], 2, 4)
    assert trimmed(loc, 2).num_ranks == 2
    full = ExpertLocation.from_phy2log([[0, 1, 2, 3, 0, 1]], 2, 4)
    assert trimmed(full, 2) is full
