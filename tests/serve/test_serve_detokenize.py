"""Incremental detokenization: whatever way the tokens are split into events, the client
gets the same text, never half a character, and never any part of a stop string."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_engine import byte_tokenizer

from elastic_ep.serve.detokenize import TextStream

TOKENIZER = byte_tokenizer()
EOS = TOKENIZER.token_to_id("<eos>")
TEXTS = st.text(alphabet="ab é你😀\n", min_size=1, max_size=30)


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:], strict=False)]


def run(stream: TextStream, chunks: list[list[int]]) -> list[str]:
    deltas = [stream.add(chunk) for chunk in chunks]
    return deltas + [stream.finish()]


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_split_gives_the_whole_text_and_no_broken_character(text, cuts):
    ids = TOKENIZER.encode(text).ids
    deltas = run(TextStream(TOKENIZER, []), split(ids, cuts))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(
    before=TEXTS,
    after=TEXTS,
    stop=st.sampled_from(["é你", "ab", "\n\n", "😀"]),
    cuts=st.lists(st.integers(0, 200)),
)
def test_text_stops_before_the_first_stop_string(before, after, stop, cuts):
    text = before + stop + after
    stream = TextStream(TOKENIZER, [stop, "never"])
    deltas = run(stream, split(TOKENIZER.encode(text).ids, cuts))
    assert "".join(deltas) == text[: text.index(stop)]
    assert stream.stopped


def test_a_held_back_stop_prefix_is_released_when_the_stop_does_not_follow():
    stream = TextStream(TOKENIZER, ["END"])
    assert stream.add(TOKENIZER.encode("xyE").ids) == "xy"
    assert stream.add(TOKENIZER.encode("N").ids) == ""
    assert stream.add(TOKENIZER.encode("D?").ids) == ""
    assert stream.stopped
    stream = TextStream(TOKENIZER, ["END"])
    assert stream.add(TOKENIZER.encode("xyEN").ids) == "xy"
    assert stream.add(TOKENIZER.encode("d").ids) == "ENd"


def test_a_truncated_character_at_the_end_is_sent_as_a_replacement_character():
    ids = TOKENIZER.encode("a你").ids
    stream = TextStream(TOKENIZER, [])
    assert stream.add(ids[:1]) == "a"
    assert stream.add(ids[1:2]) == ""
    assert stream.finish() == "\ufffd"


def test_hidden_tokens_are_not_in_the_text():
    stream = TextStream(TOKENIZER, [], hidden_token_ids=(EOS,))
    assert stream.add(TOKENIZER.encode("ok").ids + [EOS]) + stream.finish() == "ok"
