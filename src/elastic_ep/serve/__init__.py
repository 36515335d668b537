"""The HTTP server over an `Engine` (control/api.py): `app.create_app` builds it.

- `openai_api`: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize
- `protocol`: every request and response body as a pydantic model (validation and schema)
- `prompts`: prompts, chat template, sampling parameters, one engine request per choice
- `generation`, `detokenize`: requests in flight, text deltas, stop strings
- `streaming`: work and event streams that end when the client disconnects
- `openapi`: /openapi.json from the protocol models, with the real error responses
- `admin`: /health, /ready, /metrics, /cluster, /dashboard, scaling, recorder, chaos
- `metrics`: HTTP metrics; `errors`: the OpenAI error body; `response_ids`: response and request ids
"""
