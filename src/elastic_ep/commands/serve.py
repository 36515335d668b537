"""`elastic-ep serve`: controller, this node's agent and its worker processes, plus the
OpenAI-compatible HTTP server, in one command. Ctrl-C or SIGTERM stops all of them.

The deployment's cluster key (wire/codec.py) is read from --cluster-key-file, made there when
the file does not exist yet, or made for this run only and written to a private temporary file
whose path the log gives (for `elastic-ep agent --cluster-key-file` on other hosts).

Start-up order: the arguments are checked and the HTTP port bound first, then this node's worker
zygote is started (node/zygote.py), and only then is torch imported here (with the controller,
the agent and the model): the two imports, ~3 s of CPU each, run side by side instead of one after
the other, and a mistake that needs neither (a flag's value, the HTTP port) is refused before
either starts."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_ep.commands.log_options import add_log_arguments, configure_logging
from elastic_ep.commands.straggler_options import CHOICES as STRAGGLER_CHOICES
from elastic_ep.commands.straggler_options import STRAGGLER_HELP
from elastic_ep.control.config import ServeConfig
from elastic_ep.errors import ElasticEPError
from elastic_ep.node.zygote import Zygote, early_zygote
from elastic_ep.serve.guard import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    HttpGuard,
)

if TYPE_CHECKING:
    from elastic_ep.wire import ClusterKey

logger = logging.getLogger("elastic_ep.serve")


def redundant_count(text: str) -> int | str:
    """--redundant-experts: auto, or a count >= 0."""
    if text == "auto":
        return text
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a count >= 0")
    return count


TYPES = {"redundant_experts": redundant_count}
CHOICES = {"backend": ["gloo", "nccl"], "dtype": ["auto", "float32", "bfloat16", "float16"],
           "device": ["auto", "cpu", "cuda"], "all2all_backend": ["flat", "hierarchical"],
           "dp_migrate": ["off", "kv", "reprefill"], "step_plans_via": ["direct", "agent"], **STRAGGLER_CHOICES}

# vLLM's and SGLang's flag names, kept as aliases.
ALIASES = {
    "elastic_ep_scale_timeout_s": ["--elastic-ep-scale-timeout"],
    "redundant_experts": ["--num-redundant-experts", "--ep-num-redundant-experts"],
}

HELP = {
    "redundant_experts": "extra expert slots in all: auto (the fewest with which the group outlives losing a rank, "
                         "or its largest node when --local-ranks is below --ep-size) or a count K, (experts + K) "
                         "dividing by --ep-size; 0 means any loss waits for a restart (aliases: vLLM's "
                         "--num-redundant-experts, SGLang's --ep-num-redundant-experts)",
    "backend": "data plane: gloo (through the host; ranks may share a GPU) or nccl (one GPU per rank)",
    "dtype": "weights, KV cache and compute: auto (the checkpoint's), float32, bfloat16 or float16",
    "device": "where each rank runs: auto (cuda when present), cpu or cuda (a rank takes the GPU of its local "
              "index on its node)",
    "host": "address the HTTP server listens on, and the controller binds unless --advertise-host says otherwise",
    "advertise_host": "this host's address for the control plane and the store, what agents and workers on other "
                      "hosts reach (default: --host); needed when --host is 0.0.0.0",
    "max_num_seqs": "sequences in flight per rank",
    "max_model_len": "longest prompt plus output, tokens",
    "max_num_batched_tokens": "tokens per rank per step (chunked prefill)",
    "reprefill_tokens_per_step": "tokens per step, over all ranks, of re-prefilling the requests of a lost rank, so "
                                 "the others keep decoding at their pace (0: no limit)",
    "block_size": "tokens per KV cache block",
    "gpu_memory_utilization": "on a GPU, the fraction of its memory a rank uses: the KV pool gets what the weights, "
                              "every expert slot and the activation peak of a warm-up forward leave",
    "kv_cache_memory": "bytes of each rank's KV pool, on any device (0: --gpu-memory-utilization on a GPU, room "
                       "for --max-num-seqs requests of --max-model-len on a CPU)",
    "num_gpu_blocks_override": "blocks of each rank's KV pool, whatever the budget (0: from the budget; for tests)",
    "enable_prefix_caching": "share the KV blocks of a common token prefix between requests",
    "prefix_wait": "a request whose prompt's next blocks another request of its rank is computing waits for them and "
                   "hits them, instead of computing them again (--no-prefix-wait: computes them at once)",
    "async_scheduling": "plan the next step while the current one runs (vLLM's overlap scheduling), when it is "
                        "one more decode of every request in flight; sent the moment the current step commits "
                        "(requests that ended taken out) unless something else changed (a request arrived, a "
                        "failed step, a fault), else planned as usual",
    "send_ahead_steps": "with --async-scheduling, send up to this many steps in a row before the step they were "
                        "planned during completes, so the ranks go from one step to the next without waiting for "
                        "the controller (vLLM's and SGLang's overlap): a request that ended in a step is computed "
                        "once more, its token dropped; a step boundary (an epoch change, a scale, a sleep) waits "
                        "for the steps sent (0: off)",
    "padded_dispatch_max_tokens": "steps whose busiest rank runs at most this many tokens dispatch fixed-size "
                                  "blocks, one all-to-all fewer per layer (0: never)",
    "enable_dbo": "two micro-batches per step (vLLM's dual batch overlap): one's dispatch and combine are in "
                  "flight while the other runs attention and experts",
    "dbo_min_tokens": "with --enable-dbo, a step runs two micro-batches when its busiest rank runs at least this "
                      "many tokens",
    "all2all_backend": "flat (every rank to every rank) or hierarchical (gather per node, cross between nodes once, "
                       "scatter on arrival; the same as flat on one node)",
    "dp_align": "even the tokens per rank every step: prefill cut to the step's level, unstarted prefills placed "
                "again on the least loaded rank",
    "dp_align_min_chunk": "with --dp-align, least prefill tokens a rank with prefill runs per step",
    "dp_migrate": "move a decoding sequence off a rank that stays the busiest: off, kv (copy its KV cache) or "
                  "reprefill (recompute it on the new rank)",
    "dp_migrate_patience": "steps a rank must stay the busiest (two decoding sequences above the least loaded) "
                           "before one of its sequences moves",
    "expert_backup": "keep each node's share of the routed experts in host shared memory",
    "read_once": "read once, copy many at the first start: each node's agent reads the dense weights and its "
                 "backup share from storage once, and its ranks copy them from shared memory (another node's "
                 "agent for experts it backs up) instead of each reading the checkpoint",
    "load_read_rate_mb_s": "hold the storage reads of all the processes of this host, together, to this many MB/s "
                           "(a read storm measured on one machine; 0: unthrottled)",
    "warmup_gate": "/ready opens only after warm-up steps ran every batch shape the step loop runs with a token on "
                   "every expert slot (CUDA graph capture's place on a GPU; the first run of each shape on a CPU)",
    "enable_eplb": "re-place experts from the recorded load while serving",
    "eplb_interval": "steps between EPLB checks",
    "eplb_threshold": "rebalance when max/mean rank load exceeds this",
    "eplb_speed_aware": "EPLB gives slow ranks less expert load, from each rank's own time per step",
    "load_report_every_steps": "ranks sum their expert load and report it every this many steps (the EPLB window "
                               "and the expert distribution recorder count in these)",
    "enable_chaos": "enable the fault-injection endpoints",
    "record_dir": "where /dump_expert_distribution_record writes",
    "heartbeat_interval_s": "worker heartbeat period",
    "heartbeat_timeout_s": "a rank silent this long is declared lost",
    "load_heartbeat_timeout_s": "the same for a rank whose last heartbeat said it fills its expert slots (its "
                                "exit is still seen at once)",
    "watchdog_floor_s": "least time a rank may lag the others into a collective",
    "watchdog_multiple": "lag allowed as a multiple of the median recent step time",
    "result_timeout_floor_s": "least time after a step was sent before a member's missing answer (with its "
                              "heartbeats saying it is not inside the step) is asked for again",
    "result_timeout_multiple": "a missing answer is asked for again after this multiple of the median recent step "
                               "time, and never before the result timeout floor",
    "resend_timeout_s": "a rank asked to send its answer again that does not answer within this is a fault",
    "step_plans_via": "where the step plans go: direct (one frame to each rank) or agent (one frame per node to its "
                      "agent, run with --step-plans-via agent, which relays it to its ranks on loopback: fewer "
                      "frames for the control thread; a node whose agent has no plan link up gets them directly)",
    "fence_timeout_s": "wait for an agent to confirm a kill",
    "drain_timeout_s": "wait for the other ranks to leave a failed step",
    "epoch_timeout_s": "wait for a new epoch to form and move its experts",
    "collective_timeout_s": "torch.distributed timeout, a last resort behind the watchdog",
    "backup_fetch_timeout_s": "wait for another node's agent to send experts from its backup",
    "admission_timeout_s": "a request waits this long for a ready cluster before a 503",
    "degraded_timeout_s": "requests in flight wait this long for too few ranks to recover, then end with an error",
    "startup_timeout_s": "wait for every rank to register at start",
    "restart_delay_s": "restart a dead rank after this delay (negative: never)",
    "max_ep_size": "most ranks POST /scale_elastic_ep may scale to (0: twice --ep-size)",
    "elastic_ep_scale_timeout_s": "a scale not serving at its new size after this long fails (alias "
                                  "--elastic-ep-scale-timeout)",
    "scale_drain_timeout_s": "on scale-down, requests of the leaving ranks finish there for this long, "
                             "then move to the others",
    "health_checks": "heartbeat and watchdog detection (off only to measure their cost)",
    "health_check_period_s": "how often the controller runs the heartbeat and watchdog checks",
    "exit_poll_interval_s": "how often this node's agent reads its workers' /proc stat, so a worker's death is "
                            "reported when it begins, not once the kernel has freed its memory",
    "expert_sweep_interval_s": "background check of expert slots: how often each rank checksums a few slots",
    "expert_sweep_slots": "slots each rank checksums per background check (0: no background check)",
    "rebalance_move_bytes": "after a recovery or rejoin (which restore only the experts that lost every copy) and "
                            "for EPLB, experts move towards balance in the background: at most this many bytes "
                            "per move, one move between steps",
    "rebalance_every_steps": "steps served between two moves of the background rebalance",
    "isolation_max_steps": "a step that fails with every rank alive is re-run without suspect requests to find the "
                           "one at fault; after this many steps the remaining suspects end with an error",
    "agent_timeout_s": "a node whose agent is silent this long is lost (host down or cut off): its ranks are "
                       "dropped at once (an agent that registered and has not said alive yet: 1 s more, for its "
                       "welcome to reach it)",
    "lease_s": "an agent that has not heard the controller this long kills its workers and registers again "
               "(the same for the agent of this node)",
    "heartbeat_suspect_s": "a rank whose heartbeat is this old shows as suspect (nothing is done to it)",
    "stall_floor_s": "least time a step may run before /ready turns false and the rank holding it shows "
                     "as stalled, whatever the fencing deadlines",
    "stall_multiple": "a step stalls after this multiple of the median recent step time (at least "
                      "--stall-floor-s)",
    **STRAGGLER_HELP,
    "standby_ranks": "warm standby ranks kept outside the group (started, loaded, warmed up): a fault, an "
                     "eviction or a scale-up takes one instead of starting a process, and a new one starts in the "
                     "background",
    "hardware_interval_s": "how often each node agent reads its hardware signals (CPU steal and frequency; NVML "
                           "ECC, clocks, throttle reasons, Xid where present)",
    "log_stats_interval_s": "log a one-line stats summary this often (0: never)",
    "metrics_top_k": "ranks with a rank label in /metrics: those down, stalled, suspect, straggling or derated "
                     "first, then the slowest by own time per step; the whole group is in the elastic_ep_group_* "
                     "histograms",
    "otlp_traces_endpoint": "send OpenTelemetry traces (a span per request with its queue, prefill, decode, "
                            "recovery pauses and migrations; one per epoch change) to this OTLP/HTTP endpoint, "
                            "e.g. http://collector:4318/v1/traces (vLLM's flag; the OTEL_* variables apply; "
                            "needs pip install 'elastic-ep[tracing]'); empty: no tracing, nothing imported",
    "trace_sample_ratio": "with --otlp-traces-endpoint, the share of requests traced (head sampling); requests "
                          "that crossed a fault, an eviction or the p99 latency are always traced",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="checkpoint dir, or tiny-deepseek-v3 / tiny-qwen3-moe (the embedded random test models)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    parser.add_argument("--ep-size", type=int, default=2, help="number of EP ranks (worker processes)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--node", default="node0", help="this node's name (failure domain)")
    parser.add_argument("--local-ranks", type=int, default=None,
                        help="ranks started on this node (default --ep-size; others come from `elastic-ep agent`; "
                             "0: a controller with no workers and no agent here)")
    parser.add_argument("--cluster-key-file", default=None, metavar="PATH",
                        help="the deployment's shared secret, which every agent and worker must hold (mode 0600; "
                             "made there if the file does not exist; default: a new key in a private temporary "
                             "file the log names, removed at exit)")
    parser.add_argument("--api-key", default=None,
                        help=f"key clients must send as `Authorization: Bearer` on /v1 (default ${API_KEY_ENV}; "
                             "none: /v1 is open)")
    parser.add_argument("--admin-api-key", default=None,
                        help=f"key of the operating routes (scale, recorder, chaos; default ${ADMIN_API_KEY_ENV}; "
                             "none: they answer loopback clients only)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    parser.add_argument("--request-timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="close an HTTP connection that has not sent a whole request (headers and body) this "
                             "long after connecting or after its last response "
                             f"(default {DEFAULT_REQUEST_TIMEOUT_S:g})")
    parser.add_argument("--etcd", default=None, metavar="URL",
                        help="join a controller group through the etcd at URL (http://HOST:PORT): one controller of "
                             "--ha-group leads, the others stand by and take over when it is lost; its ranks come "
                             "from `elastic-ep agent --etcd` (default: no group, this controller alone)")
    parser.add_argument("--ha-group", default=None, metavar="NAME",
                        help="with --etcd: the group's name, the same on every controller of the deployment")
    parser.add_argument("--ha-lease-s", type=int, default=5,
                        help="with --etcd: the leader's etcd lease, whole seconds >= 2: a standby takes over this "
                             "long after the leader is lost (default 5)")
    parser.add_argument("--ha-journal-flush-s", type=float, default=0.05,
                        help="with --etcd: the leader ships the request journal (requests and their tokens) to "
                             "the standbys this often, one batch each time (default 0.05)")
    parser.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="HTTP server processes (as vLLM's option): with N > 1, N processes accept on --port, "
                             "each tokenizing, detokenizing and streaming its own requests, whose tokens reach it "
                             "in one frame per step; the controller's process keeps the control thread and every "
                             "other route, which the servers forward to it (default 1: HTTP in this process)")
    parser.add_argument("--step-results-via", choices=["direct", "agent"], default="direct",
                        help="where the workers' step results go: direct (each to the controller) or agent (to "
                             "their node's agent on loopback, which sends the controller one frame per step for its "
                             "ranks: fewer frames for the control thread; default direct)")
    parser.add_argument("--worker-start", choices=["fork", "exec"], default="fork",
                        help="how this node's ranks start: fork (from a zygote process of the agent that imported "
                             "torch and the worker once: a rank starts or restarts without importing anything) or "
                             "exec (a new Python each time; also what fork falls back to while the zygote is not "
                             "ready; default fork)")
    parser.add_argument("--ha-journal-via", choices=["etcd", "direct"], default="etcd",
                        help="with --etcd: how the journal reaches the standbys: etcd (each batch a write, which "
                             "outlives every controller) or direct (the leader streams it to each standby over "
                             "ZeroMQ, sealed with the cluster key; a standby started after the leader died has "
                             "none); the same on every controller of the group: one that differs from the group's "
                             "exits with code 2 (default etcd)")
    add_log_arguments(parser)
    for f in dataclasses.fields(ServeConfig):
        if f.name not in HELP:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"{HELP[f.name]} (default {'on' if f.default else 'off'})")
        else:
            kwargs = {"choices": CHOICES[f.name]} if f.name in CHOICES else {}
            parser.add_argument(flag, *ALIASES.get(f.name, []), type=TYPES.get(f.name, type(f.default)),
                                default=f.default,
                                help=f"{HELP[f.name]} (default {f.default})", **kwargs)


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP server's listening socket, bound before anything else starts, so that a port
    in use is refused at once instead of after the workers came up. Raises ElasticEPError
    naming the port and the fix."""
    if not 0 <= port <= 65535:
        raise ElasticEPError(f"--port {port} is not a TCP port (0..65535)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may rebind at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ElasticEPError(f"--port {port}: {host}:{port} is already in use (another server?); stop that "
                                 "process or pick a free port with --port") from None
        raise ElasticEPError(f"cannot listen on {host}:{port} ({e.strerror or e}); --host must be an address of "
                             "this host (or 0.0.0.0)") from None
    sock.listen(2048)
    return sock


def check_control_host(cfg: ServeConfig) -> None:
    """The control plane and the store bind --advertise-host (default --host): refuse one that is
    not an address of this host before anything binds it (zmq would raise from deep inside)."""
    if not cfg.advertise_host:
        return  # --host: bind_http has bound it
    try:
        with socket.socket(socket.AF_INET6 if ":" in cfg.advertise_host else socket.AF_INET) as probe:
            probe.bind((cfg.advertise_host, 0))
    except OSError as e:
        raise ElasticEPError(f"--advertise-host {cfg.advertise_host} is not an address of this host "
                             f"({e.strerror or e}): agents and workers reach the controller there; pass one of this "
                             "host's addresses") from None


def cluster_key(path: str | None) -> tuple[ClusterKey, Path | None]:
    """The key of --cluster-key-file (made there when the file does not exist), or a new one
    in a private temporary file; the second value is that temporary file, to remove at exit."""
    from elastic_ep.wire import ClusterKey, ClusterKeyError  # torch: see the module docstring

    try:
        if path is not None and Path(path).exists():
            return ClusterKey.read(path), None
        key = ClusterKey.generate()
        if path is not None:
            key.write(path)
            logger.info("wrote a new cluster key to %s: give it to `elastic-ep agent --cluster-key-file` on "
                        "other hosts", path)
            return key, None
    except (ClusterKeyError, OSError) as e:
        raise ElasticEPError(f"--cluster-key-file: {e}") from None
    fd, temp = tempfile.mkstemp(prefix="elastic-ep-cluster-", suffix=".key")
    os.close(fd)
    os.unlink(temp)
    key.write(temp)
    logger.info("cluster key in %s (mode 0600, removed when serve stops): agents on other hosts need it "
                "(`elastic-ep agent --cluster-key-file`)", temp)
    return key, Path(temp)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    local_ranks = (0 if args.etcd else args.ep_size) if args.local_ranks is None else args.local_ranks
    if local_ranks < 0:
        raise ElasticEPError(f"--local-ranks must be >= 0, got {local_ranks}")
    if (args.etcd is None) != (args.ha_group is None):
        raise ElasticEPError("--etcd and --ha-group go together: the etcd URL and the name of the controller group")
    if args.etcd and local_ranks:
        raise ElasticEPError(f"--local-ranks {local_ranks} with --etcd: a controller of a group runs no workers "
                             "(they would die with it); start `elastic-ep agent --etcd URL --ha-group NAME` on each "
                             "host instead")
    if args.max_request_body_bytes <= 0 or args.request_timeout_s <= 0:
        raise ElasticEPError("--max-request-body-bytes and --request-timeout-s must be > 0")
    if args.api_server_count < 1:
        raise ElasticEPError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1 and args.etcd:
        raise ElasticEPError("--api-server-count above 1 is not supported with --etcd yet: a controller group serves "
                             "HTTP in each controller's process; leave it at 1")
    http_socket = bind_http(args.host, args.port)
    zygote = early_zygote(local_ranks, args.worker_start)
    try:
        return _serve(args, local_ranks, http_socket, zygote)
    finally:
        if zygote is not None:  # the agent's from its start, closed by it; this one if serve failed before
            zygote.close()


def _serve(args: argparse.Namespace, local_ranks: int, http_socket: socket.socket, zygote: Zygote | None) -> int:
    # torch, with the controller, the agent and the model: after the zygote started (module docstring)
    from prometheus_client import CollectorRegistry

    from elastic_ep.commands.http_server import run_http
    from elastic_ep.control.controller import Controller
    from elastic_ep.control.gc_policy import tune_for_serving
    from elastic_ep.model.tiny import resolve_model
    from elastic_ep.model.tokenizer import load_tokenizer
    from elastic_ep.node.agent import NodeAgent
    from elastic_ep.runtime.devices import check_node_devices

    model_dir = resolve_model(args.model)
    check_node_devices(args.device, args.backend, local_ranks)
    guard = HttpGuard(args.api_key or os.environ.get(API_KEY_ENV) or None,
                      args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None, args.max_request_body_bytes)
    key, temp_key = cluster_key(args.cluster_key_file)
    cfg = ServeConfig(
        model_dir=str(model_dir),
        model_name=args.served_model_name or args.model,
        ep_size=args.ep_size,
        # other nodes' agents likely run as many ranks as this one: --redundant-experts auto plans for a node loss
        ranks_per_node=local_ranks if 0 < local_ranks < args.ep_size else 0,
        **{name: getattr(args, name) for name in HELP},
    )
    check_control_host(cfg)
    registry = CollectorRegistry()
    tokenizer = load_tokenizer(model_dir)
    if args.etcd:
        from elastic_ep.commands.serve_group import serve_in_group

        try:
            return serve_in_group(args, cfg, key, registry, tokenizer, guard, http_socket)
        finally:
            if temp_key is not None:
                temp_key.unlink(missing_ok=True)
    controller = Controller(cfg, key, registry)
    servers = None
    if args.api_server_count > 1:
        from elastic_ep.commands.api_servers import ApiServers

        servers = ApiServers(args.api_server_count, controller, tokenizer, key, registry, guard, http_socket,
                             args.request_timeout_s, (args.log_level, args.log_format),
                             on_exit=lambda: signal.raise_signal(signal.SIGTERM))
        app, app_socket = servers.app, servers.engine_socket
    else:
        from elastic_ep.serve.app import create_app

        app = create_app(controller.engine, tokenizer, registry=registry, enable_chaos=cfg.enable_chaos, guard=guard)
        app_socket = http_socket
    if cfg.enable_chaos:
        logger.warning("--enable-chaos: fault injection is open: anyone who reaches http://%s:%d can kill, stop, slow "
                       "and corrupt ranks through POST /chaos/*; never serve traffic like this", cfg.host,
                       http_socket.getsockname()[1])
    # the controller and the app are built, nothing runs yet: start-up's objects are frozen, out of
    # every collection, and the control thread's full collections stay rare (control/gc_policy.py)
    tune_for_serving()
    agent_stop = threading.Event()
    agent_thread = threading.Thread(name="agent", daemon=True)
    if local_ranks:
        agent = NodeAgent(controller.health_addr, args.node, key, cfg.control_host, local_ranks, lease_s=cfg.lease_s,
                          hardware_interval_s=cfg.hardware_interval_s,
                          exit_poll_s=cfg.exit_poll_interval_s, step_results_via=args.step_results_via,
                          step_plans_via=cfg.step_plans_via, worker_start=args.worker_start, zygote=zygote)
        agent_thread = threading.Thread(target=agent.run, args=(agent_stop,), name="agent", daemon=True)
        agent_thread.start()
    # A control loop that cannot go on (e.g. a rank that dies at startup) stops the server.
    controller.on_fatal = lambda: signal.raise_signal(signal.SIGTERM)
    controller.start()
    logger.info("controller at %s (agents connect here), HTTP on http://%s:%d", controller.health_addr, cfg.host,
                http_socket.getsockname()[1])
    try:
        if servers is not None:
            servers.start()
        run_http(app, app_socket, args.request_timeout_s)
    finally:
        if servers is not None:
            servers.stop()
        controller.stop()
        agent_stop.set()
        if agent_thread.is_alive():
            agent_thread.join(10)
        if temp_key is not None:
            temp_key.unlink(missing_ok=True)
    if controller.fatal:
        raise ElasticEPError(f"the cluster stopped: {controller.fatal}")
    if servers is not None and servers.exited:
        raise ElasticEPError(f"stopped: {servers.exited}")
    return 0
