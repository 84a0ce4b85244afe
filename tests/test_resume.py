"""Resuming a lost stream on another coordinator, and fencing of stale turns (in process, real gRPC
and Redis, tiny models)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from harness import InProcessStack

from coordinator.replicas import CacheRef, Fenced
from coordinator.sessions import MemorySessionStore, RedisSessionStore, SessionRecord, TurnState
from coordinator.textstream import TextStream
from draft_service.engine import ModelDrafter
from specdec import Client
from specdec.client import build_request
from specdec.errors import StaleFence
from specdec.kvcache import SessionCache
from specdec.v1 import common_pb2, coordinator_pb2_grpc, target_pb2
from target_service.engine import TargetEngine

PROMPT = "w7 w7 w8 w9 w10"
SAMPLED = {"temperature": 0.9, "top_k": 20, "seed": 99}


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_draft, tiny_dir, redis_url):
    """One target and draft behind two coordinators sharing Redis."""
    s = InProcessStack(TargetEngine(tiny_target, 64), ModelDrafter(tiny_draft, 64, 64), tiny_dir / "target", redis_url)
    s.start(default_k=3)
    s.add_coordinator(default_k=3)
    yield s
    s.close()


def _broken_stream(address: str, request, tokens_before_break: int) -> tuple[list[int], str, str]:
    """Streams ``request`` and walks away after some tokens, as a client whose coordinator died
    would see it; returns the tokens and text received and the session id."""
    with grpc.insecure_channel(address) as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=60)
        tokens, text, session = [], "", ""
        for chunk in call:
            tokens += chunk.token_ids
            text += chunk.text
            session = chunk.session_id
            if len(tokens) >= tokens_before_break:
                call.cancel()
                break
    return tokens, text, session


def _resume(address: str, request, session: str, tokens: list[int], text: str) -> tuple[list[int], str, str]:
    request.session_id = session
    request.resume.tokens = len(tokens)
    request.resume.text_chars = len(text)
    out_tokens, out_text, finish = [], "", ""
    with grpc.insecure_channel(address) as channel:
        for chunk in coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=60):
            out_tokens += chunk.token_ids
            out_text += chunk.text
            finish = chunk.finish_reason or finish
    return out_tokens, out_text, finish


@pytest.mark.parametrize("options", [{}, SAMPLED], ids=["greedy", "seeded-sampled"])
@pytest.mark.parametrize("cut", [1, 6, 15])
def test_a_stream_resumed_on_another_coordinator_is_the_uninterrupted_one(stack, options, cut):
    with Client(stack.coordinators[0], timeout=60) as client:
        whole = client.complete(PROMPT, max_new_tokens=60, **options)
    assert len(whole.token_ids) > cut + 1
    request = build_request(PROMPT, max_new_tokens=60, **options)
    request.request_id = f"broken-{cut}-{bool(options)}"
    head, head_text, session = _broken_stream(stack.coordinators[0], request, cut)
    tail, tail_text, finish = _resume(stack.coordinators[1], request, session, head, head_text)
    assert head + tail == whole.token_ids
    assert head_text + tail_text == whole.text
    assert finish == whole.finish_reason


def test_resuming_a_finished_turn_sends_what_was_missed(stack):
    request = build_request(PROMPT, max_new_tokens=20)
    request.request_id = "finished"
    with grpc.insecure_channel(stack.coordinators[0]) as channel:
        chunks = list(coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=60))
    tokens = [t for c in chunks for t in c.token_ids]
    text = "".join(c.text for c in chunks)
    tail, tail_text, finish = _resume(stack.coordinators[1], request, chunks[0].session_id, tokens[:5], "")
    assert tail == tokens[5:] and tail_text == text and finish == chunks[-1].finish_reason


def test_bad_resumes_get_clear_statuses(stack):
    with grpc.insecure_channel(stack.coordinators[1]) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = build_request(PROMPT, max_new_tokens=4)
        request.resume.tokens = 2
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, timeout=30))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in error.value.details()

        request.session_id = "no-such-session"
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, timeout=30))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND

        session = list(stub.Generate(build_request(PROMPT, max_new_tokens=4), timeout=30))[0].session_id
        other = build_request("w1 w2", max_new_tokens=4, session_id=session)
        other.resume.tokens = 3
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(other, timeout=30))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_stale_turn_is_aborted_and_the_services_refuse_it(stack, tiny_target):
    """Turn A runs on one coordinator; turn B of the same session starts on the other. A's next
    checkpoint is refused (ABORTED), and so is any cache call carrying A's older fencing token."""
    with Client(stack.coordinators[0], timeout=60) as first, Client(stack.coordinators[1], timeout=60) as second:
        session = first.complete(PROMPT, max_new_tokens=3).session_id
        stream = first.stream("w3 w4", max_new_tokens=200, session_id=session, k=0)
        next(stream)
        assert second.complete("w5", max_new_tokens=3, session_id=session).token_ids
        with pytest.raises(Exception, match="ABORTED"):
            for _ in stream:
                pass
    # Over the wire: a cache made by the turn with token 5 refuses a call with token 4, and moves on
    # to token 6 when a newer turn shows it.
    with grpc.insecure_channel(stack.target_address) as channel:
        prefill = channel.unary_unary("/specdec.v1.TargetService/Prefill")
        verify = channel.unary_unary("/specdec.v1.TargetService/Verify")
        made = common_pb2.PrefillReply.FromString(
            prefill(common_pb2.PrefillRequest(tokens=[3, 4, 5], fence=5).SerializeToString(), timeout=10)
        )

        def verify_with(fence: int) -> None:
            sync = common_pb2.CacheSync(cache_id=made.cache_id, start=3, fence=fence)
            verify(target_pb2.VerifyRequest(sync=sync).SerializeToString(), timeout=10)

        with pytest.raises(grpc.RpcError) as stale:
            verify_with(4)
        assert stale.value.code() == grpc.StatusCode.ABORTED
        verify_with(6)
        with pytest.raises(grpc.RpcError) as stale:
            verify_with(5)
        assert stale.value.code() == grpc.StatusCode.ABORTED
    cache = SessionCache(committed=[1, 2, 3])
    cache.sync(3, [4], fence=5)
    with pytest.raises(StaleFence):
        cache.sync(4, [5], fence=4)
    assert cache.committed == [1, 2, 3, 4]


def test_text_stream_skip_releases_only_what_the_client_lacks(tiny_target):
    tokenizer = tiny_target.tokenizer
    ids = tokenizer.encode("w1 w2 w3 w4 w5", add_special_tokens=False)
    stream = TextStream(tokenizer, [])
    stream.skip(ids[:3], 4, len("w1 w2 w3 w4"))  # the client got one token more than was checkpointed
    assert stream.push(ids[3:4]).token_ids == []
    out = stream.push(ids[4:])
    assert out.token_ids == ids[4:] and out.text == " w5"


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_stores_refuse_a_writer_with_an_older_fence(kind, redis_url):
    async def scenario():
        store = MemorySessionStore(60) if kind == "memory" else RedisSessionStore(redis_url, 60)
        try:
            old_fence = await store.take_fence("s-fence")
            new_fence = await store.take_fence("s-fence")
            assert new_fence > old_fence
            turn = TurnState("abc", 3, 7, round=2, drafted=[2, 1], accepted=[1])
            record = SessionRecord(
                "s-fence", [1, 2, 3], target=CacheRef("a:1", "c", 3, new_fence), turn=turn, fence=new_fence
            )
            await store.put(record)
            got = await store.get("s-fence")
            assert got.turn == turn and got.target.fence == new_fence
            with pytest.raises(Fenced):
                await store.put(SessionRecord("s-fence", [9], fence=old_fence))
            assert (await store.get("s-fence")).tokens == [1, 2, 3]
            await store.delete("s-fence")
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_restarted_peer_is_found_again_within_a_second():
    """After seconds of refused connections, gRPC's default reconnect backoff would leave a channel
    failing fast for seconds more after its peer is back, longer than the SDK's retry budget; the
    channels specdec opens retry the connection at least once a second."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.rpc import channel_options
    from specdec.stack import free_port

    address = f"127.0.0.1:{free_port()}"
    with grpc.insecure_channel(address, options=channel_options(1 << 20)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        down_until = time.monotonic() + 6.5  # several failed connection attempts
        while time.monotonic() < down_until:
            with pytest.raises(grpc.RpcError):
                stub.Check(health_pb2.HealthCheckRequest(), timeout=0.2)
            time.sleep(0.05)
        server = _health_server(address)
        try:
            back = time.monotonic()
            while True:
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=0.2)
                    break
                except grpc.RpcError:
                    time.sleep(0.05)
            assert time.monotonic() - back < 1.5
        finally:
            server.stop(0)


def test_a_replica_that_serves_late_is_found_within_a_second():
    """A coordinator that starts before its replicas (a model loads for seconds) polls their health
    with the same short reconnect backoff, so it starts serving about as soon as they do."""
    from specdec.rpc import wait_ready
    from specdec.stack import free_port

    address = f"127.0.0.1:{free_port()}"

    async def scenario() -> float:
        waiting = asyncio.create_task(wait_ready(address, 30.0))
        await asyncio.sleep(6.5)  # several refused connection attempts
        assert not waiting.done()
        server = _health_server(address)
        try:
            back = time.monotonic()
            await waiting
            return time.monotonic() - back
        finally:
            server.stop(0)

    assert asyncio.run(scenario()) < 1.5


def _health_server(address: str) -> grpc.Server:
    """A started gRPC server on ``address`` whose health service reports SERVING."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(address)
    server.start()
    return server
