"""API server processes <-> the controller (`serve --api-server-count N`, N > 1).

Each API server process serves HTTP on the shared listening socket and asks the controller's
process for generations: `Generate` and `Abort` go to the controller's API socket (the server's
DEALER, the controller's ROUTER), answered there with `Admitted` or `Refused`; a step's tokens for
that server's requests come in one `StreamOutputs` per server per step, pushed by the control
thread to the server's own token socket. Both sockets are `ipc://` in a directory only the
deployment's user can open, and every frame is sealed with the cluster key as on every socket
(wire/codec.py): a frame that is not is dropped and counted.

`key` names a request within its API server (the server picks it); `seq_id` is the controller's.
"""

from __future__ import annotations

from pathlib import Path

from elastic_ep.model.sampling import SamplingParams, TokenLogprobs

from .codec import Message


def api_address(workdir: Path) -> str:
    """The controller's API socket (its ROUTER) in the deployment's private directory."""
    return f"ipc://{workdir / 'api.sock'}"


def tokens_address(workdir: Path, server: int) -> str:
    """API server `server`'s token socket (its PULL)."""
    return f"ipc://{workdir / f'tokens-{server}.sock'}"


class Generate(Message):
    """API server `server` -> controller: admit this request, stream its outputs to `server`."""

    server: int
    key: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    resumed_output_token_ids: list[int] = []


class Abort(Message):
    """API server -> controller: the client of this sequence left."""

    seq_id: int


class PrefixKeySeen(Message):
    """API server -> controller: a generation request named this prefix key (its
    `X-Elastic-EP-Prefix-Key` header, as sent), for the controller's GET /prefix_keys."""

    key: str


class ServerReport(Message):
    """API server -> controller, every second: the frames its sockets dropped so far, as
    (socket, reason, count), for the controller's `elastic_ep_control_frames_rejected_total`."""

    server: int
    rejected: list[tuple[str, str, int]]


class Admitted(Message):
    """Controller -> API server: request `key` runs as sequence `seq_id`."""

    key: int
    seq_id: int


class Refused(Message):
    """Controller -> API server: request `key` was not admitted; the HTTP status to answer
    (400 bad input, 503 not now), the reason, and for a 503 when to retry."""

    key: int
    status: int
    message: str
    retry_after_s: int = 0


class StreamOutputs(Message):
    """Controller -> one API server: a step's outputs of that server's requests, in columns.

    keys: the requests with an output; counts: new tokens of each (0 for an end without a token);
    token_ids: all of them, in order, `sum(counts)` long; finished: (index into keys, finish
    reason) of those that ended; errors: (index, message) of those that ended in error; logprobs:
    (index, one TokenLogprobs per new token) of those that asked for logprobs."""

    keys: list[int]
    counts: list[int]
    token_ids: list[int]
    finished: list[tuple[int, str]] = []
    errors: list[tuple[int, str]] = []
    logprobs: list[tuple[int, list[TokenLogprobs]]] = []

    def check(self) -> str | None:
        """What makes the frame unreadable (None: nothing): columns that do not line up."""
        n = len(self.keys)
        if len(self.counts) != n or sum(self.counts) != len(self.token_ids) or min(self.counts, default=0) < 0:
            return "counts do not match the keys and tokens"
        if any(not 0 <= i < n for i, _ in (*self.finished, *self.errors, *self.logprobs)):
            return "an index past the keys"
        return None


TO_CONTROLLER = Generate | Abort | PrefixKeySeen | ServerReport
TO_API_SERVER = Admitted | Refused
