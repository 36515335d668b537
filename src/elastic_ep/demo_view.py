"""What `elastic-ep demo` shows in the terminal: per-stream progress, event lines, tables.

The stream state is filled by client threads and read by the view; the formatting functions
are pure (state in, text out). On a TTY the progress block is redrawn in place; elsewhere (CI,
pipes) the view prints one plain progress line per `plain_period_s`.
"""

from __future__ import annotations

import itertools
import shutil
import time
from dataclasses import dataclass, field
from typing import TextIO

CURSOR_UP_AND_CLEAR = "\x1b[1A\x1b[2K"


@dataclass
class StreamState:
    """One streaming completion as the client sees it."""

    index: int
    prompt: str
    max_tokens: int
    text: str = ""
    tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    def add_chunk(self, text: str, finish_reason: str | None, now: float) -> None:
        self.text += text
        self.tokens += 1
        self.chunk_times.append(now)
        self.finish_reason = finish_reason or self.finish_reason

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def max_gap_s(self, now: float | None = None) -> float:
        """Largest time between two chunks; with `now`, a stall still going on counts too."""
        times = self.chunk_times + ([now] if now is not None and self.chunk_times and not self.done else [])
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def median_gap_s(self) -> float:
        """The usual time between two chunks: the pace without the pause."""
        gaps = sorted(b - a for a, b in itertools.pairwise(self.chunk_times))
        return gaps[len(gaps) // 2] if gaps else 0.0


def progress_bar(done: int, total: int, width: int = 16) -> str:
    filled = min(width, done * width // max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


def stream_lines(states: list[StreamState], now: float, prompt_width: int = 18) -> list[str]:
    """One line per stream: prompt, bar, tokens, largest gap so far, how it ended."""
    lines = []
    for s in states:
        prompt = (s.prompt[: prompt_width - 1] + "~") if len(s.prompt) > prompt_width else s.prompt
        lines.append(
            f"  #{s.index:<2} {prompt:<{prompt_width}} {progress_bar(s.tokens, s.max_tokens)} "
            f"{s.tokens:>3}/{s.max_tokens:<3} gap {fmt_ms(s.max_gap_s(now)):>8} "
            f"{'error: ' + s.error if s.error else s.finish_reason or ''}"
        )
    return lines


def totals_line(states: list[StreamState], now: float, started: float, epoch: int) -> str:
    tokens = sum(s.tokens for s in states)
    finished = sum(s.done for s in states)
    gap = max((s.max_gap_s(now) for s in states), default=0.0)
    return (f"  {now - started:5.1f} s  epoch {epoch}  streams done {finished}/{len(states)}  "
            f"tokens {tokens}/{sum(s.max_tokens for s in states)}  largest gap {fmt_ms(gap)}")


def format_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns separated by two spaces, with a rule under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    line = lambda cells: "  " + "  ".join(f"{c!s:<{w}}" for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return [line(headers), "  " + "  ".join("-" * w for w in widths), *map(line, rows)]


class LiveView:
    """Event lines scroll above a progress block that is redrawn in place (live) or printed
    as one totals line every `plain_period_s` (not live)."""

    def __init__(self, out: TextIO, states: list[StreamState], live: bool, plain_period_s: float = 1.0):
        self.out = out
        self.states = states
        self.live = live
        self.plain_period_s = plain_period_s
        self.started = time.monotonic()
        self.epoch = 0
        self._drawn = 0
        self._printed_at = self.started

    def say(self, line: str) -> None:
        self._erase()
        print(line, file=self.out, flush=True)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.live:
            self._erase()
            # A line wider than the terminal wraps, and the next redraw would erase too few lines.
            width = shutil.get_terminal_size().columns - 1
            block = [line[:width] for line in
                     (*stream_lines(self.states, now), totals_line(self.states, now, self.started, self.epoch))]
            print("\n".join(block), file=self.out, flush=True)
            self._drawn = len(block)
        elif not force and now - self._printed_at >= self.plain_period_s:
            print(totals_line(self.states, now, self.started, self.epoch), file=self.out, flush=True)
            self._printed_at = now

    def close(self) -> None:
        """Leave the last progress block (live) or a last totals line (not live) on screen."""
        if self.live:
            self.refresh()
        else:
            now = time.monotonic()
            print(totals_line(self.states, now, self.started, self.epoch), file=self.out, flush=True)
        self._drawn = 0

    def _erase(self) -> None:
        if self._drawn:
            self.out.write(CURSOR_UP_AND_CLEAR * self._drawn)
            self._drawn = 0
