"""`--log-format text|json`: an event logged by the event log reaches stderr as a text line for
people or a JSON object with the event's fields for collectors, at the level its kind warrants."""

from __future__ import annotations

import json
import logging

import pytest

from elastic_ep.commands.log_options import configure_logging
from elastic_ep.control.events import EventKind, EventLog


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines_name_kind_rank_and_message(capsys, restore_logging):
    configure_logging("info", "text")
    EventLog().add(EventKind.FAULT, "rank 1: process killed by SIGKILL", 1)
    EventLog().add(EventKind.EPOCH, "epoch 1 (recovery) with ranks [0, 2]")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("WARNING elastic_ep.events: event fault rank=1: rank 1: process killed by SIGKILL")
    assert lines[1].endswith("INFO elastic_ep.events: event epoch: epoch 1 (recovery) with ranks [0, 2]")


def test_json_lines_carry_the_event_fields_and_the_level_filters(capsys, restore_logging):
    configure_logging("warning", "json")
    events = EventLog()
    events.add(EventKind.EPOCH, "epoch 1 (recovery)")  # info: below --log-level warning
    events.add(EventKind.CHAOS, "SIGSTOP to rank 2 (pid 99) in epoch 1", 2, pid=99)
    [line] = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert {k: record[k] for k in ("level", "logger", "kind", "rank_id", "pid", "id")} == {
        "level": "WARNING", "logger": "elastic_ep.events", "kind": "chaos", "rank_id": 2, "pid": 99, "id": 2}
    assert record["message"] == "event chaos rank=2: SIGSTOP to rank 2 (pid 99) in epoch 1"


def test_httpx_request_lines_stay_out_of_info_but_not_out_of_debug(capsys, restore_logging):
    httpx_logger = logging.getLogger("httpx")
    before = httpx_logger.level
    try:
        configure_logging("info", "text")
        httpx_logger.info("HTTP Request: GET http://10.0.0.2:8000/ready \"HTTP/1.1 200 OK\"")
        assert capsys.readouterr().err == ""
        configure_logging("debug", "text")
        httpx_logger.info("HTTP Request: GET http://10.0.0.2:8000/ready")
        assert "HTTP Request" in capsys.readouterr().err
    finally:
        httpx_logger.setLevel(before)
