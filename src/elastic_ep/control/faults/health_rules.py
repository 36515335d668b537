"""Failure detection from heartbeats and progress: pure functions the controller calls.

- heartbeats: a rank whose last heartbeat is older than `heartbeat_timeout_s` is lost (a
  stopped process, a cut link). Its heartbeat thread is independent of the main thread, so a
  rank blocked in a collective or merely slow keeps beating. While a rank fills its expert
  slots (its last heartbeat said phase "transfer": allocating them, reading experts from disk
  or a backup, receiving them from peers) its heartbeats may come late, the thread starved
  of the interpreter, CPU or memory by the load, so it is judged by `load_heartbeat_timeout_s`
  instead; a process that dies while loading is still reported at once by its agent.
- progress watchdog: workers report the number of collectives they have entered in the epoch
  (`seq`). When some rank has entered collective k and another has not, for longer than the
  adaptive deadline (a multiple of recent step times, with a floor), the one that has not is
  hung and is named, unless it is heard saying it is idle between steps (its plan was lost: the
  result deadline's to find, without a fence). A slow rank enters k late but within the
  deadline, and the deadline grows with the step times it causes, so slowness alone does not get
  a rank killed.
- lost results: a step whose answer (`StepResult` or `StepFailed`) from a member has not come
  past the result deadline (a multiple of recent step times, with a floor), while that rank's
  heartbeats say it is not inside the step, lost the answer or the plan on the way: the rank is
  asked to send it again (`ResendResult`), and one that says it never ran the step (its plan was
  lost) or does not answer within the resend deadline is a fault of the step. A rank still inside
  the step is slow or hung, which is the watchdog's to judge, never asked.
- liveness: what an operator sees before any deadline above acts (`Liveness`): a late heartbeat
  makes a rank suspect; a step that runs past the stall deadline names the rank that holds it
  stalled and the ranks blocked in its collectives waiting. The stall deadline only informs
  (`/ready`, `/cluster`, the dashboard, `/metrics`); fencing stays with the deadlines above.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable, Mapping

from elastic_ep.wire import Progress

from ..ranks import Liveness, RankLiveness

COLLECTIVE_PHASES = ("dispatch", "combine")


def adaptive_deadline_s(recent_step_s: Iterable[float], multiple: float, floor_s: float) -> float:
    """max(floor_s, multiple * median of recent step times)."""
    times = list(recent_step_s)
    return max(floor_s, multiple * statistics.median(times)) if times else floor_s


LOADING_PHASES = ("transfer",)


def lost_heartbeats(last_seen: Mapping[int, float], now: float, timeout_s: float,
                    loading: Collection[int] = (), load_timeout_s: float = 0.0) -> list[int]:
    """Ranks whose last heartbeat (controller clock) is older than timeout_s, or, for the
    `loading` ones (last heard filling their slots), older than load_timeout_s."""
    return sorted(r for r, t in last_seen.items()
                  if now - t > (max(timeout_s, load_timeout_s) if r in loading else timeout_s))


def hung_ranks(
    progress: Mapping[int, Progress],
    epoch: int,
    first_seen: Mapping[int, float],
    now: float,
    deadline_s: float,
    heard: Mapping[int, float] | None = None,
) -> list[int]:
    """Members that have not entered the furthest collective of `epoch` although another
    member entered it more than deadline_s ago (first_seen: seq -> controller time it was first
    reported), and are not themselves waiting inside a collective: a member blocked in
    collective k waits on a peer (one that died, stopped or was cut off mid-collective, so some
    members got its part and moved on to k + 1 while others still wait for it) and is its victim,
    not the culprit. A peer that is silent is named by its heartbeats. Nor a member whose
    heartbeat, heard (`heard`: rank -> when) within deadline_s / 2, says it is idle between
    steps: it waits for its plan, lost on the way (a cut link, a stalled agent), and the result
    deadline asks it for the step (NOT_RUN: run again by all, no rank fenced); were its main
    thread hung there, it would not answer that and be named then."""
    seqs = {r: (p.seq if p.epoch == epoch else 0) for r, p in progress.items()}
    if not seqs:
        return []
    furthest = max(seqs.values())
    if furthest == 0 or now - first_seen.get(furthest, now) <= deadline_s:
        return []
    heard = heard or {}
    return sorted(r for r, s in seqs.items() if s < furthest and progress[r].phase not in COLLECTIVE_PHASES
                  and not (progress[r].phase == "idle" and now - heard.get(r, -math.inf) <= deadline_s / 2))


def running_step(progress: Progress | None, epoch: int, step: int) -> bool:
    """The rank's last heartbeat shows it inside step `step` of `epoch` (computing or in a collective)."""
    return progress is not None and (progress.epoch, progress.step) == (epoch, step) and progress.phase != "idle"


def results_to_ask(unanswered: Iterable[int], progress: Mapping[int, Progress], epoch: int, step: int,
                   waited_s: float, deadline_s: float) -> list[int]:
    """Members to ask for their answer to (epoch, step) again: the step was sent `waited_s` ago, past
    `deadline_s`, they have not answered, and their last heartbeat does not show them inside the step."""
    if waited_s <= deadline_s:
        return []
    return sorted(r for r in unanswered if not running_step(progress.get(r), epoch, step))


def resends_unanswered(asked_at: Mapping[int, float], progress: Mapping[int, Progress], epoch: int, step: int,
                       now: float, timeout_s: float) -> list[int]:
    """Ranks asked to resend (asked_at: rank -> when, of those still without an answer) more than
    `timeout_s` ago, unless their heartbeat now shows them inside the step (its plan came late)."""
    return sorted(r for r, at in asked_at.items()
                  if now - at > timeout_s and not running_step(progress.get(r), epoch, step))


def rank_liveness(heartbeat_age_s: float, step_age_s: float | None, in_step: bool, phase: str,
                  suspect_after_s: float, stall_after_s: float) -> RankLiveness:
    """A running rank's liveness. heartbeat_age_s: since its last heartbeat; step_age_s: how long
    the step in flight has run (None: no step in flight); in_step: it has not answered that step
    yet; phase: where its last heartbeat says it is (`Progress.phase`)."""
    if heartbeat_age_s >= stall_after_s:
        return RankLiveness(Liveness.STALLED, heartbeat_age_s,
                            f"no heartbeat for {heartbeat_age_s:.1f}s: stopped, frozen or cut off")
    if step_age_s is not None and step_age_s >= stall_after_s and in_step:
        if phase in COLLECTIVE_PHASES:
            return RankLiveness(Liveness.WAITING, step_age_s, f"waits in a {phase} all-to-all for {step_age_s:.1f}s")
        return RankLiveness(Liveness.STALLED, step_age_s,
                            f"in {phase}, outside the collective the others wait in, for {step_age_s:.1f}s")
    if heartbeat_age_s >= suspect_after_s:
        return RankLiveness(Liveness.SUSPECT, None, f"heartbeat {heartbeat_age_s:.2f}s old")
    return RankLiveness(Liveness.LIVE)


def stall_reason(step_age_s: float | None, stall_after_s: float, liveness: Mapping[int, RankLiveness]) -> str | None:
    """Why the group cannot make progress now (None when it can): the step in flight ran past the
    stall deadline, or a member is stalled (the next step would wait for it)."""
    stalled = {r: lv for r, lv in sorted(liveness.items()) if lv.state == Liveness.STALLED}
    step_stalled = step_age_s is not None and step_age_s >= stall_after_s
    if not stalled and not step_stalled:
        return None
    waiting = sorted(r for r, lv in liveness.items() if lv.state == Liveness.WAITING)
    parts = [f"rank {r} {lv.reason}" for r, lv in stalled.items()]
    parts += [f"ranks {waiting} wait in a collective"] if waiting else []
    head = (f"stalled: the step in flight has run {step_age_s:.1f}s, past the stall deadline {stall_after_s:.2f}s"
            if step_stalled else f"stalled: a member has been silent past the stall deadline {stall_after_s:.2f}s")
    return "; ".join([head, *parts])


def relative_speeds(own_s: Mapping[int, Iterable[float]]) -> dict[int, float]:
    """rank -> speed relative to the median rank (1.0), from each rank's own time per step
    (step time less collective wait): a rank that takes twice the median is 0.5. Ranks with no
    samples are left out (placement takes them as 1.0)."""
    medians = {r: statistics.median(v) for r, v in own_s.items() if list(v)}
    medians = {r: m for r, m in medians.items() if m > 0}
    if not medians:
        return {}
    typical = statistics.median(medians.values())
    return {r: typical / m for r, m in medians.items()}
