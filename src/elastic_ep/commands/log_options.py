"""`--log-level` and `--log-format` for `serve` and `agent`: every log line goes to stderr, as text
for people or one JSON object per line for collectors (journald, Kubernetes logs, Loki, ...).

What reaches the log: the cluster's events (`elastic_ep.events`: fault, fencing, epoch,
recovered, registered, scale, chaos, ...), the periodic stats line (`elastic_ep.stats`), the
node agent's actions (`elastic_ep.node.agent`), Python warnings, and the HTTP server's warnings.
A JSON line carries the record's structured fields (an event's id, kind, rank_id and details; the
stats numbers) next to time, level, logger and message.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, timezone

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="least severity logged on stderr (default info: events and the stats line)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text for people, json for log collectors: one object per line (default text)")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (unix s), time (ISO 8601, UTC), level, logger, message, the
    record's `fields` (passed as `extra={"fields": {...}}`) flattened in, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6),
               "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key, value in (getattr(record, "fields", None) or {}).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """Root logger to stderr at `level` in `fmt` (text or json); Python warnings logged too.

    httpx's per-request INFO lines (the router polls every backend twice a second) are kept at
    WARNING unless `level` is debug."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)
    logging.getLogger("httpx").setLevel(logging.NOTSET if level.lower() == "debug" else logging.WARNING)
