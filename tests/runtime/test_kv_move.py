"""A decoding sequence moves to another rank with its KV cache (real gloo, the tiny models):
the next token's logits on the new rank equal those on the old one, for MLA's latent cache and
for per-head keys and values, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from elastic_ep.harness.ranks import run_ranks
from elastic_ep.model.engine import OfflineEngine
from elastic_ep.model.model import SeqChunk
from elastic_ep.model.tiny import resolve_model
from elastic_ep.runtime.group import EpochGroup
from elastic_ep.runtime.kv_move import move_kv
from elastic_ep.wire import KVMove

PROMPT = list(range(3, 20))


def move_then_decode(rank: int, world: int, store, model_name: str, dtype: str):
    engine = OfflineEngine.from_pretrained(resolve_model(model_name), dtype=dtype)
    model, moe_fn = engine.model, engine.moe_fn
    kv = model.new_kv_cache(12, block_size=8)
    group = EpochGroup(0, [0, 1], rank, "gloo", torch.device("cpu"))
    group.form(store, 30, lambda: False)
    tokens: dict[int, list[int]] = {}
    kv.set_blocks(8, [0, 1, 2, 3])  # the cache was written inside a forward: its tensors are inference tensors
    model.forward([SeqChunk(8, list(range(30, 60)), 0)], kv, moe_fn)
    logits = None
    if rank == 0:  # sequence 7 is prefilled here, and decodes one token here for reference
        kv.set_blocks(7, [9, 5, 4])
        model.forward([SeqChunk(7, PROMPT, 0)], kv, moe_fn)
        logits = model.forward([SeqChunk(7, [42], len(PROMPT))], kv, moe_fn)
    move_kv(kv, group, [KVMove(7, 0, 1, PROMPT, [11, 6, 8])], tokens)  # other blocks, another order
    if rank == 1:
        logits = model.forward([SeqChunk(7, [42], len(PROMPT))], kv, moe_fn)
    group.destroy()
    return {"logits": logits.float().tolist(), "tokens": tokens.get(7)}


@pytest.mark.e2e
@pytest.mark.parametrize(("model_name", "dtype"), [("tiny-deepseek-v3", "float32"), ("tiny-qwen3-moe", "float32"),
                                                   ("tiny-deepseek-v3", "bfloat16")])
def test_the_moved_sequence_decodes_the_same_on_its_new_rank(model_name, dtype):
    source, destination = run_ranks(move_then_decode, 2, model_name, dtype)
    assert destination["tokens"] == PROMPT and source["tokens"] is None
    assert torch.equal(torch.tensor(destination["logits"]), torch.tensor(source["logits"]))
