"""The contract between the HTTP server (`serve/`) and the engine that runs requests.

The controller's facade (`control/facade/engine.py`) implements `Engine`; the HTTP app only talks to
this protocol, so it can be exercised in tests with any engine that honours it.
Token ids only cross this boundary: the HTTP layer tokenizes, detokenizes and applies stop
strings; the engine schedules, runs steps on the ranks and survives their faults.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from elastic_ep.errors import ElasticEPError

if TYPE_CHECKING:  # annotations only: the client commands (chaos) import this module without torch
    from elastic_ep.model.sampling import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine sees it: one prompt, one sequence (the HTTP layer turns
    `n` choices and lists of prompts into one GenerationRequest each).

    The engine samples every token with `model.sampling.sample_tokens(logits, [params],
    [seed], [TokenHistory(prompt_token_ids, output so far)], eos_token_ids)`, so a token is a
    pure function of (seed, position, logits, history) and a recomputation after a fault draws
    the same one. `seed` is fixed at admission (params.seed is the client's, maybe None).
    It finishes the request with "stop" on a token in `params.stop_ids(eos_token_ids)`,
    "length" after `params.max_tokens` tokens or at max_model_len; the sampler already keeps
    stop tokens out before `params.min_tokens`.

    `resumed_output_token_ids`: output this request already produced on another instance (a
    stream the router moved): the sequence starts with them as its output, so penalties,
    min_tokens, max_tokens and sampling positions are those of the uninterrupted request;
    events carry only the tokens generated after them.

    `reattach`: the client names an earlier request by `request_id` (serve's `resume_request_id`,
    a stream whose controller died): an engine that runs or holds that request (a new leader of a
    controller group runs on the last one's journaled requests) answers from it, with the tokens
    after `resumed_output_token_ids`, instead of starting a second copy; an engine that does not
    runs it anew under that id. It raises `ResumeConflict` when the request it holds disagrees.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    resumed_output_token_ids: tuple[int, ...] = ()
    reattach: bool = False


@dataclass(frozen=True)
class RequestOutput:
    """One event of a request's stream: the tokens produced since the last event.

    finish_reason: None while running; "stop" (EOS or a stop token id), "length"
    (max_tokens or max_model_len), "abort" (client gone), "error" (see `error`).
    logprobs: when `params.logprobs` is not None, one `TokenLogprobs` per token of
    `new_token_ids`, as `sample_tokens` returned it; else None.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str = ""


HEALTH_STATUSES = ("ok", "degraded", "dead")


@dataclass(frozen=True)
class Health:
    """Whether the server process is worth keeping (GET /health, a liveness probe): "ok";
    "degraded" while it runs but not at full strength (not ready, a rank stalled, suspect or down;
    `reason` says which), which a restart would not mend; "dead" when the engine stopped and
    only a restart helps (HTTP 503)."""

    status: str
    reason: str = ""


class ServiceUnavailable(ElasticEPError):
    """The engine cannot take the request now (e.g. too few live ranks to hold every
    expert). The HTTP layer answers 503 with `Retry-After: retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ResumeConflict(ElasticEPError):
    """A resume that names a request the engine holds otherwise (other tokens, prompt, seed or
    parameters, or another client attached): the HTTP layer answers 409; `param` names the field."""

    def __init__(self, message: str, param: str = "resume_request_id"):
        super().__init__(message)
        self.param = param


class ScaleRejected(ElasticEPError):
    """A scale, drain or uncordon the engine will not start: status 400 (invalid) or 409 (busy);
    `param` names the request field at fault."""

    def __init__(self, message: str, status: int, param: str = "new_ep_size"):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class ChaosOrder:
    """A fault to inject. action: kill (SIGKILL), hang (SIGSTOP), resume (SIGCONT), slow (the rank
    sleeps `delay_s` per step), corrupt (overwrite expert slot (`layer`, `slot`) of the rank; by
    default its first occupied slot), poison (every step of the requests whose id starts with
    `request_id`, running or yet to come, raises on its rank, in `phase`: its local computation,
    its experts, or its sampling; without `request_id` every step of rank `rank_id` raises: a
    broken rank), cut (drop every packet of the rank's process, or with `node` of a whole
    `elastic-ep agent` node, healing by itself after `duration_s`), heal (undo a cut), lose (the
    rank's answer to the next step is lost on the way: it runs the step, keeps the answer and sends
    it only when the controller asks again).
    `at_next_epoch`: for kill and hang, act
    right after the next epoch is announced, so the fault lands while that epoch forms."""

    action: str
    rank_id: int
    delay_s: float = 0.0
    layer: int | None = None
    slot: int | None = None
    at_next_epoch: bool = False
    request_id: str | None = None
    phase: str = "local"
    node: str | None = None
    duration_s: float = 0.0


CHAOS_ACTIONS = ("kill", "hang", "resume", "slow", "corrupt", "poison", "cut", "heal", "lose", "lose_plan")


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    info: EngineInfo

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Admit the request and stream its outputs. Closing the iterator early (client
        disconnect) aborts the request and frees its KV cache. Raises ServiceUnavailable
        when it cannot admit the request within its bound."""
        ...

    def readiness(self) -> Readiness: ...

    def health(self) -> Health: ...

    def cluster(self, events_since: int | None = None, events_limit: int | None = 50) -> dict[str, Any]:
        """JSON for GET /cluster: epoch, ranks, scale state, deadlines, events: the last
        `events_limit` (None: all kept, up to 1000), only those with id > `events_since` if given.

        The dashboard (serve/static/dashboard.html) reads these fields; any may be missing
        or null, extra fields are shown as they are:
          {"time_s": unix seconds of the snapshot, "epoch": int, "ep_size": int,
           "ranks": [{"rank_id": int, "node": str, "pid": int | None,
                      "state": a RankStatus value (below),
                      "liveness": {"state": "live" | "suspect" | "waiting" | "stalled",
                                   "stalled_s": float | None, "reason": str} | None,  # None: not running
                      "slots": {"used": int, "total": int}, "requests": int,
                      "step_ms": {"p50", "p99", "max"},   # step time of the recent window
                      "wait_ms": {"p50", "p99"},            # collective (all-to-all) wait per step
                      "own_ms": {"p50", "p99", "max"},      # step less collective wait
                      "link_ms": {"p50", "p99", "max"},     # control-plane round trip less the step
                      "heartbeat_age_s": float, "progress_age_s": float,  # since the last heartbeat / move
                      "progress": {"epoch", "step", "layer", "phase", "seq"}, "last_collective": str,
                      "verdict": {"kind": "ok" | "straggler" | "dp-imbalance" | "unknown", "evidence": str,
                                  "own_ms": own time per step, "ratio": own_ms over the peers' median (the one
                                  slowness figure), ...numbers} | None,   # members only; policy/straggler_verdict.py
                      "ready": bool,  # ready: serves in a verified epoch
                      "safe_to_terminate": bool,  # not a member and no request: killing it costs nothing
                      "dense_source": "host_memory" | "peer" | "disk" | None,
                      "version": str | None}, ...],   # the elastic-ep the rank's process runs
           "ready": bool, "reason": str,   # as GET /ready
           "health": {"status": "ok" | "degraded" | "dead", "reason": str},   # as GET /health
           "load": {"running", "waiting": requests now, "steps_per_s", "tokens_per_s",
                    "generated_tokens_per_s": over the last 5 s, None before two samples},
           "straggler_rule": {"ratio", "min_excess_ms", "window_s", "min_steps", "persistence", ...},
           "straggler_policy": {"action": "off" | "derate" | "evict", "evict_after_s", "clear_after_s",
                                "max_evictions", "eviction_window_s",   # the policy (policy/straggler_policy.py)
                                "derated": {rank: {"speed", "slow_for_s", "ok_for_s"}},   # its state
                                "evictions_s_ago": [float], "group_slowdown": bool},
           "standby": {"wanted": int, "ready": [rank_id]},   # --standby-ranks, ranks standing by
           "agents": [{"node", "host", "ranks", "standalone", "backup", "cordoned": bool,
                       "safe_to_terminate": bool,   # no member and no request on the node
                       "zygote": "ready" | "starting" | "down" | "off" | "unknown"}],   # how its ranks start
                                                                 # (node/zygote.py; unknown: no AgentAlive yet)
           "cordoned": [node],   # drained nodes no rank starts on until POST /uncordon
           "hardware": {node: {"cpu_steal_ratio", "cpu_freq_mhz", "gpus": [{"index", "ecc_corrected",
                        "ecc_uncorrected", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "throttle_reasons",
                        "xid_errors", "absent"}], "absent": {signal: why}, "age_s"}},   # node/hardware.py
           "scale": scale_status(), "deadlines": {name: value},   # seconds where the name ends in _s, else a multiple
           "rollout": rolling_restart_status(),   # the last rolling restart, {"state": "idle"} before any
           "data_plane": {"all2all_backend", "enable_dbo", "dbo_min_tokens", "padded_dispatch_max_tokens",
                          "dp_align", "dp_align_min_chunk", "dp_migrate", "dp_migrate_patience",
                          "nodes": {node: [member rank_ids]}},   # the host groups of this epoch
           "rebalance": {"active": bool, "reason": str | None, "moves": int, "slots": int},  # background
           "listening": {"step", "health", "store"},   # the controller's sockets, tcp://HOST:PORT
           "agents": [{"node", "host", "ranks", "standalone", "backup", "fetch"}],  # fetch: the agent's socket
           "events": [{"id": int, "time_s": unix seconds, "kind": str, "rank_id": int | None,
                       "message": str, ...details}, ...]}
        Rank states are `control.ranks.RankStatus` values: starting, standby, serving, draining,
        fencing, fenced, dead, retiring; liveness values are `control.ranks.Liveness`.
        """
        ...

    def start_expert_distribution_record(self) -> None: ...

    def stop_expert_distribution_record(self) -> None: ...

    def dump_expert_distribution_record(self) -> dict[str, Any]:
        """Write the recorded load [L, E] to a file `elastic-ep eplb --load` reads;
        returns {"path": ..., "layers": L, "experts": E, "tokens": n}."""
        ...

    async def scale(self, new_ep_size: int, ranks: list[int] | None = None) -> dict[str, Any]:
        """Start a scale to `new_ep_size` in the background (a scale-down retires `ranks` when
        given, else the highest ids); returns {"old_ep_size", "new_ep_size"}. Raises ScaleRejected."""
        ...

    async def drain(self, ranks: list[int] | None = None, node: str | None = None) -> dict[str, Any]:
        """Retire the `ranks` named, or every rank of `node` and cordon it, in the background (a
        scale-down: their experts move off, their requests finish or move, then they stop; a
        drained `elastic-ep agent` exits 0 once its ranks are gone); returns {"ranks", "node",
        "old_ep_size", "new_ep_size"}. Raises ScaleRejected (400 unknown rank or node, too few
        ranks left; 409 a scale in flight)."""
        ...

    async def uncordon(self, node: str) -> dict[str, Any]:
        """Let new ranks start on a drained `node` again; returns {"node", "cordoned": False}.
        Raises ScaleRejected (400 not cordoned)."""
        ...

    async def rolling_restart(self, options: dict[str, Any]) -> dict[str, Any]:
        """Replace every worker process (members and standbys), one at a time, by one started with
        `options` (WorkerLaunch fields: control/membership/rollout_rules.py) in the background;
        returns the rollout view. Raises ScaleRejected (400 an option it cannot take; 409 a scale
        or rollout in flight, a group not whole, or no rank could leave without a standby)."""
        ...

    async def abort_rolling_restart(self) -> dict[str, Any]:
        """The rank in flight finishes, no other is replaced; returns the rollout view. Raises
        ScaleRejected 409 when none is in flight."""
        ...

    def rolling_restart_status(self) -> dict[str, Any]:
        """JSON for GET /rolling_restart (also /cluster's "rollout"): state, the rank in flight and
        its phase, replaced and pending ranks (control/membership/rollout_rules.py `rollout_view`)."""
        ...

    async def sleep(self, level: int) -> dict[str, Any]:
        """Sleep at `level` (1: free the KV cache; 2: drop the weights too) once every rank did;
        returns the sleep view (`is_sleeping`, `level`, per rank `rss_before_bytes`,
        `rss_after_bytes`, `seconds`, `error`). Raises ScaleRejected (400 level, 409 busy)."""
        ...

    async def wake_up(self) -> dict[str, Any]:
        """Build what the sleep freed on every rank; returns the sleep view."""
        ...

    def is_sleeping(self) -> dict[str, Any]:
        """JSON for GET /is_sleeping: {"is_sleeping": bool, ...the sleep view}."""
        ...

    def scale_status(self) -> dict[str, Any]:
        """JSON for GET /is_scaling_elastic_ep: is_scaling_elastic_ep, effective_ep_size,
        scale_phase, last_error, old_ep_size, new_ep_size, elapsed_s (see control/membership/scale_rules.py)."""
        ...

    def chaos(self, order: ChaosOrder) -> dict[str, Any]:
        """Fault injection (only when served with --enable-chaos); returns what was done to
        which process. Raises ElasticEPError for an unknown rank, slot or action."""
        ...
