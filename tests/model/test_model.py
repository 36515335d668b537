"""The forward contract the EP runtime relies on: moe_fn calls, batching, re-running a step."""

import pytest
import torch

from elastic_ep.model.engine import OfflineEngine
from elastic_ep.model.model import SeqChunk


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return OfflineEngine.from_pretrained(tiny_dirs["deepseek_v3"])


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe_sparse_step"])
def test_empty_step_calls_moe_fn_for_every_moe_layer_in_order(tiny_dirs, variant):
    engine = OfflineEngine.from_pretrained(tiny_dirs[variant])
    model = engine.model
    calls = []

    def recording_moe_fn(layer, hidden, topk_ids, topk_weights):
        calls.append((layer, tuple(hidden.shape), tuple(topk_ids.shape), topk_weights.dtype))
        return engine.moe_fn(layer, hidden, topk_ids, topk_weights)

    logits = model.forward([], model.new_kv_cache(1), recording_moe_fn)
    cfg = model.config
    assert logits.shape == (0, cfg.vocab_size)
    assert [c[0] for c in calls] == cfg.moe_layers
    assert cfg.moe_layers == ([1, 2, 3] if cfg.arch == "deepseek_v3" else [1])
    assert all(c[1:] == ((0, cfg.hidden_size), (0, cfg.top_k), torch.float32) for c in calls)


def test_a_mixed_batch_gives_the_logits_of_each_sequence_run_alone(engine, paged_cache):
    model, moe_fn = engine.model, engine.moe_fn
    a, b = list(range(10, 25)), list(range(40, 47))
    alone = paged_cache(model, [0, 1])
    a_prefill = model.forward([SeqChunk(0, a, 0)], alone, moe_fn)
    b_first = model.forward([SeqChunk(1, b[:4], 0)], alone, moe_fn)
    b_rest = model.forward([SeqChunk(1, b[4:], 4)], alone, moe_fn)
    a_decode = model.forward([SeqChunk(0, [99], len(a))], alone, moe_fn)

    batched = paged_cache(model, [1, 0], block_size=16)
    step1 = model.forward([SeqChunk(0, a, 0), SeqChunk(1, b[:4], 0)], batched, moe_fn)
    step2 = model.forward([SeqChunk(1, b[4:], 4), SeqChunk(0, [99], len(a))], batched, moe_fn)
    torch.testing.assert_close(step1, torch.cat([a_prefill, b_first]), atol=1e-4, rtol=0)
    torch.testing.assert_close(step2, torch.cat([b_rest, a_decode]), atol=1e-4, rtol=0)
    assert batched.length(0) == len(a) + 1 and batched.length(1) == len(b)


def test_rerunning_an_interrupted_step_gives_the_same_logits(engine, paged_cache):
    model, moe_fn = engine.model, engine.moe_fn
    prompt = list(range(3, 15))

    def run(interrupt_at_layer):
        cache = paged_cache(model, [5])
        model.forward([SeqChunk(5, prompt, 0)], cache, moe_fn)
        if interrupt_at_layer is not None:

            def dying_moe_fn(layer, *args):
                if layer == interrupt_at_layer:
                    raise ConnectionError("peer died")
                return moe_fn(layer, *args)

            with pytest.raises(ConnectionError):
                model.forward([SeqChunk(5, [77, 78], len(prompt))], cache, dying_moe_fn)
        logits = model.forward([SeqChunk(5, [77, 78], len(prompt))], cache, moe_fn)
        return logits, model.forward([SeqChunk(5, [79], len(prompt) + 2)], cache, moe_fn)

    clean = run(None)
    for layer in (engine.model.config.moe_layers[0], engine.model.config.moe_layers[-1]):
        rerun = run(layer)
        torch.testing.assert_close(rerun[0], clean[0], atol=0, rtol=0)
        torch.testing.assert_close(rerun[1], clean[1], atol=0, rtol=0)


def test_reprefill_after_a_fault_reproduces_the_decode_logits(engine, paged_cache):
    model, moe_fn = engine.model, engine.moe_fn
    tokens = list(range(20, 36))
    cache = paged_cache(model, [0, 1])
    model.forward([SeqChunk(1, tokens[:10], 0)], cache, moe_fn)
    for pos in range(10, 15):
        model.forward([SeqChunk(1, [tokens[pos]], pos)], cache, moe_fn)
    decoded = model.forward([SeqChunk(1, [tokens[15]], 15)], cache, moe_fn)
    # Another rank re-prefills prompt + generated tokens in one chunk.
    other = paged_cache(model, [1], block_size=16)
    reprefilled = model.forward([SeqChunk(1, tokens, 0)], other, moe_fn)
    torch.testing.assert_close(reprefilled, decoded, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_a_step_makes_every_tensor_on_the_models_device(tiny_dirs, variant, paged_cache):
    # With the default device set to meta, any tensor made without naming the model's device
    # lands on meta: the step then fails, or its logits come back on meta.
    engine = OfflineEngine.from_pretrained(tiny_dirs[variant])
    model, moe_fn = engine.model, engine.moe_fn

    def two_steps():
        cache = paged_cache(model, [0, 1, 2])
        first = model.forward([SeqChunk(2, [5, 6, 7], 0), SeqChunk(0, [9], 0)], cache, moe_fn)
        # Decode rows next to a prefill chunk, and an empty step.
        second = model.forward(
            [SeqChunk(2, [8], 3), SeqChunk(1, [3, 4, 5, 6], 0), SeqChunk(0, [4], 1)], cache, moe_fn
        )
        return first, second, model.forward([], cache, moe_fn)

    expected = two_steps()
    with torch.device("meta"):
        got = two_steps()
    for logits, want in zip(got, expected, strict=True):
        assert logits.device.type == "cpu"
        torch.testing.assert_close(logits, want, atol=0, rtol=0)
