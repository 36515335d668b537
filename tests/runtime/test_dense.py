"""A joining rank's dense weights: this node's backup file, else another node's agent, else disk."""

from __future__ import annotations

import threading

import pytest
import torch

from elastic_ep.harness.server_process import free_port
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.node.agent import NodeAgent
from elastic_ep.node.backup_file import write_backup
from elastic_ep.runtime.dense import load_dense
from elastic_ep.wire import ClusterKey

KEY = ClusterKey.generate()


@pytest.fixture(scope="module")
def reader():
    return CheckpointReader(resolve_model("tiny-deepseek-v3"))


@pytest.fixture
def agent_with_backup(reader, tmp_path):
    """A real node agent (its controller address leads nowhere) holding a backup file."""
    agent = NodeAgent(f"tcp://127.0.0.1:{free_port()}", "nodeX", KEY)
    agent.backup.path, _ = write_backup(reader, [(0, 0)], "nodeX", directory=str(tmp_path))
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    yield agent
    stop.set()
    thread.join(10)


def same_as_disk(state, reader) -> bool:
    disk = reader.dense_state()
    return state.keys() == disk.keys() and all(torch.equal(state[k], disk[k]) for k in disk)


def test_dense_weights_come_from_this_nodes_file_first(reader, agent_with_backup):
    state, source, _ = load_dense(reader, agent_with_backup.backup.path, agent_with_backup.fetch_addr, 5.0, KEY)
    assert source == "host_memory" and same_as_disk(state, reader)


def test_dense_weights_come_from_another_nodes_agent_when_this_node_has_none(reader, agent_with_backup):
    state, source, _ = load_dense(reader, "", agent_with_backup.fetch_addr, 5.0, KEY)
    assert source == "peer" and same_as_disk(state, reader)


def test_dense_weights_come_from_disk_when_no_copy_answers(reader, tmp_path):
    silent = f"tcp://127.0.0.1:{free_port()}"
    state, source, _ = load_dense(reader, str(tmp_path / "gone.safetensors"), silent, 0.3, KEY)
    assert source == "disk" and same_as_disk(state, reader)
