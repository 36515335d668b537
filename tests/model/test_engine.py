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


def test_stop_token_ids_end_generation_and_min_tokens_hold_them_back(tiny_dirs):
    engine = OfflineEngine.from_pretrained(tiny_dirs["qwen3_moe"])
    prompt = [30, 31, 32]
    free = engine.generate([prompt], greedy(20, ignore_eos=True))[0].token_ids
    stop = free[4]
    cut = free.index(stop) + 1
    stopped = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=(stop,)))[0]
    assert (stopped.token_ids, stopped.finish_reason) == (free[:cut], "stop")
    held = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=(stop,), min_tokens=cut + 2))[0]
    assert stop not in held.token_ids[: cut + 2]
    assert held.token_ids[: cut - 1] == free[: cut - 1]


def test_logprobs_are_raw_one_per_token_and_greedy_takes_the_top_one(tiny_dirs):
    engine = OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"])
    prompt = [40, 41, 42, 43]
    plain = engine.generate([prompt], SamplingParams(max_tokens=8, logprobs=3))[0]
    assert len(plain.logprobs) == len(plain.token_ids) == 8
    for token, lp in zip(plain.token_ids, plain.logprobs, strict=True):
        assert lp.top[0] == (token, lp.logprob) and len(lp.top) == 3
        assert lp.logprob <= 0
    penalized = engine.generate([prompt], SamplingParams(max_tokens=8, logprobs=3, repetition_penalty=2.0))[0]
    # Raw logprobs describe the model: the first step sees the same logits either way.
    assert penalized.logprobs[0] == plain.logprobs[0]


def test_penalties_change_a_repetitive_greedy_output(tiny_dirs):
    engine = OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"])
    prompt = [40, 41, 42, 43]
    plain = engine.generate([prompt], greedy(24, ignore_eos=True))[0].token_ids
    assert len(set(plain)) < len(plain), "the tiny model repeats itself under greedy decoding"
    penalized = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    varied = engine.generate([prompt], penalized)[0].token_ids
    assert len(set(varied)) > len(set(plain))
    assert engine.generate([prompt], penalized)[0].token_ids == varied
