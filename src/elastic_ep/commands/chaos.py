"""`elastic-ep chaos URL ACTION RANK`: inject a fault into a server started with
--enable-chaos (POST /chaos/ACTION), and print the server's answer. A server with
--admin-api-key needs it here too (`--admin-api-key` or $ELASTIC_EP_ADMIN_API_KEY)."""

from __future__ import annotations

import argparse
import json
import os

import httpx

from elastic_ep.commands.remote import error_message, server_url, unreachable
from elastic_ep.control.api import CHAOS_ACTIONS
from elastic_ep.errors import ElasticEPError
from elastic_ep.serve.guard import ADMIN_API_KEY_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", type=server_url, help="the server, e.g. http://127.0.0.1:8000 (or 127.0.0.1:8000)")
    parser.add_argument(
        "action",
        choices=CHAOS_ACTIONS,
        help="kill (SIGKILL), hang (SIGSTOP), resume (SIGCONT), slow (add delay_s per step), corrupt (overwrite "
             "one of its expert slots: --layer, --slot, default its first), poison (with --request-id: that "
             "request's steps raise on its rank; with RANK: every step of the rank raises), cut (drop every packet "
             "of the rank's process, or with --node of a whole node; --duration-s to heal by itself), heal, lose (the "
             "rank's answer to the next step is lost on the way: the controller asks for it again), lose_plan (its "
             "plan of the next step is lost: asked for, the rank says it never ran it, and the step runs again)",
    )
    parser.add_argument("rank", type=int, nargs="?", help="rank_id, as listed by GET /cluster")
    parser.add_argument("--delay-s", type=float, default=None,
                        help="slow needs it: seconds added to every step of the rank; 0 takes the delay away")
    parser.add_argument("--layer", type=int, default=None, help="for corrupt: MoE layer index of the slot")
    parser.add_argument("--slot", type=int, default=None, help="for corrupt: slot within the rank")
    parser.add_argument("--at-next-epoch", action="store_true",
                        help="for kill / hang: act right after the next epoch is announced (a fault during recovery)")
    parser.add_argument("--request-id", default=None, help="for poison: the id of a running request")
    parser.add_argument("--node", default=None, help="for cut / heal: a whole node (one run by `elastic-ep agent`)")
    parser.add_argument("--duration-s", type=float, default=0.0,
                        help="for cut: heal by itself after this long (needed for a node: it cannot hear `heal`)")
    parser.add_argument("--phase", choices=["local", "experts", "sampling"], default="local",
                        help="for poison: where the steps raise")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="HTTP timeout (default 10)")
    parser.add_argument("--admin-api-key", default=None,
                        help=f"the server's --admin-api-key (default ${ADMIN_API_KEY_ENV}; none: send no key)")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    url = f"{args.url}/chaos/{args.action}"
    key = args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV)
    try:
        response = httpx.post(
            url, json={"rank_id": args.rank, "delay_s": args.delay_s or 0.0, "layer": args.layer, "slot": args.slot,
                       "at_next_epoch": args.at_next_epoch, "request_id": args.request_id, "phase": args.phase,
                       "node": args.node, "duration_s": args.duration_s},
            timeout=args.timeout_s, headers={"Authorization": f"Bearer {key}"} if key else None,
        )
    except httpx.HTTPError as e:
        raise unreachable(args.url, e) from None
    if response.status_code != 200:
        target = f"rank {args.rank}" if args.rank is not None else f"node {args.node}" if args.node else \
            f"request {args.request_id}"
        raise ElasticEPError(
            f"{args.action} {target} refused (HTTP {response.status_code}): {error_message(response)}"
        )
    print(json.dumps(response.json(), indent=2))
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.rank is None and not (args.action == "poison" and args.request_id) and not (
            args.action in ("cut", "heal") and args.node):
        raise ElasticEPError(f"{args.action} needs RANK, a rank_id listed by GET {args.url}/cluster"
                             + (" (or --request-id for one request)" if args.action == "poison" else ""))
    if args.rank is not None and args.rank < 0:
        raise ElasticEPError(f"rank {args.rank} is not a rank_id: give one listed by GET {args.url}/cluster")
    if args.timeout_s <= 0:
        raise ElasticEPError(f"--timeout-s must be > 0 seconds, got {args.timeout_s}")
    if args.action == "slow" and args.delay_s is None:
        raise ElasticEPError("chaos slow needs --delay-s SECONDS, the time added to every step of the rank "
                             "(e.g. --delay-s 0.05); --delay-s 0 takes a delay away")
    if args.delay_s is not None and not args.delay_s >= 0:
        raise ElasticEPError(f"--delay-s must be >= 0 seconds, got {args.delay_s}")
    if args.action != "slow" and args.delay_s:
        raise ElasticEPError(f"--delay-s is for slow only; {args.action} takes no delay")
