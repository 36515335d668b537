"""The node's backup file: what the agent writes is what workers and other nodes read back, and
nothing is left behind: files of owners that are gone are reaped, a killed owner's guard removes
its file."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.node.backup_file import (
    FILE_PREFIX,
    owner_tag,
    read_backup,
    read_dense,
    reap_stale_backups,
    write_backup,
)


@pytest.fixture(scope="module")
def reader():
    return CheckpointReader(resolve_model("tiny-deepseek-v3"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backup_round_trips_experts_and_dense_weights(tmp_path, dtype):
    reader = CheckpointReader(resolve_model("tiny-deepseek-v3"), dtype=dtype)  # the backup keeps the served dtype
    items = [(0, 3), (1, 0), (0, 15)]
    path, nbytes = write_backup(reader, items, "nodeA", directory=str(tmp_path))
    assert path.startswith(str(tmp_path)) and "nodeA" in path and nbytes > 0
    assert f"-{owner_tag(os.getpid())}-" in path  # named for its owner
    w13, w2 = read_backup(path, items)
    for i, (layer, expert) in enumerate(items):
        e13, e2 = reader.read_experts(reader.config.moe_layers[layer], [expert])
        assert w13.dtype == dtype and torch.equal(w13[i], e13[0]) and torch.equal(w2[i], e2[0])
    dense = read_dense(path)
    expected = reader.dense_state()
    assert dense.keys() == expected.keys()
    assert all(torch.equal(dense[k], expected[k]) for k in expected)


def test_a_missing_expert_or_missing_dense_weights_are_named(reader, tmp_path):
    path, _ = write_backup(reader, [(0, 1)], "nodeB", directory=str(tmp_path), dense=False)
    with pytest.raises(KeyError, match="layer 1 expert 2 is not in this node's backup"):
        read_backup(path, [(0, 1), (1, 2)])
    with pytest.raises(KeyError, match="holds no dense weights"):
        read_dense(path)


def _tagged(directory, owner: str) -> str:
    path = directory / f"{FILE_PREFIX}nodeX-{owner}-abc123.safetensors"
    path.write_bytes(b"x")
    return str(path)


def test_only_files_of_owners_that_are_gone_are_reaped(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    tag_of_gone = owner_tag(gone.pid)
    gone.wait()
    stale = _tagged(tmp_path, tag_of_gone)
    reused_pid = _tagged(tmp_path, f"pid{os.getpid()}-12345")  # this pid, but another start time
    mine = _tagged(tmp_path, owner_tag(os.getpid()))
    legacy = tmp_path / f"{FILE_PREFIX}nodeX-k3j9x_a1.safetensors"  # no owner tag: left alone
    legacy.write_bytes(b"x")
    assert sorted(reap_stale_backups(str(tmp_path))) == sorted([stale, reused_pid])
    assert os.path.exists(mine) and legacy.exists()


@pytest.mark.e2e
def test_the_guard_removes_the_file_when_its_owner_is_killed(tmp_path):
    """The owner (a real process) writes a tagged file and starts its guard; SIGKILL of the owner
    leaves the guard to remove the file."""
    code = ("import os, sys, time\n"
            "from elastic_ep.node.backup_file import guard_backup, owner_tag, FILE_PREFIX\n"
            f"path = os.path.join({str(tmp_path)!r}, "
            "FILE_PREFIX + 'nodeG-' + owner_tag(os.getpid()) + '-x.safetensors')\n"
            "open(path, 'wb').write(b'x')\n"
            "guard_backup(path)\n"
            "print(path, flush=True)\n"
            "time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        path = owner.stdout.readline().strip()
        assert os.path.exists(path)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(path)
    finally:
        owner.kill()
        owner.wait()
