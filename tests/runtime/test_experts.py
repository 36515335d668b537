"""Expert slots filled from the checkpoint, then swapped between two real ranks at once
(point-to-point in both directions, plus a local move): every slot ends with the weights of the
checkpoint, and the checksums the controller compares are those of the source. Slots restored
from the node's backup are checksummed as they land, to the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elastic_ep.control.epochs.epoch_plan import held_placement, split_by_rank
from elastic_ep.harness.ranks import run_ranks
from elastic_ep.model.checkpoint import CheckpointReader
from elastic_ep.model.tiny import resolve_model
from elastic_ep.node import backup_file
from elastic_ep.placement.location import ExpertLocation
from elastic_ep.placement.transfer import plan_transfers
from elastic_ep.runtime.experts import ExpertSlots, expert_checksum
from elastic_ep.runtime.group import EpochGroup
from elastic_ep.wire import BackupSite, ClusterKey, SlotSource

KEY = ClusterKey.generate()

S = 8  # 16 experts on two ranks


def placements(num_layers: int) -> tuple[ExpertLocation, ExpertLocation]:
    """Rank 0 holds experts 0-7 and rank 1 8-15; then rank 0 keeps 0 and 1 (swapping their slots)
    and takes 10-15, rank 1 keeps 8 and 9 (moved to its last slots) and takes 2-7."""
    first = np.tile(np.arange(16), (num_layers, 1))
    second = np.tile(np.array([1, 0, 10, 11, 12, 13, 14, 15, 2, 3, 4, 5, 6, 7, 8, 9]), (num_layers, 1))
    return ExpertLocation.from_phy2log(first, S, 16), ExpertLocation.from_phy2log(second, S, 16)


def fill(slots, location, held, epoch, rank, store, reader):
    plan = plan_transfers(held, location, [0, 1], {0: "n0", 1: "n1"}, {}, reader.expert_nbytes)
    sources, sends = split_by_rank(plan, S)
    group = EpochGroup(epoch, [0, 1], rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    filled = slots.apply(location.experts_of_rank(rank), sources[rank], sends[rank], group, reader, {}, f"n{rank}", 5.0,
                          key=KEY)
    group.destroy()
    return {s.source: s.bytes_moved for s in filled.stats if s.bytes_moved}, filled.source_checksums


def slots_rank(rank: int, world: int, store, model_dir: str):
    reader = CheckpointReader(model_dir)
    layers = reader.config.moe_layers
    slots = ExpertSlots(layers, S, reader.config.moe_intermediate_size, reader.config.hidden_size)
    first, second = placements(len(layers))
    empty = held_placement(None, len(layers), 16, S, 2, [])
    moved1, from_disk = fill(slots, first, empty, 1, rank, store, reader)
    moved2, _ = fill(slots, second, first, 2, rank, store, reader)
    truth = {}
    for li, layer in enumerate(layers):
        w13, w2 = reader.read_experts(layer, list(range(16)))
        truth.update({(li, e): expert_checksum(w13[e], w2[e]) for e in range(16)})
    held = {(li, j): truth[(li, int(e))] for (li, j), e in np.ndenumerate(second.experts_of_rank(rank))}
    return {"moved1": moved1, "moved2": moved2, "disk_sources_match": all(truth[k] == v for k, v in from_disk.items()),
            "disk_sources": len(from_disk), "slots_match": slots.checksums() == held}


@pytest.mark.e2e
def test_two_ranks_swap_every_expert_at_once_and_end_with_the_checkpoint_weights():
    model_dir = str(resolve_model("tiny-deepseek-v3"))
    layers = len(CheckpointReader(model_dir).config.moe_layers)
    results = run_ranks(slots_rank, 2, model_dir)
    for res in results:
        assert set(res["moved1"]) == {"disk"} and res["disk_sources"] == S * layers
        assert res["disk_sources_match"] and res["slots_match"]
        assert res["moved2"]["peer"] > 0 and res["moved2"]["local"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_restored_from_the_nodes_backup_are_checksummed_as_they_land(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(backup_file, "READ_CHUNK_BYTES", 4096)  # several chunks per tensor
    reader = CheckpointReader(resolve_model("tiny-deepseek-v3"), dtype=dtype)
    cfg = reader.config
    path, _ = backup_file.write_backup(reader, [(0, 3), (1, 7), (2, 9)], "n0", directory=str(tmp_path), dense=False)
    slots = ExpertSlots(cfg.moe_layers, 2, cfg.moe_intermediate_size, cfg.hidden_size, dtype)
    new = np.full((len(cfg.moe_layers), 2), -1)
    new[0, 1], new[1, 0] = 3, 7
    sources = [SlotSource(0, 1, 3, "backup", src_node="n0"), SlotSource(1, 0, 7, "backup", src_node="n0")]
    filled = slots.apply(new, sources, [], EpochGroup(1, [0], 0, "gloo", torch.device("cpu")), reader,
                         {"n0": BackupSite("n0", path, "")}, "n0", 1.0, key=KEY)
    assert filled.checked == slots.checksums([(0, 1), (1, 0)])  # what a second pass would have found
    for (layer, slot), expert in (((0, 1), 3), ((1, 0), 7)):
        w13, w2 = reader.read_experts(cfg.moe_layers[layer], [expert])
        assert filled.checked[(layer, slot)] == expert_checksum(w13[0], w2[0])
    assert {s.source: s.bytes_moved for s in filled.stats}["backup"] == 2 * reader.expert_nbytes
