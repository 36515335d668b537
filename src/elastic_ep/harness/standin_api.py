"""Stand-in API server processes: what `serve --api-server-count N` runs in front of the controller,
without the HTTP. `python -m elastic_ep.harness.standin_api --server K --workdir DIR --first I
--count N [--max-tokens M]` (the cluster key in $ELASTIC_EP_CLUSTER_KEY) streams N requests at
once through the real API server engine (serve/remote_engine.py: `Generate` to the controller's
API socket, a step's outputs in one `StreamOutputs` frame per server), each followed by another of
the same prompt when it ends, until SIGTERM. With it a benchmark's streams are consumed outside the controller's
process, as they are behind `--api-server-count`, and not by an event loop sharing its GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
from pathlib import Path

from elastic_ep.control.api import EngineInfo, GenerationRequest
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.parent_death import end_with_parent
from elastic_ep.serve.remote_engine import RemoteEngine
from elastic_ep.wire import key_from_env


def prompt_of(i: int, prompt_len: int) -> list[int]:
    """Stream `i`'s prompt, the one benchmarks/control_plane.py's in-process load sends it."""
    return [2 + (i + j) % 300 for j in range(prompt_len)]


def request_tokens(i: int, n: int, max_tokens: int) -> int:
    """The length of stream `i`'s `n`-th request: `max_tokens`, the first 1 + i mod `max_tokens`, so
    that the streams' requests end (and the next arrive) spread over the steps; 0: 1,500 each, all
    started together."""
    if not max_tokens:
        return 1500
    return 1 + i % max_tokens if n == 0 else max_tokens


async def consume(engine: RemoteEngine, i: int, prompt: list[int], max_tokens: int) -> None:
    for n in itertools.count():
        params = SamplingParams(max_tokens=request_tokens(i, n, max_tokens), ignore_eos=True)
        async for _ in engine.generate(GenerationRequest(f"r{i}.{n}", prompt, params, i)):
            pass


async def serve(args: argparse.Namespace) -> None:
    info = EngineInfo("standin", 0, (), {})  # what `generate` does not read
    engine = RemoteEngine(info, args.server, key_from_env(), Path(args.workdir))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.ensure_future(consume(engine, i, prompt_of(i, args.prompt_len), args.max_tokens))
             for i in range(args.first, args.first + args.count)]
    await stop.wait()
    for task in tasks:  # each stream's end aborts its request
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", type=int, required=True, help="this server's index (0..N-1)")
    parser.add_argument("--workdir", required=True, help="the controller's private directory of ipc sockets")
    parser.add_argument("--first", type=int, required=True, help="the first request's index")
    parser.add_argument("--count", type=int, required=True, help="requests streamed at once")
    parser.add_argument("--prompt-len", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=0, help="requests' length (`request_tokens`)")
    args = parser.parse_args(argv)
    end_with_parent(signal.SIGTERM)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
