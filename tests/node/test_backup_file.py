"""The node's backup file: what the agent writes is what workers and other nodes read back."""

from __future__ import annotations

import pytest
import torch

from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.node.backup_file import read_backup, read_dense, write_backup


@pytest.fixture(scope="module")
def reader():
    return CheckpointReader(resolve_model("tiny-deepseek-v3"))


def test_backup_round_trips_experts_and_dense_weights(reader, tmp_path):
    items = [(0, 3), (1, 0), (0, 15)]
    path, nbytes = write_backup(reader, items, "nodeA", directory=str(tmp_path))
    assert path.startswith(str(tmp_path)) and "nodeA" in path and nbytes > 0
    w13, w2 = read_backup(path, items)
    for i, (layer, expert) in enumerate(items):
        e13, e2 = reader.read_experts(reader.config.moe_layers[layer], [expert])
        assert torch.equal(torch.from_numpy(w13[i]), e13[0]) and torch.equal(torch.from_numpy(w2[i]), e2[0])
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
