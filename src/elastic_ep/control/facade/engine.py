"""The engine facade the HTTP thread talks to (`control.api.Engine`): it sends typed commands to
the control thread and reads what that thread publishes. It writes no cluster state.

While a rank dies, hangs or is slow nothing here changes: requests already admitted wait on
their streams (they pause, never fail), new ones wait up to --admission-timeout-s for a ready
cluster and then get a 503 with the reason, and the snapshot shows recovery as it happens.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from elastic_ep.errors import ElasticEPError
from elastic_ep.model.block_manager import blocks_for

from ..api import (
    CHAOS_ACTIONS,
    ChaosOrder,
    EngineInfo,
    GenerationRequest,
    Health,
    Readiness,
    RequestOutput,
    ScaleRejected,
    ServiceUnavailable,
)
from ..config import ServeConfig
from ..events import select_events
from ..serving.recorder import ExpertRecorder
from ..serving.scheduler import Sequence
from ..serving.streams import Stream
from .to_loop import (
    AbortRequest,
    AbortRollout,
    AddRequest,
    Command,
    CorruptExpertSlot,
    CutNetwork,
    LoseMessage,
    Lost,
    PoisonRank,
    PoisonRequest,
    SignalRank,
    Sleep,
    SlowRank,
    StartDrain,
    StartRollout,
    StartScale,
    Uncordon,
    WakeUp,
)

SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "resume": signal.SIGCONT}


@dataclass
class Published:
    """What the control thread publishes for other threads; each field is replaced whole."""

    readiness: Readiness = field(default_factory=lambda: Readiness(False, "starting: waiting for ranks to register"))
    health: Health = field(default_factory=lambda: Health("degraded", "starting"))
    snapshot: dict[str, Any] = field(default_factory=dict)
    fatal: str | None = None
    sleep_level: int = 0  # 0 awake; else the level the group sleeps at, or is falling asleep to


class EngineFacade:
    """`send(command)` enqueues for the control thread and wakes it. `answer_timeout_s`: how long
    a scale, drain or uncordon waits for the control loop's answer; `sleep_answer_timeout_s`: how
    long a sleep or wake waits for every rank's (a wake at level 2 reads the weights again)."""

    def __init__(self, cfg: ServeConfig, info: EngineInfo, recorder: ExpertRecorder, published: Published,
                 send: Callable[[Command], None], answer_timeout_s: float = 10.0,
                 sleep_answer_timeout_s: float = 300.0):
        self.cfg = cfg
        self.info = info
        self.recorder = recorder
        self.published = published
        self.send = send
        self.answer_timeout_s = answer_timeout_s
        self.sleep_answer_timeout_s = sleep_answer_timeout_s
        self._ids = itertools.count()

    def readiness(self) -> Readiness:
        return self.published.readiness

    def health(self) -> Health:
        return self.published.health

    def cluster(self, events_since: int | None = None, events_limit: int | None = 50) -> dict[str, Any]:
        snapshot = self.published.snapshot
        if not snapshot:
            return snapshot
        return {**snapshot, "events": select_events(snapshot["events"], events_since, events_limit)}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        seq = await self.admit(request)
        stream = Stream(request.request_id, asyncio.get_running_loop(), asyncio.Queue())
        self.send(AddRequest(seq, stream))
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.send(AbortRequest(seq.seq_id))

    async def admit(self, request: GenerationRequest) -> Sequence:
        """The request's sequence once the engine can take it (not yet sent to the control thread).
        Raises ElasticEPError for a request no rank can hold, ServiceUnavailable while asleep and
        when no ready cluster came within --admission-timeout-s."""
        held = len(request.prompt_token_ids) + len(request.resumed_output_token_ids)
        if held >= self.cfg.max_model_len:
            raise ElasticEPError(
                f"prompt (with resumed output) has {held} tokens but --max-model-len is "
                f"{self.cfg.max_model_len} (prompt plus at least one generated token); shorten the prompt"
            )
        if self.published.sleep_level:
            raise ServiceUnavailable(f"the engine is asleep (level {self.published.sleep_level}); POST /wake_up",
                                     retry_after_s=5)
        deadline = time.monotonic() + self.cfg.admission_timeout_s
        while not self.published.readiness.ready:
            if time.monotonic() > deadline or self.published.fatal:
                raise ServiceUnavailable(f"not ready: {self.published.readiness.reason}", retry_after_s=5)
            await asyncio.sleep(0.05)
        self._check_fits(request)
        return Sequence(next(self._ids), request, self.cfg.max_model_len, self.info.eos_token_ids,
                        resumed_output=list(request.resumed_output_token_ids))

    def _check_fits(self, request: GenerationRequest) -> None:
        """A request that no rank's KV pool can hold at its longest is refused (a 400), instead of
        waiting for blocks that never free."""
        pools = self.published.snapshot.get("kv_cache", {}).get("ranks", {})
        if not pools:
            return
        largest = max(p["blocks"] for p in pools.values())
        prompt_len = len(request.prompt_token_ids)
        tokens = min(prompt_len + request.params.max_tokens, self.cfg.max_model_len)
        needed = blocks_for(tokens, self.cfg.block_size)
        if needed > largest:
            raise ElasticEPError(
                f"this request needs {needed} KV cache blocks of {self.cfg.block_size} tokens (prompt {prompt_len} + "
                f"max_tokens {request.params.max_tokens}, at most --max-model-len {self.cfg.max_model_len}), a "
                f"rank's KV pool holds {largest} ({largest * self.cfg.block_size} tokens); lower max_tokens or "
                "shorten the prompt")

    def start_expert_distribution_record(self) -> None:
        self.recorder.start()

    def stop_expert_distribution_record(self) -> None:
        self.recorder.stop()

    def dump_expert_distribution_record(self) -> dict[str, Any]:
        return self.recorder.dump(self.cfg.record_dir)

    async def scale(self, new_ep_size: int, ranks: list[int] | None = None) -> dict[str, Any]:
        return await self._ask(lambda reply: StartScale(new_ep_size, reply, ranks))

    async def drain(self, ranks: list[int] | None = None, node: str | None = None) -> dict[str, Any]:
        return await self._ask(lambda reply: StartDrain(ranks, node, reply))

    async def uncordon(self, node: str) -> dict[str, Any]:
        return await self._ask(lambda reply: Uncordon(node, reply))

    async def rolling_restart(self, options: dict[str, Any]) -> dict[str, Any]:
        return await self._ask(lambda reply: StartRollout(options, reply))

    async def abort_rolling_restart(self) -> dict[str, Any]:
        return await self._ask(lambda reply: AbortRollout(reply))

    def rolling_restart_status(self) -> dict[str, Any]:
        return self.published.snapshot.get("rollout", {"state": "idle", "active": False})

    async def sleep(self, level: int) -> dict[str, Any]:
        return await self._ask(lambda reply: Sleep(level, reply), self.sleep_answer_timeout_s)

    async def wake_up(self) -> dict[str, Any]:
        return await self._ask(lambda reply: WakeUp(reply), self.sleep_answer_timeout_s)

    def is_sleeping(self) -> dict[str, Any]:
        return self.published.snapshot.get("sleep", {"is_sleeping": False})

    async def _ask(self, command: Callable[[Future], Command], timeout_s: float | None = None) -> dict[str, Any]:
        """Send the command built around a reply future and wait for the control loop's answer.
        Raises ScaleRejected: the loop's refusal, 409 once it stopped or when it did not answer
        within `timeout_s` (default `answer_timeout_s`)."""
        timeout_s = self.answer_timeout_s if timeout_s is None else timeout_s
        if self.published.fatal:
            raise ScaleRejected(f"the cluster stopped: {self.published.fatal}", 409)
        reply: Future = Future()
        self.send(command(reply))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(reply), timeout_s)
        except asyncio.TimeoutError:
            raise ScaleRejected(f"the control loop did not answer within {timeout_s:g}s; "
                                "retry, and check /cluster", 409) from None

    def scale_status(self) -> dict[str, Any]:
        return self.published.snapshot.get("scale", {})

    def chaos(self, order: ChaosOrder) -> dict[str, Any]:
        if not self.cfg.enable_chaos:
            raise ElasticEPError("fault injection is off; start the server with --enable-chaos")
        if order.action == "poison" and order.request_id:
            self.send(PoisonRequest(order.request_id, order.phase))
            return {"action": "poison", "request_id": order.request_id, "phase": order.phase}
        snapshot = self.published.snapshot
        if order.action in ("cut", "heal") and order.node is not None:
            return self._cut_node(order, snapshot)
        ranks = {r["rank_id"]: r for r in snapshot.get("ranks", [])}
        rank = ranks.get(order.rank_id)
        if rank is None or rank["pid"] is None:
            raise ElasticEPError(f"no rank {order.rank_id}; ranks are {sorted(ranks)}")
        done: dict[str, Any] = {"action": order.action, "rank_id": order.rank_id, "pid": rank["pid"]}
        if order.action in SIGNALS:
            self.send(SignalRank(order.rank_id, SIGNALS[order.action], order.at_next_epoch))
            return {**done, "at_next_epoch": order.at_next_epoch}
        if order.action == "slow":
            if not order.delay_s >= 0:
                raise ElasticEPError(f"delay_s must be >= 0, got {order.delay_s}")
            self.send(SlowRank(order.rank_id, order.delay_s))
            return {**done, "delay_s": order.delay_s}
        if order.action == "poison":
            self.send(PoisonRank(order.rank_id, order.phase))
            return {**done, "phase": order.phase}
        if order.action in ("lose", "lose_plan"):
            self.send(LoseMessage(order.rank_id, Lost.RESULT if order.action == "lose" else Lost.PLAN))
            return done
        if order.action in ("cut", "heal"):
            self.send(CutNetwork(rank["node"], order.rank_id, order.duration_s, order.action == "heal"))
            return {**done, "node": rank["node"], "duration_s": order.duration_s}
        if order.action == "corrupt":
            layer, slot = self._slot_to_corrupt(rank, order)
            self.send(CorruptExpertSlot(order.rank_id, layer, slot))
            return {**done, "layer": layer, "slot": slot, "expert": rank["slots"]["experts"][layer][slot]}
        raise ElasticEPError(f"unknown chaos action {order.action!r}; use one of {', '.join(CHAOS_ACTIONS)}")

    def _cut_node(self, order: ChaosOrder, snapshot: dict[str, Any]) -> dict[str, Any]:
        agents = {a["node"]: a for a in snapshot.get("agents", [])}
        agent = agents.get(order.node)
        if agent is None:
            raise ElasticEPError(f"no node {order.node!r}; nodes are {sorted(agents)}")
        if order.action == "cut" and not agent["standalone"]:
            raise ElasticEPError(f"node {order.node} runs inside `elastic-ep serve` with the controller: cutting it "
                                 "would cut the controller; cut its ranks, or run the node as `elastic-ep agent`")
        if order.action == "cut" and order.duration_s <= 0:
            raise ElasticEPError("a node that is cut cannot hear `heal`: give duration_s, after which it heals itself")
        self.send(CutNetwork(order.node, None, order.duration_s, order.action == "heal"))
        return {"action": order.action, "node": order.node, "duration_s": order.duration_s}

    @staticmethod
    def _slot_to_corrupt(rank: dict[str, Any], order: ChaosOrder) -> tuple[int, int]:
        """(layer, slot) named by the order, else the rank's first occupied slot."""
        experts = rank["slots"]["experts"]
        occupied = [(li, j) for li, layer in enumerate(experts) for j, e in enumerate(layer) if e >= 0]
        if order.layer is None and order.slot is None and occupied:
            return occupied[0]
        wanted = (order.layer or 0, order.slot or 0)
        if wanted not in occupied:
            raise ElasticEPError(f"rank {order.rank_id} holds no expert in layer {wanted[0]} slot {wanted[1]}; "
                                 f"occupied (layer, slot): {occupied[:8]}")
        return wanted
