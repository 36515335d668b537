"""`elastic-ep router`: one OpenAI endpoint over several `serve` instances (`app.create_app`).

- `scoring`: which backend a request goes to (prefix-block rendezvous hashing, bounded load)
- `admission`: the backend of each request, and the bounded queue while all are saturated
- `backends`: the set of instances, their /ready and /metrics polled
- `relay`: a client's stream, carried to another instance when its instance dies
- `config`, `metrics`: settings; the router's own Prometheus metrics
"""
