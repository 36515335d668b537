"""Our forward against transformers' implementation loaded from the same checkpoint dir."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.model import SeqChunk

TOL = 1e-4


def load_reference(model_dir):
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # The parity claim is void unless transformers really loaded every tensor of our files.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def prompt_ids(vocab, length, seed):
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_and_decode_logits_match_transformers(any_tiny_dir):
    engine = OfflineEngine.from_pretrained(any_tiny_dir)
    ref = load_reference(any_tiny_dir)
    ids = prompt_ids(engine.model.config.vocab_size, 20, seed=1)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
    cache = engine.model.new_kv_cache(max_seqs=2)
    cache.allocate(7)
    prefill = engine.model.forward([SeqChunk(7, ids[:12], 0)], cache, engine.moe_fn)
    torch.testing.assert_close(prefill[0], ref_logits[11], atol=TOL, rtol=0)
    for pos in range(12, 20):
        step = engine.model.forward([SeqChunk(7, [ids[pos]], pos)], cache, engine.moe_fn)
        torch.testing.assert_close(step[0], ref_logits[pos], atol=TOL, rtol=0)


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
    engine = OfflineEngine.from_pretrained(model_dir)
    ref = load_reference(model_dir)
    ids = prompt_ids(engine.model.config.vocab_size, 12, seed=3)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0, -1]
    cache = engine.model.new_kv_cache(max_seqs=1)
    cache.allocate(0)
    torch.testing.assert_close(
        engine.model.forward([SeqChunk(0, ids, 0)], cache, engine.moe_fn)[0], expected, atol=TOL, rtol=0
    )
