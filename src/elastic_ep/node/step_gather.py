"""Step results gathered per node (`--step-results-via agent`): the `StepResult`s a node's ranks
send their agent for a step go to the controller as one `NodeStepResults`, so the control thread
authenticates and decodes one frame per node and step instead of one per rank.

A step's results are forwarded as soon as every rank expected to answer it has (the last of them
completes the set, so the slowest rank's result, the one the controller waits for, is never held),
or once `window_s` has passed since the first of them arrived: a slow or stopped rank holds its
node's others back at most that long, and its own result follows alone when it comes. Expected:
the running ranks whose last result was of the same epoch (every member runs every step of its
epoch, step_loop.py); at an epoch's first step none is known yet, so its results go one by one.
Pure bookkeeping, no sockets: the node agent (node/agent.py) and the stand-in agents
(harness/standin.py) drive it with their clocks, and send each batch as `node_results` builds it.
"""

from __future__ import annotations

from collections.abc import Collection

from elastic_ep.wire import NodeStepResults, StepResult

# How long a node's results wait for its slowest rank. The ranks of a step finish within the
# skew of its last collective (well under a millisecond on one host); a rank later than that is
# a straggler the controller waits for anyway, and 2 ms keeps the others' results from waiting
# on it much longer than the step's own skew.
GATHER_WINDOW_S = 0.002
STEPS_REMEMBERED = 8  # steps whose forwarded ranks are kept, so a late result waits for no one


class StepGather:
    """`add` each result as it arrives, then `due(now, running)`: the batches to forward now."""

    def __init__(self, window_s: float = GATHER_WINDOW_S):
        self.window_s = window_s
        self._held: dict[tuple[int, int], tuple[float, list[StepResult]]] = {}  # (epoch, step) -> (first at, results)
        self._sent: dict[tuple[int, int], set[int]] = {}  # (epoch, step) -> ranks already forwarded
        self._epoch_of: dict[int, int] = {}  # rank -> epoch of its last result

    def add(self, result: StepResult, now: float) -> None:
        """A rank's result arrived at `now` (monotonic s); a second one of the same rank and step
        replaces the first."""
        key = (result.epoch, result.step)
        self._epoch_of[result.rank_id] = result.epoch
        first_at, held = self._held.get(key, (now, []))
        self._held[key] = first_at, [r for r in held if r.rank_id != result.rank_id] + [result]

    def due(self, now: float, running: Collection[int]) -> list[list[StepResult]]:
        """The held results to forward at `now`, one list per step: every step whose expected ranks
        (those of `running` whose last result was of its epoch, less those already forwarded) all
        answered, or whose first result waited `window_s`."""
        out = []
        for key, (first_at, held) in list(self._held.items()):
            sent = self._sent.setdefault(key, set())
            arrived = {r.rank_id for r in held}
            expected = {r for r in running if self._epoch_of.get(r) == key[0]} - sent
            if expected <= arrived or now - first_at >= self.window_s:
                out.append(held)
                sent |= arrived
                del self._held[key]
        while len(self._sent) > STEPS_REMEMBERED:
            del self._sent[next(iter(self._sent))]
        return out

    def next_due_s(self, now: float) -> float | None:
        """Seconds until the oldest held step's window ends (0 when it has), None when none is held."""
        if not self._held:
            return None
        return max(min(first_at for first_at, _ in self._held.values()) + self.window_s - now, 0.0)



def node_results(node: str, session: str, results: list[StepResult]) -> NodeStepResults:
    """The `NodeStepResults` of one step's `results` (one batch of `StepGather.due`: the same epoch
    and step, a rank at most once) of `node`'s agent session `session`, in columns."""
    assert results and len({(r.epoch, r.step) for r in results}) == 1, "one step's results"
    return NodeStepResults(
        node, session, results[0].epoch, results[0].step, [r.rank_id for r in results], [r.step_s for r in results],
        [r.compute_s for r in results], [r.dispatch_wait_s + r.combine_wait_s for r in results],
        [r.slot_tokens for r in results], [r.shape for r in results], [r.remote_messages for r in results],
        [r.remote_bytes for r in results], [r.kv_move_s for r in results], [len(r.tokens) for r in results],
        [q for r in results for q in r.tokens], [t for r in results for t in r.tokens.values()],
        logprobs={r.rank_id: r.logprobs for r in results if r.logprobs},
        errors={r.rank_id: r.errors for r in results if r.errors},
        expert_load={r.rank_id: r.expert_load for r in results if r.expert_load.size})
