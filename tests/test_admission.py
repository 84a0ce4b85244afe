"""Admission control: the bound on running requests, the bounded queue, fairness, and the SDK's view."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from harness import InProcessStack

from coordinator.admission import Admission, Overloaded
from coordinator.auth import hash_key
from coordinator.identity import caller_of
from coordinator.server import SERVICE_NAME, CoordinatorServicer, register
from coordinator.sessions import MemorySessionStore, RedisSessionStore
from coordinator.turns import Chunk, Stats
from draft_service.engine import ModelDrafter
from specdec import Client
from specdec.client import ResourceExhausted, RetryPolicy, Unavailable
from specdec.config import AdmissionLimits, ServerConfig
from specdec.rpc import start_server
from target_service.engine import TargetEngine


def test_slots_bound_the_running_requests_and_the_queue():
    async def run():
        admission = Admission(AdmissionLimits(max_active=2, max_queued=1))
        release = asyncio.Event()
        running = []

        async def request(name: str):
            async with admission.slot(name):
                running.append(name)
                await release.wait()

        tasks = [asyncio.create_task(request(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.01)
        assert running == ["a", "b"] and admission.queued == 1
        with pytest.raises(Overloaded) as refused:
            async with admission.slot("d"):
                pass
        assert refused.value.retry_after_s > 0
        release.set()
        await asyncio.gather(*tasks)
        assert running == ["a", "b", "c"] and admission.active == 0 and admission.queued == 0

    asyncio.run(run())


def test_a_burst_from_one_client_does_not_starve_another():
    """Client A queues five requests, then B one: B's runs second, not sixth."""

    async def run():
        admission = Admission(AdmissionLimits(max_active=1, max_queued=10))
        order = []
        gate = asyncio.Event()

        async def request(client: str, tag: str):
            async with admission.slot(client):
                order.append(tag)
                if tag == "first":
                    await gate.wait()

        first = asyncio.create_task(request("a", "first"))
        await asyncio.sleep(0)
        burst = [asyncio.create_task(request("a", f"a{i}")) for i in range(5)]
        await asyncio.sleep(0)
        late = asyncio.create_task(request("b", "b0"))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *burst, late)
        assert order[:3] == ["first", "a0", "b0"]

    asyncio.run(run())


def test_per_client_limit_and_cancelled_waiters_free_their_place():
    async def run():
        admission = Admission(AdmissionLimits(max_active=1, max_queued=5, max_per_client=2))
        gate = asyncio.Event()

        async def request(client: str):
            async with admission.slot(client):
                await gate.wait()

        held = [asyncio.create_task(request("a")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="limit"):
            async with admission.slot("a"):
                pass
        waiting = asyncio.create_task(request("b"))
        await asyncio.sleep(0)
        assert admission.queued == 2
        waiting.cancel()
        await asyncio.sleep(0)
        assert admission.queued == 1
        gate.set()
        await asyncio.gather(*held)
        assert admission.active == 0 and admission.queued == 0

    asyncio.run(run())


class _HeldLoop:
    """A stand-in round loop whose requests run until the test lets them finish."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.release = asyncio.Event()
        self.started = threading.Event()

    async def generate(self, request, remaining_s):
        self.started.set()
        await self.release.wait()
        yield Chunk("s", "done", [1], "stop", Stats())


def test_a_full_coordinator_answers_resource_exhausted_with_a_retry_hint():
    """One slot, no queue, over real gRPC: while one request runs, the next gets RESOURCE_EXHAUSTED
    with a retry hint the SDK reads; once it ends, the next is served."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    held = _HeldLoop(loop)
    servicer = CoordinatorServicer(held, 256, Admission(AdmissionLimits(max_active=1, max_queued=0)))
    running = asyncio.run_coroutine_threadsafe(
        start_server(ServerConfig(), register(servicer), (SERVICE_NAME,)), loop
    ).result(10)
    try:
        with Client(f"127.0.0.1:{running.port}", timeout=30) as client, ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.complete, "w1", max_new_tokens=4)
            assert held.started.wait(10)
            with pytest.raises(ResourceExhausted) as refused:
                client.complete("w2", max_new_tokens=4)
            assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
            loop.call_soon_threadsafe(held.release.set)
            assert first.result(10).text == "done"
            assert client.complete("w3", max_new_tokens=4).text == "done"
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_client_keeps_at_most_its_share_of_live_sessions(kind, redis_url):
    async def scenario():
        store = MemorySessionStore(60) if kind == "memory" else RedisSessionStore(redis_url, 60)
        try:
            client = f"id:c-{kind}-{time.time()}"
            assert await store.claim(client, "s1", 2) and await store.claim(client, "s2", 2)
            assert not await store.claim(client, "s3", 2)
            assert await store.claim(client, "s1", 2)  # a session already counted goes on
            assert await store.claim(f"{client}-other", "s3", 2)  # limits are per client
        finally:
            await store.close()

    asyncio.run(scenario())


def test_sessions_per_client_over_grpc(tiny_target, tiny_draft, tiny_dir, redis_url):
    """The limit counts the sessions of one API key; another key has its own, and a header the client
    sets itself changes neither."""
    mine, theirs = f"sessions-{time.time()}", f"someone-else-{time.time()}"
    stack = InProcessStack(
        TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url
    )
    stack.start(admission=AdmissionLimits(max_sessions_per_client=2), api_key_hashes=(hash_key(mine), hash_key(theirs)))
    try:
        with Client(stack.address, timeout=30, api_key=mine, client_id="a") as client:
            first = client.complete("w1 w2", max_new_tokens=2)
            client.complete("w3 w4", max_new_tokens=2)
        with Client(stack.address, timeout=30, api_key=mine, client_id="b") as client:
            with pytest.raises(ResourceExhausted, match="live sessions"):
                client.complete("w5 w6", max_new_tokens=2)
            assert client.complete("w7", max_new_tokens=2, session_id=first.session_id).session_id == first.session_id
        with Client(stack.address, timeout=30, api_key=theirs) as other:
            assert other.complete("w1 w2", max_new_tokens=2).token_ids
    finally:
        stack.close()


def test_a_new_session_that_never_streamed_does_not_count_for_its_client(tiny_target, tiny_draft, tiny_dir, redis_url):
    """A new session's id reaches its client only with a chunk. When the request fails before one (here
    the target is unreachable), the session can never be continued, so it leaves the client's session
    limit as it was: the SDK's retries end UNAVAILABLE, not "too many live sessions"."""
    stack = InProcessStack(
        TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url
    )
    key = f"unreached-{time.time()}"
    stack.start(admission=AdmissionLimits(max_sessions_per_client=1), api_key_hashes=(hash_key(key),))
    try:
        stack.run(stack._servers[0].stop(0))  # the target
        with Client(stack.address, timeout=30, api_key=key, retry=RetryPolicy(attempts=3, backoff_s=0.05)) as c:
            with pytest.raises(Unavailable, match="target"):
                c.complete("w1 w2", max_new_tokens=2)
        client = caller_of(key, None, "").client
        assert redis.Redis.from_url(redis_url).zcard(f"specdec:client:{client}") == 0
    finally:
        stack.close()
