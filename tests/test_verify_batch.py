"""Batched verify calls: the coalescer that gathers a coordinator's rounds, the target's VerifyBatch,
and the coordinator's target replica that speaks it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from harness import InProcessStack

from coordinator.backends import TargetReplica
from coordinator.coalescing import Coalescer
from coordinator.replicas import BackendRejected, BackendUnavailable, CacheLost, CacheRef
from draft_service.engine import ModelDrafter
from specdec.sampling_params import Sampling
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine

# --- the coalescer, alone --------------------------------------------------------------------------


class Sends:
    """A batched ``send`` that records its batches and answers each request by doubling it; a
    negative request fails alone, and ``fail_all`` fails the whole batch."""

    def __init__(self, delay_s: float = 0.0, fail_all: bool = False) -> None:
        self.batches: list[list[int]] = []
        self.timeouts: list[float] = []
        self._delay_s = delay_s
        self._fail_all = fail_all

    async def __call__(self, requests: list[int], timeout_s: float) -> list[int | Exception]:
        self.batches.append(list(requests))
        self.timeouts.append(timeout_s)
        await asyncio.sleep(self._delay_s)
        if self._fail_all:
            raise ConnectionError("the batch failed")
        return [ValueError(f"bad {r}") if r < 0 else 2 * r for r in requests]


def test_calls_made_in_one_turn_share_one_send_and_get_their_own_answers():
    async def main():
        sends = Sends()
        coalescer: Coalescer[int, int] = Coalescer(sends)
        answers = await asyncio.gather(*(coalescer.call(r, 5.0 + r) for r in (1, 2, 3)))
        return sends, answers

    sends, answers = asyncio.run(main())
    assert sends.batches == [[1, 2, 3]]
    assert answers == [2, 4, 6]
    assert sends.timeouts == [8.0]  # the longest: no call is cut short by another's deadline


def test_a_lone_call_is_sent_at_once_and_later_calls_go_in_later_batches():
    async def main():
        sends = Sends()
        coalescer: Coalescer[int, int] = Coalescer(sends)
        first = await coalescer.call(1, 5.0)
        rest = await asyncio.gather(coalescer.call(2, 5.0), coalescer.call(3, 5.0))
        return sends, first, rest

    sends, first, rest = asyncio.run(main())
    assert sends.batches == [[1], [2, 3]]
    assert (first, rest) == (2, [4, 6])


def test_one_calls_error_fails_that_call_only():
    async def main():
        coalescer: Coalescer[int, int] = Coalescer(Sends())
        return await asyncio.gather(*(coalescer.call(r, 5.0) for r in (1, -1, 3)), return_exceptions=True)

    first, bad, last = asyncio.run(main())
    assert (first, last) == (2, 6)
    assert isinstance(bad, ValueError) and str(bad) == "bad -1"


def test_a_failed_batch_fails_each_of_its_calls():
    async def main():
        coalescer: Coalescer[int, int] = Coalescer(Sends(fail_all=True))
        return await asyncio.gather(*(coalescer.call(r, 5.0) for r in (1, 2)), return_exceptions=True)

    assert all(isinstance(a, ConnectionError) for a in asyncio.run(main()))


def test_a_call_that_times_out_or_is_cancelled_leaves_the_others_their_answers():
    async def main():
        coalescer: Coalescer[int, int] = Coalescer(Sends(delay_s=0.2))
        hurried = asyncio.ensure_future(coalescer.call(1, 0.05))
        cancelled = asyncio.ensure_future(coalescer.call(2, 5.0))
        patient = asyncio.ensure_future(coalescer.call(3, 5.0))
        await asyncio.sleep(0.1)
        cancelled.cancel()
        results = await asyncio.gather(hurried, cancelled, patient, return_exceptions=True)
        return results, coalescer.busy

    (hurried, cancelled, patient), busy = asyncio.run(main())
    assert isinstance(hurried, TimeoutError)
    assert isinstance(cancelled, asyncio.CancelledError)
    assert patient == 6
    assert not busy


# --- the target's VerifyBatch and the replica that calls it ----------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_draft, tiny_dir, redis_url):
    """A target server alone: the tests are its callers."""
    s = InProcessStack(TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url)
    s.target_address = s.add_target(s.target_engine)
    yield s
    s.close()


PROMPTS = ([3, 4, 5], [6, 7, 8, 9], [10, 11])


def _prefill(stub, tokens: list[int]) -> str:
    return stub.Prefill(common_pb2.PrefillRequest(tokens=tokens), timeout=10).cache_id


def _round(cache_id: str, start: int, drafts: list[int], temperature: float = 0.0) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        sync=common_pb2.CacheSync(cache_id=cache_id, start=start),
        draft_tokens=drafts,
        sampling=common_pb2.SamplingParams(temperature=temperature, top_p=1.0),
    )


def test_a_batch_verifies_its_rounds_in_one_pass_as_lone_calls_would(stack):
    with grpc.insecure_channel(stack.target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        lone = [stub.Verify(_round(_prefill(stub, p), len(p), [5, 6]), timeout=10) for p in PROMPTS]
        batch = [_round(_prefill(stub, p), len(p), [5, 6]) for p in PROMPTS]
        reply = stub.VerifyBatch(target_pb2.VerifyBatchRequest(requests=batch), timeout=10)
    assert [r.WhichOneof("outcome") for r in reply.results] == ["reply"] * 3
    batched = [r.reply for r in reply.results]
    assert [(b.accepted, list(b.tokens), b.committed) for b in batched] == [
        (a.accepted, list(a.tokens), a.committed) for a in lone
    ]
    assert all(b.load.sessions == 3 and b.load.rows == 9 for b in batched)  # one shared pass


def test_a_requests_error_in_a_batch_is_its_own_and_its_session_survives(stack):
    with grpc.insecure_channel(stack.target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        good, other = (_prefill(stub, p) for p in PROMPTS[:2])
        requests = [
            _round(good, 3, [5]),
            _round("no-such-cache", 3, [5]),
            _round(other, 4, [5], temperature=-1.0),
        ]
        reply = stub.VerifyBatch(target_pb2.VerifyBatchRequest(requests=requests), timeout=10)
        assert reply.results[0].WhichOneof("outcome") == "reply"
        missing, invalid = reply.results[1].error, reply.results[2].error
        assert missing.code == grpc.StatusCode.NOT_FOUND.value[0] and "no-such-cache" in missing.message
        assert invalid.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "temperature" in invalid.message
        failed = [sp for sp in stack.exporter.get_finished_spans() if sp.status.description == missing.message]
        assert [sp.name for sp in failed] == ["TargetService/Verify"]
        # The refused request's session is intact: its next round verifies.
        again = stub.VerifyBatch(target_pb2.VerifyBatchRequest(requests=[_round(other, 4, [5])]), timeout=10)
        assert again.results[0].reply.committed == 5
        assert not stub.VerifyBatch(target_pb2.VerifyBatchRequest(), timeout=10).results


def test_the_replicas_concurrent_rounds_go_in_one_call_with_their_own_errors(stack):
    async def main():
        replica = TargetReplica(stack.target_address, timeout_s=10.0, max_message_bytes=1 << 22)
        calls = 0
        send = replica._stub.VerifyBatch

        async def counted(request, **kwargs):
            nonlocal calls
            calls += 1
            return await send(request, **kwargs)

        replica._stub.VerifyBatch = counted
        try:
            refs = [await replica.prefill(p) for p in PROMPTS[:2]]
            lost = CacheRef(refs[0].address, "no-such-cache", 3, 0)
            greedy = Sampling(temperature=0.0)
            results = await asyncio.gather(
                *(replica.verify(ref, p, None, greedy, 0, 10.0) for ref, p in zip([*refs, lost], PROMPTS)),
                return_exceptions=True,
            )
            return calls, results, replica.busy
        finally:
            await replica.close()

    calls, (first, second, missing), busy = stack.run(main())
    assert calls == 1
    assert (first.committed, second.committed) == (4, 5)
    assert first.load.sessions == 2  # the lost cache's round never reached the pass
    assert isinstance(missing, CacheLost) and "no-such-cache" in str(missing)
    assert not busy


def test_the_replica_maps_a_batched_refusal_and_an_outage_as_lone_calls_did(stack):
    async def main():
        replica = TargetReplica(stack.target_address, timeout_s=10.0, max_message_bytes=1 << 22)
        try:
            ref = await replica.prefill([3, 4, 5])
            with pytest.raises(BackendRejected) as refused:
                await replica.verify(ref, [3, 4, 5], None, Sampling(temperature=0.0, top_k=-1), 0, 10.0)
        finally:
            await replica.close()
        gone = TargetReplica("127.0.0.1:1", timeout_s=2.0, max_message_bytes=1 << 22)
        try:
            with pytest.raises(BackendUnavailable):
                await gone.verify(ref, [3, 4, 5], None, Sampling(temperature=0.0), 0, 2.0)
        finally:
            await gone.close()
        return refused.value

    refused = stack.run(main())
    assert refused.status == "INVALID_ARGUMENT"
