"""An OTLP/HTTP traces endpoint on loopback that keeps every span it is sent (protobuf), for tests
and benchmarks of `--otlp-traces-endpoint`. Needs the tracing extra (opentelemetry-proto)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port) at `url` until `close()`."""

    def __init__(self):
        self.requests: list[ExportTraceServiceRequest] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                msg = ExportTraceServiceRequest()
                msg.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.requests.append(msg)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"
        threading.Thread(target=self.http.serve_forever, name="otlp-receiver", daemon=True).start()

    def spans(self) -> list[tuple[dict[str, str], Any]]:
        """(resource attributes, span) of every span received so far."""
        out = []
        for msg in list(self.requests):
            for rs in msg.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                out += [(resource, span) for ss in rs.scope_spans for span in ss.spans]
        return out

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def attributes(span) -> dict[str, Any]:
    """A received span's attributes as Python values."""

    def value(v):
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}
