"""Nothing left behind in /dev/shm: `kill -9` of the serve process (its workers die with it)
leaves no expert backup file, and a stale file of an owner that is gone is removed when the
next server starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastic_ep.node.backup_file import FILE_PREFIX, SHM_DIR, owner_tag

from .conftest import Server


def backup_path(server: Server) -> str:
    cluster = server.wait_for(lambda c: any(e["kind"] == "backup" and e.get("path") for e in c["events"]), 60,
                              "the node's backup written")
    return next(e["path"] for e in cluster["events"] if e["kind"] == "backup" and e.get("path"))


def gone_within(path: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")
@pytest.mark.timeout(240)
@pytest.mark.e2e
def test_sigkill_of_serve_leaves_no_backup_file_and_stale_files_are_reaped(tmp_path):
    gone_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    tag = owner_tag(gone_owner.pid)
    gone_owner.wait()
    stale = Path(SHM_DIR) / f"{FILE_PREFIX}node0-{tag}-test{os.getpid()}.safetensors"
    stale.write_bytes(b"left by a server that was killed")

    server = Server(["--model", "tiny-deepseek-v3", "--ep-size", "2"], tmp_path / "serve.log")
    try:
        path = backup_path(server)
        assert os.path.exists(path) and f"-{owner_tag(server.proc.pid)}-" in path  # named for its owner
        assert not stale.exists(), "the agent removes a stale file when it starts"
        workers = list(server.pids().values())
        server.proc.kill()  # SIGKILL: no shutdown code runs in the server
        server.proc.wait()
        assert gone_within(path, 30), f"{path} outlived its server"
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(psutil.pid_exists(p) for p in workers)
    finally:
        server.stop()
        stale.unlink(missing_ok=True)
