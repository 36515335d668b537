"""The running server that `chaos`, `doctor` and `rollout` talk to: its URL as typed, the error
when it cannot be reached, and the message of an error it answered."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

import httpx

from elastic_ep.errors import ElasticEPError


def server_url(text: str) -> str:
    """An argparse type: `http://HOST:PORT` (or https) as given, `HOST:PORT` with `http://` added,
    without a trailing slash; anything else is refused with the form to use."""
    url = text.strip()
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port that is not a number, or out of range
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a server URL: give http://HOST:PORT (or HOST:PORT), e.g. http://127.0.0.1:8000"
        )
    return url.rstrip("/")


def unreachable(url: str, error: httpx.HTTPError) -> ElasticEPError:
    """The error for a server that did not answer."""
    return ElasticEPError(
        f"cannot reach {url} ({type(error).__name__}: {error}); is `elastic-ep serve` running there?"
    )


def error_message(response: httpx.Response) -> str:
    """The message of an elastic-ep error answer, or what to check when the answer is not one."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"{response.request.url} did not answer as elastic-ep does; check the URL and port"
