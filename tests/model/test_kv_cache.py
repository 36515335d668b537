import pytest

from elastic_ep.errors import ElasticEPError
from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.kv_cache import KVCache, KVShape
from elastic_ep.model.model import SeqChunk


def make_cache(max_seqs=2, max_model_len=64, initial_capacity=4):
    return KVCache(2, KVShape(kv_heads=2, k_dim=4, v_dim=3), max_seqs, max_model_len, initial_capacity)


def test_too_many_sequences_is_a_clear_error_and_free_makes_room():
    cache = make_cache(max_seqs=2)
    cache.allocate(1)
    cache.allocate(2)
    with pytest.raises(ElasticEPError, match="KV cache is full: 2 sequences"):
        cache.allocate(3)
    cache.free(1)
    cache.allocate(3)
    assert cache.num_seqs == 2 and 3 in cache and 1 not in cache


def test_a_sequence_longer_than_max_model_len_is_a_clear_error():
    cache = make_cache(max_model_len=16)
    cache.allocate(1)
    cache.begin_chunk(1, 0, 16)
    with pytest.raises(ElasticEPError, match="needs 17 positions, more than max_model_len 16"):
        cache.begin_chunk(1, 16, 1)


def test_chunks_overwrite_and_set_the_length_and_cannot_leave_gaps():
    cache = make_cache()
    cache.allocate(1)
    cache.begin_chunk(1, 0, 10)
    assert cache.length(1) == 10 and cache.capacity >= 10
    cache.begin_chunk(1, 4, 2)
    assert cache.length(1) == 6
    with pytest.raises(ValueError, match="only 6 positions are cached"):
        cache.begin_chunk(1, 8, 1)


def test_cache_growth_does_not_change_generated_tokens(tiny_dirs):
    engine = OfflineEngine.from_pretrained(tiny_dirs["qwen3_moe"])
    prompt = list(range(30, 50))
    expected = engine.generate([prompt], greedy(24))[0].token_ids
    cache = KVCache(engine.model.config.num_layers, engine.model.kv_shape, 1, 256, initial_capacity=8)
    cache.allocate(0)
    logits = engine.model.forward([SeqChunk(0, prompt, 0)], cache, engine.moe_fn)
    tokens = [int(logits.argmax())]
    while len(tokens) < len(expected):
        pos = len(prompt) + len(tokens) - 1
        tokens.append(
            int(engine.model.forward([SeqChunk(0, [tokens[-1]], pos)], cache, engine.moe_fn).argmax())
        )
    assert cache.capacity > 8
    assert tokens == expected
