"""The straggler flags, one definition for `serve` and `sim fleet`: the verdict's rule
(`policy/straggler_verdict.py` StragglerRule) and the policy (`policy/straggler_policy.py`
StragglerPolicy). Names, help and defaults are the same in both commands (defaults are the
dataclasses' own), so a simulated fleet runs the policy a server would run with the same flags."""

from __future__ import annotations

import argparse

from elastic_ep.policy.straggler_policy import FLAG_FIELDS, StragglerAction, StragglerPolicy, from_flags
from elastic_ep.policy.straggler_verdict import StragglerRule

STRAGGLER_HELP = {
    "straggler_ratio": "a straggler's own time per step is at least this multiple of its peers' median",
    "straggler_min_excess_ms": "and at least this many ms above it",
    "straggler_window_s": "the straggler verdict judges the steps of this recent window only",
    "straggler_min_steps": "no straggler verdict with fewer steps than this in the window",
    "straggler_persistence": "fraction of the window a rank must be slow in to be named a straggler",
    "straggler_policy": "what is done about a straggler: off (shown only), derate (lighter experts at once, in an "
                        "epoch with the same members) or evict (derated at once, fenced and replaced when it stays "
                        "a straggler for --straggler-evict-after-s)",
    "straggler_evict_after_s": "evict a rank whose straggler verdicts ran this long without a break",
    "straggler_clear_after_s": "a derated rank gets its full weight back after this long of ok verdicts",
    "straggler_max_evictions": "at most this many evictions per --straggler-eviction-window-s",
    "straggler_eviction_window_s": "the window --straggler-max-evictions counts over",
}
CHOICES = {"straggler_policy": [a.value for a in StragglerAction]}


def default(name: str):
    cls, attr = FLAG_FIELDS[name]
    value = getattr(cls, attr)
    return value.value if isinstance(value, StragglerAction) else value


def add_straggler_arguments(parser: argparse.ArgumentParser) -> None:
    """Every straggler flag with its default and help (for commands without a ServeConfig)."""
    for name, text in STRAGGLER_HELP.items():
        value = default(name)
        kwargs = {"choices": CHOICES[name]} if name in CHOICES else {}
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=type(value), default=value,
                            help=f"{text} (default {value})", **kwargs)


def straggler_from_args(args: argparse.Namespace) -> tuple[StragglerRule, StragglerPolicy]:
    """The rule and the policy the flags describe (errors name the flag)."""
    return from_flags(vars(args))
