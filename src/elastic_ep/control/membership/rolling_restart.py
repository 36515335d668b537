"""The rolling restart driver (`POST /rolling_restart`): moves a `RolloutOp`
(membership/rollout_rules.py, the rules) on at step boundaries, one rank at a time, out of what
exists: a scale-up that takes a standby or starts a process (on the node of the rank it replaces),
a scale-down that names the rank (it drains, its experts move off, it stops), and the retirement
of a standby. It starts no process and forms no epoch itself: the scale driver does both.

The new options apply from the request on to every process started (the rollout's, a restart
after a fault, a standby, a scale-up): `Processes.options`, sent with each `StartWorker`. A new
`model_dir` must hold the same model (`check_model`): the ranks of one group serve one model,
and experts move between them, so new weights are no rolling restart's job.

Abort (`POST /rolling_restart/abort`): the rank in flight finishes its plan (its replacement
serves, so the group is whole again), no later rank is touched, the state ends `aborted`; the
ranks not reached keep their old processes and the options stay those of the rollout for any
process started later. A step that fails (its scale failed, or a wait ran past
--elastic-ep-scale-timeout) fails the rollout with the reason; the service serves on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from ..api import ScaleRejected
from ..cluster import ClusterState
from ..config import ServeConfig
from ..events import EventKind
from ..ranks import RankStatus
from .rollout_rules import ROLLOUT_OPTIONS, GroupView, RolloutOp, next_turn, old_processes, refusal, rollout_view
from .scale_rules import ScaleOp, scale_limits


class Scaling(Protocol):
    """The scale driver (membership/scale_driver.py)."""

    op: ScaleOp | None

    def request(self, new_ep_size: int | None, ranks: list[int] | None = None, node: str | None = None,
                param: str = "ranks", start_on: str | None = None) -> dict[str, Any]: ...

    @property
    def active(self) -> bool: ...


class Processes(Protocol):
    """The rank processes (membership/nodes.py)."""

    options: dict[str, Any]

    def retire(self, rank_id: int, reason: str) -> None: ...


class RollingRestart:
    """Built with the cluster state, the scale driver, the rank processes and the callables
    `standbys()` (the standbys ready), `check_model(path)` (why `path` cannot replace the served
    checkpoint, "" when it can) and `publish()`."""

    def __init__(self, cluster: ClusterState, cfg: ServeConfig, scaling: Scaling, processes: Processes, *,
                 standbys: Callable[[], list[int]], check_model: Callable[[str], str], publish: Callable[[], None]):
        self.cluster = cluster
        self.cfg = cfg
        self.scaling = scaling
        self.processes = processes
        self.standbys = standbys
        self.check_model = check_model
        self.publish = publish
        self.op: RolloutOp | None = None
        self.scale_op: ScaleOp | None = None  # the scale the step in flight asked for
        self.node = ""  # the node of the rank in flight: its restarted process starts there
        self.size = 0  # the members when the rollout began

    @property
    def active(self) -> bool:
        return self.op is not None and self.op.active

    def busy(self) -> str:
        """Why a scale or drain from outside must wait ("" when none is in flight)."""
        op = self.op
        if op is None or not op.active:
            return ""
        return (f"a rolling restart is in flight (rank {op.rank_id}, {op.phase})" if op.rank_id is not None
                else "a rolling restart is in flight") + "; wait for it, or POST /rolling_restart/abort"

    def request(self, options: dict[str, Any]) -> dict[str, Any]:
        """Start replacing every process with one started with `options` (WorkerLaunch fields of
        ROLLOUT_OPTIONS). Raises ScaleRejected: 400 for an option it cannot take, 409 while a
        rollout or a scale is in flight, before the group is whole, or when no rank could leave."""
        c = self.cluster
        if self.active:
            raise ScaleRejected(self.busy(), 409, "rolling_restart")
        if self.scaling.active:
            raise ScaleRejected("a scale or drain is in flight; wait until GET /is_scaling_elastic_ep says "
                                "is_scaling_elastic_ep false", 409, "rolling_restart")
        unknown = sorted(set(options) - set(ROLLOUT_OPTIONS))
        if unknown:
            raise ScaleRejected(f"options {unknown} cannot change in a rolling restart; these can: "
                                f"{', '.join(ROLLOUT_OPTIONS)}", 400, unknown[0])
        if "model_dir" in options:
            problem = self.check_model(options["model_dir"])
            if problem:
                raise ScaleRejected(problem, 400, "model")
        if c.epoch < 0 or not c.readiness.ready:
            raise ScaleRejected(f"the cluster is not ready ({c.readiness.reason or 'starting'}); retry once "
                                "GET /ready answers 200", 409, "rolling_restart")
        away = [r for r in c.intended_ranks() if r not in c.members]
        if away:
            raise ScaleRejected(f"ranks {away} are not serving (down or starting); a rolling restart begins with "
                                "the whole group: wait until GET /cluster shows them serving", 409, "rolling_restart")
        old = {r.rank_id: r.pid for r in c.ranks.values()
               if r.pid is not None and (r.rank_id in c.members or r.status == RankStatus.STANDBY)}
        problem = refusal(self._view(old))
        if problem:
            raise ScaleRejected(problem, 409, "rolling_restart")
        self.op, self.size = RolloutOp(old, dict(options)), len(c.members)
        self.processes.options.update(options)
        c.events.add(EventKind.ROLLOUT, f"rolling restart of {len(old)} processes (ranks {sorted(old)}) with "
                     f"options {options or 'unchanged'}", options=dict(options))
        self.publish()
        return self.status()

    def abort(self) -> dict[str, Any]:
        """No rank after the one in flight (which finishes) is replaced. Raises ScaleRejected 409
        when no rollout is in flight."""
        op = self.op
        if op is None or not op.active:
            raise ScaleRejected("no rolling restart is in flight (GET /rolling_restart shows the last)", 409,
                                "rolling_restart")
        if op.state == "running":
            op.state = "aborting"
            if op.rank_id is None:
                self._end("aborted")
            else:
                self.cluster.events.add(EventKind.ROLLOUT, f"rolling restart aborted: rank {op.rank_id} ({op.phase}) "
                                        "finishes, no other rank is replaced", op.rank_id)
        self.publish()
        return self.status()

    def status(self) -> dict[str, Any]:
        op = self.op
        return rollout_view(op, old_processes(self._pids(), op.old) if op is not None else [])

    # ---- at step boundaries ---------------------------------------------------------------------

    def advance(self) -> None:
        """Move the rollout on (call it while no scale is in flight); publishes when it moved."""
        op = self.op
        assert op is not None
        now = time.monotonic()
        was = (op.state, op.rank_id, op.step, op.waiting)
        if op.rank_id is None:
            self._next_rank(op, now)
        elif self._step_done(op):
            if op.next_step(now):
                self._enter(op)
            else:
                joined = op.joined
                r = self.cluster.ranks.get(joined) if joined is not None else None
                old_pid = op.old[op.rank_id]
                self.cluster.events.add(EventKind.ROLLOUT, f"rank {op.rank_id} (pid {old_pid}) replaced "
                                        f"({op.plan}) in {now - op.rank_started_at:.2f}s" +
                                        (f" by rank {joined} (pid {r.pid})" if r is not None else ""), op.rank_id)
                op.rank_done(old_pid, r.pid if r is not None else None, now)
                if not op.active:
                    self._end(op.state)
        elif op.phase in ("retiring_standby", "stopping") and now - op.step_started_at > self._timeout_s:
            self._fail(f"rank {op.rank_id} (pid {op.old[op.rank_id]}) did not stop within --elastic-ep-scale-timeout "
                       f"{self._timeout_s:g}s; check its node's agent")
        if (op.state, op.rank_id, op.step, op.waiting) != was:
            self.publish()

    def _next_rank(self, op: RolloutOp, now: float) -> None:
        turn = next_turn(self._view(op.old))
        if turn.plan == "done":
            self._end("done")
        elif turn.plan == "stuck":
            self._fail(turn.reason)
        elif turn.plan == "wait":
            if not op.waiting:
                op.waiting, op.step_started_at = turn.reason, now
            elif now - op.step_started_at > self._timeout_s:
                self._fail(f"no standby registered within --elastic-ep-scale-timeout {self._timeout_s:g}s "
                           f"({turn.reason})")
        else:
            assert turn.rank_id is not None
            op.begin(turn, now)
            self.node = self.cluster.ranks[turn.rank_id].node
            self._enter(op)

    def _enter(self, op: RolloutOp) -> None:
        """Begin the step of the rank in flight."""
        c, rank = self.cluster, op.rank_id
        assert rank is not None
        c.events.add(EventKind.ROLLOUT, f"rank {rank}: {op.phase} ({op.plan})", rank, plan=op.plan, phase=op.phase)
        if op.phase == "retiring_standby":
            self.processes.retire(rank, "rolling restart: a new standby replaces it")
        elif op.phase == "draining":
            self._scale(None, [rank])
        elif op.phase in ("taking_standby", "starting"):
            self._scale(len(c.members) + 1, start_on=self.node if op.phase == "starting" else None)

    def _scale(self, new_ep_size: int | None, ranks: list[int] | None = None, start_on: str | None = None) -> None:
        try:
            self.scaling.request(new_ep_size, ranks, start_on=start_on)
        except ScaleRejected as e:
            self._fail(f"rank {self.op.rank_id if self.op else None}: {e}")
            return
        self.scale_op = self.scaling.op

    def _step_done(self, op: RolloutOp) -> bool:
        """The step of the rank in flight has done its part (a scale that failed fails the rollout)."""
        rank = op.rank_id
        assert rank is not None
        if op.phase in ("retiring_standby", "stopping"):
            return self._pids().get(rank) != op.old[rank]
        scale = self.scale_op
        if scale is None or scale.active:
            return False
        if scale.phase == "failed":
            self._fail(f"rank {rank} ({op.phase}): {scale.error}")
            return False
        if op.phase in ("taking_standby", "starting") and scale.new_ranks:
            op.joined = scale.new_ranks[0]
        return True

    def _fail(self, error: str) -> None:
        members = len(self.cluster.members)
        self._end("failed", error + (f"; the group serves at {members} ranks, not {self.size}: POST /scale_elastic_ep "
                                     "brings it back" if members < self.size else ""))

    def _end(self, state: str, error: str | None = None) -> None:
        op = self.op
        assert op is not None
        op.finish(state, error)
        pending = old_processes(self._pids(), op.old)
        self.cluster.events.add(EventKind.SCALE_FAILED if state == "failed" else EventKind.ROLLOUT,
                                f"rolling restart {state} after {op.finished_s:.2f}s: {len(op.replaced)} ranks "
                                f"replaced, {len(pending)} not" + (f": {error}" if error else ""))

    # ---- what it reads -------------------------------------------------------------------------

    @property
    def _timeout_s(self) -> float:
        return self.cfg.elastic_ep_scale_timeout_s

    def _pids(self) -> dict[int, int | None]:
        return {r.rank_id: r.pid for r in self.cluster.ranks.values()}

    def _view(self, old: dict[int, int]) -> GroupView:
        c = self.cluster
        still = old_processes(self._pids(), old)
        standbys = self.standbys()
        return GroupView(
            old_standbys=[r for r in still if r in standbys], old_members=[r for r in still if r in c.members],
            new_standbys=[r for r in standbys if r not in still], size=len(c.members),
            fewest=scale_limits(c.num_experts, c.slots_per_rank, self.cfg.max_ranks)[0], most=self.cfg.max_ranks,
            standbys_wanted=self.cfg.standby_ranks)
