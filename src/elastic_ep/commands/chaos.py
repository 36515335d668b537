"""`elastic-ep chaos URL ACTION RANK`: inject a fault into a server started with
--enable-chaos (POST /chaos/ACTION), and print the server's answer."""

from __future__ import annotations

import argparse
import json

import httpx

from elastic_ep.control.api import CHAOS_ACTIONS
from elastic_ep.errors import ElasticEPError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "action",
        choices=CHAOS_ACTIONS,
        help="kill (SIGKILL), hang (SIGSTOP), resume (SIGCONT), slow (add delay_s per step), corrupt (overwrite "
             "one of its expert slots: --layer, --slot, default its first)",
    )
    parser.add_argument("rank", type=int, help="rank_id, as listed by GET /cluster")
    parser.add_argument("--delay-s", type=float, default=0.0, help="for slow: seconds added to every step")
    parser.add_argument("--layer", type=int, default=None, help="for corrupt: MoE layer index of the slot")
    parser.add_argument("--slot", type=int, default=None, help="for corrupt: slot within the rank")
    parser.add_argument("--at-next-epoch", action="store_true",
                        help="for kill / hang: act right after the next epoch is announced (a fault during recovery)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="HTTP timeout (default 10)")


def run(args: argparse.Namespace) -> int:
    url = f"{args.url.rstrip('/')}/chaos/{args.action}"
    try:
        response = httpx.post(
            url, json={"rank_id": args.rank, "delay_s": args.delay_s, "layer": args.layer, "slot": args.slot,
                       "at_next_epoch": args.at_next_epoch}, timeout=args.timeout_s
        )
    except httpx.HTTPError as e:
        raise ElasticEPError(
            f"cannot reach {args.url} ({type(e).__name__}: {e}); is `elastic-ep serve` running there?"
        ) from None
    if response.status_code != 200:
        raise ElasticEPError(
            f"{args.action} rank {args.rank} refused (HTTP {response.status_code}): {_message(response)}"
        )
    print(json.dumps(response.json(), indent=2))
    return 0


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text.strip() or "(empty body)"
