"""Admission without any server: sessions stay on their backend, the queue is bounded, and a
router with nothing ready says so."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from elastic_ep.router.admission import Admission, NoBackend, Saturated
from elastic_ep.router.backends import BackendPool
from elastic_ep.router.scoring import Limits, rendezvous_order, user_key

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 4)]


def pool_of(urls: list[str]) -> BackendPool:
    pool = BackendPool(httpx.AsyncClient())
    for url in urls:
        pool.add(url, "cli").ready = True
    return pool


def test_a_user_stays_on_its_backend_when_a_backend_is_added():
    pool = pool_of(URLS[:2])
    admission = Admission(pool, Limits())
    # users whom the third backend would win on a fresh hash
    movers = [f"user-{i}" for i in range(200)
              if rendezvous_order(user_key(f"user-{i}"), URLS)[0] == URLS[2]]
    assert movers
    before = {u: admission.pick(user_key(u), u).url for u in movers}
    pool.add(URLS[2], "api").ready = True
    after = {u: admission.pick(user_key(u), u).url for u in movers}
    assert after == before
    assert admission.pick(user_key("newcomer"), None) is not None
    newcomers = [f"new-{i}" for i in range(200)]
    assert URLS[2] in {admission.pick(user_key(u), u).url for u in newcomers}


def test_a_user_whose_backend_is_not_ready_moves_and_stays_moved():
    pool = pool_of(URLS[:2])
    admission = Admission(pool, Limits())
    first = admission.pick(user_key("ann"), "ann")
    first.ready = False
    second = admission.pick(user_key("ann"), "ann")
    assert second.url != first.url
    first.ready = True
    assert admission.pick(user_key("ann"), "ann").url == second.url


def test_the_queue_holds_up_to_its_bound_then_answers_saturated():
    async def scenario():
        pool = pool_of(URLS[:1])
        admission = Admission(pool, Limits(max_open=1), queue_size=1, queue_timeout_s=5.0)
        key = user_key("k")
        held = await admission.acquire(key)
        waiter = asyncio.ensure_future(admission.acquire(key))
        await asyncio.sleep(0.05)
        assert admission.waiting == 1
        with pytest.raises(Saturated):
            await admission.acquire(key)  # the queue is full: at once
        admission.release(held)
        got = await asyncio.wait_for(waiter, 1.0)
        assert got.url == URLS[0] and got.open_here == 1
        short = Admission(pool, Limits(max_open=1), queue_size=4, queue_timeout_s=0.2)
        with pytest.raises(Saturated, match="within 0.2s"):
            await short.acquire(key)  # waited its time out

    asyncio.run(scenario())


def test_no_ready_backend_is_no_backend_not_saturated():
    async def scenario():
        pool = pool_of(URLS[:2])
        for b in pool.backends.values():
            b.ready = False
        with pytest.raises(NoBackend):
            await Admission(pool, Limits()).acquire(user_key("k"))

    asyncio.run(scenario())


def test_backends_file_adds_and_removes_only_its_own(tmp_path):
    listed = tmp_path / "backends"
    listed.write_text(f"{URLS[0]}\n# a comment\n{URLS[1]}/\n")
    pool = BackendPool(httpx.AsyncClient(), backends_file=str(listed))
    pool.add(URLS[2], "cli")
    pool.read_file()
    assert set(pool.backends) == set(URLS)
    listed.write_text(f"{URLS[1]}\n")
    os.utime(listed, ns=(1, 1))  # a change the mtime shows even within one clock tick
    pool.read_file()
    assert set(pool.backends) == {URLS[1], URLS[2]}


def test_a_resumed_stream_waits_for_a_backend_to_become_ready():
    async def scenario():
        pool = pool_of(URLS[:1])
        backend = pool.backends[URLS[0]]
        backend.ready = False
        admission = Admission(pool, Limits(), queue_size=0, queue_timeout_s=5.0)
        waiter = asyncio.ensure_future(admission.acquire(user_key("k"), resuming=True))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        backend.ready = True
        admission.notify()
        assert (await asyncio.wait_for(waiter, 1.0)).url == URLS[0]
        backend.ready = False
        short = Admission(pool, Limits(), queue_timeout_s=0.1)
        with pytest.raises(NoBackend, match="became ready"):
            await short.acquire(user_key("k"), resuming=True)

    asyncio.run(scenario())
