"""The answers of the step in flight, in columns: what the step loop reads of every rank's result
once the step is complete, gathered as the results arrive, a rank's `StepResult` (sent by itself)
or its part of its node's `NodeStepResults` (--step-results-via agent) alike.

Why columns: at 256 ranks the step loop read every rank's result as an object, field by field,
several times a step (timings, tokens, the metrics, the shapes); a node's columns go in with one
`extend` per column, a rank's own result with one `append`, and the step's completion reads each
column once, as an array.
"""

from __future__ import annotations

import itertools

import numpy as np

from elastic_ep.model.sampling import TokenLogprobs
from elastic_ep.wire import NodeStepResults, StepResult

from .sampled import Sampled

COLUMNS = ("rank_ids", "step_s", "compute_s", "wait_s", "slot_tokens", "shape", "remote_messages", "remote_bytes",
           "kv_move_s")


class StepAnswers:
    """Per column, one entry per rank that answered, in the order they were added; `sampled`
    (each rank's tokens, serving/sampled.py) and `logprobs` (seq_id -> the token's) of them all;
    `errors`: (rank, seq_id, why) of the sequences whose token could not be sampled; `loads`: the
    [L, E] expert load reports; `arrived_s`: per rank, how long after the step was sent its answer came (s)."""

    def __init__(self) -> None:
        self.rank_ids: list[int] = []
        self.step_s: list[float] = []
        self.compute_s: list[float] = []
        self.wait_s: list[float] = []  # dispatch + combine
        self.slot_tokens: list[int] = []
        self.shape: list[int] = []
        self.remote_messages: list[int] = []
        self.remote_bytes: list[int] = []
        self.kv_move_s: list[float] = []
        self.arrived_s: list[float] = []
        self.sampled = Sampled()
        self.logprobs: dict[int, TokenLogprobs] = {}
        self.errors: list[tuple[int, int, str]] = []
        self.loads: list[np.ndarray] = []

    def add(self, res: StepResult, arrived_s: float) -> None:
        """One rank's own result, come `arrived_s` after the step was sent."""
        self.rank_ids.append(res.rank_id)
        self.arrived_s.append(arrived_s)
        self.step_s.append(res.step_s)
        self.compute_s.append(res.compute_s)
        self.wait_s.append(res.dispatch_wait_s + res.combine_wait_s)
        self.slot_tokens.append(res.slot_tokens)
        self.shape.append(res.shape)
        self.remote_messages.append(res.remote_messages)
        self.remote_bytes.append(res.remote_bytes)
        self.kv_move_s.append(res.kv_move_s)
        self.sampled.add(res.rank_id, list(res.tokens), list(res.tokens.values()))
        if res.logprobs or res.errors or res.expert_load.size:  # what few results have
            self.logprobs.update(res.logprobs)
            self.errors.extend((res.rank_id, seq_id, why) for seq_id, why in res.errors.items())
            if res.expert_load.size:
                self.loads.append(res.expert_load)

    def add_node(self, msg: NodeStepResults, arrived_s: float, take: list[int] | None = None) -> None:
        """A node's results, come `arrived_s` after the step was sent: all of them, or the ranks at the
        indices `take` of `msg.rank_ids`."""
        self.arrived_s.extend([arrived_s] * (len(msg.rank_ids) if take is None else len(take)))
        ends = list(itertools.accumulate(msg.token_counts))
        if take is None:
            for name in COLUMNS:
                getattr(self, name).extend(getattr(msg, name))
            taken = msg.rank_ids
        else:
            for name in COLUMNS:
                column = getattr(msg, name)
                getattr(self, name).extend(column[i] for i in take)
            taken = [msg.rank_ids[i] for i in take]
        for i in range(len(msg.rank_ids)) if take is None else take:
            start = ends[i] - msg.token_counts[i]
            self.sampled.add(msg.rank_ids[i], msg.seq_ids[start:ends[i]], msg.tokens[start:ends[i]])
        if msg.logprobs or msg.errors or msg.expert_load:  # the rare parts, of the ranks taken
            for r in taken:
                self.logprobs.update(msg.logprobs.get(r, {}))
                self.errors.extend((r, seq_id, why) for seq_id, why in msg.errors.get(r, {}).items())
                if r in msg.expert_load and msg.expert_load[r].size:
                    self.loads.append(msg.expert_load[r])

    def array(self, name: str) -> np.ndarray:
        """Column `name` (one of `COLUMNS`, or `arrived_s`) as an array, one entry per rank."""
        return np.asarray(getattr(self, name))

    def link_s(self, start: int = 0) -> np.ndarray:
        """[answers from index `start` on] the control plane's round trip to each rank, its step time
        left out (s, at least 0)."""
        return np.maximum(np.asarray(self.arrived_s[start:]) - np.asarray(self.step_s[start:], dtype=np.float64), 0.0)
