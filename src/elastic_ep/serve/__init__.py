"""The HTTP server over an `Engine` (control/api.py): `app.create_app` builds it.

- `openai_api`: /v1/completions, /v1/chat/completions, /v1/models
- `protocol`, `prompts`: request bodies, validation, chat template, sampling parameters
- `generation`, `detokenize`: a request in flight, text deltas, stop strings, disconnects
- `admin`: /health, /ready, /metrics, /cluster, /dashboard, scaling, recorder, chaos
- `metrics`: HTTP metrics; `errors`: the OpenAI error body
"""
