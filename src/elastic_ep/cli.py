"""The `elastic-ep` command line: one sub-command per module in `elastic_ep.commands`.

Sub-command modules are imported lazily so that `elastic-ep sim` does not pay for torch.
Each module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

from elastic_ep.errors import ElasticEPError

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "serve a model: controller, node agent and N EP ranks, OpenAI-compatible HTTP"),
    "router": ("router", "an OpenAI gateway over several serve instances: prefix affinity, load, streams that "
                         "outlive their instance"),
    "agent": ("agent", "run a node agent that supervises workers and joins a controller"),
    "demo": ("demo", "the elastic demo on the embedded tiny model: serve, load, kill a rank, recover"),
    "generate": ("generate", "offline generation in one process"),
    "make-tiny": ("make_tiny", "write a small random checkpoint in Hugging Face format"),
    "eplb": ("eplb", "compute an expert placement from a load file"),
    "sim": ("sim", "fleet-scale failure simulation and expert-redundancy analysis"),
    "plan": ("plan", "compare deployment options: EP size, redundancy, backup"),
    "chaos": ("chaos", "inject a fault into a server started with --enable-chaos"),
    "rollout": ("rollout", "rolling restart of a running server, one rank at a time, with new worker options"),
    "doctor": ("doctor", "diagnose a hang or a straggler on a running server"),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Adds "(default X)" to every option whose help does not say its default already. Options
    without a value (None) or off switches explain themselves."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == argparse.SUPPRESS
        if "default" in text or not action.option_strings or unset:
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default {str(shown).replace('%', '%%')})"


def _load(name: str):
    module_name, _ = COMMANDS[name]
    return importlib.import_module(f"elastic_ep.commands.{module_name}")


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of sub-command `name` (imports its module)."""
    parser = argparse.ArgumentParser(
        prog=f"elastic-ep {name}", description=COMMANDS[name][1], formatter_class=DefaultsHelpFormatter
    )
    _load(name).add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="elastic-ep", description="elastic-ep: fault-tolerant elastic MoE serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        parser.print_usage(sys.stderr)
        print(f"error: unknown command {argv[0]!r}" if argv else "error: a command is required", file=sys.stderr)
        return 2
    name = argv[0]
    try:
        cmd_parser = command_parser(name)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("elastic_ep.commands"):
            print(f"error: `elastic-ep {name}` is not built yet (see docs/FEATURES.md)", file=sys.stderr)
            return 2
        raise
    module = _load(name)
    args = cmd_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except ElasticEPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; stop quietly like other Unix tools.
        sys.stderr.close()
        return 141


def exit_without_teardown(code: int) -> None:
    """End the process once a command has returned, without the interpreter's teardown: its last
    garbage collection over the objects of torch and the server took 1 to 3 s on a loaded host,
    and every stop of a server or agent (a test's, a pod's) waited for it. Each
    command has cleaned up by then; the logs and the standard streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone (`| head`), or closed after it went
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
