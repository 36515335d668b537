import json
from pathlib import Path

import numpy as np
import pytest

from elastic_ep.errors import PlacementError
from elastic_ep.placement import ExpertLocation, rebalance_experts

# A copy of ../shared/data/eplb_readme_example.json (DeepSeek EPLB README example, MIT), so a clone tests alone.
EXAMPLE = Path(__file__).resolve().parent / "data" / "eplb_readme_example.json"


def test_readme_example_comes_out_exactly():
    example = json.loads(EXAMPLE.read_text())
    phy2log, log2phy, logcnt = rebalance_experts(example["weight"], **example["call"])
    assert phy2log.tolist() == example["expected_phy2log"]
    loc = ExpertLocation(phy2log, logcnt, 2, 8)
    loc.validate()
    assert np.array_equal(loc.log2phy, log2phy)


def test_global_policy_when_groups_do_not_split_over_nodes():
    rng = np.random.default_rng(1)
    weight = rng.integers(1, 100, size=(3, 12))
    phy2log, log2phy, logcnt = rebalance_experts(weight, 18, 4, 3 + 0, 6)  # 4 % 3 != 0: global
    assert phy2log.shape == (3, 18)
    assert logcnt.sum(1).tolist() == [18, 18, 18]
    assert (logcnt >= 1).all()
    # the hottest expert of each layer gets the most replicas
    assert (logcnt[np.arange(3), weight.argmax(1)] == logcnt.max(1)).all()


def test_too_few_slots_is_a_clear_error():
    with pytest.raises(PlacementError, match="4 slots missing"):
        rebalance_experts(np.ones((1, 12)), 8, 1, 1, 4)
