"""`serve --api-server-count N` (N > 1): N API server processes in front of the controller's.

As vLLM's option of that name: the HTTP work (parsing, tokenizing, detokenizing, streaming every
token to its client) runs in N processes that accept on the one listening socket, and the
controller's process keeps the control thread and an app with every other route, on a Unix
socket the servers forward to. A request's outputs reach its server in one frame per step
(control/facade/api_bridge.py). The servers' HTTP metrics are prometheus-client's multiprocess
files, summed by the controller's /metrics. An API server that exits stops `serve` (exit code 2,
naming the server and its signal or code), as a dead HTTP server would.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import mark_process_dead
from tokenizers import Tokenizer

from elastic_ep.commands.api_server import ENGINE_SOCKET, ApiServerLaunch
from elastic_ep.control.controller import Controller
from elastic_ep.control.facade.api_bridge import ApiBridge, ServerSockets
from elastic_ep.serve.app import create_engine_app
from elastic_ep.serve.guard import ADMIN_API_KEY_ENV, API_KEY_ENV, HttpGuard
from elastic_ep.serve.prefix_keys import PrefixKeys
from elastic_ep.wire import ClusterKey
from elastic_ep.wire.codec import KEY_ENV

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


class ApiServers:
    """The API server processes of one `serve` and what joins them to `controller`: `app` and
    `engine_socket` are what serve's own uvicorn runs; `start()` after the controller started,
    `stop()` at the end. `on_exit`: called once when a server exits on its own (`exited` then says which and how)."""

    def __init__(self, count: int, controller: Controller, tokenizer: Tokenizer, key: ClusterKey,
                 registry: CollectorRegistry, guard: HttpGuard, http_socket: socket.socket, request_timeout_s: float,
                 log: tuple[str, str], on_exit: Callable[[], None]):
        self.count, self.key, self.guard, self.http_socket, self.log = count, key, guard, http_socket, log
        self.request_timeout_s = request_timeout_s
        self.on_exit = on_exit
        self.cfg = controller.cfg
        self.info = controller.engine.info
        self.workdir = Path(tempfile.mkdtemp(prefix="elastic-ep-api-"))  # mode 0700: only this user
        self.metrics_dir = self.workdir / "metrics"
        self.metrics_dir.mkdir()
        prefix_keys = PrefixKeys()
        self.app = create_engine_app(controller.engine, tokenizer, registry=registry, prefix_keys=prefix_keys,
                                     metrics_dir=self.metrics_dir, enable_chaos=self.cfg.enable_chaos, guard=guard)
        self.engine_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.engine_socket.bind(str(self.workdir / ENGINE_SOCKET))
        self.engine_socket.listen(2048)
        self.sockets = ServerSockets(zmq.Context.instance(), key, self.workdir, count)
        controller.streams.servers = self.sockets
        self.bridge = ApiBridge(controller.engine, key, self.workdir, controller.rejected_frames, prefix_keys.record)
        self.procs: list[subprocess.Popen] = []
        self.exited: str | None = None  # which server exited on its own, and how
        self._stopping = threading.Event()

    def start(self) -> None:
        self.bridge.start()
        env = {**os.environ, KEY_ENV: self.key.hex(), "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir),
               API_KEY_ENV: self.guard.api_key or "", ADMIN_API_KEY_ENV: self.guard.admin_api_key or ""}
        fd = self.http_socket.fileno()
        for server in range(self.count):
            launch = ApiServerLaunch(server, fd, str(self.workdir), self.cfg.model_dir, self.info.model_name,
                                     self.info.max_model_len, tuple(self.info.eos_token_ids), self.info.extra,
                                     self.guard.max_request_body_bytes, self.request_timeout_s, *self.log)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "elastic_ep.commands.api_server", msgspec.json.encode(launch).decode()],
                env=env, pass_fds=(fd,)))
        self.http_socket.close()  # the servers accept on it; this process would only hold connections back
        logger.info("%d API server processes (pids %s) serve HTTP", self.count, [p.pid for p in self.procs])
        threading.Thread(target=self._watch, name="api-servers", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for server, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    self.exited = f"API server {server} (pid {proc.pid}) {how}"
                    logger.error("%s: stopping", self.exited)
                    self._stopping.set()
                    self.on_exit()
                    return

    def stop(self) -> None:
        self._stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            mark_process_dead(proc.pid, str(self.metrics_dir))
        self.bridge.stop()
        self.sockets.close()
        self.engine_socket.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
