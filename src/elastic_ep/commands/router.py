"""`elastic-ep router`: an OpenAI-compatible gateway over `elastic-ep serve` instances (prefix
affinity, load scoring, streams carried across an instance's death). Ctrl-C or SIGTERM stops it."""

from __future__ import annotations

import argparse
import signal

import uvicorn

from elastic_ep.commands.http_server import KEEP_ALIVE_S
from elastic_ep.commands.log_options import add_log_arguments, configure_logging
from elastic_ep.errors import ElasticEPError
from elastic_ep.router.backends import normalize_url
from elastic_ep.router.config import RouterConfig
from elastic_ep.router.scoring import Limits

DEFAULTS = RouterConfig()
LIMITS = Limits()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="a serve instance, e.g. http://10.0.0.5:8000 (repeat for each)")
    parser.add_argument("--backends-file", default=None,
                        help="a file of backend URLs, one a line (# comments), re-read when it changes")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port")
    parser.add_argument("--api-key", default=None, help="clients must send `Authorization: Bearer KEY` on /v1/*")
    parser.add_argument("--backend-api-key", default=None,
                        help="sent to backends as `Authorization: Bearer KEY` (unset: a client's header is passed "
                             "through when the router checks no key of its own)")
    parser.add_argument("--migration-limit", type=int, default=DEFAULTS.migration_limit,
                        help="times one choice may move to another instance (its instance died mid-stream, or the "
                             "request failed before starting); then it ends with an error")
    parser.add_argument("--max-open-per-backend", type=int, default=LIMITS.max_open,
                        help="requests this router keeps open on one backend; beyond, it is saturated")
    parser.add_argument("--max-waiting-per-backend", type=int, default=LIMITS.max_waiting,
                        help="a backend whose own queue (elastic_ep_num_requests_waiting) holds this many is "
                             "saturated (0: no limit)")
    parser.add_argument("--balance-abs-threshold", type=int, default=LIMITS.balance_abs,
                        help="requests a backend may hold above the least loaded one before load sends its "
                             "prefix's requests to the next backend in the prefix's order (SGLang's name)")
    parser.add_argument("--balance-rel-threshold", type=float, default=LIMITS.balance_rel,
                        help="... when it also holds more than this times as many as the least loaded one")
    parser.add_argument("--kv-high", type=float, default=LIMITS.kv_high,
                        help="when load moves a request off its prefix's backend, a backend whose KV cache is "
                             "this full (elastic_ep_kv_cache_usage_perc) is passed over while another has room")
    parser.add_argument("--block-bytes", type=int, default=DEFAULTS.block_bytes,
                        help="prefix block size, bytes of prompt")
    parser.add_argument("--affinity-blocks", type=int, default=DEFAULTS.affinity_blocks,
                        help="leading blocks that name a prompt's prefix: set their total near the shared "
                             "prefix (system prompt) length of the workload")
    parser.add_argument("--prefix-live-s", type=float, default=DEFAULTS.prefix_live_s,
                        help="a prefix a backend was sent within this long counts toward its share when a new "
                             "prefix is placed (on the backend with the fewest)")
    parser.add_argument("--queue-size", type=int, default=DEFAULTS.queue_size,
                        help="requests that may wait while every backend is saturated; beyond, 429")
    parser.add_argument("--queue-timeout-s", type=float, default=DEFAULTS.queue_timeout_s,
                        help="a queued request waits this long for room, then 429")
    parser.add_argument("--retry-after-s", type=int, default=DEFAULTS.retry_after_s,
                        help="Retry-After of a 429 or 503")
    parser.add_argument("--poll-interval-s", type=float, default=DEFAULTS.poll_interval_s,
                        help="how often each backend's /ready and /metrics are read")
    parser.add_argument("--poll-timeout-s", type=float, default=DEFAULTS.poll_timeout_s,
                        help="a backend that does not answer a poll within this is not ready")
    parser.add_argument("--connect-timeout-s", type=float, default=DEFAULTS.connect_timeout_s,
                        help="connecting to a backend and sending it a request")
    parser.add_argument("--request-timeout-s", type=float, default=DEFAULTS.request_timeout_s,
                        help="a non-streaming answer (streams may take any time)")
    parser.add_argument("--stream-check-s", type=float, default=DEFAULTS.stream_check_s,
                        help="a stream waiting for its next chunk checks this often that its instance is ready")
    add_log_arguments(parser)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def config_from(args: argparse.Namespace) -> RouterConfig:
    if not args.backend and not args.backends_file:
        raise ElasticEPError("give at least one --backend URL or a --backends-file (backends may also be added "
                             "later with POST /backends, but the router needs one to serve)")
    try:
        backends = tuple(normalize_url(u) for u in args.backend)
    except ValueError as e:
        raise ElasticEPError(str(e)) from None
    if args.migration_limit < 0:
        raise ElasticEPError(f"--migration-limit must be >= 0, got {args.migration_limit}")
    if args.block_bytes < 1 or args.affinity_blocks < 1:
        raise ElasticEPError("--block-bytes and --affinity-blocks must be >= 1")
    if args.prefix_live_s <= 0:
        raise ElasticEPError(f"--prefix-live-s must be > 0, got {args.prefix_live_s}")
    if args.balance_abs_threshold < 0 or args.balance_rel_threshold < 0:
        raise ElasticEPError("--balance-abs-threshold and --balance-rel-threshold must be >= 0")
    limits = Limits(max_open=args.max_open_per_backend, max_waiting=args.max_waiting_per_backend,
                    balance_abs=args.balance_abs_threshold, balance_rel=args.balance_rel_threshold,
                    kv_high=args.kv_high)
    return RouterConfig(
        backends=backends, backends_file=args.backends_file, api_key=args.api_key,
        backend_api_key=args.backend_api_key, migration_limit=args.migration_limit, limits=limits,
        block_bytes=args.block_bytes, affinity_blocks=args.affinity_blocks, prefix_live_s=args.prefix_live_s,
        queue_size=args.queue_size,
        queue_timeout_s=args.queue_timeout_s, retry_after_s=args.retry_after_s,
        poll_interval_s=args.poll_interval_s, poll_timeout_s=args.poll_timeout_s,
        connect_timeout_s=args.connect_timeout_s, request_timeout_s=args.request_timeout_s,
        stream_check_s=args.stream_check_s,
    )


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    cfg = config_from(args)
    from elastic_ep.router.app import create_app

    app = create_app(cfg)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", log_config=None,
                    timeout_graceful_shutdown=2, timeout_keep_alive=KEEP_ALIVE_S)
    except KeyboardInterrupt:
        pass
    return 0
