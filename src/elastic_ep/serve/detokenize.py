"""Incremental detokenization with stop strings, for streaming.

Token ids arrive a few at a time; the text sent to the client must never contain half of a
multi-byte character (a byte-level tokenizer splits "é" over two tokens), and must never
contain a stop string or the start of one that the next tokens might complete.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class TextStream:
    """Turns a request's token ids into text deltas.

    Decoding a window that starts a few tokens back (`_prefix_offset`) keeps the spacing
    that tokenizers such as SentencePiece only produce in context; text is released once it
    no longer ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str], hidden_token_ids: tuple[int, ...] = ()):
        self._tokenizer = tokenizer
        self._stop = stop
        self._hidden = set(hidden_token_ids)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._sent = 0
        self.stopped = False
        """True once a stop string was produced: the caller finishes with reason "stop"."""
        self.stop_string: str | None = None
        """The stop string that stopped it (vLLM's `stop_reason`)."""

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that can be sent now (maybe "")."""
        if self.stopped:
            return ""
        self._ids.extend(t for t in token_ids if t not in self._hidden)
        self._decode(final=False)
        return self._release(final=False)

    def resume(self, token_ids: list[int]) -> None:
        """Take tokens whose text was already sent elsewhere (a resumed stream) without
        returning it: one at a time, as the engine's events brought them, so the text held back
        (an incomplete character, the start of a stop string) is the same as it was there."""
        for token_id in token_ids:
            self.add([token_id])

    def finish(self) -> str:
        """The request ended: release everything held back (incomplete bytes included)."""
        if self.stopped:
            return ""
        self._decode(final=True)
        return self._release(final=True)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone, special tokens shown (for logprobs)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _decode(self, final: bool) -> None:
        if self._read_offset == len(self._ids):
            return
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(window_text) > len(prefix_text) and (final or not window_text.endswith(_INCOMPLETE)):
            self._text += window_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _release(self, final: bool) -> str:
        hits = [(i, s) for i, s in ((self._text.find(s, self._sent), s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            at, self.stop_string = min(hits, key=lambda hit: hit[0])
            return self._advance(at)
        if final:
            return self._advance(len(self._text))
        return self._advance(len(self._text) - _partial_stop_len(self._text, self._stop, self._sent))

    def _advance(self, end: int) -> str:
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta


def _partial_stop_len(text: str, stops: list[str], start: int) -> int:
    """Length of the longest tail of text[start:] that begins some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text) - start), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
