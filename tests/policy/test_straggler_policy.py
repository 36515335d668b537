"""The straggler policy's decisions over sequences of verdicts: derate at once, evict only after a
slow stretch of the whole window, hysteresis, the cap, the floor and a group slowdown."""

import pytest

from elastic_ep.errors import ElasticEPError
from elastic_ep.policy.straggler_policy import (
    DecisionKind,
    PolicyState,
    StragglerAction,
    StragglerPolicy,
    decide,
)
from elastic_ep.policy.straggler_verdict import Verdict, VerdictKind

MEMBERS = [0, 1, 2, 3]
POLICY = StragglerPolicy(StragglerAction.EVICT, evict_after_s=10, clear_after_s=5, max_evictions=1,
                         eviction_window_s=100)


def verdicts(slow=(), unknown=(), members=MEMBERS):
    def one(r):
        if r in slow:
            return Verdict(r, VerdictKind.STRAGGLER, 40, 5, 5, 5, 0, own_ms=30.0, peer_own_ms=10.0)
        return Verdict(r, VerdictKind.UNKNOWN if r in unknown else VerdictKind.OK, 40, 5, 5, 0, 0, own_ms=10.0,
                       peer_own_ms=10.0)
    return {r: one(r) for r in members}


def run(timeline, policy=POLICY, members=MEMBERS, min_ranks=2, standbys=0, state=None):
    """timeline: (time, verdicts) pairs; an evicted rank leaves the members (and its verdict is
    dropped), as on the server; -> [(time, decision)] and the last state."""
    state, members = state or PolicyState(), list(members)
    out = []
    for t, v in timeline:
        v = {r: x for r, x in v.items() if r in members}
        state, decisions = decide(state, policy, v, t, members, min_ranks, standbys)
        out += [(t, d) for d in decisions]
        members = [r for r in members if not any(d.kind == DecisionKind.EVICT and d.rank_id == r for d in decisions)]
    return out, state


def kinds(out):
    return [(t, d.kind, d.rank_id) for t, d in out]


def test_a_straggler_is_derated_at_once_and_evicted_when_it_stays_slow():
    out, _ = run([(t, verdicts(slow={2})) for t in range(0, 15)])
    assert kinds(out) == [(0, DecisionKind.DERATE, 2), (10, DecisionKind.EVICT, 2)]
    derate = out[0][1]
    assert derate.speed == pytest.approx(1 / 3) and "own time 30.0 ms/step" in derate.evidence


def test_derate_policy_never_evicts_and_off_does_nothing():
    timeline = [(t, verdicts(slow={2})) for t in range(0, 30)]
    out, _ = run(timeline, StragglerPolicy(StragglerAction.DERATE, evict_after_s=10))
    assert kinds(out) == [(0, DecisionKind.DERATE, 2)]
    out, state = run(timeline, StragglerPolicy(StragglerAction.OFF))
    assert out == [] and state.speeds() == {}


def test_a_flapping_rank_is_derated_once_and_its_eviction_clock_restarts():
    # slow 4 s, ok 3 s, again and again: never slow for the 10 s window, never ok for the 5 s clear
    timeline = [(t, verdicts(slow={1} if t % 7 < 4 else ())) for t in range(0, 70)]
    out, state = run(timeline)
    assert kinds(out) == [(0, DecisionKind.DERATE, 1)]
    assert state.speeds() == {1: pytest.approx(1 / 3)}


def test_a_rank_ok_for_the_clear_window_gets_full_weight_back():
    timeline = [(t, verdicts(slow={1})) for t in range(0, 3)] + [(t, verdicts()) for t in range(3, 10)]
    out, state = run(timeline)
    assert kinds(out) == [(0, DecisionKind.DERATE, 1), (8, DecisionKind.RESTORE, 1)]
    assert state.speeds() == {}


def test_no_verdict_is_no_evidence_either_way():
    # an idle stretch (unknown) neither clears the derate nor lets the eviction clock run on
    timeline = ([(t, verdicts(slow={1})) for t in range(0, 6)] + [(t, verdicts(unknown={0, 1, 2, 3}))
                                                                   for t in range(6, 60)]
                + [(t, verdicts(slow={1})) for t in range(60, 65)])
    out, state = run(timeline)
    assert kinds(out) == [(0, DecisionKind.DERATE, 1)]
    assert 1 in state.speeds()


def test_the_cap_holds_over_the_window_and_is_said_once():
    timeline = [(t, verdicts(slow={1, 2})) for t in range(0, 40)]
    out, state = run(timeline)
    assert kinds(out) == [(0, DecisionKind.DERATE, 1), (0, DecisionKind.DERATE, 2), (10, DecisionKind.EVICT, 1),
                          (11, DecisionKind.HOLD, 2)]
    assert "--straggler-max-evictions 1" in out[-1][1].reason
    # once the window has passed, the next one may go
    later, _ = run([(t, verdicts(slow={2})) for t in range(111, 113)], members=[0, 2, 3], state=state)
    assert kinds(later) == [(111, DecisionKind.EVICT, 2)]


def test_never_below_the_size_that_holds_every_expert_unless_a_standby_takes_the_place():
    timeline = [(t, verdicts(slow={3})) for t in range(0, 12)]
    out, _ = run(timeline, min_ranks=4)
    assert kinds(out) == [(0, DecisionKind.DERATE, 3), (10, DecisionKind.HOLD, 3)]
    assert "fewer than the 4 that hold every expert" in out[-1][1].reason
    out, _ = run(timeline, min_ranks=4, standbys=1)
    assert kinds(out)[-1] == (10, DecisionKind.EVICT, 3)


def test_a_slowdown_of_most_of_the_group_acts_on_nobody():
    out, state = run([(t, verdicts(slow={0, 1, 2})) for t in range(0, 30)])
    assert kinds(out) == [(0, DecisionKind.HOLD, None)]
    assert "whole group" in out[0][1].reason and state.speeds() == {}


def test_bad_parameters_are_named():
    with pytest.raises(ElasticEPError, match="--straggler-evict-after-s"):
        StragglerPolicy(evict_after_s=-1)
    with pytest.raises(ElasticEPError, match="--straggler-max-evictions"):
        StragglerPolicy(max_evictions=-1)
    with pytest.raises(ValueError):
        StragglerPolicy(action="sometimes")
