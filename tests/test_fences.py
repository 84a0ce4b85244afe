"""Fencing tokens never go backwards, even when the store loses a session's data."""

from __future__ import annotations

import asyncio

import pytest
import redis
from harness import InProcessStack

from coordinator.sessions import MemorySessionStore, RedisSessionStore, SessionRecord
from draft_service.engine import ModelDrafter
from specdec import Client
from target_service.engine import TargetEngine


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_fence_passes_the_loaded_record_when_the_counter_is_gone(kind, redis_url):
    async def scenario():
        store = MemorySessionStore(60) if kind == "memory" else RedisSessionStore(redis_url, 60)
        sid = f"f-{kind}-lost"
        try:
            fence = await store.take_fence(sid)
            fence = await store.take_fence(sid, fence)
            await store.put(SessionRecord(sid, [1, 2], fence=fence))
            if kind == "memory":
                store._fences.clear()
            else:
                await store._redis.delete(f"specdec:session:{sid}:fence")
            record = await store.get(sid)
            newer = await store.take_fence(sid, record.fence)
            assert newer > fence
            await store.put(SessionRecord(sid, [1, 2, 3], fence=newer))
            with pytest.raises(Exception, match="newer turn"):
                await store.put(SessionRecord(sid, [9], fence=fence))  # the stale writer loses
            await store.delete(sid)
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_session_goes_on_after_redis_loses_its_data_mid_session(tiny_target, tiny_draft, tiny_dir, redis_url):
    """Two turns give the session's caches fence 2. The store then loses the session's keys during
    turn 2 (eviction, a restart without persistence), and its fence counter again after it: turn 3
    must still take a fence above the caches' and go on, not be refused as stale."""
    stack = InProcessStack(
        TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url
    ).start()
    raw = redis.Redis.from_url(redis_url)
    try:
        with Client(stack.address, timeout=30) as client:
            first = client.complete("w1 w2", max_new_tokens=4)
            sid = first.session_id
            keys = (f"specdec:session:{sid}", f"specdec:session:{sid}:fence")
            second = []
            for i, chunk in enumerate(client.stream("w3", max_new_tokens=12, session_id=sid, k=2)):
                if i == 0:
                    raw.delete(*keys)  # lost mid-turn: the turn's own checkpoints write the record again
                second.extend(chunk.token_ids)
            assert raw.exists(keys[0])
            raw.delete(keys[1])  # the counter alone evicted
            third = client.complete("w4", max_new_tokens=4, session_id=sid, k=2)
        assert third.session_id == sid and len(third.token_ids) == 4 and len(second) == 12
    finally:
        raw.close()
        stack.close()
