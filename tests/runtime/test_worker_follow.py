"""A worker still loading its weights when its leader dies follows the new leader (runtime/worker.py):
a real worker process, started by a stand-in leader A whose store it has not reached yet, reads the
`NewLeader` its agent writes on its stdin while its storage reads are held back
(--load-read-rate-mb-s), and once loaded registers with leader B (join_mode adopt, the same process)
instead of waiting out A's dead store and exiting, which would fail a scale-up resumed by B."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import zmq

from elastic_ep.harness.server_process import free_port
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.read_throttle import create_rate_file
from elastic_ep.model.tiny import resolve_model
from elastic_ep.wire import (
    STEP_TO_CONTROLLER,
    ClusterKey,
    Inbox,
    NewLeader,
    Shutdown,
    WorkerArgs,
    WorkerHello,
    WorkerLaunch,
)
from elastic_ep.wire.codec import KEY_ENV
from elastic_ep.wire.pipe import write_message

KEY = ClusterKey.generate()
LOAD_S = 4.0  # how long the throttle makes the dense weights' reads last: the leader changes meanwhile
LOADED = "KV pool of"  # the worker's line once its weights are read and its KV pool is sized (before the store)
# A's store, in a process of its own: the dead leader's is gone with it
STORE_SCRIPT = ("import sys, time, datetime, torch.distributed as dist; "
                "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False, "
                "timeout=datetime.timedelta(seconds=60)); print('up', flush=True); time.sleep(600)")


class StandInLeader:
    """A leader's step socket (ROUTER), and its store: `store_port`, served by whoever the test says."""

    def __init__(self, store_port: int):
        self.step = zmq.Context.instance().socket(zmq.ROUTER)
        self.step.setsockopt(zmq.LINGER, 0)
        self.step_addr = f"tcp://127.0.0.1:{self.step.bind_to_random_port('tcp://127.0.0.1')}"
        self.store_port = store_port
        self.inbox = Inbox("standin_step", STEP_TO_CONTROLLER, KEY, "test")
        self.identity = b""

    def launch(self, rate_mb_s: float, rate_path: str) -> WorkerLaunch:
        return WorkerLaunch(str(resolve_model("tiny-deepseek-v3")), self.step_addr, "tcp://127.0.0.1:1", "127.0.0.1",
                            self.store_port, "gloo", 4, 64, 0.0, connect_timeout_s=10.0, read_rate_mb_s=rate_mb_s,
                            read_rate_path=rate_path)

    def hello(self, worker: subprocess.Popen, timeout_s: float = 120.0) -> WorkerHello:
        """The next WorkerHello on the step socket, while the worker runs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert worker.poll() is None, f"the worker exited ({worker.returncode}) instead of registering"
            if self.step.poll(100):
                self.identity, *frames = self.step.recv_multipart()
                msg = self.inbox.read(frames)
                if isinstance(msg, WorkerHello):
                    return msg
        raise TimeoutError(f"no WorkerHello within {timeout_s}s")


def reserved_until(rate_path: str) -> float:
    """The end of the last storage read the throttle reserved (time.time(); 0 before any read)."""
    with open(rate_path, "rb") as f:
        raw = f.read(8)
    return struct.unpack("<d", raw)[0] if len(raw) == 8 else 0.0


@pytest.mark.e2e
@pytest.mark.parametrize("change", ["during_load", "after_load"])
def test_a_worker_loading_when_its_leader_dies_registers_with_the_new_leader(change, tmp_path):
    """during_load: B is announced while the weights are read; after_load: once they are read, while
    the worker tries A's dead store again every second."""
    model_dir = resolve_model("tiny-deepseek-v3")
    dense_bytes = sum(t.numel() * t.element_size()
                      for t in CheckpointReader(model_dir, MoEConfig.from_pretrained(model_dir)).dense_state().values())
    rate_path = create_rate_file()
    store_a = subprocess.Popen([sys.executable, "-c", STORE_SCRIPT, str(port_a := free_port())],
                               stdout=subprocess.PIPE, text=True)
    store_b = None
    a, b = StandInLeader(port_a), StandInLeader(free_port())
    worker = None
    try:
        assert store_a.stdout.readline().strip() == "up"
        store_b = dist.TCPStore("127.0.0.1", b.store_port, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=30))
        rate_mb_s = dense_bytes / LOAD_S / 1e6
        args = WorkerArgs(a.launch(rate_mb_s, rate_path), rank_id=3, node="nodeT", join_mode="initial")
        log_path = tmp_path / "worker.log"
        with open(log_path, "w") as log:
            worker = subprocess.Popen([sys.executable, "-m", "elastic_ep.runtime.worker", args.to_json()],
                                      stdin=subprocess.PIPE, stderr=log,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", KEY_ENV: KEY.hex()})
        deadline = time.monotonic() + 120
        while reserved_until(rate_path) <= time.time():  # its dense weights are being read
            assert time.monotonic() < deadline and worker.poll() is None, "the worker's load never began"
            time.sleep(0.01)
        # leader A dies (its store with it) before the worker reached it
        store_a.kill()
        store_a.wait()
        if change == "after_load":
            while LOADED not in log_path.read_text():  # printed once the weights are read and warmed up
                assert worker.poll() is None, f"the worker exited ({worker.returncode}): {log_path.read_text()}"
                time.sleep(0.01)
        # its agent, welcomed by B, says so
        write_message(worker.stdin, KEY.seal(NewLeader(b.launch(rate_mb_s, rate_path)), 2))
        changed_at, reserved_at_change = time.time(), reserved_until(rate_path)
        hello = b.hello(worker)
        assert (hello.rank_id, hello.pid, hello.join_mode, hello.dense_source) == (3, worker.pid, "adopt", "disk")
        assert hello.dense_bytes == dense_bytes
        if change == "during_load":  # storage reads were reserved past the change: the load went on
            assert reserved_until(rate_path) > changed_at, "the load had ended before the leader changed"
        else:
            assert reserved_until(rate_path) == reserved_at_change < changed_at
        assert "following the new leader" in log_path.read_text()
        assert not a.step.poll(0), "the worker registered with the dead leader"
        # it obeys B (B's term): a Shutdown ends it cleanly
        b.step.send_multipart([b.identity, *KEY.seal(Shutdown(), 2)])
        assert worker.wait(30) == 0
    finally:
        for proc in (worker, store_a):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        a.step.close()
        b.step.close()
        del store_b
        os.unlink(rate_path)
