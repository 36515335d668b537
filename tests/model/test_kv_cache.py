import pytest
import torch
from transformers import DeepseekV3Config

from elastic_ep.errors import ElasticEPError
from elastic_ep.model.checkpoint import EXPERT_KEY
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.kv_cache import KVCache, KVShape
from elastic_ep.model.model import MoEForCausalLM, SeqChunk
from elastic_ep.model.tiny import tensor_shapes


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


def cache_nbytes(cache):
    return sum(t.numel() * t.element_size() for t in cache.keys + cache.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_latent_cache_holds_kv_lora_rank_plus_rope_dims_per_token_and_layer(tiny_dirs, dtype):
    engine = OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"], dtype=dtype)
    cfg = engine.model.config
    cache = engine.model.new_kv_cache(max_seqs=3, max_model_len=64, initial_capacity=16)
    expected = cfg.num_layers * (cfg.hf["kv_lora_rank"] + cfg.hf["qk_rope_head_dim"]) * dtype.itemsize
    assert cache.bytes_per_token == expected
    assert cache_nbytes(cache) == expected * 3 * 16
    assert all(k.dtype == dtype for k in cache.keys) and cache.values == []


def test_the_per_head_cache_holds_every_heads_keys_and_values(tiny_dirs):
    deepseek = OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"], mla_cache="per_head").model
    qwen = OfflineEngine.from_pretrained(tiny_dirs["qwen3_moe"]).model
    hf = deepseek.config.hf
    per_head = (
        deepseek.config.num_layers
        * deepseek.config.num_attention_heads
        * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"])
    )
    assert deepseek.new_kv_cache(1).bytes_per_token == per_head * 4
    gqa = qwen.config.num_layers * qwen.config.hf["num_key_value_heads"] * 2 * qwen.config.hf["head_dim"]
    cache = qwen.new_kv_cache(2, 32, initial_capacity=32)
    assert cache.bytes_per_token == gqa * 4 == cache_nbytes(cache) // (2 * 32)


def test_at_deepseek_v3s_sizes_the_latent_cache_is_71x_smaller():
    # transformers' default DeepseekV3Config is DeepSeek-V3 itself; weights on the meta device cost nothing.
    config = MoEConfig.from_dict(DeepseekV3Config().to_dict())
    dense = {
        name: torch.empty(shape, device="meta")
        for name, shape in tensor_shapes(config).items()
        if not EXPERT_KEY.match(name)
    }
    caches = {
        mla_cache: MoEForCausalLM(
            config, dense, dtype=torch.bfloat16, device="meta", mla_cache=mla_cache
        ).new_kv_cache(max_seqs=1, max_model_len=1)
        for mla_cache in ("latent", "per_head")
    }
    assert all(k.is_meta and k.dtype == torch.bfloat16 for c in caches.values() for k in c.keys + c.values)
    sizes = {mla_cache: cache.bytes_per_token for mla_cache, cache in caches.items()}
    assert sizes["latent"] == 61 * (512 + 64) * 2 == 70_272
    assert sizes["per_head"] == 61 * 128 * (192 + 128) * 2
    assert sizes["per_head"] / sizes["latent"] == pytest.approx(71.1, abs=0.05)
