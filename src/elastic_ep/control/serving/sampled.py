"""The tokens one step sampled, kept as each rank answered them: per rank, its seq_ids and their
tokens in the order it ran its rows (its chunks, then its decode rows: runtime/held.py `runs`).

Why not one dict of the step: at 256 ranks x 64 sequences, a dict of the step's 16,384 tokens
built from every answer and then looked up once per decode row was the step's largest cost per
sequence after the commit's own (docs/BENCHMARKS.md, "A step's tokens by rank"). A rank whose
decode rows were answered as planned gives their tokens as one slice of its answer, checked with
one list comparison of the seq_ids; only a rank that did not (a row whose sampling failed, so its
answer lacks one) and a rank's chunks are looked up, in a dict of that rank's answer built when
first asked.
"""

from __future__ import annotations

from collections.abc import Mapping


class Sampled:
    """`add` each rank's answer, once (the step loop takes a rank's first answer of a step and
    no other); `len` counts the tokens."""

    def __init__(self) -> None:
        self._columns: dict[int, tuple[list[int], list[int]]] = {}  # rank -> (seq_ids, tokens)
        self._lookups: dict[int, dict[int, int]] = {}  # rank -> seq_id -> token, built when asked
        self._unranked: Mapping[int, int] | None = None
        self._count = 0

    @classmethod
    def unranked(cls, tokens: Mapping[int, int]) -> Sampled:
        """Tokens whose ranks are not known (seq_id -> token): each rank's lookup is all of them,
        and every row's token is looked up."""
        sampled = cls()
        sampled._unranked, sampled._count = tokens, len(tokens)
        return sampled

    def add(self, rank: int, seq_ids: list[int], tokens: list[int]) -> None:
        """Rank `rank`'s answer: the tokens it sampled for `seq_ids`, in the order it ran them."""
        assert len(seq_ids) == len(tokens), "a token per seq_id"
        self._columns[rank] = seq_ids, tokens
        self._count += len(seq_ids)

    def __len__(self) -> int:
        return self._count

    def lookup(self, rank: int) -> Mapping[int, int]:
        """seq_id -> token of what `rank` answered."""
        if self._unranked is not None:
            return self._unranked
        found = self._lookups.get(rank)
        if found is None:
            seq_ids, tokens = self._columns.get(rank, ((), ()))
            found = self._lookups[rank] = dict(zip(seq_ids, tokens, strict=True))
        return found

    def row_tokens(self, rank: int, seq_ids: list[int]) -> tuple[list[int | None], bool]:
        """The tokens `rank` sampled for its decode rows `seq_ids` (None where it sampled none), and
        whether every row has one: a slice of its answer where the answer ends with those rows as
        planned (one list comparison), else each looked up in its answer."""
        answer = self._columns.get(rank)
        if answer is not None:
            answered, tokens = answer
            start = len(answered) - len(seq_ids)
            if start == 0 and answered == seq_ids:
                return tokens, True
            if start > 0 and answered[start:] == seq_ids:
                return tokens[start:], True
        found = self.lookup(rank)
        looked_up = [found.get(q) for q in seq_ids]
        return looked_up, None not in looked_up
