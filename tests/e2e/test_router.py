"""`elastic-ep router` over real `serve` instances (tiny model, `--ep-size 1` each): streams
survive an instance killed with SIGKILL (its whole process group) mid-stream with outputs
identical to a fault-free run, greedy and seeded; an instance that is not ready gets nothing;
a backend added at run time takes load; two routers place each prefix alike."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_ep.harness.load import PROMPTS, client_for, stream
from elastic_ep.harness.router_process import RouterProcess
from elastic_ep.harness.server_process import ServerProcess

MODEL = "tiny-deepseek-v3"
MAX_TOKENS = 40
SEEDED = {"temperature": 1.0, "top_p": 0.9, "presence_penalty": 0.5}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three ready instances and one that never gets ready (its only rank never comes)."""
    logs = tmp_path_factory.mktemp("fleet")
    args = ["--model", MODEL, "--ep-size", "1", "--max-model-len", "1024"]
    started: list[ServerProcess] = []
    try:
        for i in range(3):
            started.append(ServerProcess(args, logs / f"serve{i}.log", ready_timeout_s=None, own_group=True))
        idle = ServerProcess([*args, "--local-ranks", "0", "--startup-timeout-s", "900"], logs / "idle.log",
                             ready_timeout_s=None, own_group=True)
        started.append(idle)
        for s in started[:3]:
            s.wait_ready(300)
        yield started[:3], idle
    finally:
        for s in started:
            s.stop()


@pytest.fixture
def start_router(tmp_path):
    routers: list[RouterProcess] = []

    def start(*backends: str, extra: tuple[str, ...] = ()) -> RouterProcess:
        args = [a for url in backends for a in ("--backend", url)]
        router = RouterProcess([*args, "--poll-interval-s", "0.2", "--poll-timeout-s", "10", *extra],
                               tmp_path / f"router{len(routers)}.log")
        routers.append(router)
        return router

    yield start
    for router in routers:
        router.stop()


def completions_served(server: ServerProcess) -> float:
    """/v1/completions requests the instance answered, from its own /metrics."""
    total = 0.0
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith("elastic_ep_http_requests_total{") and 'endpoint="/v1/completions"' in line:
            total += float(line.split()[-1])
    return total


def test_two_routers_agree_and_an_instance_that_is_not_ready_gets_nothing(fleet, start_router):
    ready, idle = fleet
    urls = [s.url for s in ready] + [idle.url]
    one, two = start_router(*urls), start_router(*reversed(urls))
    assert not one.backends()[idle.url]["ready"]
    system = "You answer questions about rivers, mountains and the stars, briefly and exactly. " * 7
    prompts = [f"[{k}] {system} Question {q}?" for k in range(4) for q in range(2)]
    placed: dict[str, set[str]] = {}
    for router in (one, two):
        client, model = client_for(router.url)
        for p in prompts:
            before = {u: b["sent"] for u, b in router.backends().items()}
            client.completions.create(model=model, prompt=p, max_tokens=4, temperature=0)
            after = router.backends()
            [where] = [u for u in after if after[u]["sent"] > before[u]]
            placed.setdefault(p, set()).add(where)
    assert all(len(w) == 1 for w in placed.values()), placed
    assert len({next(iter(w)) for w in placed.values()}) > 1
    assert completions_served(idle) == 0
    assert idle.url not in set().union(*placed.values())


def test_a_backend_added_at_run_time_takes_load(fleet, start_router):
    ready, _ = fleet
    router = start_router(ready[0].url, ready[1].url)
    before = completions_served(ready[2])
    added = router.http.post("/backends", json={"url": ready[2].url})
    assert added.status_code == 200 and added.json()["ready"]
    client, model = client_for(router.url)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: stream(client, model, f"load {i} {PROMPTS[i % 6]}", 8, temperature=0), range(24)))
    assert router.backends()[ready[2].url]["sent"] > 0
    assert completions_served(ready[2]) > before


def test_streams_outlive_an_instance_killed_mid_stream(fleet, start_router):
    """Runs last in this module: it kills two of the three instances."""
    ready, _ = fleet
    router = start_router(*(s.url for s in ready))
    client, model = client_for(ready[0].url)
    greedy = {p: stream(client, model, p, MAX_TOKENS, temperature=0).text for p in PROMPTS}
    seeded = {p: stream(client, model, p, MAX_TOKENS, seed=1000 + i, **SEEDED).text for i, p in enumerate(PROMPTS)}
    assert len(set(greedy.values())) > 1 and set(seeded.values()) != set(greedy.values())
    alive = list(ready)
    for expected, sampling in ((greedy, {"temperature": 0}), (seeded, SEEDED)):
        held = killed_mid_stream(router, alive, expected, sampling)
        assert held > 0, "the instance killed held no stream"
    assert router.metric("elastic_ep_router_migrations_total") >= 2


def killed_mid_stream(router: RouterProcess, alive: list[ServerProcess], expected: dict[str, str],
                      sampling: dict) -> int:
    """Stream every prompt twice through the router; once each stream has 3 chunks, SIGKILL the
    process group of the instance holding the most of them. Every stream must finish with the
    fault-free text. Returns the streams the killed instance held."""
    client, model = client_for(router.url)
    jobs = [(i, p) for i, p in enumerate(PROMPTS)] * 2
    barrier = threading.Barrier(len(jobs) + 1, timeout=120)
    held: list[int] = []

    def one(job: tuple[int, str]) -> str:
        i, prompt = job
        seed = {"seed": 1000 + i} if sampling.get("temperature") else {}
        return stream(client, model, prompt, MAX_TOKENS, lambda t: barrier.wait() if len(t) == 3 else None,
                      **seed, **sampling).text

    def kill() -> None:
        barrier.wait()
        views = router.backends()
        victim = max(alive, key=lambda s: views[s.url]["open_here"])
        held.append(views[victim.url]["open_here"])
        victim.kill_group()
        alive.remove(victim)

    killer = threading.Thread(target=kill)
    killer.start()
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(one, jobs))
    killer.join()
    assert texts == [expected[p] for _, p in jobs]
    return held[0]
