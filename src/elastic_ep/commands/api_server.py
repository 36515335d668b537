"""An API server process (`serve --api-server-count N`, N > 1): `python -m
elastic_ep.commands.api_server LAUNCH_JSON`, started by `serve` (commands/api_servers.py).

It serves HTTP on the listening socket `serve` bound (inherited as `fd`; the kernel hands each
new connection to one of the N processes accepting on it), runs the OpenAI routes itself
(tokenizing, detokenizing, streaming) over a `RemoteEngine`, and forwards every other route to
the controller's app. The cluster key comes in $ELASTIC_EP_CLUSTER_KEY, the API keys in
$ELASTIC_EP_API_KEY and $ELASTIC_EP_ADMIN_API_KEY (never on the command line), and
$PROMETHEUS_MULTIPROC_DIR names where its HTTP metrics go. It ends with its parent.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from elastic_ep.commands.http_server import run_http
from elastic_ep.commands.log_options import configure_logging
from elastic_ep.control.api import EngineInfo
from elastic_ep.model.tokenizer import load_tokenizer
from elastic_ep.parent_death import end_with_parent
from elastic_ep.serve.app import create_api_server_app
from elastic_ep.serve.guard import ADMIN_API_KEY_ENV, API_KEY_ENV, HttpGuard
from elastic_ep.serve.remote_engine import RemoteEngine
from elastic_ep.wire import key_from_env

ENGINE_SOCKET = "engine.sock"  # the controller's app, in the deployment's private directory


class ApiServerLaunch(msgspec.Struct, frozen=True):
    """What `serve` tells API server `server` at start."""

    server: int
    fd: int  # the listening socket, inherited
    workdir: str  # the deployment's private directory: the ipc sockets and the controller's app
    model_dir: str  # for the tokenizer
    model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    info_extra: dict[str, Any]
    max_request_body_bytes: int
    request_timeout_s: float
    log_level: str = "info"
    log_format: str = "text"


def main(argv: list[str]) -> int:
    launch = msgspec.json.decode(argv[0], type=ApiServerLaunch)
    end_with_parent(signal.SIGTERM)  # it ends with serve
    configure_logging(launch.log_level, launch.log_format)
    workdir = Path(launch.workdir)
    info = EngineInfo(launch.model_name, launch.max_model_len, launch.eos_token_ids, launch.info_extra)
    engine = RemoteEngine(info, launch.server, key_from_env(), workdir)
    guard = HttpGuard(os.environ.get(API_KEY_ENV) or None, os.environ.get(ADMIN_API_KEY_ENV) or None,
                      launch.max_request_body_bytes)
    app = create_api_server_app(engine, load_tokenizer(launch.model_dir), registry=CollectorRegistry(),
                                controller_socket=workdir / ENGINE_SOCKET, guard=guard)
    run_http(app, socket.socket(fileno=launch.fd), launch.request_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
