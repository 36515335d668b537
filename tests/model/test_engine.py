from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.model.tiny import make_tiny


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_dirs):
    engine = OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"], max_batch=2)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    prompt = [40, 41, 42, 43]
    alone = engine.generate([prompt], params)[0].token_ids
    # Third in a batch of three with max_batch 2: admitted later, next to another sequence.
    batched = engine.generate([[7, 8, 9], [50] * 12, prompt], params)[2].token_ids
    assert alone == batched
    assert (
        alone
        != engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0].token_ids
    )


def test_generation_stops_at_eos_unless_told_to_ignore_it(tmp_path):
    prompt = [30, 31, 32]
    free_running = OfflineEngine.from_pretrained(make_tiny("qwen3_moe", tmp_path / "a")).generate(
        [prompt], greedy(20)
    )[0]
    assert free_running.finish_reason == "length" and len(free_running.token_ids) == 20
    eos = free_running.token_ids[5]
    cut = free_running.token_ids.index(eos) + 1
    engine = OfflineEngine.from_pretrained(
        make_tiny("qwen3_moe", tmp_path / "b", config_overrides={"eos_token_id": [eos, 1]})
    )
    stopped = engine.generate([prompt], greedy(20))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_running.token_ids[:cut]
    assert engine.generate([prompt], greedy(20, ignore_eos=True))[0].token_ids == free_running.token_ids


def test_a_full_context_ends_generation_with_length(tiny_dirs):
    loaded = OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"])
    engine = OfflineEngine(loaded.model, loaded.moe_fn, max_model_len=20)
    result = engine.generate([list(range(40, 55))], greedy(50))[0]
    assert result.finish_reason == "length"
    assert len(result.prompt_token_ids) + len(result.token_ids) == 20
