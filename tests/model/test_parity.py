"""Our forward against transformers' implementation loaded from the same checkpoint dir.

Checkpoints come from make_tiny, from transformers' own `save_pretrained` (5.x configs) and from
hand-written config.json files modelled on the hub's 4.x configs (tests/model/configs).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from elastic_ep.model import attention
from elastic_ep.model.config import MoEConfig
from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.model import SeqChunk
from elastic_ep.model.tiny import write_checkpoint

TOL = 1e-4
CONFIG_VECTORS = Path(__file__).parent / "configs"


def load_reference(model_dir, dtype=torch.float32):
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager", output_loading_info=True
    )
    # The parity claim is void unless transformers really loaded every tensor of our files.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def prompt_ids(vocab, length, seed):
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model_dir, ids, dtype=torch.float32):
    """transformers' logits [len(ids), V] (float32) of one forward over ids."""
    with torch.no_grad():
        return load_reference(model_dir, dtype)(torch.tensor([ids])).logits[0].float()


def prefill_then_decode(engine, ids, prefill_len, first_chunk=None):
    """Our logits [len(ids) - prefill_len + 1, V]: the prefill's last position, then each decode
    step. The sequence's blocks of 4 positions are every other block of the pool (a scattered
    table); first_chunk: prefill in two chunks, the first of that many tokens."""
    blocks = -(-len(ids) // 4)
    cache = engine.model.new_kv_cache(2 * blocks, block_size=4)
    cache.set_blocks(7, list(range(2 * blocks - 1, 0, -2)))
    if first_chunk:
        engine.model.forward([SeqChunk(7, ids[:first_chunk], 0)], cache, engine.moe_fn)
    start = first_chunk or 0
    steps = [engine.model.forward([SeqChunk(7, ids[start:prefill_len], start)], cache, engine.moe_fn)[0]]
    for pos in range(prefill_len, len(ids)):
        steps.append(engine.model.forward([SeqChunk(7, [ids[pos]], pos)], cache, engine.moe_fn)[0])
    return torch.stack(steps)


def assert_prefill_and_decode_match(model_dir, mla_cache="latent", length=20, prefill_len=12, first_chunk=None):
    engine = OfflineEngine.from_pretrained(model_dir, mla_cache=mla_cache)
    ids = prompt_ids(engine.model.config.vocab_size, length, seed=1)
    expected = reference_logits(model_dir, ids)[prefill_len - 1 :]
    ours = prefill_then_decode(engine, ids, prefill_len, first_chunk)
    torch.testing.assert_close(ours, expected, atol=TOL, rtol=0)


def test_prefill_and_decode_logits_match_transformers(any_tiny_dir):
    assert_prefill_and_decode_match(any_tiny_dir)


@pytest.mark.parametrize("mla_cache", ["latent", "per_head"])
@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_paged_attention_in_score_tiles_over_a_chunked_prefill_matches_transformers(
    tiny_dirs, monkeypatch, variant, mla_cache
):
    # Tiles of a few queries each, a second prefill chunk that starts inside a block: the paths a
    # long prompt takes, at a size the tiny model runs in a moment.
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 64)
    assert_prefill_and_decode_match(tiny_dirs[variant], mla_cache, length=30, prefill_len=23, first_chunk=6)


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v3_no_q_lora", "deepseek_v3_yarn"])
def test_the_per_head_mla_cache_matches_transformers_too(tiny_dirs, variant):
    assert_prefill_and_decode_match(tiny_dirs[variant], mla_cache="per_head")


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v3_no_q_lora", "qwen3_moe"])
def test_32_greedy_tokens_match_transformers_generate_in_a_mixed_batch(tiny_dirs, variant):
    engine = OfflineEngine.from_pretrained(tiny_dirs[variant], max_batch=2)
    ref = load_reference(tiny_dirs[variant])
    vocab = engine.model.config.vocab_size
    prompts = [prompt_ids(vocab, n, seed=n) for n in (5, 17, 9)]
    # max_batch 2 with 3 prompts: the third is prefilled while the others decode (continuous batching).
    ours = engine.generate(prompts, greedy(32))
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        expected = out[0, len(prompt) :].tolist()
        assert result.token_ids == expected[: len(result.token_ids)]
        assert len(result.token_ids) == len(expected)
        assert len(set(result.token_ids)) > 8, "tiny weights should give varied greedy output"


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_a_checkpoint_saved_by_the_installed_transformers_loads_with_parity(tiny_dirs, tmp_path, variant):
    # What a fine-tune saved today looks like: config.json and weights written by transformers 5.x.
    load_reference(tiny_dirs[variant]).save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "rope_parameters" in config and "rope_theta" not in config and config["dtype"] == "float32"
    if variant == "qwen3_moe":
        assert config["num_local_experts"] == 16 and "num_experts" not in config
    assert MoEConfig.from_pretrained(tmp_path / "saved").num_experts == 16
    assert_prefill_and_decode_match(tmp_path / "saved")


@pytest.mark.parametrize("vector", sorted(p.name for p in CONFIG_VECTORS.glob("*.json")))
def test_hand_written_hub_style_configs_load_with_parity(tmp_path, vector):
    hf = json.loads((CONFIG_VECTORS / vector).read_text())
    model_dir = write_checkpoint(hf, tmp_path / "m", num_shards=1)
    assert_prefill_and_decode_match(model_dir)


def test_the_hub_configs_mean_what_transformers_reads_in_them(tmp_path):
    deepseek = MoEConfig.from_pretrained(
        write_checkpoint(json.loads((CONFIG_VECTORS / "deepseek_v3_hub_4x.json").read_text()), tmp_path / "d")
    )
    qwen = MoEConfig.from_pretrained(
        write_checkpoint(json.loads((CONFIG_VECTORS / "qwen3_moe_hub_4x.json").read_text()), tmp_path / "q")
    )
    assert (deepseek.num_experts, deepseek.moe_layers, deepseek.declared_dtype) == (16, [1, 2], "bfloat16")
    assert (deepseek.rope.rope_type, deepseek.rope.factor, deepseek.rope.interleave) == ("yarn", 32.0, True)
    assert (qwen.num_experts, qwen.moe_layers, qwen.rope.theta, qwen.rope.dim) == (16, [0, 1, 2], 1e6, 16)


@pytest.mark.parametrize(
    "variant, omitted",
    [
        (
            "deepseek_v3",
            ["routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "rope_interleave"],
        ),
        ("qwen3_moe", ["norm_topk_prob", "decoder_sparse_step", "rope_theta"]),
    ],
)
def test_fields_left_out_of_config_json_mean_what_they_mean_to_transformers(
    tiny_dirs, tmp_path, variant, omitted
):
    model_dir = shutil.copytree(tiny_dirs[variant], tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    for name in omitted:
        del config[name]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert_prefill_and_decode_match(model_dir, length=12, prefill_len=12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_half_precision_is_as_close_to_transformers_as_its_rounding_allows(tiny_dirs, variant, dtype):
    """In bfloat16 (8 significant bits) or float16 (11), two correct implementations that round in
    a different order differ by about as much as either differs from the float32 result; and a
    routing choice that is a tie at that resolution flips expert in one and not in the other,
    moving that position's logits by far more. So the tolerance is transformers' own rounding
    error (its half-precision logits against its float32 ones), compared per position by the
    median over 21 positions: flips are outliers, a systematic error is not."""
    model_dir = tiny_dirs[variant]
    engine = OfflineEngine.from_pretrained(model_dir, dtype=dtype)
    assert engine.model.embed.dtype == dtype
    ids = prompt_ids(engine.model.config.vocab_size, 40, seed=1)
    ours = prefill_then_decode(engine, ids, 20)
    theirs = reference_logits(model_dir, ids, dtype)[19:]
    exact = reference_logits(model_dir, ids)[19:]

    def median_error(a, b):
        return (a - b).abs().amax(dim=-1).median().item()

    rounding = median_error(theirs, exact)
    assert 0 < median_error(ours, theirs) <= 1.5 * rounding
