"""A step's tokens on the control thread, by rank (control/serving/sampled.py) against one dict of
the step, side by side in one process: at 256 ranks x 64 decoding sequences, answered as 32 nodes'
`NodeStepResults` of 8 ranks, what the step loop does to give each decode row its token. One dict:
each node's (seq_id, token) pairs put in (`dict.update`), then a lookup per row, as a column
(`map(dict.__getitem__)`) or row by row (`dict.get`): what the step loop and the commit did
before. By rank: each rank's answer kept as two slices of its node's columns, then each rank's
decode rows' tokens as one slice of its answer after one list comparison (`Sampled.row_tokens`).
The two run in turn, 200 times each; the median CPU ms of each is printed.

What this leaves out: everything else the commit does with a row (its position, its token
appended, a block keyed), the same either way; and a tree's own code: `benchmarks/control_cpu.py
--completion --baseline REV` measures the trees themselves, where the machine's swing between
the two halves of a run is larger than this difference.

    PYTHONPATH=src .venv/bin/python benchmarks/sampled_tokens.py
"""

from __future__ import annotations

import gc
import itertools
import random
import time

from elastic_ep.control.serving.sampled import Sampled

RANKS, SEQS, RANKS_PER_NODE, RUNS = 256, 64, 8, 200


def node_columns() -> tuple[dict[int, list[int]], list[tuple[list[int], list[int], list[int], list[int]]]]:
    """Each rank's decode rows (seq_ids, shuffled over the ranks), and each node's answer columns:
    (rank_ids, token_counts, seq_ids, tokens)."""
    ids = list(range(1_000_000, 1_000_000 + RANKS * SEQS))
    random.Random(0).shuffle(ids)
    rows = {r: ids[r * SEQS:(r + 1) * SEQS] for r in range(RANKS)}
    nodes = []
    for n in range(RANKS // RANKS_PER_NODE):
        ranks = list(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE))
        seq_ids = [q for r in ranks for q in rows[r]]
        nodes.append((ranks, [SEQS] * RANKS_PER_NODE, seq_ids, [5] * len(seq_ids)))
    return rows, nodes


def one_dict(rows, nodes, as_columns: bool) -> None:
    sampled: dict[int, int] = {}
    for _, _, seq_ids, tokens in nodes:
        sampled.update(zip(seq_ids, tokens, strict=True))
    for r in range(RANKS):
        if as_columns:
            list(map(sampled.__getitem__, rows[r]))
        else:
            get = sampled.get
            for q in rows[r]:
                get(q)


def by_rank(rows, nodes, as_columns: bool) -> None:
    sampled = Sampled()
    for ranks, counts, seq_ids, tokens in nodes:
        ends = list(itertools.accumulate(counts))
        for i, rank in enumerate(ranks):
            start = ends[i] - counts[i]
            sampled.add(rank, seq_ids[start:ends[i]], tokens[start:ends[i]])
    for r in range(RANKS):
        sampled.row_tokens(r, rows[r])


def main() -> None:
    rows, nodes = node_columns()
    gc.disable()
    print("| 256 ranks x 64 decoding, tokens to their rows | one dict ms | by rank ms | ratio |\n|---|---|---|---|")
    for as_columns, how in ((True, "as columns"), (False, "row by row")):
        spent: dict[str, list[float]] = {"dict": [], "rank": []}
        for _ in range(RUNS):
            for name, fn in (("dict", one_dict), ("rank", by_rank)):
                cpu0 = time.process_time()
                fn(rows, nodes, as_columns)
                spent[name].append(time.process_time() - cpu0)
        med = {name: 1000 * sorted(v)[len(v) // 2] for name, v in spent.items()}
        print(f"| {how} | {med['dict']:.2f} | {med['rank']:.2f} | {med['dict'] / med['rank']:.2f}x |")


if __name__ == "__main__":
    main()
