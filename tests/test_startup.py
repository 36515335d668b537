"""Start-up mistakes are refused before any worker starts, naming the problem and the fix; exits
say the signal by name (a rank that ends during start-up: tests/control/membership/test_nodes.py)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from elastic_ep.cli import main
from elastic_ep.control.config import ServeConfig, check_config
from elastic_ep.control.faults.detector import FaultDetector
from elastic_ep.errors import ElasticEPError
from elastic_ep.harness.server_process import free_port
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.tiny import resolve_model
from elastic_ep.wire import ClusterKey, exit_reason


def serve(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_ep.cli", "serve", "--model", "tiny-deepseek-v3", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def test_a_port_in_use_is_refused_before_any_worker_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = serve("--ep-size", "2", "--port", str(port), "--log-level", "info")
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"127.0.0.1:{port} is already in use" in done.stderr and "--port" in done.stderr
    assert "controller at" not in done.stderr and "registered" not in done.stderr, "nothing may start"
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(("args", "said"), [
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--host", "10.254.254.1"], "--host must be an address of this host"),
    (["--advertise-host", "10.254.254.1"], "--advertise-host 10.254.254.1 is not an address of this host"),
])
def test_an_address_this_host_cannot_bind_is_refused(args, said):
    done = serve("--ep-size", "2", *args, timeout_s=60)
    assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "registered" not in done.stderr


def tiny_config() -> tuple[MoEConfig, int]:
    model_dir = resolve_model("tiny-deepseek-v3")
    return MoEConfig.from_pretrained(model_dir), CheckpointReader(model_dir).expert_nbytes


def test_an_ep_size_beyond_the_experts_is_refused_with_the_limit():
    config, nbytes = tiny_config()
    with pytest.raises(ElasticEPError, match=rf"--ep-size 64 exceeds the model's {config.num_experts} routed "
                                             rf"experts.*--ep-size {config.num_experts} or fewer"):
        check_config(ServeConfig(model_dir="", model_name="m", ep_size=64), config, nbytes)
    check_config(ServeConfig(model_dir="", model_name="m", ep_size=config.num_experts), config, nbytes)


@pytest.mark.parametrize(("flags", "said"), [
    ({"send_ahead_steps": 4}, "--send-ahead-steps 4 sends steps planned while the one before runs, which only "
                              "--async-scheduling plans: add --async-scheduling"),
    ({"send_ahead_steps": -1, "async_scheduling": True}, "--send-ahead-steps must be at least 0, got -1"),
])
def test_steps_sent_ahead_without_overlap_scheduling_are_refused_naming_the_flag(flags, said):
    config, nbytes = tiny_config()
    with pytest.raises(ElasticEPError, match=re.escape(said)):
        check_config(ServeConfig(model_dir="", model_name="m", ep_size=4, **flags), config, nbytes)
    check_config(ServeConfig(model_dir="", model_name="m", ep_size=4, async_scheduling=True, send_ahead_steps=4),
                 config, nbytes)


def test_serve_refuses_an_ep_size_beyond_the_experts_without_starting_workers():
    done = serve("--ep-size", "64", "--port", str(free_port()), timeout_s=60)
    assert done.returncode == 2 and "--ep-size 64 exceeds" in done.stderr
    assert "registered" not in done.stderr and "Traceback" not in done.stderr


def test_an_unreachable_controller_is_named_by_the_agent(capsys, tmp_path):
    port = free_port()  # nothing listens there
    ClusterKey.generate().write(tmp_path / "cluster.key")
    started = time.monotonic()
    assert main(["agent", "--controller", f"127.0.0.1:{port}", "--node", "n1", "--connect-timeout-s", "1",
                 "--cluster-key-file", str(tmp_path / "cluster.key")]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the controller at tcp://127.0.0.1:{port}" in err and "--controller" in err
    assert time.monotonic() - started < 10


def test_the_agent_waits_for_a_controller_that_starts_late():
    port = free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def start_late():
        time.sleep(0.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    threading.Thread(target=start_late, daemon=True).start()
    from elastic_ep.commands.agent import wait_for_controller

    try:
        wait_for_controller(f"tcp://127.0.0.1:{port}", timeout_s=10)
    finally:
        listener.close()


def test_the_agent_refuses_the_http_url_for_the_controller(capsys):
    assert main(["agent", "--controller", "http://127.0.0.1:8000", "--node", "n1", "--cluster-key-file", "k"]) == 2
    err = capsys.readouterr().err
    assert "not the controller's agent address" in err and "controller at tcp://" in err


@pytest.mark.parametrize(("returncode", "said"), [
    (-signal.SIGKILL, "killed by SIGKILL"), (-signal.SIGTERM, "killed by SIGTERM"),
    (-signal.SIGSEGV, "killed by SIGSEGV"), (3, "exited with code 3"), (0, "exited with code 0")])
def test_exits_say_the_signal_by_name(returncode, said):
    assert exit_reason(returncode) == said
    assert FaultDetector.exited(1, returncode).detail == f"process {said}"


SPY_ON_THE_ZYGOTE = """
import os, sys
import elastic_ep.node.zygote as zygote

def spy(num_ranks, worker_start):
    print(f"zygote for {num_ranks} ranks by {worker_start}; torch imported before: {'torch' in sys.modules}",
          flush=True)
    os._exit(0)

zygote.early_zygote = spy
from elastic_ep.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [
    ["serve", "--model", "tiny-deepseek-v3", "--ep-size", "2", "--port", "0"],
    ["agent", "--controller", "tcp://127.0.0.1:9", "--node", "n0", "--cluster-key-file", "/none", "--ranks", "2"],
])
def test_serve_and_agent_start_the_worker_zygote_before_they_import_torch(command):
    """Its ~3 s of imports then run beside the command's own instead of after them (node/zygote.py)."""
    done = subprocess.run([sys.executable, "-c", SPY_ON_THE_ZYGOTE, *command], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "zygote for 2 ranks by fork; torch imported before: False" in done.stdout, done.stdout + done.stderr[-2000:]
