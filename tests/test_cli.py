import argparse
import http.server
import subprocess
import sys
import threading

import pytest

from elastic_ep.cli import COMMANDS, command_parser, main


def test_unknown_command_prints_usage_and_fails(capsys):
    assert main(["no-such-command"]) == 2
    assert "usage: elastic-ep" in capsys.readouterr().err


def _parsers(parser: argparse.ArgumentParser, name: str):
    """(name, parser) for a command and each of its sub-commands."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _help_block(help_text: str, flag: str) -> str:
    """The lines of `--help` that describe `flag`: its line up to the next option."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(flag))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("-")), len(lines))
    return " ".join(lines[start:end])


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_help_shows_the_default_of_every_option(command):
    for name, parser in _parsers(command_parser(command), command):
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS) or action.default is False:
                continue
            block = _help_block(text, action.option_strings[0])
            assert "default" in block, f"`elastic-ep {name} --help` hides the default of {action.option_strings[0]}"


def test_help_formats_list_defaults_as_typed(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "(default 32,64,128,256)" in " ".join(capsys.readouterr().out.split())


def test_serve_needs_an_explicit_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--ep-size", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: --model" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--redundant-experts", "--num-redundant-experts", "--ep-num-redundant-experts"])
def test_serve_takes_vllm_and_sglang_names_for_redundant_experts(flag):
    args = command_parser("serve").parse_args(["--model", "tiny-deepseek-v3", flag, "4"])
    assert args.redundant_experts == 4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["chaos", "http://127.0.0.1:9", "slow", "1"], "chaos slow needs --delay-s"),
        (["chaos", "http://127.0.0.1:9", "slow", "1", "--delay-s", "-1"], "--delay-s must be >= 0"),
        (["chaos", "http://127.0.0.1:9", "kill", "1", "--delay-s", "2"], "--delay-s is for slow only"),
        (["chaos", "http://127.0.0.1:9", "kill", "-1"], "rank -1 is not a rank_id"),
        (["chaos", "http://127.0.0.1:9", "kill", "1", "--timeout-s", "0"], "--timeout-s must be > 0"),
        (["doctor", "http://127.0.0.1:9", "--timeout-s", "0"], "--timeout-s must be > 0"),
        (["doctor", "http://127.0.0.1:9", "--interval-s", "-1"], "--interval-s must be > 0"),
        (["doctor", "http://127.0.0.1:9", "--straggler-ratio", "0.5"], "--straggler-ratio must be > 1"),
    ],
)
def test_bad_chaos_and_doctor_input_is_named_before_any_request(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "cannot reach" not in err


@pytest.mark.parametrize("command", [["doctor", "{url}"], ["chaos", "{url}", "kill", "1"]])
@pytest.mark.parametrize("url", ["tcp://127.0.0.1:8000", "127.0.0.1:port", "http://"])
def test_a_url_that_is_not_http_is_refused_with_the_form_to_use(capsys, command, url):
    with pytest.raises(SystemExit) as exit_info:
        main([part.format(url=url) for part in command])
    assert exit_info.value.code == 2
    assert "give http://HOST:PORT" in capsys.readouterr().err


@pytest.fixture
def plain_http_server():
    """A web server that is not elastic-ep: it answers GET with files and POST with 501."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    "command, reached",
    [(["doctor"], "not an elastic-ep server"), (["chaos", "kill", "1"], "refused (HTTP 501)")],
)
def test_host_and_port_without_http_reach_the_server(capsys, plain_http_server, command, reached):
    argv = [command[0], f"127.0.0.1:{plain_http_server}", *command[1:]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert reached in err and f"http://127.0.0.1:{plain_http_server}" in err


@pytest.mark.parametrize("command", ["chaos", "rollout", "doctor"])
def test_client_commands_import_neither_torch_nor_fastapi(command):
    """A client command talks HTTP to a server: it must not pay torch's or FastAPI's import (0.5-3 s a call)."""
    code = (f"import sys; import elastic_ep.commands.{command}; "
            "heavy = sorted({'torch', 'fastapi'} & set(sys.modules)); assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
