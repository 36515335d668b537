"""An idle keep-alive connection outlives the clients' own 5 s expiry (httpx and the OpenAI SDK on
it, the router's pool): `run_http`, which serve, the API servers and a controller group's gate run,
keeps it `KEEP_ALIVE_S`. At uvicorn's default, also 5 s, a client could send its next request on a
connection the server was closing at that moment and have it reset (seen once in the suite)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

SERVER = """
import socket
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from elastic_ep.commands.http_server import run_http

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
print(sock.getsockname()[1], flush=True)
run_http(Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))]), sock, 30.0)
"""


def get(conn: socket.socket) -> bytes:
    """One GET / on `conn` (kept alive) and its response, b"" when the server had closed it."""
    conn.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    response = b""
    while not response.endswith(b"\r\n\r\nok"):
        part = conn.recv(4096)
        if not part:
            break
        response += part
    return response


def test_an_idle_connection_stays_open_past_the_clients_five_second_expiry():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            assert get(conn).startswith(b"HTTP/1.1 200")
            time.sleep(6)  # idle past 5 s, where uvicorn's default closes it
            assert get(conn).startswith(b"HTTP/1.1 200")
    finally:
        server.terminate()
        server.wait(10)
