"""/openapi.json describes every route from the models the handlers validate with: request
bodies (fields, ranges, no unknown fields), responses with their status codes and content
types, errors in OpenAI's shape; /docs renders it."""

from __future__ import annotations

import httpx
import pytest

from elastic_ep.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DrainRequest,
    ScaleRequest,
    UncordonRequest,
)

BODIES = {
    ("post", "/v1/completions"): CompletionRequest,
    ("post", "/v1/chat/completions"): ChatCompletionRequest,
    ("post", "/scale_elastic_ep"): ScaleRequest,
    ("post", "/drain"): DrainRequest,
    ("post", "/uncordon"): UncordonRequest,
}


@pytest.fixture(scope="module")
def spec(served):
    return httpx.get(f"{served.url}/openapi.json").json()


def schema_of(spec, ref_holder):
    return spec["components"]["schemas"][ref_holder["$ref"].rsplit("/", 1)[-1]]


@pytest.mark.parametrize(("operation", "model"), list(BODIES.items()))
def test_request_bodies_are_the_handlers_models(spec, operation, model):
    method, path = operation
    body = spec["paths"][path][method]["requestBody"]
    assert body["required"] is True
    schema = schema_of(spec, body["content"]["application/json"]["schema"])
    assert set(schema["properties"]) == set(model.model_fields)
    assert schema["additionalProperties"] is False


def test_ranges_are_in_the_schema(spec):
    fields = spec["components"]["schemas"]["CompletionRequest"]["properties"]

    def bounds(name):
        number = next(s for s in fields[name]["anyOf"] if s["type"] != "null")
        return number.get("minimum", number.get("exclusiveMinimum")), number.get("maximum")

    assert bounds("temperature") == (0, 2)
    assert bounds("top_p") == (0, 1)
    assert bounds("presence_penalty") == (-2, 2)
    assert bounds("logprobs") == (0, 20)
    assert fields["n"]["maximum"] == 128


def test_every_operation_documents_its_answers(spec):
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "200" in responses and "500" in responses, (method, path)
            assert "422" not in responses, (method, path)
            for status, response in responses.items():
                assert response.get("content"), (method, path, status)
                # they answer with a status body
                if status.startswith(("4", "5")) and path not in ("/ready", "/health", "/ping"):
                    assert (
                        schema_of(spec, response["content"]["application/json"]["schema"])
                        == spec["components"]["schemas"]["ErrorResponse"]
                    )
    for path in ("/v1/completions", "/v1/chat/completions"):
        operation = spec["paths"][path]["post"]
        assert {"200", "400", "404", "500", "503"} <= set(operation["responses"])
        assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in operation["responses"]["503"]["headers"]
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_stream_events_and_tokenize_bodies_are_described(spec):
    schemas = spec["components"]["schemas"]
    assert {"CompletionStreamResponse", "ChatCompletionStreamResponse", "ChatDelta"} <= set(schemas)
    tokenize = spec["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {schema_of(spec, s)["title"] for s in tokenize["oneOf"]} == {
        "TokenizeCompletionRequest",
        "TokenizeChatRequest",
    }


def test_docs_page_is_served(served):
    page = httpx.get(f"{served.url}/docs")
    assert page.status_code == 200
    assert "/openapi.json" in page.text
