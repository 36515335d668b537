"""Hypothesis strategies that fuzz an elastic-ep server through its own /openapi.json.

`FuzzTarget(spec, model_name).requests()` draws a request to any documented operation: a body
that matches the operation's schema, the same body with one field made hostile (NaN,
±Infinity, 1e308, huge or negative ints, wrong types, empty values, a lone surrogate, a long
string), with an unsupported or unknown field added or a required one dropped, or junk that is
no JSON object at all. `FuzzTarget.problems(request, response)` lists what an answer did
wrong: a 5xx, a status or content type the document does not list for the operation, an
error body not in OpenAI's shape, a stream without `data: [DONE]` or with an internal error.

tests/serve/test_serve_fuzz.py runs it against the scripted engine; tests/e2e/test_isolation.py
fuzzes the real distributed server's OpenAI routes beside innocent streams; `caps` keeps the
valid bodies cheap there (n, token counts, list lengths), since a real engine runs every
token. The schema walker covers what pydantic emits: $ref, anyOf / oneOf, const / enum,
null, boolean, integer and number ranges, string, array, object with properties, required,
additionalProperties.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import strategies as st

DEFAULT_CAPS = {
    "n": 3,
    "max_tokens": 24,
    "max_completion_tokens": 24,
    "min_tokens": 24,
    "logprobs": 5,
    "top_logprobs": 5,
    "prompt": 3,
    "messages": 3,
    "stop": 3,
    "stop_token_ids": 4,
    "tokens": 16,
    "content": 3,
}
"""property name -> largest integer / longest array drawn for it in schema-valid bodies."""
TOKEN_ID_FIELDS = ("prompt", "tokens", "stop_token_ids")
"""Properties whose integers are token ids: drawn from [0, vocab_size + 8)."""

HOSTILE_VALUES = (
    math.nan,
    math.inf,
    -math.inf,
    1e308,
    -1e308,
    2**64,
    -(2**63) - 1,
    10**30,
    -1,
    0,
    0.5,
    "",
    "\ud800",
    "x" * 5000,
    [],
    {},
    None,
    True,
    [None],
    {"type": "text"},
    [[-1]],
)
UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "response_format",
    "functions",
    "suffix",
    "best_of",
    "no_such_field",
)
JUNK_BODIES = (
    b"",
    b"{",
    b"[]",
    b"null",
    b"NaN",
    b'"text"',
    b"{}",
    b"[" * 5000,
    b'{"n": 1' + b"0" * 5000 + b"}",
    b"\xff\xfe",
)


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    """The template, e.g. /chaos/{action}."""
    body: dict[str, Any] | None
    """The request body's schema, or None when the operation takes none."""
    path_params: tuple[str, ...]
    responses: dict[str, frozenset[str]]
    """Documented status -> its content types."""


@dataclass(frozen=True)
class FuzzRequest:
    operation: Operation
    path: str
    body: bytes


class FuzzTarget:
    def __init__(
        self, spec: dict[str, Any], model_name: str, vocab_size: int, caps: dict[str, int] | None = None
    ):
        self.components = spec.get("components", {}).get("schemas", {})
        self.caps = DEFAULT_CAPS if caps is None else caps
        self.token_ids = st.integers(0, vocab_size + 7)
        self.hints = {
            "model": st.sampled_from([model_name, "no-such-model"]),
            "type": st.sampled_from(["text", "image_url"]),
            "logit_bias": st.dictionaries(
                st.integers(0, 300).map(str) | st.text(max_size=3), st.floats(-100, 100), max_size=3
            ),
            "role": st.sampled_from(["system", "user", "assistant", "wizard"]),
        }
        self.operations = [
            Operation(
                method.upper(),
                path,
                op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema"),
                tuple(p["name"] for p in op.get("parameters", []) if p["in"] == "path"),
                {status: frozenset(r.get("content", {})) for status, r in op["responses"].items()},
            )
            for path, ops in spec["paths"].items()
            for method, op in ops.items()
        ]
        self._bodies = {
            (op.method, op.path): self._body(op.body) for op in self.operations if op.body is not None
        }

    def requests(self) -> st.SearchStrategy[FuzzRequest]:
        return st.sampled_from(self.operations).flatmap(self._request)

    def _request(self, op: Operation) -> st.SearchStrategy[FuzzRequest]:
        segment = st.sampled_from(["kill", "slow", "explode"]) | st.text(min_size=1, max_size=8)
        path = st.fixed_dictionaries({name: segment for name in op.path_params}).map(
            lambda values: op.path.format(**{k: quote(v, safe="") for k, v in values.items()})
        )
        body = self._bodies.get((op.method, op.path), st.just(b""))
        return st.builds(FuzzRequest, st.just(op), path, body)

    def _body(self, schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
        valid = self._strategy(schema, None)
        names = sorted(self._properties(schema)) or ["prompt"]
        mutated = st.tuples(
            valid, st.sampled_from(names + list(UNSUPPORTED_FIELDS)), st.sampled_from(HOSTILE_VALUES)
        )
        dropped = st.tuples(valid, st.sampled_from(names))
        return st.one_of(
            valid.map(_encode),
            valid.map(_encode),
            valid.map(_encode),
            mutated.map(lambda t: _encode({**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[0])),
            dropped.map(lambda t: _encode(_without(t[0], t[1]))),
            st.sampled_from(JUNK_BODIES),
        )

    def _properties(self, schema: dict[str, Any]) -> set[str]:
        schema = self._resolve(schema)
        names = set(schema.get("properties", {}))
        for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
            names |= self._properties(branch)
        return names

    def _resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.components[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def _strategy(self, schema: dict[str, Any], name: str | None) -> st.SearchStrategy[Any]:
        """Values valid for `schema`; `name` is the property it describes (for hints and caps)."""
        if name in self.hints:
            return self.hints[name]
        schema = self._resolve(schema)
        branches = schema.get("anyOf") or schema.get("oneOf")
        if branches:
            return st.one_of([self._strategy(b, name) for b in branches])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        cap = self.caps.get(name) if name else None
        kind = schema.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer" and name in TOKEN_ID_FIELDS:
            return self.token_ids
        if kind == "integer":
            low = schema.get("minimum", schema.get("exclusiveMinimum", -(2**63) - 1) + 1)
            high = schema.get("maximum", schema.get("exclusiveMaximum", 2**63) - 1)
            return st.integers(int(low), int(high if cap is None else min(high, cap)))
        if kind == "number":
            return st.floats(
                schema.get("minimum", schema.get("exclusiveMinimum")),
                schema.get("maximum", schema.get("exclusiveMaximum")),
                exclude_min="exclusiveMinimum" in schema,
                exclude_max="exclusiveMaximum" in schema,
                allow_nan=False,
                allow_infinity=False,
            )
        if kind == "string":
            return st.text(max_size=24)
        if kind == "array":
            high = min(schema.get("maxItems", 8), 8 if cap is None else cap)
            return st.lists(
                self._strategy(schema.get("items", {}), name),
                min_size=schema.get("minItems", 0),
                max_size=high,
            )
        if kind == "object" or "properties" in schema:
            properties = schema.get("properties", {})
            required = set(schema.get("required", []))
            fixed = {k: self._strategy(v, k) for k, v in properties.items() if k in required}
            optional = {k: self._strategy(v, k) for k, v in properties.items() if k not in required}
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict) and not properties:
                return st.dictionaries(st.text(max_size=8), self._strategy(extra, None), max_size=4)
            return st.fixed_dictionaries(fixed, optional=optional)
        return st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8), st.lists, max_leaves=4
        )

    def problems(self, request: FuzzRequest, response: httpx.Response) -> list[str]:
        """What is wrong with `response` to `request` ([] when nothing is)."""
        status = str(response.status_code)
        media = response.headers.get("content-type", "").split(";")[0].strip()
        what = f"{request.operation.method} {request.path} {request.body[:200]!r} -> {status} {media}"
        found = []
        if response.status_code >= 500:
            found.append(f"server error: {what}: {response.text[:300]}")
        documented = request.operation.responses.get(status)
        if documented is None:
            found.append(f"undocumented status: {what}")
        elif media not in documented:
            found.append(f"undocumented content type (documented: {sorted(documented)}): {what}")
        if media == "application/json" and response.status_code >= 400:
            error = response.json().get("error")
            if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
                found.append(f"error body not in OpenAI's shape: {what}: {response.text[:300]}")
        if media == "text/event-stream":
            found += [f"{p}: {what}" for p in stream_problems(response.text)]
        return found


def stream_problems(text: str) -> list[str]:
    """What is wrong with a server-sent event stream of a completion."""
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return ["the stream does not end with data: [DONE]"]
    found = []
    for event in events[:-1]:
        error = json.loads(event).get("error")
        if error is not None and error.get("type") == "internal_error":
            found.append(f"internal error in the stream: {error.get('message')}")
    return found


def _without(body: Any, name: str) -> Any:
    """The body less its field `name`; a body that is not an object (a null one) as it is."""
    return {k: v for k, v in body.items() if k != name} if isinstance(body, dict) else body


def _encode(value: Any) -> bytes:
    # allow_nan writes NaN and Infinity as Python's json module reads them (not valid JSON).
    return json.dumps(value, allow_nan=True).encode()
