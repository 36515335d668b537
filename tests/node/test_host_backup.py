"""Read once, copy many on the agent's side: the dense weights staged in shared memory for the
node's first ranks, then the backup written from that copy (not from the checkpoint again), with
each expert's checksum as read, equal to what a rank computes on the same weights."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.node.backup_file import expert_checksum, read_backup, read_dense
from elastic_ep.node.host_backup import HostBackup
from elastic_ep.wire import WorkerLaunch


def launch(model: str) -> WorkerLaunch:
    return WorkerLaunch(model, "tcp://x:1", "tcp://x:2", "127.0.0.1", 1, "gloo", 1, 16, 0.1, dtype="float32")


@pytest.mark.parametrize("device_kind", ["cpu", "cuda"])
def test_the_backup_takes_the_staged_dense_weights_and_checksums_what_it_read(device_kind):
    model = str(resolve_model("tiny-deepseek-v3"))
    backup = HostBackup("nodeA", "tcp://127.0.0.1:9")
    backup.stage_dense(launch(model))
    staged = backup.dense_path
    try:
        assert staged and os.path.exists(staged) and backup.site().path == staged
        dense_bytes = backup.storage_bytes
        truth = CheckpointReader(model).dense_state()
        assert read_dense(staged).keys() == truth.keys() and dense_bytes == sum(
            t.numel() * t.element_size() for t in truth.values())
        items = [(0, 3), (1, 0)]
        ready = []
        backup.build(launch(model), items, device_kind, ready.append, threading.Event())
        # the dense weights came from the staged copy: storage gave the two experts only
        expert_bytes = CheckpointReader(model).expert_nbytes
        assert backup.storage_bytes == dense_bytes + len(items) * expert_bytes
        assert not os.path.exists(staged) and backup.dense_path is None and backup.site().path == backup.path
        assert read_dense(backup.path).keys() == truth.keys()
        w13, w2 = read_backup(backup.path, items)
        assert [c for msg in ready for c in msg.checksums] == [
            expert_checksum(w13[i], w2[i], device_kind) for i in range(len(items))]
    finally:
        backup.drop("test over")
    assert not os.path.exists(staged)


def test_cpu_and_device_checksums_differ_in_kind_not_by_chance():
    w13, w2 = torch.randn(8, 4), torch.randn(4, 4)
    assert expert_checksum(w13, w2) == expert_checksum(w13, w2, "cpu")
    assert expert_checksum(w13, w2, "cuda") != expert_checksum(w13, w2, "cpu")
    w2b = w2.clone()
    w2b[0, 0] += 1
    assert expert_checksum(w13, w2b, "cuda") != expert_checksum(w13, w2, "cuda")
