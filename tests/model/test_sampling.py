"""model.sampling: a pure function of (seed, position, logits, history, params) that no
accepted parameters and no logits (huge, infinite, NaN) can drive to a NaN or infinite
probability, with vLLM's meaning for every parameter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_ep.model.sampling import (
    InvalidSamplingParams,
    SamplingParams,
    TokenHistory,
    sample_tokens,
    token_distribution,
)

VOCAB = 24
EOS = (VOCAB - 1,)

any_float32 = st.floats(width=32) | st.sampled_from([3.4e38, -3.4e38, math.inf, -math.inf, math.nan])
any_logits = st.lists(any_float32, min_size=VOCAB, max_size=VOCAB).map(
    lambda v: torch.tensor(v, dtype=torch.float32)
)
tame_logits = st.lists(st.floats(-10, 10), min_size=VOCAB, max_size=VOCAB).map(lambda v: torch.tensor(v))
token_ids = st.lists(st.integers(0, VOCAB - 1), max_size=12)
histories = st.builds(TokenHistory, token_ids, token_ids)
# Every range that validate() accepts, bounds and tiny values included.
accepted_params = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    temperature=st.just(0.0) | st.floats(0, 2) | st.sampled_from([5e-324, 1e-300, 1e-5, 2.0]),
    top_p=st.floats(0, 1, exclude_min=True) | st.sampled_from([5e-324, 1.0]),
    top_k=st.integers(0, VOCAB + 2),
    min_p=st.floats(0, 1) | st.sampled_from([0.0, 1.0, 5e-324]),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0, 2, exclude_min=True) | st.sampled_from([5e-324, 2.0]),
    logit_bias=st.lists(st.tuples(st.integers(0, VOCAB + 3), st.floats(-100, 100)), max_size=4).map(
        lambda pairs: tuple(dict(pairs).items())
    ),
    min_tokens=st.integers(0, 16),
    stop_token_ids=st.lists(st.integers(0, VOCAB + 3), max_size=3).map(tuple),
    logprobs=st.none() | st.integers(0, 20),
    ignore_eos=st.booleans(),
)


def one(logits, params, history, seed=7, eos=EOS):
    return sample_tokens(logits[None], [params], [seed], [history], eos)


@settings(max_examples=400, deadline=None)
@given(logits=any_logits, params=accepted_params, history=histories, seed=st.integers(-(2**63), 2**63 - 1))
def test_no_accepted_input_gives_a_nan_or_infinite_probability(logits, params, history, seed):
    params.validate()
    probs = token_distribution(logits, params, history, EOS)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert probs.sum().item() == pytest.approx(1.0)
    out = one(logits, params, history, seed)
    token = out.tokens[0]
    assert 0 <= token < VOCAB and probs[token] > 0
    if params.logprobs is None:
        assert out.logprobs == [None]
    else:
        lp = out.logprobs[0]
        values = [lp.logprob] + [v for _, v in lp.top]
        assert not any(math.isnan(v) or v > 0 for v in values)
        assert len(lp.top) == min(params.logprobs, VOCAB)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@settings(max_examples=200, deadline=None)
@given(logits=any_logits, params=accepted_params, history=histories)
def test_stop_tokens_are_never_drawn_before_min_tokens(logits, params, history):
    stops = params.stop_ids(EOS)
    token = one(logits, params, history).tokens[0]
    if len(history.output_token_ids) < params.min_tokens and len(stops & set(range(VOCAB))) < VOCAB:
        assert token not in stops


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(any_logits, accepted_params, histories, st.integers(0, 2**32)), min_size=2, max_size=5
    ),
    pick=st.integers(0, 4),
)
def test_a_row_gets_the_same_token_and_logprobs_alone_or_in_any_batch(rows, pick):
    i = pick % len(rows)
    logits, params, history, seed = rows[i]
    batch = sample_tokens(
        torch.stack([r[0] for r in rows]),
        [r[1] for r in rows],
        [r[3] for r in rows],
        [r[2] for r in rows],
        EOS,
    )
    alone = one(logits, params, history, seed)
    assert (batch.tokens[i], batch.logprobs[i]) == (alone.tokens[0], alone.logprobs[0])


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties, written out per token."""
    out = logits.tolist()
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        out[t] -= frequency * output.count(t) + presence * (t in output)
    return torch.tensor(out, dtype=torch.float64)


@settings(max_examples=150, deadline=None)
@given(
    logits=tame_logits,
    history=histories,
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(0.1, 2),
    temperature=st.floats(0.2, 2),
)
def test_penalties_follow_vllm(logits, history, presence, frequency, repetition, temperature):
    params = SamplingParams(
        temperature=temperature,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
    )
    prompt, output = list(history.prompt_token_ids), list(history.output_token_ids)
    expected = torch.softmax(
        reference_penalties(logits, prompt, output, presence, frequency, repetition) / temperature, -1
    )
    assert torch.allclose(token_distribution(logits, params, history), expected, atol=1e-9)


def test_repetition_penalty_counts_the_prompt_and_presence_frequency_only_the_output():
    logits = torch.tensor([2.0, 2.0, -2.0, 0.0])
    history = TokenHistory(prompt_token_ids=[0, 2], output_token_ids=[1, 1])
    params = SamplingParams(
        temperature=1.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    expected = torch.softmax(torch.tensor([1.0, 1.0 - 0.5 - 0.5, -4.0, 0.0], dtype=torch.float64), -1)
    assert torch.allclose(token_distribution(logits, params, history), expected)


def test_min_p_top_k_and_top_p_cut_the_candidates():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits, history = probs.log(), TokenHistory([], [])

    def support(**cut):
        return (
            torch.nonzero(token_distribution(logits, SamplingParams(temperature=1.0, **cut), history))
            .flatten()
            .tolist()
        )

    assert support() == [0, 1, 2, 3]
    assert support(min_p=0.45) == [0, 1]
    assert support(min_p=1.0) == [0]
    assert support(top_k=3) == [0, 1, 2]
    assert support(top_p=0.7) == [0, 1]
    assert support(top_p=1e-9) == [0]


@pytest.mark.parametrize("temperature", [1e-5, 1e-300, 5e-324])
def test_a_tiny_temperature_is_greedy_not_nan(temperature):
    logits = torch.tensor([1e30, 1e30 - 1e25, -1e30, 3.0], dtype=torch.float32)
    probs = token_distribution(logits, SamplingParams(temperature=temperature), TokenHistory([], []))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_logprobs_are_the_models_raw_log_softmax_whatever_the_sampling():
    logits = torch.tensor([3.0, 1.0, 0.5, -1.0])
    raw = torch.log_softmax(logits.double(), -1)
    history = TokenHistory([0], [0, 1])
    for params in [
        SamplingParams(logprobs=2),
        SamplingParams(logprobs=2, temperature=0.3, repetition_penalty=2.0, presence_penalty=2.0, top_k=2),
    ]:
        out = one(logits, params, history)
        token, lp = out.tokens[0], out.logprobs[0]
        assert lp.logprob == pytest.approx(raw[token].item())
        assert [t for t, _ in lp.top] == [0, 1]
        assert [v for _, v in lp.top] == pytest.approx(raw[:2].tolist())


def test_logit_bias_and_min_tokens_steer_greedy_picks():
    logits = torch.tensor([5.0, 1.0, 0.0, 4.0])
    empty = TokenHistory([], [])
    assert one(logits, SamplingParams(), empty).tokens == [0]
    assert one(logits, SamplingParams(logit_bias=((2, 100.0),)), empty).tokens == [2]
    assert one(logits, SamplingParams(stop_token_ids=(0,), min_tokens=1), empty).tokens == [3]
    assert one(logits, SamplingParams(stop_token_ids=(0,), min_tokens=1), TokenHistory([], [1])).tokens == [0]
    eos_first = torch.tensor([0.0, 1.0, 0.0, 9.0])
    assert one(eos_first, SamplingParams(min_tokens=2), empty, eos=(3,)).tokens == [1]
    assert one(eos_first, SamplingParams(min_tokens=2, ignore_eos=True), empty, eos=(3,)).tokens == [3]


def test_seeded_draws_repeat_per_seed_and_position_and_differ_across_seeds():
    logits = torch.zeros(VOCAB)
    params = SamplingParams(temperature=1.0)

    def draws(seed):
        return [one(logits, params, TokenHistory([0], [0] * pos), seed).tokens[0] for pos in range(16)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", math.nan),
        ("min_p", 1.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", math.inf),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e308),
        ("top_k", -1),
        ("min_tokens", 17),
        ("logprobs", 21),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("logit_bias", ((1, 101.0),)),
        ("stop_token_ids", (-1,)),
    ],
)
def test_validate_names_the_field_out_of_range(field, value):
    with pytest.raises(InvalidSamplingParams) as raised:
        SamplingParams(**{"max_tokens": 16, field: value}).validate()
    assert raised.value.param == field
    assert field in str(raised.value)
