"""The scripted test engine (the only double: FastAPI, uvicorn, prometheus and the
clients are real) and a real uvicorn server in a background thread.

It honours the Engine contract as the real engines do: every token is drawn by
`model.sampling.sample_tokens` (all sampling parameters, seeds, min_tokens, logprobs) from
scripted logits, and a request ends on a stop token ("stop") or at max_tokens ("length").
The logits put a peak of PEAK on REPLY's next token, so every setting short of strong
penalties yields REPLY, two tokens per event.

The prompt text chooses the rest, so tests need no shared switches:
  "[slow]"     0.05 s between events (time to disconnect mid-stream)
  "[stall]"    no event for 30 s (a cluster that cannot step: disconnect before the first token)
  "[eos]"      EOS peaks (above REPLY's token) at the 5th token
  "[random]"   flat logits: what is drawn depends on the seed
  "[error]"    an error event after the first tokens
  "[badtoken]" after the first tokens, a token id no tokenizer can decode (an engine bug)
  "[crash]"    generate raises an unexpected exception
  "[busy]"     generate raises ServiceUnavailable(retry_after_s=7)
  "[held]"     a re-attach (`resume_request_id`) raises ResumeConflict (the request held otherwise)
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import torch
import uvicorn
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from elastic_ep.control.api import (
    ChaosOrder,
    EngineInfo,
    GenerationRequest,
    Health,
    Readiness,
    RequestOutput,
    ResumeConflict,
    ScaleRejected,
    ServiceUnavailable,
)
from elastic_ep.control.membership.scale_rules import ScaleOp, status_view
from elastic_ep.model.sampling import TokenHistory, TokenLogprobs, sample_tokens

MODEL = "tiny-test"
MAX_MODEL_LEN = 128
REPLY = "Hello, wörld! 你好 END of the reply, and then some more text to reach max_tokens."
PEAK = 60.0
EOS_AT = 4
BAD_TOKEN = 2**40


def byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (so "你" spans three tokens) plus a special <eos>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer


class ScriptedEngine:
    """Implements the `Engine` protocol with scripted, deterministic token streams."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        eos = tokenizer.token_to_id("<eos>")
        self.info = EngineInfo(MODEL, MAX_MODEL_LEN, (eos,), {"vocab_size": tokenizer.get_vocab_size()})
        self.reply_ids = tokenizer.encode(REPLY).ids
        self.requests: dict[str, GenerationRequest] = {}
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.ready = Readiness(True)
        self.healthy = Health("ok")
        self.ep_size = 4
        self.scaling_to: int | None = None
        self.cordoned: str | None = None
        self.sleep_level = 0
        self.rollouts: list[dict] = []  # the options of each rolling restart asked for
        self.chaos_calls: list[tuple[str, int, float]] = []
        self.recording = False
        self.fail_after_events: int | None = None
        """Set: every stream ends with an error event after this many events (an instance going bad)."""
        self.pause_after_events: int | None = None
        """Set: every stream sends nothing more after this many events (an instance that hangs)."""

    async def generate(self, request: GenerationRequest):
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        if "[busy]" in prompt:
            raise ServiceUnavailable("2 of 4 ranks are recovering; experts 3, 7 have no live replica", 7)
        if "[crash]" in prompt:
            raise RuntimeError("scripted engine crash")
        if "[held]" in prompt and request.reattach:
            raise ResumeConflict(f"request {request.request_id} is attached to another client; it runs on there")
        self.requests[request.request_id] = request
        delay_s = 0.05 if "[slow]" in prompt else 0.0
        params, output, stopped = request.params, list(request.resumed_output_token_ids), False
        stop_ids = params.stop_ids(self.info.eos_token_ids)
        done = False
        events = 0
        try:
            if "[stall]" in prompt:
                await asyncio.sleep(30)
            while True:
                await asyncio.sleep(delay_s)
                if self.fail_after_events is not None and events >= self.fail_after_events:
                    done = True
                    yield RequestOutput(request.request_id, [], True, "error", "this instance is failing")
                    return
                if self.pause_after_events is not None and events >= self.pause_after_events:
                    await asyncio.sleep(30)
                events += 1
                if output and "[error]" in prompt:
                    done = True
                    yield RequestOutput(request.request_id, [], True, "error", "rank 2 lost its KV cache")
                    return
                if output and "[badtoken]" in prompt:
                    yield RequestOutput(
                        request.request_id, [BAD_TOKEN], False, None, None, self._logprobs(params, 1)
                    )
                new, logprobs = [], []
                while len(new) < 2 and not done:
                    sampled = sample_tokens(
                        self.logits(prompt, len(output))[None],
                        [params],
                        [request.seed],
                        [TokenHistory(request.prompt_token_ids, output)],
                        self.info.eos_token_ids,
                    )
                    output.append(sampled.tokens[0])
                    new.append(sampled.tokens[0])
                    logprobs += sampled.logprobs
                    stopped = sampled.tokens[0] in stop_ids
                    done = stopped or len(output) >= params.max_tokens
                reason = ("stop" if stopped else "length") if done else None
                yield RequestOutput(
                    request.request_id,
                    new,
                    done,
                    reason,
                    None,
                    logprobs if params.logprobs is not None else None,
                )
                if done:
                    return
        finally:
            (self.finished if done else self.aborted).add(request.request_id)

    def logits(self, prompt: str, index: int) -> torch.Tensor:
        """[V] logits of output token `index` (see the module docstring)."""
        vocab = self.tokenizer.get_vocab_size()
        if "[random]" in prompt:
            return torch.rand(vocab, generator=torch.Generator().manual_seed(index)) * 2
        logits = torch.zeros(vocab)
        logits[self.reply_ids[index % len(self.reply_ids)]] = PEAK
        if "[eos]" in prompt and index == EOS_AT:
            logits[self.info.eos_token_ids[0]] = 2 * PEAK
        return logits

    @staticmethod
    def _logprobs(params, count: int) -> list[TokenLogprobs] | None:
        if params.logprobs is None:
            return None
        return [TokenLogprobs(-1.0, ())] * count

    def request_of(self, response_id: str, index: int = 0) -> GenerationRequest:
        """The engine request behind choice `index` of a response."""
        return self.requests[f"{response_id}-{index}"]

    def readiness(self) -> Readiness:
        return self.ready

    def health(self) -> Health:
        return self.healthy

    def cluster(self, events_since: int | None = None, events_limit: int | None = 50) -> dict:
        return sample_cluster(self.ep_size)

    def start_expert_distribution_record(self) -> None:
        self.recording = True

    def stop_expert_distribution_record(self) -> None:
        self.recording = False

    def dump_expert_distribution_record(self) -> dict:
        return {"path": "/tmp/expert_load.pt", "layers": 2, "experts": 8, "tokens": 123}

    async def scale(self, new_ep_size: int, ranks: list[int] | None = None) -> dict:
        if new_ep_size > 8:
            raise ScaleRejected(f"new_ep_size {new_ep_size} exceeds --max-ep-size 8", 400)
        if self.scaling_to is not None:
            raise ScaleRejected(
                f"a scale to {self.scaling_to} is still in progress; retry when it is done", 409
            )
        self.scaling_to = new_ep_size
        return {"old_ep_size": self.ep_size, "new_ep_size": new_ep_size}

    async def drain(self, ranks: list[int] | None = None, node: str | None = None) -> dict:
        if (ranks is None) == (node is None):
            raise ScaleRejected('give "ranks" or "node", not both', 400, "ranks")
        if node is not None and node != "n0":
            raise ScaleRejected(f"no node {node!r}; nodes are ['n0']", 400, "node")
        leaving = list(range(self.ep_size)) if node is not None else sorted(ranks or [])
        unknown = [r for r in leaving if r >= self.ep_size]
        if unknown:
            raise ScaleRejected(f"ranks {unknown} are not in the group", 400, "ranks")
        self.cordoned = node
        return {"ranks": leaving, "node": node, "old_ep_size": self.ep_size, "new_ep_size": self.ep_size - len(leaving)}

    async def uncordon(self, node: str) -> dict:
        if node != self.cordoned:
            raise ScaleRejected(f"node {node!r} is not cordoned", 400, "node")
        self.cordoned = None
        return {"node": node, "cordoned": False}

    async def rolling_restart(self, options: dict) -> dict:
        if self.rollouts and self.rollouts[-1] is not None:
            raise ScaleRejected("a rolling restart is in flight; wait for it, or POST /rolling_restart/abort", 409,
                                "rolling_restart")
        self.rollouts.append(options)
        return self.rolling_restart_status()

    async def abort_rolling_restart(self) -> dict:
        if not self.rollouts or self.rollouts[-1] is None:
            raise ScaleRejected("no rolling restart is in flight", 409, "rolling_restart")
        self.rollouts.append(None)
        return self.rolling_restart_status()

    def rolling_restart_status(self) -> dict:
        running = bool(self.rollouts) and self.rollouts[-1] is not None
        state = "running" if running else "aborted" if self.rollouts else "idle"
        return {"state": state, "active": running, "options": self.rollouts[-1] if running else {}, "total": 4,
                "replaced_count": 0, "rank_in_flight": None, "replaced": [], "pending": [0, 1, 2, 3]}

    async def sleep(self, level: int) -> dict:
        if level not in (1, 2):
            raise ScaleRejected(f"level {level} is not a sleep level", 400, "level")
        self.sleep_level = level
        return self.is_sleeping()

    async def wake_up(self) -> dict:
        self.sleep_level = 0
        return self.is_sleeping()

    def is_sleeping(self) -> dict:
        return {"is_sleeping": self.sleep_level > 0, "level": self.sleep_level}

    def scale_status(self) -> dict:
        op = None
        if self.scaling_to is not None:
            op = ScaleOp(self.ep_size, self.scaling_to)
            op.phase = "joining"
        return status_view(op, self.ep_size)

    def chaos(self, order: ChaosOrder) -> dict:
        self.chaos_calls.append((order.action, order.rank_id, order.delay_s))
        return {"action": order.action, "rank_id": order.rank_id, "delay_s": order.delay_s}


SLOW_RANK = 2


def sample_cluster(ep_size: int) -> dict:
    """A /cluster document in the shape `Engine.cluster` documents (also feeds the dashboard)."""
    ranks = []
    for r in range(ep_size):
        slow = r == SLOW_RANK
        ranks.append(
            {
                "rank_id": r,
                "node": f"node{r // 2}",
                "pid": 4000 + r,
                "state": "serving",
                "slots": {"used": 5, "total": 6},
                "requests": 3,
                # In an all-to-all everyone's step lasts as long as the straggler's; it alone
                # does not wait (rank 2 here: 50 ms own time against 12 ms for the others).
                "step_ms": {"p50": 52.0 + r, "p99": 60.0 + r, "max": 75.0},
                "wait_ms": {"p50": 2.0 + r if slow else 40.0 + r, "p99": 45.0},
                "liveness": {"state": "live", "stalled_s": None, "reason": ""},
                "verdict": {"kind": "straggler" if slow else "ok", "own_ms": 50.0 if slow else 12.0 + r,
                            "ratio": 50.0 / 12.0 if slow else 1.0,
                            "evidence": f"own time {50.0 if slow else 12.0} ms/step against 12.0 ms ..."},
            }
        )
    ranks.append(
        {"rank_id": ep_size, "node": "node9", "pid": None, "state": "dead", "slots": {"used": 0, "total": 6}}
    )
    events = [
        {
            "time_s": time.time() - 30,
            "kind": "fault",
            "rank_id": ep_size,
            "message": f"rank {ep_size}: process killed by SIGKILL",
        },
        {
            "time_s": time.time() - 29,
            "kind": "epoch",
            "message": f"epoch 3: {ep_size} ranks, placement moved 4 experts",
        },
    ]
    deadlines = {"heartbeat_timeout_s": 2.0, "exit_poll_interval_s": 0.005, "stall_multiple": 10.0}
    return {
        "epoch": 3,
        "ep_size": ep_size,
        "ranks": ranks,
        "scale": {"state": "idle"},
        "deadlines": deadlines,
        "load": {"running": 12, "waiting": 3, "steps_per_s": 20.0, "tokens_per_s": 250.0,
                 "generated_tokens_per_s": 240.0},
        "health": {"status": "degraded", "reason": f"rank {SLOW_RANK} is a straggler: 4.2x the own time per step "
                                                   "of its peers"},
        "events": events,
    }


class ServerThread:
    """uvicorn on a socket bound to a free port, served from a daemon thread."""

    def __init__(self, app, startup_timeout_s: float = 10.0):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        # Accepted sockets inherit it; uvicorn leaves Nagle on for sockets it is handed, which
        # costs every keep-alive request a 40 ms delayed ACK.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline_s = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline_s or not self._thread.is_alive():
                raise RuntimeError(f"uvicorn did not start within {startup_timeout_s} s")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
