"""Where one thread's samples go, from a py-spy raw profile: each function's inclusive share of the
samples whose stack holds `--thread` (default: the controller's control thread), and the lines
most often on top. py-spy samples a live process from outside, so unlike `--profile` (cProfile,
which costs every call and list append) it does not slow the loop it measures.

    py-spy record -p PID -d 25 -r 100 -f raw --threads -o RAW    # while a benchmark point runs
    PYTHONPATH=src .venv/bin/python benchmarks/thread_shares.py RAW --top 30
"""

from __future__ import annotations

import argparse
from collections import Counter


def shares(lines: list[str], thread: str) -> tuple[int, Counter, Counter]:
    """(samples of the thread, inclusive samples per function, samples per top line) of py-spy's
    raw lines ("frame;frame;... COUNT", outermost first; a frame is "name (file:line)")."""
    total, inclusive, tops = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if thread not in stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for name in {frame.split(" (")[0] for frame in frames}:
            inclusive[name] += n
        tops[frames[-1]] += n
    return total, inclusive, tops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", help="py-spy record -f raw output")
    parser.add_argument("--thread", default="Controller._run", help="a frame every sample of the thread holds")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.raw) as f:
        total, inclusive, tops = shares(f.readlines(), args.thread)
    if not total:
        raise SystemExit(f"no sample holds {args.thread!r}")
    print(f"{total} samples of {args.thread} (frames in every sample left out)")
    for name, n in [(name, n) for name, n in inclusive.most_common() if n < total][:args.top]:
        print(f"{n / total:6.1%}  {name}")
    print("on top:")
    for frame, n in tops.most_common(args.top // 2):
        print(f"{n / total:6.1%}  {frame}")


if __name__ == "__main__":
    main()
