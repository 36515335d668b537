"""The ids serve gives a response and the requests of its choices (torch-free: the router imports it)."""

from __future__ import annotations

RESPONSE_ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}
"""The response id's prefix of each route (OpenAI's): `<prefix>-<X-Request-Id>`."""


def response_id(route: str, named: str) -> str:
    """The id of the response to a `route` ("completion" or "chat") request whose X-Request-Id is
    `named`; its choice `j` runs as request `<id>-<j>`. A router that names the request knows it
    before the backend answers at all."""
    return f"{RESPONSE_ID_PREFIX[route]}-{named}"
