import pytest
import torch
from transformers import DeepseekV3Config

from elastic_ep.errors import ElasticEPError
from elastic_ep.model.block_manager import BlockManager
from elastic_ep.model.checkpoint import EXPERT_KEY
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.kv_cache import KVCache, KVShape
from elastic_ep.model.model import MoEForCausalLM
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.model.tiny import tensor_shapes


def make_cache(num_blocks=8, block_size=4):
    return KVCache(2, KVShape(kv_heads=2, k_dim=4, v_dim=3), num_blocks, block_size)


def test_a_chunk_past_the_block_table_is_a_clear_error():
    cache = make_cache()
    cache.set_blocks(1, [5, 2])
    cache.begin_chunk(1, 0, 8)
    with pytest.raises(ElasticEPError, match="needs 9 positions, its block table holds 8 \\(2 blocks of 4\\)"):
        cache.begin_chunk(1, 8, 1)


def test_chunks_overwrite_and_set_the_length_and_cannot_leave_gaps():
    cache = make_cache()
    cache.set_blocks(1, [0, 1, 2])
    cache.begin_chunk(1, 0, 10)
    assert cache.length(1) == 10
    cache.begin_chunk(1, 4, 2)
    assert cache.length(1) == 6
    with pytest.raises(ValueError, match="only 6 positions are cached"):
        cache.begin_chunk(1, 8, 1)


def test_read_gives_a_sequences_positions_in_order_whatever_its_blocks_and_load_puts_them_back():
    cache = make_cache()
    cache.set_blocks(3, [6, 1])
    cache.begin_chunk(3, 0, 6)
    slots = cache.slots(3, 0, 6)
    assert slots.tolist() == [24, 25, 26, 27, 4, 5]
    for layer in range(2):
        cache.write(layer, slots, torch.arange(6 * 8.0).view(6, 2, 4) + layer,
                    -torch.arange(6 * 6.0).view(6, 2, 3))
    rows = cache.read(3, 6)
    assert rows.shape == (2, 2, 6, 7)
    assert rows[1, 0, :, 0].tolist() == [1.0, 9.0, 17.0, 25.0, 33.0, 41.0]
    other = make_cache()
    other.load(3, rows, [0, 7])
    torch.testing.assert_close(other.read(3, 6), rows, atol=0, rtol=0)


def test_the_pool_hands_out_free_blocks_until_none_is_left():
    pool = BlockManager(4, 4)
    assert pool.allocate(0, list(range(9)), 9) == 0 and len(pool.tables[0]) == 3
    assert pool.allocate(1, list(range(50, 59)), 9) is None and 1 not in pool
    assert pool.grow(0, 16) and not pool.grow(0, 17)
    assert pool.usage == 1.0
    pool.free(0)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0


def test_a_shared_prefix_takes_the_cached_blocks_and_leaves_at_least_one_token_to_compute():
    pool = BlockManager(8, 4)
    first = list(range(10))
    pool.allocate(0, first, 10)
    pool.cache_computed(0, first, 10)  # two full blocks keyed, the third is partial
    assert pool.num_cached_blocks == 2
    assert pool.allocate(1, first[:8] + [99, 98], 10) == 8
    assert pool.tables[1][:2] == pool.tables[0][:2] and pool.blocks[pool.tables[0][0]].ref_count == 2
    assert pool.allocate(2, first[:8], 8) == 4  # the whole prompt cached: its last block is computed again
    assert pool.allocate(3, [7] + first[1:10], 10) == 0  # a different first token: no block matches
    assert (pool.queries_tokens, pool.hit_tokens) == (38, 12)


def test_freed_blocks_stay_cached_until_the_pool_needs_them_least_recently_freed_first():
    pool = BlockManager(4, 2)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    for seq, tokens in ((0, a), (1, b)):
        pool.allocate(seq, tokens, 4)
        pool.cache_computed(seq, tokens, 4)
    pool.free(0)
    pool.free(1)
    assert pool.num_cached_blocks == 4 and pool.usage == 0.0
    pool.allocate(2, [0] * 4, 4)  # evicts a's two blocks, freed first
    pool.free(2)
    assert pool.num_cached_blocks == 2
    assert pool.allocate(3, b, 5) == 4
    assert pool.allocate(4, a, 5) is None  # a's blocks are gone and b's are held
    pool.free(3)
    assert pool.allocate(4, a, 5) == 0


def test_blocks_held_but_not_computed_yet_are_claimed_until_computed_or_freed():
    pool = BlockManager(16, 4)
    prompt = list(range(10))
    assert pool.computing_prefix(prompt + [50]) == (0, None)
    pool.allocate(0, prompt, 10)  # two full blocks to compute, claimed by sequence 0
    assert pool.computing_prefix(prompt[:8] + [50]) == (8, 0)
    assert pool.computing_prefix(prompt[:4] + [51] * 5) == (4, 0)  # only the first block is shared
    assert pool.computing_prefix(prompt[:8]) == (4, 0)  # leaves one token to compute, as a hit does
    pool.cache_computed(0, prompt, 5)  # the first block computed and keyed: the second is still claimed
    assert pool.cached_prefix_tokens(prompt[:8] + [50]) == 4 and pool.computing_prefix(prompt[:8] + [50]) == (4, 0)
    pool.allocate(1, [7] * 9, 9)
    pool.free(0)  # released before its second block was computed (aborted, preempted): nothing is claimed
    assert pool.computing_prefix(prompt[:8] + [50]) == (0, None)
    assert pool.computing_prefix([7] * 9) == (8, 1)
    off = BlockManager(16, 4, enable_prefix_caching=False)
    off.allocate(0, prompt, 10)
    assert off.computing_prefix(prompt + [50]) == (0, None)


def test_prefix_caching_off_never_shares():
    pool = BlockManager(8, 2, enable_prefix_caching=False)
    pool.allocate(0, [1, 2, 3, 4, 5], 5)
    pool.cache_computed(0, [1, 2, 3, 4, 5], 5)
    assert pool.allocate(1, [1, 2, 3, 4, 5], 5) == 0 and pool.num_cached_blocks == 0


def prompts_of(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_a_pool_too_small_for_every_request_at_once_preempts_and_the_tokens_are_unchanged(tiny_dirs, variant):
    roomy = OfflineEngine.from_pretrained(tiny_dirs[variant], block_size=4)
    prompts = prompts_of(roomy.model.config.vocab_size, [13, 22, 7, 30, 18])
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    expected = roomy.generate(prompts, params)
    assert roomy.num_preemptions == 0
    # 24 blocks of 4 hold about two of these requests at their longest, not five
    tight = OfflineEngine.from_pretrained(tiny_dirs[variant], block_size=4, num_blocks=24)
    got = tight.generate(prompts, params)
    assert tight.num_preemptions > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_a_prefix_hit_gives_the_tokens_of_a_cold_run(tiny_dirs, variant):
    engine = OfflineEngine.from_pretrained(tiny_dirs[variant], block_size=4, num_blocks=64)
    prefix, tail = prompts_of(engine.model.config.vocab_size, [37, 5], seed=3)
    engine.generate([prefix + [9]], greedy(4))
    warm = engine.generate([prefix + tail], greedy(16))[0].token_ids
    assert engine.pool.hit_tokens == 36
    cold = OfflineEngine.from_pretrained(tiny_dirs[variant], block_size=4, num_blocks=64,
                                         enable_prefix_caching=False)
    assert warm == cold.generate([prefix + tail], greedy(16))[0].token_ids
    assert cold.pool.hit_tokens == 0


def test_a_request_larger_than_the_whole_pool_is_refused_naming_the_sizes(tiny_dirs):
    engine = OfflineEngine.from_pretrained(tiny_dirs["qwen3_moe"], block_size=4, num_blocks=8)
    with pytest.raises(ElasticEPError, match="request 1 needs 10 KV blocks of 4 tokens .* the pool holds 8"):
        engine.generate([[5, 6], [5] * 30], greedy(8))


def cache_nbytes(cache):
    return sum(t.numel() * t.element_size() for t in cache.keys + cache.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_latent_cache_holds_kv_lora_rank_plus_rope_dims_per_token_and_layer(tiny_dirs, dtype):
    engine = OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"], dtype=dtype)
    cfg = engine.model.config
    cache = engine.model.new_kv_cache(num_blocks=3, block_size=16)
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
    cache = qwen.new_kv_cache(4, block_size=16)
    assert cache.bytes_per_token == gqa * 4 == cache_nbytes(cache) // (4 * 16)


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
        ).new_kv_cache(1, block_size=1)
        for mla_cache in ("latent", "per_head")
    }
    assert all(k.is_meta and k.dtype == torch.bfloat16 for c in caches.values() for k in c.keys + c.values)
    sizes = {mla_cache: cache.bytes_per_token for mla_cache, cache in caches.items()}
    assert sizes["latent"] == 61 * (512 + 64) * 2 == 70_272
    assert sizes["per_head"] == 61 * 128 * (192 + 128) * 2
    assert sizes["per_head"] / sizes["latent"] == pytest.approx(71.1, abs=0.05)
