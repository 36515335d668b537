"""The worker zygote: a process of the agent's that imported the worker's modules once (torch
among them, ~3 s of CPU each time) and forks each worker of its node from there, so a rank starts
or restarts without importing anything.

How a worker is made, and why each part is there:
- The agent sends `Fork` (the function to run, `module:function`, and its argv; the title the
  process shows; the agent's pid; what the worker adds to the zygote's environment, the cluster key
  among it) over an unnamed SOCK_SEQPACKET socketpair, with two descriptors: the read end of the
  worker's stdin (its agent link) and of a go pipe. Only the agent holds the other end of the
  pair, so nothing else can ask for a process; the message is typed (msgspec) all the same.
- The zygote forks twice: the middle process forks the worker and exits, the zygote reaps it and
  answers `Forked(pid)`. The worker is then an orphan, and the kernel hands it to the agent,
  which made itself a child subreaper (`adopt_orphans`): the agent waits for it (`ForkedWorker`)
  and gets its exit status as from a process it started itself. So a zygote that dies takes no
  worker with it; only starts fall back to exec until the agent has a new one.
- The worker names itself (setproctitle: `elastic-ep doctor` finds a rank's process by it), then
  waits on the go pipe until the agent has moved it into its cgroup (node/netcut.py:
  a socket belongs to the cgroup its process was in when it made the socket), then has the
  kernel kill it with the agent (PR_SET_PDEATHSIG, set only now that the agent is its parent)
  and exits with
  what the function returns (`elastic_ep.runtime.worker:main`, as `python -m` runs it).
- The zygote itself dies with the agent (PR_SET_PDEATHSIG) and when the agent closes the pair.

The zygote's own environment is `base_env()`, which holds no secret: a command starts it before it
has read the cluster key or imported torch itself (`elastic-ep serve` and `elastic-ep agent`), so the
two imports run side by side, and each `Fork` brings the key the worker needs.

What a fork copies is the zygote's state before any thread, socket or device exists: it imports,
it does not initialise CUDA or start a thread (`preload` checks that no other thread runs), and
Python's `random` is seeded again in each child by the standard library. Code changed on disk
after the zygote imported it is not what a fork would run: `Zygote.fresh` compares the package's
source files with what they were when it started, and the agent starts a new zygote (and that
rank by exec) when they differ.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import setproctitle

from elastic_ep.parent_death import end_with_parent

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20  # a Fork is a launch spec of a few KB
REPLY_TIMEOUT_S = 30.0  # a fork answers in milliseconds; a zygote silent this long is taken for dead
PACKAGE_DIR = Path(__file__).resolve().parents[1]
WORKER_MODULE = "elastic_ep.runtime.worker"  # what a rank runs (its `main`), by exec or from a zygote


class Fork(msgspec.Struct, tag=True, frozen=True):
    """Agent -> zygote, with [stdin, go] read ends attached: make a process that exits with what
    `target` ("module:function", imported by the zygote) returns for `argv`, shows `title`, whose
    parent will be `parent_pid` and whose environment is the zygote's with `env` added."""
    target: str
    argv: list[str]
    title: str
    parent_pid: int
    env: dict[str, str] = msgspec.field(default_factory=dict)


class Ready(msgspec.Struct, tag=True, frozen=True):
    """Zygote -> agent, once: its preloads imported, it forks from now on."""
    pid: int


class Forked(msgspec.Struct, tag=True, frozen=True):
    pid: int


class ForkRefused(msgspec.Struct, tag=True, frozen=True):
    """The kernel refused a fork (EAGAIN: the pids limit; ENOMEM), with its errno and reason."""
    errno: int
    reason: str


_to_zygote = msgspec.msgpack.Decoder(Fork)
_to_agent = msgspec.msgpack.Decoder(Ready | Forked | ForkRefused)
_encode = msgspec.msgpack.encode


def base_env() -> dict[str, str]:
    """The environment a node's workers start from, and a zygote's: this process's, with one OpenMP
    thread (its runtime reads the variable as torch loads). Nothing secret: a worker's key comes with
    its start (`Fork.env`, or the agent's environment for one started by exec)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def source_fingerprint(root: Path = PACKAGE_DIR) -> tuple[int, int]:
    """(how many, newest mtime in ns) of the .py files under `root`: what changes when the code a
    process would import changes on disk (an upgrade in place, an edit)."""
    count, newest = 0, 0
    for path in root.rglob("*.py"):
        try:
            newest = max(newest, path.stat().st_mtime_ns)
        except FileNotFoundError:  # removed while walked: the count says so
            continue
        count += 1
    return count, newest


# ---- the agent's side ----------------------------------------------------------------


class ForkedWorker:
    """A worker forked by a zygote and adopted by this process: what the agent uses of a
    `subprocess.Popen` (pid, stdin, wait, returncode), plus `release`, which lets it run."""

    def __init__(self, pid: int, stdin: int, go: int):
        self.pid = pid
        self.stdin = os.fdopen(stdin, "wb")
        self._go = go
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._reaping = False
        self._reaped = threading.Event()

    def release(self) -> None:
        """Let the worker run (it waits on its go pipe until now)."""
        if self._go >= 0:
            try:
                os.write(self._go, b"g")
            except OSError:  # it died already: its wait says how
                pass
            self._close_go()

    def _close_go(self) -> None:
        os.close(self._go)
        self._go = -1

    def wait(self, timeout: float | None = None) -> int:
        """Its returncode by Popen's convention (-N: killed by signal N). The first wait without a
        timeout reaps it; any other waits for that one (subprocess.TimeoutExpired past `timeout`)."""
        with self._lock:
            reap = not self._reaping and timeout is None
            self._reaping = self._reaping or reap
        if reap:
            if self._go >= 0:  # never released: the end of its go pipe ends it
                self._close_go()
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
            self._reaped.set()
        if not self._reaped.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The agent's handle on its zygote: started at once, `ready` once its imports are done (it
    never blocks the caller for them), `fork` then makes workers in milliseconds. `env`: the
    environment the zygote and so every worker it forks starts from (`base_env()`; OMP_NUM_THREADS
    must be in it: the OpenMP runtime reads it as torch loads it); `preload`: the modules it imports."""

    def __init__(self, env: dict[str, str] | None = None, preload: tuple[str, ...] = (WORKER_MODULE,)):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.fingerprint = source_fingerprint()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "elastic_ep.node.zygote", str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()], env=base_env() if env is None else env, stdin=subprocess.DEVNULL)
        except BaseException:
            self._sock.close()
            raise
        finally:
            theirs.close()
        self._lock = threading.Lock()
        self.pid: int | None = None  # its pid once it said Ready

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def ready(self) -> bool:
        """Whether it forks now (never waits: reads its Ready if that came)."""
        if self.pid is None and self.alive:
            with self._lock:
                if self.pid is None and select.select([self._sock], [], [], 0)[0]:
                    try:
                        reply = self._read()
                    except ConnectionError:  # it died importing (its error is on its stderr)
                        return False
                    self.pid = reply.pid if isinstance(reply, Ready) else None
        return self.pid is not None and self.alive

    def wait_ready(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.ready and self.alive and time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                return False
            select.select([self._sock], [], [], 0.05)
        return self.ready

    @property
    def fresh(self) -> bool:
        """Whether the code on disk is what it imported."""
        return source_fingerprint() == self.fingerprint

    def fork(self, target: str, argv: list[str], title: str, env: dict[str, str] | None = None) -> ForkedWorker:
        """A worker that runs `target` ("module:function") on `argv`, with `env` added to the zygote's
        environment (held until `release`). Raises
        OSError with the kernel's errno when the fork is refused, ConnectionError when the zygote is
        gone or silent."""
        stdin_r, stdin_w = os.pipe()
        go_r, go_w = os.pipe()
        try:
            with self._lock:
                try:
                    msg = _encode(Fork(target, argv, title, os.getpid(), env or {}))
                    socket.send_fds(self._sock, [msg], [stdin_r, go_r])
                except (BrokenPipeError, ConnectionResetError):
                    raise self._gone() from None
                reply = self._read()
        except BaseException:
            os.close(stdin_w)
            os.close(go_w)
            raise
        finally:
            os.close(stdin_r)
            os.close(go_r)
        if isinstance(reply, Forked):
            return ForkedWorker(reply.pid, stdin_w, go_w)
        os.close(stdin_w)
        os.close(go_w)
        if isinstance(reply, ForkRefused):
            raise OSError(reply.errno, reply.reason)
        raise ConnectionError(f"the worker zygote answered {type(reply).__name__} to a fork")

    def _read(self) -> Ready | Forked | ForkRefused:
        if not select.select([self._sock], [], [], REPLY_TIMEOUT_S)[0]:
            raise ConnectionError(f"the worker zygote (pid {self.proc.pid}) did not answer in {REPLY_TIMEOUT_S:g}s")
        data = self._sock.recv(MAX_MESSAGE_BYTES)
        if not data:
            raise self._gone()
        try:
            return _to_agent.decode(data)
        except msgspec.DecodeError as e:
            raise ConnectionError(f"the worker zygote sent an undecodable message: {e}") from None

    def _gone(self) -> ConnectionError:
        return ConnectionError(f"the worker zygote (pid {self.proc.pid}) is gone (exit status {self.proc.poll()})")

    def close(self, timeout_s: float = 5.0) -> None:
        """End it (it exits when the pair closes; one still importing, which forked nothing and holds
        nothing, is killed at once); workers it forked are not its and keep running."""
        starting = not self.ready
        self._sock.close()
        if starting:
            self.proc.kill()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def early_zygote(num_ranks: int, worker_start: str) -> Zygote | None:
    """The zygote of a command's node agent, started before the command imports torch itself (module
    docstring); None when the node forks no rank (`num_ranks` 0, `worker_start` "exec") or when it
    cannot start (the agent then starts one itself, or its ranks by exec). The agent takes it
    (`NodeAgent(zygote=...)`); the command closes it when it fails before that."""
    if not num_ranks or worker_start != "fork":
        return None
    try:
        return Zygote()
    except OSError as e:
        logger.warning("could not start the worker zygote early (%s); the agent starts one", e)
        return None


# ---- the zygote's side ---------------------------------------------------------------


def preload(modules: list[str]) -> None:
    """Import `modules` (those of the targets it will run); fail when that left a thread running (a
    fork copies only the calling thread: whatever another held, a lock included, would be held for
    ever in every worker) or initialised CUDA. The agent then starts its ranks by exec."""
    for name in modules:
        __import__(name)
    others = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
    if others:
        raise RuntimeError(f"importing {', '.join(modules)} started {len(others)} thread(s): cannot fork from here")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child cannot use the parent's CUDA context
        raise RuntimeError(f"importing {', '.join(modules)} initialised CUDA: cannot fork from here")


def serve(sock: socket.socket) -> None:
    """Answer each `Fork` until the agent closes the pair."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 2)
        except ConnectionError:
            return
        if not data:
            return
        try:
            msg = _to_zygote.decode(data)
        except msgspec.DecodeError:
            msg = None
        if msg is None or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        try:
            reply = _fork(sock, msg, *fds)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            sock.send(_encode(reply))
        except OSError:  # the agent is gone
            return


def _fork(sock: socket.socket, msg: Fork, stdin: int, go: int) -> Forked | ForkRefused:
    """Fork twice (module docstring): the middle process writes the worker's pid, or why its
    fork was refused, to a pipe and exits; answered once it is reaped, so the worker is the
    agent's child by the time the agent learns its pid."""
    report_r, report_w = os.pipe()
    try:
        middle = os.fork()
    except OSError as e:
        os.close(report_r)
        os.close(report_w)
        return _refused(e)
    if middle == 0:
        os.close(report_r)
        try:
            pid = os.fork()
        except OSError as e:
            os.write(report_w, msgspec.json.encode(_refused(e)))
            os._exit(1)
        if pid == 0:
            os.close(report_w)
            _become(sock, msg, stdin, go)
        os.write(report_w, msgspec.json.encode(Forked(pid)))
        os._exit(0)
    os.close(report_w)
    with os.fdopen(report_r, "rb") as report:
        said = report.read()
    os.waitpid(middle, 0)
    try:
        return msgspec.json.decode(said, type=Forked | ForkRefused)
    except msgspec.DecodeError:
        return ForkRefused(errno.ECHILD, "the fork's middle process died before it reported")


def _refused(e: OSError) -> ForkRefused:
    return ForkRefused(e.errno or errno.EAGAIN, e.strerror or str(e))


def _become(sock: socket.socket, msg: Fork, stdin: int, go: int) -> None:
    """In the worker: wait for the agent's go, then exit with what `msg.target` returns; never returns."""
    code = 1
    try:
        sock.close()
        setproctitle.setproctitle(msg.title)
        os.dup2(stdin, 0)
        if os.read(go, 1) != b"g":  # the agent closed it instead: it gave this start up
            os._exit(1)
        os.close(go)
        os.environ.update(msg.env)
        end_with_parent(signal.SIGKILL)
        if os.getppid() != msg.parent_pid:  # the agent died before this process was its child
            os._exit(1)
        module, _, function = msg.target.partition(":")
        sys.argv = [module, *msg.argv]
        try:
            result = getattr(importlib.import_module(module), function)(msg.argv)
            code = result if isinstance(result, int) else 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str]) -> int:
    """`python -m elastic_ep.node.zygote FD MODULE...`: FD is its end of the agent's socketpair."""
    end_with_parent(signal.SIGKILL)
    sock = socket.socket(fileno=int(argv[0]))
    preload(argv[1:])
    try:
        sock.send(_encode(Ready(os.getpid())))
    except OSError:  # the agent closed the pair while this imported: it is not wanted
        return 0
    serve(sock)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Out at once: the interpreter's teardown of what it imported (torch) is ~0.7 s, which every agent's
    # stop would wait for, and a zygote has nothing to flush or close but its standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
