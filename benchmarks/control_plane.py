"""The control plane at 8 to 1,024 ranks, measured with stand-in ranks (harness/standin.py).

The real controller runs in this process (as in `elastic-ep serve`, streams consumed by an
event loop thread as the HTTP side consumes them); stand-in agents in a few child processes
register stand-in ranks with it over the real wire protocol. A stand-in rank's step takes
--step-ms; the model's config is DeepSeek-V3's shape (58 MoE layers x 256 experts, top-8), its
tensors tiny. One point:

    PYTHONPATH=src .venv/bin/python benchmarks/control_plane.py --ranks 256 --seqs-per-rank 64 [--json]

measures, under load (seqs-per-rank decoding sequences per rank; 0: one sequence in all, every
other rank runs empty plans): the controller's time per step
by part (control/timing.py) and what it adds to the slowest rank's time (`added_ms_per_step`:
wall time per step less the slowest member's own step time; `between`, the control thread's work from
a step's completion to the next one's start, is outside both, so the table also gives the step
period less the slowest member's time, what the ranks wait for in all; `turnaround` sums the control
thread's own part of the wait from a step's last answer to the next step's plans: commit, between,
plan, encode, send; `metrics`, the step's observation, runs in the next step's wait), the
heartbeat load (rank heartbeats and heartbeat frames a second, one per rank heartbeat before node
heartbeats and one per node after, and the control thread's share of a second spent on them),
the /cluster snapshot (built on the control thread; serialised by the HTTP thread) and the
/metrics scrape, then kills one
rank and stops another (SIGSTOP) through the chaos path and reports the time to detect each
(and `signalled_s`, when the control thread sent the signal to the rank's agent), the events
from 10 s before each signal to its recovery (`events`), the pause until a step completes again,
the recovery epoch's placement and change times, a full placement over all ranks, and every
fault that was not injected (a false fault). Before each fault it waits up to 60 s for the
restores of the epoch's likely losses, computed ahead in a process of their own
(`restores_waited_s`; the recovery's `restore` says whether it looked its loss up), and
`--profile-recovery FILE` profiles the control thread from each recovery's start to its first
completed step. `--sample-s S` samples the controller's RSS, the /cluster body's size, the
watchdog's first sightings and the faults so far every S seconds of a point's --seconds: a run of
minutes shows whether memory stays flat. With it, each sample also has what the RSS is made of:
glibc's heap in use (`malloc_bytes`: Python's objects over 512 bytes, numpy's arrays, ZeroMQ's
queued frames), Python's small-object blocks, and with `--tracemalloc FRAMES` the bytes Python
allocated since the first sample (tracemalloc, which slows Python: fewer steps), whose top growing
sites the point reports (`tracemalloc_top`); right after the samples the stand-ins are stopped
(SIGSTOP) for up to 3 s, and the frames the control thread still reads then (`backlog`) are what
sat queued for it (benchmarks/zmq_queue_cost.py: what one costs).

`--warm-all` measures with the readiness gate's old rule: every epoch runs every batch shape on
every member (`WarmUpGate.every_step`), not only what it changed (the slots it filled, each on its
rank as the epoch forms, and the shapes a member has not run); with the table it is the before
(this code with `--warm-all`). A stand-in runs a gate forward in a step's time and a filled
slot in 0.1 ms (harness/standin.py). Each fault's `warmup` says what its recovery warmed.

`--before` measures with the control-plane changes of issue 25 turned off in the same code:
every rank sends its expert load every step (`--load-report-every-steps 1`), liveness is computed
at every pump, the /cluster snapshot is rebuilt every 0.25 s whatever it costs and its placement
parts are built again each time, and EPLB's check and the straggler policy's weighted placement
are computed on the control thread at any size (`--placements-on-thread`: only these).
`--slow RANK:MS` makes stand-in ranks slower (the straggler policy derates them: `stragglers`
lists its decisions in the measured seconds), and `longest_deaf_ms` is the longest stretch of
them in which the control thread read no socket. No arguments runs the table (8, 64, 256 and
1,024 ranks, 0 and 64 sequences per rank; --table-ranks, --table-seqs), before and after side by side, one child
process per point, before and after in turn --repeats times; --baseline REV takes the before from
that git revision's code (its benchmark run with this run's step modes, those it has); the
epochs formed while a point is measured (`epochs_formed`: a straggler derated, a rebalance's
move) say how much of its per-step figures was not steps; --table-results-via direct,agent runs this code with each
--step-results-via instead (the stand-ins' results by each rank, or per node by its agent:
`result_frames_per_step` shows which). `--step-plans-via agent` sends one point's plans per node
through the stand-in agents (`plans_out` counts the plans sent each way). The stop's pause is
reported against the issue's bound, the heartbeat deadline + 0.1 s (`hang_pause_within_bound`).
The per-rank parts alone, on the CPU clock: benchmarks/control_cpu.py.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import itertools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from elastic_ep.control.api import GenerationRequest
from elastic_ep.control.config import ServeConfig
from elastic_ep.control.controller import Controller
from elastic_ep.control.facade.api_bridge import ApiBridge, ServerSockets
from elastic_ep.control.facade.to_loop import SignalRank
from elastic_ep.control.gc_policy import tune_for_serving
from elastic_ep.harness.standin import standin_model
from elastic_ep.harness.standin_api import prompt_of, request_tokens
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.placement.fault_aware import fault_aware_placement
from elastic_ep.wire import KEY_ENV, ClusterKey

RANKS_PER_NODE = 8
TABLE = [(r, s) for r in (8, 64, 256, 1024) for s in (0, 8, 64)]  # --table-seqs picks (default 0,64)


def ranks_per_node(ranks: int) -> int:
    """8, or half the ranks: at least two nodes, so the group outlives a node's loss (two faults)."""
    return max(min(RANKS_PER_NODE, ranks // 2), 1)


def start_standins(addr: str, ranks: int, processes: int, step_ms: float, jitter_ms: float,
                   model: Path, key: ClusterKey, step_results_via: str = "direct",
                   step_plans_via: str = "direct", slow: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    per_node = ranks_per_node(ranks)
    nodes = [f"n{i}" for i in range(math.ceil(ranks / per_node))]
    procs = []
    for p in range(min(processes, len(nodes))):
        args = [a for n in nodes[p::processes] for a in ("--node", n)]
        procs.append(subprocess.Popen([sys.executable, "-m", "elastic_ep.harness.standin", "--controller", addr,
                                       "--ranks-per-node", str(per_node), "--step-ms", str(step_ms),
                                       "--jitter-ms", str(jitter_ms), "--model", str(model),
                                       "--step-results-via", step_results_via, "--step-plans-via", step_plans_via,
                                       *[a for s in slow for a in ("--slow", s)], *args],
                                      env={**os.environ, KEY_ENV: key.hex()}))
    return procs


def stop_standins(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Load:
    """seqs sequences that decode for as long as the run lasts, consumed on an event loop thread:
    each that ends (after `request_tokens`) is followed by another of the same prompt, so a run of
    minutes keeps every sequence decoding (one of 1,500 tokens ran out after ~1,500 steps)."""

    def __init__(self, ctl: Controller, seqs: int, max_tokens: int = 0, prompt_len: int = 6):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tokens = 0
        self.requests = 0  # requests that ended
        self.engine = ctl.engine
        for i in range(seqs):
            asyncio.run_coroutine_threadsafe(self._consume(i, prompt_of(i, prompt_len), max_tokens), self.loop)

    async def _consume(self, i: int, prompt: list[int], max_tokens: int) -> None:
        for n in itertools.count():
            params = SamplingParams(max_tokens=request_tokens(i, n, max_tokens), ignore_eos=True)
            async for out in self.engine.generate(GenerationRequest(f"r{i}.{n}", prompt, params, i)):
                self.tokens += len(out.new_token_ids)
            self.requests += 1

    def stop(self) -> None:
        """Its streams cancelled (each request aborted), then the loop ended and closed."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(30)
        except TimeoutError:
            print("the load's streams did not end within 30 s", file=sys.stderr)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


class RemoteLoad:
    """The same sequences streamed by `servers` stand-in API server processes
    (harness/standin_api.py) through the controller's API socket, as `serve --api-server-count N`
    runs them: their outputs leave the control thread in one frame per server and step, and no
    event loop of this process wakes for them."""

    def __init__(self, ctl: Controller, key: ClusterKey, seqs: int, servers: int, max_tokens: int = 0):
        self.workdir = Path(tempfile.mkdtemp(prefix="elastic-ep-bench-api-"))
        self.sockets = ServerSockets(zmq.Context.instance(), key, self.workdir, servers)
        ctl.streams.servers = self.sockets  # set before any request: the control thread reads it per step
        self.bridge = ApiBridge(ctl.engine, key, self.workdir, ctl.rejected_frames, lambda _key: None)
        self.bridge.start()
        share = math.ceil(seqs / servers)
        self.procs = [subprocess.Popen([sys.executable, "-m", "elastic_ep.harness.standin_api", "--server", str(k),
                                        "--workdir", str(self.workdir), "--first", str(k * share),
                                        "--count", str(min(share, seqs - k * share)),
                                        "--max-tokens", str(max_tokens)],
                                       env={**os.environ, KEY_ENV: key.hex()})
                      for k in range(servers) if k * share < seqs]

    def stop(self) -> None:
        stop_standins(self.procs)
        self.bridge.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)  # the control thread's sockets close with its context


def newest_seq_id(ctl: Controller) -> int:
    """The highest sequence id in flight (ids are given in admission order), read from this thread."""
    while True:
        try:
            return max(ctl.scheduler.by_id, default=0)
        except RuntimeError:  # the dict changed while it was read
            continue


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g}s")
        time.sleep(0.01)


def events(ctl: Controller) -> list[dict]:
    """The controller's events, read from this thread while the control thread adds more."""
    while True:
        try:
            return ctl.cluster.events.all()
        except RuntimeError:  # the deque changed while it was copied
            continue


def events_after(ctl: Controller, event_id: int, kind: str) -> list[dict]:
    return [e for e in events(ctl) if e["id"] > event_id and e["kind"] == kind]


def last_event_id(ctl: Controller) -> int:
    known = events(ctl)
    return known[-1]["id"] if known else 0


def inject(ctl: Controller, rank_id: int, sig: int, timeout_s: float,
           profile: RecoveryProfile | None = None) -> dict:
    """Signal a rank through its agent; time to its fault and until a step completes again, and
    the recovery's parts (the `recovered` event: fence, placement, rendezvous, transfer, verify,
    the epoch change, the first step). `profile`: the control thread profiled from the recovery's
    start to its first completed step."""
    prepared = ctl.changer.ahead.prepared  # the restores computed ahead: given up to 60 s to be done
    t = time.monotonic()
    if prepared is not None:
        try:
            wait_for(prepared.result.done, 60, "")
        except TimeoutError:
            pass
    ready_s = round(time.monotonic() - t, 1) if prepared is not None and prepared.result.done() else None
    since = last_event_id(ctl)
    if profile is not None:
        profile.arm()
    t0 = time.time()
    ctl.engine.send(SignalRank(rank_id, sig))
    try:
        wait_for(lambda: any(e["rank_id"] == rank_id for e in events_after(ctl, since, "fault")), timeout_s,
                 f"no fault for rank {rank_id}")
    except TimeoutError:
        explain(ctl, since, t0, rank_id)
        raise
    fault = next(e for e in events_after(ctl, since, "fault") if e["rank_id"] == rank_id)
    # when the control thread sent the signal to the rank's agent: detect_s less this is the agent's
    # report (or the silence) until the control thread acted on it
    chaos = next((e for e in events_after(ctl, since, "chaos") if e["rank_id"] == rank_id), None)
    try:
        wait_for(lambda: events_after(ctl, since, "recovered"), timeout_s, "no recovery")
    except TimeoutError:
        explain(ctl, since, t0, rank_id)
        raise
    recovered = events_after(ctl, since, "recovered")[0]
    # what the controller did from 10 s before the signal to the recovery (an epoch, a straggler
    # decision, a stall), seconds from the signal: what the detection and the pause waited behind
    around = [(round(e["time_s"] - t0, 3), e["kind"], e["message"][:120]) for e in events(ctl)
              if t0 - 10 <= e["time_s"] <= recovered["time_s"] and e["kind"] not in ("registered", "started")]
    if profile is not None:
        profile.dump()
    parts = {k: recovered.get(k) for k in ("detect_to_fence_s", "placement_s", "rendezvous_s", "transfer_s",
                                           "verify_s", "epoch_change_s", "recompute_s", "restore")}
    # the recovery epoch's warm-up: from its `epoch` event to its `warmup` event, and what it ran
    epoch = next((e for e in events_after(ctl, since, "epoch") if e.get("epoch") == recovered.get("epoch")), None)
    warmup = next((e for e in events_after(ctl, since, "warmup") if e.get("epoch") == recovered.get("epoch")), None)
    if epoch is not None and warmup is not None:
        parts["warmup_s"] = round(warmup["time_s"] - epoch["time_s"], 3)
        parts["warmup_forwards"] = len(warmup["shapes"])
        parts["warmup_filled_slots_run"] = warmup["filled_slots_warmed"]
    return {"parts": parts, "restores_waited_s": ready_s,
            "rank_id": rank_id, "detect_s": round(fault["time_s"] - t0, 3), "cause": fault["signal"],
            "signalled_s": round(chaos["time_s"] - t0, 3) if chaos is not None else None, "events": around,
            "pause_s": round(recovered["time_s"] - t0, 3), "recovery_s": recovered["total_s"],
            "placement_s": recovered.get("placement_s"), "epoch_change_s": recovered.get("epoch_change_s")}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


class ControlThreadProfile:
    """cProfile of the control thread only, from its next step until `stop()` (written to `path`):
    a profiler is enabled in the thread that calls it, so the step loop's `run` enables it there."""

    def __init__(self, ctl: Controller, path: str):
        self.ctl, self.path, self.profile, self.on = ctl, path, cProfile.Profile(), True
        self.run = ctl.steps.run
        ctl.steps.run = self._run

    def _run(self):
        if self.on:
            self.profile.enable()
        else:
            self.profile.disable()
            self.ctl.steps.run = self.run
        return self.run()

    def stop(self) -> None:
        self.on = False
        wait_for(lambda: self.ctl.steps.run == self.run, 10, "the control thread did not stop profiling")
        self.profile.dump_stats(self.path)


class RecoveryProfile:
    """cProfile of the control thread from the start of the next recovery (`Recovery.run`) to
    the first step that completes after it, written to `path` + "." + the fault's name."""

    def __init__(self, ctl: Controller, path: str):
        self.ctl, self.path, self.profile, self.armed, self.name = ctl, path, None, False, ""
        self.done: cProfile.Profile | None = None
        self.recover, self.step = ctl.recovery.run, ctl.steps.run
        ctl.recovery.run, ctl.steps.run = self._recover, self._step

    def arm(self) -> None:
        self.profile, self.armed = cProfile.Profile(), True

    def _recover(self):
        if self.armed and self.profile is not None:
            self.armed = False
            self.profile.enable()
        return self.recover()

    def _step(self):
        out = self.step()  # a wall time: the step completed (the recovery's record closes next)
        if self.profile is not None and not self.armed and out is not None:
            self.profile.disable()
            self.done, self.profile = self.profile, None
        return out

    def dump(self) -> None:
        wait_for(lambda: self.profile is None, 10, "the recovery's profile did not end")
        self.done.dump_stats(f"{self.path}.{self.name}")


def explain(ctl: Controller, since: int, t0: float, rank_id: int) -> None:
    """On stderr, for a fault not named or a recovery that did not end: what the controller did instead
    (its events since `since`, seconds from `t0`), what it knows of the rank, and where its thread is."""
    for e in [e for e in events(ctl) if e["id"] > since][-40:]:
        print(f"{e['time_s'] - t0:.3f} {e['kind']}: {e['message'][:200]}", file=sys.stderr)
    r = ctl.cluster.ranks.get(rank_id)
    if r is not None:
        print(f"rank {rank_id}: {r.status.value}, heard {ctl.plane.heard_clock() - r.last_heartbeat:.2f}s ago, "
              f"{r.progress}", file=sys.stderr)
    frame = sys._current_frames().get(ctl._thread.ident)
    if frame is not None:
        print("the control thread now:\n" + "".join(traceback.format_stack(frame)[-12:]), file=sys.stderr)


def run_point(ranks: int, seqs_per_rank: int, seconds: float, step_ms: float, jitter_ms: float, processes: int,
              before: bool, faults: bool, timeout_s: float, profile: str | None = None,
              profile_recovery: str | None = None, sample_s: float | None = None, warm_all: bool = False,
              trace_frames: int = 0, step_results_via: str = "direct", step_plans_via: str = "direct",
              async_scheduling: bool = False, slow: tuple[str, ...] = (), placements_on_thread: bool = False,
              api_servers: int = 0, max_tokens: int = 0, send_ahead_steps: int = 0) -> dict:
    model = standin_model(max(256, ranks))  # past 256 ranks, an expert per rank (the controller refuses fewer)
    cfg = ServeConfig(model_dir=str(model), model_name="standin", ep_size=ranks,
                      ranks_per_node=ranks_per_node(ranks),
                      max_num_seqs=max(seqs_per_rank, 1), max_model_len=2048, enable_chaos=True, restart_delay_s=-1,
                      log_stats_interval_s=0, startup_timeout_s=300, heartbeat_timeout_s=timeout_s,
                      agent_timeout_s=timeout_s, step_plans_via=step_plans_via, async_scheduling=async_scheduling,
                      send_ahead_steps=send_ahead_steps)
    # after: load summed on the rank over 16 steps (the server's default stays 1 until the recorder
    # counts a window's last partial sums)
    cfg.load_report_every_steps = 1 if before else 16
    registry = CollectorRegistry()
    key = ClusterKey.generate()
    ctl = Controller(cfg, key, registry)
    ctl.warmup.every_step = warm_all
    if before:
        ctl.publisher.liveness_period_s, ctl.publisher.snapshot_share = 0.0, math.inf
        ctl.cluster.cache_placement_view = False
    if before or placements_on_thread:  # EPLB's check and the weighted placement on the control thread
        ctl.stragglers.placing.min_ranks = ctl.rebalancer.eplb.min_ranks = math.inf
    tune_for_serving()  # the collector as `elastic-ep serve` sets it before its controller starts
    ctl.start()
    procs = start_standins(ctl.health_addr, ranks, processes, step_ms, jitter_ms, model, key, step_results_via,
                           step_plans_via, slow)
    load = None
    try:
        wait_for(lambda: ctl.published.readiness.ready or ctl.published.fatal, 300, "the cluster was not ready")
        if ctl.published.fatal:  # the control loop ended (a rank lost during startup): no point to measure
            for e in [e for e in events(ctl) if e["kind"] not in ("registered", "agent")][-40:]:  # agents lost, faults
                print(f"{e['time_s']:.3f} {e['kind']}: {e['message'][:200]}", file=sys.stderr)
            raise RuntimeError(f"the controller stopped: {ctl.published.fatal}")
        seqs = max(ranks * seqs_per_rank, 1)  # 0 per rank: one sequence, so steps run with empty plans elsewhere
        load = RemoteLoad(ctl, key, seqs, api_servers, max_tokens) if api_servers else Load(ctl, seqs, max_tokens)
        wait_for(lambda: sum(len(s) for s in ctl.scheduler.running.values()) >= seqs, 120,
                 "not every sequence was scheduled")
        step0 = ctl.cluster.step
        wait_for(lambda: ctl.cluster.step >= step0 + 10, 120, "ten warm-up steps did not run")
        times = ctl.plane.times
        v0, h0, d0 = times.view(), dict(times.handled_s), dict(times.decode_s)
        beats0 = rank_heartbeats(ctl)
        n0, w0, s0, parts0 = times.steps, times.wall_s, times.slowest_rank_s, dict(times.part_s)
        epoch0, admitted0 = ctl.cluster.epoch, newest_seq_id(ctl)
        profiler = ControlThreadProfile(ctl, profile) if profile else None
        cpu_clock = time.pthread_getcpuclockid(ctl._thread.ident)
        cpu0, t0, t0_wall = time.clock_gettime(cpu_clock), time.monotonic(), time.time()
        ctl.plane.listening.longest_s = 0.0
        samples = sample_memory(ctl, seconds, sample_s, trace_frames)
        dt, cpu_s = time.monotonic() - t0, time.clock_gettime(cpu_clock) - cpu0
        if profiler is not None:
            profiler.stop()
        v1, h1, d1 = times.view(), dict(times.handled_s), dict(times.decode_s)
        steps = times.steps - n0
        parts = delta(dict(times.part_s), parts0)
        parts["decode"] = d1.get("step", 0) - d0.get("step", 0)
        handled = delta(v1["handled"], v0["handled"])
        handled_s = delta(h1, h0)
        beat_kinds = ("Heartbeat", "NodeHeartbeat")  # a rank's own; its node's (the agent gathers them)
        out = {
            "ranks": ranks, "seqs_per_rank": seqs_per_rank,
            "mode": ("before" if before else "after") + (", warm-all" if warm_all else "")
            + (", placements on the control thread" if placements_on_thread and not before else ""),
            "step_results_via": step_results_via, "step_plans_via": step_plans_via,
            "async_scheduling": async_scheduling, "send_ahead_steps": send_ahead_steps, "api_servers": api_servers,
            "plans_out": delta(v1["plans_out"], v0["plans_out"]), "step_ms": step_ms, "steps": steps,
            "step_period_ms": round(1000 * dt / max(steps, 1), 2),
            "slowest_rank_ms": round(1000 * (times.slowest_rank_s - s0) / max(steps, 1), 2),
            "added_ms_per_step": round(1000 * ((times.wall_s - w0) - (times.slowest_rank_s - s0)) / max(steps, 1), 2),
            # the control thread's CPU time: what it would add on a machine of its own (no wait for a core)
            "control_cpu_ms_per_step": round(1000 * cpu_s / max(steps, 1), 2),
            "control_cpu_share": round(cpu_s / dt, 3),
            "parts_ms": {p: round(1000 * s / max(steps, 1), 2) for p, s in parts.items()},
            "heartbeats_per_s": round((rank_heartbeats(ctl) - beats0 + handled.get("Heartbeat", 0)) / dt),
            "heartbeat_frames_per_s": round(sum(handled.get(k, 0) for k in beat_kinds) / dt),
            # handling them plus the health socket's receive (whose other frames, the agents' own, are few)
            "heartbeat_load": round((sum(handled_s.get(k, 0) for k in beat_kinds) + d1.get("health", 0)
                                     - d0.get("health", 0)) / dt, 4),
            "publish_ms_per_s": round(1000 * handled_s.get("(publish)", 0) / dt, 1),
            "bytes_in_per_step": round(delta(v1["bytes_in"], v0["bytes_in"]).get("step", 0) / max(steps, 1)),
            # frames the control thread read for the steps' results: one per rank, or one per node and step
            "result_frames_per_step": round((handled.get("StepResult", 0) + handled.get("NodeStepResults", 0))
                                            / max(steps, 1), 1),
            "epochs_formed": ctl.cluster.epoch - epoch0,
            # requests admitted a step in those seconds (each that ended followed by another: --max-tokens)
            "admitted_per_step": round((newest_seq_id(ctl) - admitted0) / max(steps, 1), 1),
            # the longest stretch the control thread read no socket in (a placement on it, a GC pause)
            "longest_deaf_ms": round(1000 * ctl.plane.listening.longest_s, 1),
            # the straggler policy's decisions in those seconds (--slow): when, and what
            "stragglers": [f"{e['time_s'] - t0_wall:.1f}s {e['decision']} rank {e['rank_id']}" for e in events(ctl)
                           if e["kind"] == "straggler" and e["time_s"] >= t0_wall],
            "members": len(ctl.cluster.members),  # at the end of the measured seconds
            # every frame of the health socket (the agents' and the ranks' own: beats, alives, results)
            "health_frames_per_s": round(delta(v1["frames_in"], v0["frames_in"]).get("health", 0) / dt),
        }
        if async_scheduling:  # steps prepared while the one before ran: sent, or dropped and planned again
            out["prepared_steps"] = {o: registry.get_sample_value("elastic_ep_prepared_steps_total", {"outcome": o})
                                     for o in ("sent", "rebuilt", "ahead", "dropped")}
        if samples:
            out["samples"] = samples
            # what else ran on the control thread in those minutes (epochs, stalls, resends)
            out["events"] = [f"{e['time_s'] - t0_wall:.1f}s {e['kind']}: {e['message'][:160]}" for e in events(ctl)
                             if e["kind"] not in ("registered", "agent", "started") and e["time_s"] >= t0_wall]
            out["backlog"] = queued_backlog(ctl, procs)  # before this thread's own work below takes the GIL
        snap = times.snapshot_s
        out["cluster_snapshot_ms"] = round(1000 * snap, 2)
        t = time.perf_counter()
        body = json.dumps(ctl.engine.cluster())
        out["cluster_json_ms"] = round(1000 * (time.perf_counter() - t), 2)
        out["cluster_bytes"] = len(body)
        t = time.perf_counter()
        scrape = generate_latest(registry)
        out["metrics_scrape_ms"] = round(1000 * (time.perf_counter() - t), 2)
        out["metrics_bytes"] = len(scrape)
        c = ctl.cluster
        t = time.perf_counter()
        fault_aware_placement(np.ones((c.num_layers, c.num_experts)), sorted(c.members), c.rank_nodes(), None,
                              c.slots_per_rank, max(cfg.ep_size, max(c.members) + 1))
        out["placement_ms"] = round(1000 * (time.perf_counter() - t), 1)
        if faults:
            recovery_profile = RecoveryProfile(ctl, profile_recovery) if profile_recovery else None
            if recovery_profile is not None:
                recovery_profile.name = "kill"
            out["kill"] = inject(ctl, c.members[len(c.members) // 3], signal.SIGKILL, 60, recovery_profile)
            t = time.monotonic()
            try:  # the stop lands in a quiet group where the background rebalance ends in time
                wait_for(lambda: not ctl.rebalancer.status()["active"], 60, "")
                out["rebalance_after_kill_s"] = round(time.monotonic() - t, 1)
            except TimeoutError:
                out["rebalance_after_kill_s"] = None  # still walking after 60 s
            if recovery_profile is not None:
                recovery_profile.name = "stop"
            out["stop"] = inject(ctl, c.members[2 * len(c.members) // 3], signal.SIGSTOP, 60, recovery_profile)
            # the bound on the hang's pause (signal to the first step after): the deadline + 0.1 s
            out["hang_pause_bound_s"] = round(cfg.heartbeat_timeout_s + 0.1, 3)
            out["hang_pause_within_bound"] = out["stop"]["pause_s"] <= out["hang_pause_bound_s"]
        injected = {out[k]["rank_id"] for k in ("kill", "stop") if k in out}
        # each with when it came, from the start of the measured seconds (negative: during startup)
        out["false_faults"] = [f"{e['time_s'] - t0_wall:.2f}s {e['message']}" for e in events_after(ctl, 0, "fault")
                               if e["rank_id"] not in injected]
        if out["false_faults"]:  # what came before the first of them and after it
            first = next(e for e in events_after(ctl, 0, "fault") if e["rank_id"] not in injected)
            around = [e for e in events(ctl) if e["kind"] not in ("registered", "agent", "started", "fault")]
            out["false_fault_events"] = [f"{e['time_s'] - first['time_s']:.3f}s {e['kind']}: {e['message'][:200]}"
                                         for e in around if abs(e["time_s"] - first["time_s"]) < 10][:40]
        return out
    finally:
        if load is not None:
            load.stop()
        ctl.stop()
        stop_standins(procs)


def malloc_in_use_bytes() -> int:
    """glibc's heap in use in this process, every thread's arena and mmap'd chunks (mallinfo2):
    where ZeroMQ's queued frames, numpy's arrays and Python's objects over 512 bytes live."""
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def sample_memory(ctl: Controller, seconds: float, sample_s: float | None, trace_frames: int = 0) -> list[dict]:
    """Sleep `seconds`; every `sample_s` (None: never) the controller's RSS (this process: the
    stand-ins run in others), glibc's heap in use, Python's small-object blocks, the frames and
    bytes each socket read so far, the /cluster body's size and the watchdog's first sightings, so
    a long run shows whether any of them grows and which. `trace_frames` > 0: tracemalloc traces
    from the first sample on (that many frames a site) and each sample has its traced bytes; the
    last sample carries the snapshots' difference under "tracemalloc_top"."""
    if not sample_s:
        time.sleep(seconds)
        return []
    if trace_frames:
        tracemalloc.start(trace_frames)
    me, t0, out, first = psutil.Process(), time.monotonic(), [], None
    while True:
        elapsed = time.monotonic() - t0
        snapshot, location, times = ctl.engine.cluster(), ctl.cluster.location, ctl.plane.times
        out.append({"t_s": round(elapsed, 1), "step": ctl.cluster.step, "rss_bytes": me.memory_info().rss,
                    "malloc_bytes": malloc_in_use_bytes(), "py_blocks": sys.getallocatedblocks(),
                    "frames_in": dict(times.frames_in), "bytes_in": dict(times.bytes_in),
                    "cluster_bytes": len(json.dumps(snapshot)),
                    "placement_bytes": len(json.dumps(snapshot.get("placement"))),
                    # log2phy's padding: the hottest expert's replicas (what the snapshot's size followed)
                    "max_replicas": int(location.logcnt.max()) if location is not None else 0,
                    "first_sightings": len(ctl.detector.seq_first_seen),
                    "faults": len(events_after(ctl, 0, "fault"))})
        if trace_frames:
            out[-1]["py_traced_bytes"] = tracemalloc.get_traced_memory()[0]
            if first is None:
                first = tracemalloc.take_snapshot()
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
        if elapsed >= seconds:
            if trace_frames:
                out[-1]["tracemalloc_top"] = growing_sites(first, tracemalloc.take_snapshot(), trace_frames)
                tracemalloc.stop()
            return out
        time.sleep(min(sample_s, seconds - elapsed))


def growing_sites(first: tracemalloc.Snapshot, last: tracemalloc.Snapshot, frames: int, top: int = 15) -> list[dict]:
    """The allocation sites whose live bytes grew most from `first` to `last` (innermost frame, and
    with `frames` > 1 the whole traceback of the top few)."""
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    first, last = first.filter_traces(ignore), last.filter_traces(ignore)
    out = [{"site": f"{s.traceback[0].filename}:{s.traceback[0].lineno}", "grew_bytes": s.size_diff,
            "bytes": s.size, "grew_blocks": s.count_diff} for s in last.compare_to(first, "lineno")[:top]]
    if frames > 1:
        out += [{"traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback], "grew_bytes": s.size_diff,
                 "bytes": s.size} for s in last.compare_to(first, "traceback")[:5]]
    return out


def queued_backlog(ctl: Controller, procs: list[subprocess.Popen], quiet_s: float = 0.5,
                   limit_s: float = 3.0) -> dict:
    """Stop the stand-ins (SIGSTOP) and count what the control thread still reads until it reads
    nothing for `quiet_s` (at most `limit_s`, under the deadlines), then continue them: the frames
    and bytes that were queued for it (ZeroMQ's pipes in this process, the kernel's socket
    buffers). A fault this causes is counted with the false faults."""
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    times = ctl.plane.times
    frames0, bytes0 = dict(times.frames_in), dict(times.bytes_in)
    t0 = last_t = time.monotonic()
    seen = sum(frames0.values())
    while time.monotonic() - last_t < quiet_s and time.monotonic() - t0 < limit_s:
        time.sleep(0.05)
        now = sum(times.frames_in.values())
        if now != seen:
            seen, last_t = now, time.monotonic()
    for p in procs:
        p.send_signal(signal.SIGCONT)
    return {"frames": delta(dict(times.frames_in), frames0), "bytes": delta(dict(times.bytes_in), bytes0),
            "drain_s": round(last_t - t0, 2), "drained": time.monotonic() - last_t >= quiet_s}


def rank_heartbeats(ctl: Controller) -> float:
    """Rank heartbeats taken from node heartbeats so far (`elastic_ep_rank_heartbeats_total`, every node)."""
    return sum(s.value for family in ctl.metrics.rank_heartbeats.collect() for s in family.samples
               if s.name.endswith("_total"))


def baseline_tree(rev: str, into: Path) -> Path:
    """The repository's `src` and this benchmark as of git revision `rev`, written under `into`."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "src", "benchmarks/control_plane.py"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def table(args) -> None:
    """Each point before and after, one child process each, side by side. Before: this code with
    `--before`, or with --baseline REV the code of that revision (its own benchmark, its defaults)."""
    rows = []
    sizes = [int(x) for x in args.table_ranks.split(",")]
    loads = [int(x) for x in args.table_seqs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        old = baseline_tree(args.baseline, Path(tmp)) if args.baseline else None
        points = [(r, s) for r, s in TABLE if r in sizes and s in loads]
        # before and after (or each --table-results-via) in turn, --repeats times: a minute of a shared
        # machine's load lands on all
        modes = [f"after, results {v}" for v in args.table_results_via.split(",")] if args.table_results_via \
            else [f"after, {n} API servers" for n in args.table_api_servers.split(",")] if args.table_api_servers \
            else ["before", "after"]
        for ranks, seqs, repeat, mode in [(r, s, k, m) for r, s in points for k in range(args.repeats)
                                          for m in modes]:
            script, env = __file__, dict(os.environ)
            flags = [("--warm-all" if args.warm_all else "--before")] if mode == "before" and old is None else []
            results_via = mode.removeprefix("after, results ") if mode.startswith("after, results ") \
                else args.step_results_via
            servers = mode.removeprefix("after, ").removesuffix(" API servers") if mode.endswith(" API servers") \
                else str(args.api_servers)
            step_modes = [*(["--step-results-via", results_via] if results_via != "direct" else []),
                          *(["--api-servers", servers] if servers != "0" else []),
                          *(["--max-tokens", str(args.max_tokens)] if args.max_tokens else []),
                          *(["--step-plans-via", args.step_plans_via] if args.step_plans_via != "direct" else []),
                          *(["--async-scheduling"] if args.async_scheduling else []),
                          *(["--send-ahead-steps", str(args.send_ahead_steps)] if args.send_ahead_steps else [])]
            if mode != "before" or old is not None:  # after, and a --baseline's code: this run's step modes
                flags = step_modes
            if mode == "before" and old is not None:
                script, env["PYTHONPATH"] = str(old / "benchmarks" / "control_plane.py"), str(old / "src")
            cmd = [sys.executable, script, "--ranks", str(ranks), "--seqs-per-rank", str(seqs), "--json",
                   "--seconds", str(args.seconds), "--step-ms", str(args.step_ms), "--timeout-s",
                   str(args.timeout_s), *flags, *(["--no-faults"] if args.no_faults else [])]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            except subprocess.TimeoutExpired:
                print(f"{ranks} ranks, {seqs} per rank, {mode}: over 900 s", file=sys.stderr)
                continue
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["mode"] = f"before ({args.baseline})" if mode == "before" and old is not None else mode
            row["repeat"] = repeat + 1
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print("| ranks | seqs/rank | mode | run | added ms/step | period - slowest ms | control CPU ms/step | period ms "
          "| plan | encode | send "
          "| gather | decode | commit | metrics | between | turnaround "
          "| rank heartbeats/s | heartbeat frames/s | hb load "
          "| health frames/s | /cluster build ms | /metrics ms "
          "| kill detect s / pause s | stop detect s (by) | hang pause s (bound) | placement ms | epochs formed "
          "| false faults |")
    print("|" + "---|" * 29)
    for r in rows:
        p, kill, stop = r["parts_ms"], r.get("kill", {}), r.get("stop", {})
        print(f"| {r['ranks']} | {r['seqs_per_rank']} | {r['mode']} | {r['repeat']} | {r['added_ms_per_step']} "
              f"| {r['step_period_ms'] - r['slowest_rank_ms']:.2f} "
              f"| {r.get('control_cpu_ms_per_step', 'n/a')} | {r['step_period_ms']} "
              f"| {p['plan']} | {p['encode']} | {p['send']} | {p['gather']} | {p['decode']} | {p['commit']} "
              f"| {p['metrics']} | {p.get('between', '-')} | {turnaround_ms(p)} "
              f"| {r['heartbeats_per_s']} | {r.get('heartbeat_frames_per_s', r['heartbeats_per_s'])} "
              f"| {r['heartbeat_load']:.1%} | {r.get('health_frames_per_s', '-')} | {r['cluster_snapshot_ms']} "
              f"| {r['metrics_scrape_ms']} | {kill.get('detect_s', '-')} / {kill.get('pause_s', '-')} "
              f"| {stop.get('detect_s', '-')} ({stop.get('cause', '-')}) "
              f"| {stop.get('pause_s', '-')} ({r.get('hang_pause_bound_s', '-')}) | {r['placement_ms']} "
              f"| {r.get('epochs_formed', '-')} | {len(r['false_faults'])} |")


def turnaround_ms(parts_ms: dict) -> float | str:
    """The control thread's own part of the wait from a step's last answer to the next step's plans
    (control/timing.py): commit + between + plan + encode + send (`metrics` runs in the next step's
    wait; a tree before that has its own script, which adds it); '-' for a tree that does not time
    `between`."""
    if "between" not in parts_ms:
        return "-"
    return round(sum(parts_ms[p] for p in ("commit", "between", "plan", "encode", "send")), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=None, help="one point at this many ranks (default: the table)")
    parser.add_argument("--seqs-per-rank", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long a point is measured")
    parser.add_argument("--step-ms", type=float, default=20.0, help="a stand-in rank's step time")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--processes", type=int, default=4, help="stand-in processes")
    parser.add_argument("--before", action="store_true", help="the control-plane changes of issue 25 turned off")
    parser.add_argument("--no-faults", action="store_true", help="skip the kill and stop")
    parser.add_argument("--placements-on-thread", action="store_true",
                        help="only EPLB's check and the straggler policy's weighted placement on the control "
                             "thread at any size (as --before does), the rest as after")
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:MS",
                        help="a stand-in rank's extra time per step (repeat): what the straggler policy derates")
    parser.add_argument("--warm-all", action="store_true",
                        help="the readiness gate's old rule: every shape on every member in every epoch "
                             "(with the table: its before)")
    parser.add_argument("--timeout-s", type=float, default=1.0,
                        help="--heartbeat-timeout-s and --agent-timeout-s of the controller (the stop's deadline)")
    parser.add_argument("--table-ranks", default="8,64,256,1024", help="the table's sizes (comma-separated)")
    parser.add_argument("--repeats", type=int, default=1, help="the table's runs of each point and mode, in turn")
    parser.add_argument("--table-seqs", default="0,64", help="the table's sequences per rank (comma-separated)")
    parser.add_argument("--step-results-via", choices=["direct", "agent"], default="direct",
                        help="the stand-ins' step results to the controller by each rank, or per node by its agent "
                             "(`NodeStepResults`; a table's after points too)")
    parser.add_argument("--step-plans-via", choices=["direct", "agent"], default="direct",
                        help="the step plans to each stand-in rank, or one frame per node to its agent "
                             "(`NodeStepPlans`; a table's after points too)")
    parser.add_argument("--table-results-via", default=None, metavar="MODES",
                        help="the table: instead of before and after, this code with each of these "
                             "--step-results-via (e.g. direct,agent), in turn")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="the table's before: the code of this git revision instead of this code with --before")
    parser.add_argument("--sample-s", type=float, default=None, metavar="S",
                        help="one point: every S seconds of --seconds, the controller's RSS, the /cluster size, the "
                             "watchdog's first sightings and the faults so far (`samples`; each also on stderr)")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="with --sample-s: trace Python's allocations from the first sample (FRAMES frames a "
                             "site) and report the sites that grew most (slows Python)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="serve --async-scheduling: the next step planned while one runs (a table's after "
                             "points too)")
    parser.add_argument("--send-ahead-steps", type=int, default=0, metavar="N",
                        help="serve --send-ahead-steps N (with --async-scheduling): up to N steps sent before the "
                             "one they were planned during completes (a table's after points too)")
    parser.add_argument("--api-servers", type=int, default=0, metavar="N",
                        help="the load streamed by N stand-in API server processes (harness/standin_api.py), as "
                             "behind serve --api-server-count N; 0: by an event loop of this process")
    parser.add_argument("--max-tokens", type=int, default=0, metavar="N",
                        help="requests of N tokens, the first of each stream 1 + its index mod N, each that ends "
                             "followed by another: about seqs / N arrive every step (`admitted_per_step`); 0: "
                             "1,500 each, all started together (none ends in a short run)")
    parser.add_argument("--table-api-servers", default=None, metavar="COUNTS",
                        help="the table: instead of before and after, this code with each of these "
                             "--api-servers (e.g. 0,2), in turn")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="write a cProfile of the control thread over the measured seconds (pstats format)")
    parser.add_argument("--profile-recovery", default=None, metavar="FILE",
                        help="write cProfiles of the control thread from each recovery's start to its first "
                             "completed step (FILE.kill, FILE.stop)")
    args = parser.parse_args()
    logging.getLogger("elastic_ep").setLevel(logging.ERROR)
    if args.ranks is None:
        table(args)
        return
    out = run_point(args.ranks, args.seqs_per_rank, args.seconds, args.step_ms, args.jitter_ms, args.processes,
                    args.before, not args.no_faults, args.timeout_s, args.profile, args.profile_recovery,
                    args.sample_s, args.warm_all, args.tracemalloc, args.step_results_via, args.step_plans_via,
                    args.async_scheduling, tuple(args.slow), args.placements_on_thread, args.api_servers,
                    args.max_tokens, args.send_ahead_steps)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
