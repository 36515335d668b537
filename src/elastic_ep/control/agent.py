"""The node agent: starts and supervises the node's workers, fences them on order, and keeps
the node's share of the expert backup in shared memory.

It reports a worker's exit the moment it happens (one thread blocked in `wait()` per worker),
kills a rank on the controller's `FenceWorker` and confirms once the process is gone, sends
signals for fault injection, and answers `BackupFetch` from workers of other nodes on its own
ROUTER socket. `elastic-ep serve` runs one in a thread; `elastic-ep agent` runs one alone.
On shutdown it terminates its workers (SIGTERM, then SIGKILL after `stop_grace_s`) and removes
its backup file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import psutil
import zmq

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.runtime.worker import WorkerArgs

from .backup import read_backup, write_backup
from .messages import (
    AgentHello,
    AgentShutdown,
    AgentWelcome,
    BackupAssign,
    BackupFetch,
    BackupReady,
    BackupSite,
    BackupTensors,
    FenceWorker,
    SignalWorker,
    StartWorker,
    WorkerExited,
    WorkerFenced,
    WorkerStarted,
    decode,
    encode,
)


@dataclass
class _Child:
    rank_id: int
    proc: subprocess.Popen
    fencing: bool = False


class NodeAgent:
    """controller_addr: the controller's health socket (tcp://host:port); node: this failure
    domain's name; advertise_host: the address other nodes reach this agent's backup at;
    num_ranks: how many ranks this node offers (the controller assigns their rank_ids)."""

    def __init__(
        self,
        controller_addr: str,
        node: str,
        advertise_host: str = "127.0.0.1",
        num_ranks: int = 0,
        stop_grace_s: float = 3.0,
    ):
        self.node = node
        self.stop_grace_s = stop_grace_s
        self.num_ranks = num_ranks
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"a{node}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(controller_addr)
        self.fetch = self.ctx.socket(zmq.ROUTER)
        self.fetch.setsockopt(zmq.LINGER, 0)
        port = self.fetch.bind_to_random_port(f"tcp://{advertise_host}")
        self.fetch_addr = f"tcp://{advertise_host}:{port}"
        self._events_addr = f"inproc://agent-events-{id(self)}"
        self.events = self.ctx.socket(zmq.PULL)
        self.events.bind(self._events_addr)
        self.children: dict[int, _Child] = {}
        self.worker_args: dict | None = None
        self.backup_path: str | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until AgentShutdown or `stop` is set; then stop every worker."""
        stop = stop or threading.Event()
        self.sock.send(
            encode(AgentHello(self.node, os.getpid(), self.fetch_addr, psutil.virtual_memory().available, self.num_ranks))
        )
        poller = zmq.Poller()
        for s in (self.sock, self.fetch, self.events):
            poller.register(s, zmq.POLLIN)
        try:
            while not stop.is_set():
                ready = dict(poller.poll(50))
                if self.events in ready:
                    self.sock.send(self.events.recv())
                if self.fetch in ready:
                    self._answer_fetch()
                if self.sock in ready and not self._handle(decode(self.sock.recv())):
                    break
        finally:
            self.shutdown()

    def _handle(self, msg) -> bool:
        if isinstance(msg, AgentWelcome):
            self.worker_args = msg.worker_args
        elif isinstance(msg, BackupAssign):
            threading.Thread(target=self._build_backup, args=(msg.items,), daemon=True).start()
        elif isinstance(msg, StartWorker):
            self._start(msg.rank_id, msg.join_mode)
        elif isinstance(msg, FenceWorker):
            self._fence(msg)
        elif isinstance(msg, SignalWorker):
            self._signal(msg.pid, msg.signal)
        elif isinstance(msg, AgentShutdown):
            return False
        return True

    def _notify(self, message) -> None:
        """Queue a report to the controller from any thread (each gets its own PUSH socket)."""
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(self._events_addr)
        push.send(encode(message))
        push.close()

    def _start(self, rank_id: int, join_mode: str) -> None:
        assert self.worker_args is not None, "StartWorker before AgentWelcome"
        args = WorkerArgs(**{**self.worker_args, "rank_id": rank_id, "node": self.node, "join_mode": join_mode})
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "elastic_ep.runtime.worker", args.to_json()], env=env)
        with self._lock:
            self.children[proc.pid] = _Child(rank_id, proc)
        threading.Thread(target=self._wait, args=(proc.pid,), daemon=True).start()
        self.sock.send(encode(WorkerStarted(self.node, rank_id, proc.pid)))

    def _wait(self, pid: int) -> None:
        child = self.children[pid]
        returncode = child.proc.wait()
        with self._lock:
            self.children.pop(pid, None)
        if child.fencing:
            self._notify(WorkerFenced(self.node, child.rank_id, pid))
        else:
            self._notify(WorkerExited(self.node, child.rank_id, pid, returncode))

    def _fence(self, msg: FenceWorker) -> None:
        with self._lock:
            child = self.children.get(msg.pid)
            if child is not None:
                child.fencing = True
        if child is None:
            self.sock.send(encode(WorkerFenced(self.node, msg.rank_id, msg.pid)))
            return
        self._signal(msg.pid, signal.SIGKILL)

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _build_backup(self, items: list[tuple[int, int]]) -> None:
        assert self.worker_args is not None
        reader = CheckpointReader(self.worker_args["model_dir"])
        path, nbytes = write_backup(reader, items, self.node)
        self.backup_path = path
        if self._stopped.is_set():
            os.unlink(path)
            return
        self._notify(BackupReady(self.node, BackupSite(self.node, path, self.fetch_addr), items, nbytes))

    def _answer_fetch(self) -> None:
        sender, _, frame = self.fetch.recv_multipart()
        msg = decode(frame)
        reply = BackupTensors(None, None, "this node holds no expert backup")
        if isinstance(msg, BackupFetch) and self.backup_path:
            try:
                w13, w2 = read_backup(self.backup_path, msg.items)
                reply = BackupTensors(w13, w2)
            except KeyError as e:
                reply = BackupTensors(None, None, str(e))
        self.fetch.send_multipart([sender, b"", encode(reply)])

    def shutdown(self) -> None:
        """Stop every worker (SIGTERM, SIGKILL after stop_grace_s) and remove the backup file."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._lock:
            procs = [c.proc for c in self.children.values()]
        for p in procs:
            self._signal(p.pid, signal.SIGCONT)
            self._signal(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                self._signal(p.pid, signal.SIGKILL)
                p.wait()
        if self.backup_path and os.path.exists(self.backup_path):
            os.unlink(self.backup_path)
        for s in (self.sock, self.fetch, self.events):
            s.close()
