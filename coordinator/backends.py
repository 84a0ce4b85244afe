"""gRPC clients of the draft and target services, speaking core types to the round loop.

This is the coordinator's one conversion module for internal calls: the round loop never sees a
protocol message. Every call carries a deadline and the current trace context. The replicas here
implement ``coordinator.replicas.DraftBackend`` and ``TargetBackend``.
"""

from __future__ import annotations

from typing import Any

import grpc

from coordinator.coalescing import Coalescer
from coordinator.replicas import (
    BackendRejected,
    BackendUnavailable,
    CacheLost,
    CacheRef,
    DraftResult,
    Fenced,
    Forked,
    HiddenChunk,
    VerifyResult,
)
from specdec.rpc import aio_channel, channel_options
from specdec.sampling_params import Sampling, TokenLogprob
from specdec.tracing import outgoing_metadata, trace_carrier
from specdec.trees import TreeShape, is_chain
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.vocab import ModelFacts
from specdec.wire import facts_from_pb, logprobs_from_pb, pass_load_from_pb, sampling_to_pb


def _translate(service: str, address: str, code: grpc.StatusCode, details: str) -> Exception:
    """The round loop's error for a call that ended with ``code``."""
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return CacheLost(f"{service} at {address}: {details}")
    if code == grpc.StatusCode.ABORTED:
        return Fenced(f"{service} at {address}: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return BackendUnavailable(service, address, f"{code.name}: {details}")
    return BackendRejected(code.name, f"{service} at {address}: {details}", address)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class _Replica:
    """One channel to one replica, with the calls draft and target share."""

    service = ""
    _stub: Any  # the service's generated stub, set by each subclass

    def __init__(
        self,
        address: str,
        timeout_s: float,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None = None,
        tls_name: str | None = None,
    ) -> None:
        """``tls_name``: the name the replica's certificate must carry, when not the address's host."""
        self.address = address
        self.tls_name = tls_name
        self._timeout_s = timeout_s
        self._channel = aio_channel(address, channel_options(max_message_bytes), credentials, tls_name)
        self._in_flight = 0
        self._closed = False

    @property
    def busy(self) -> bool:
        """Whether a call is in flight: closing the channel now would cut it off."""
        return self._in_flight > 0

    def _deadline(self, remaining_s: float | None) -> float:
        return self._timeout_s if remaining_s is None else max(0.001, min(self._timeout_s, remaining_s))

    async def _call(self, method, request, remaining_s: float | None, traced: bool = True):
        """One call with the deadline ``remaining_s`` allows, carrying the current trace context
        unless not ``traced``; its errors translated for the round loop."""
        if self._closed:
            # A replica that left and was closed between two calls of one round: like an outage.
            raise BackendUnavailable(self.service, self.address, "the replica left")
        self._in_flight += 1
        try:
            metadata = outgoing_metadata() if traced else ()
            return await method(request, timeout=self._deadline(remaining_s), metadata=metadata)
        except grpc.aio.AioRpcError as error:
            raise _translate(self.service, self.address, error.code(), error.details() or "") from None
        finally:
            self._in_flight -= 1

    async def prefill(self, tokens: list[int], remaining_s: float | None = None, fence: int = 0) -> CacheRef:
        """Creates a cache over the committed ``tokens`` for the turn holding fencing token ``fence``."""
        request = common_pb2.PrefillRequest(tokens=tokens, fence=fence)
        reply = await self._call(self._stub.Prefill, request, remaining_s)
        return CacheRef(self.address, reply.cache_id, reply.committed, fence)

    async def fork(
        self, source: CacheRef, tokens: list[int], remaining_s: float | None = None, fence: int = 0
    ) -> Forked:
        """Creates a cache over the committed ``tokens`` copying ``source``'s state where their tokens
        match (``PrefillRequest.fork_of``); CacheLost when ``source`` is gone."""
        request = common_pb2.PrefillRequest(tokens=tokens, fence=fence, fork_of=source.cache_id)
        reply = await self._call(self._stub.Prefill, request, remaining_s)
        return Forked(CacheRef(self.address, reply.cache_id, reply.committed, fence), reply.copied)

    async def release(self, cache_id: str, remaining_s: float | None = None) -> None:
        """Drops a cache (best effort)."""
        await self._call(self._stub.Release, common_pb2.ReleaseRequest(cache_id=cache_id), remaining_s)

    async def idle(self, cache_id: str, remaining_s: float | None = None) -> None:
        """The session's turn ended (``ReleaseRequest.keep_cache``): the replica stops waiting for it."""
        request = common_pb2.ReleaseRequest(cache_id=cache_id, keep_cache=True)
        await self._call(self._stub.Release, request, remaining_s)

    async def facts(self, remaining_s: float | None = None) -> ModelFacts:
        """The replica's model facts."""
        return facts_from_pb(await self._call(self._stub.GetModelInfo, common_pb2.ModelInfoRequest(), remaining_s))

    async def close(self) -> None:
        """Closes the channel."""
        self._closed = True
        await self._channel.close()


def hidden_from_message(msg: common_pb2.HiddenStates) -> HiddenChunk | None:
    """The core form of a reply's hidden rows (None when it carries none)."""
    return HiddenChunk(msg.start, msg.dim, msg.fp16) if msg.fp16 else None


def hidden_to_message(chunk: HiddenChunk | None) -> common_pb2.HiddenStates | None:
    """The wire form of hidden rows for a draft call (None: none to send)."""
    return None if chunk is None else common_pb2.HiddenStates(start=chunk.start, dim=chunk.dim, fp16=chunk.fp16)


def _sync(ref: CacheRef, committed: list[int]) -> common_pb2.CacheSync:
    start = min(ref.committed, len(committed))
    return common_pb2.CacheSync(cache_id=ref.cache_id, start=start, tokens=committed[start:], fence=ref.fence)


class DraftReplica(_Replica):
    """A draft service replica."""

    service = "draft"

    def __init__(
        self,
        address: str,
        timeout_s: float,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None = None,
        tls_name: str | None = None,
    ) -> None:
        super().__init__(address, timeout_s, max_message_bytes, credentials, tls_name)
        self._stub = draft_pb2_grpc.DraftServiceStub(self._channel)

    async def propose(
        self,
        ref: CacheRef,
        committed: list[int],
        k: int,
        sampling: Sampling,
        round_index: int,
        remaining_s: float | None,
        hidden: HiddenChunk | None = None,
        min_confidence: float = 0.0,
        ahead: int = 0,
        tree: TreeShape | None = None,
    ) -> DraftResult:
        """Syncs the cache to ``committed`` (and hands over target hidden states) and asks for up to
        ``k`` tokens, fewer where the draft's confidence falls below ``min_confidence``; then up to
        ``ahead`` tokens drafted ahead while the target verifies (``ProposeRequest.ahead``)."""
        request = draft_pb2.ProposeRequest(
            sync=_sync(ref, committed),
            k=k,
            sampling=sampling_to_pb(sampling),
            round=round_index,
            hidden=hidden_to_message(hidden),
            min_confidence=min_confidence,
            ahead=ahead,
        )
        if tree is not None:
            request.tree.CopyFrom(draft_pb2.TreeShape(nodes=tree.nodes, depth=tree.depth, width=tree.width))
        reply = await self._call(self._stub.Propose, request, remaining_s)
        q = [(list(d.token_ids), list(d.probs)) for d in reply.q]
        return DraftResult(
            list(reply.tokens), q, reply.committed, reply.from_ahead, reply.looked_up, tuple(reply.parents)
        )


class TargetReplica(_Replica):
    """A target service replica."""

    service = "target"

    def __init__(
        self,
        address: str,
        timeout_s: float,
        max_message_bytes: int,
        credentials: grpc.ChannelCredentials | None = None,
        tls_name: str | None = None,
    ) -> None:
        super().__init__(address, timeout_s, max_message_bytes, credentials, tls_name)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)
        # The rounds this coordinator's sessions send in one event-loop turn go in one call.
        self._verify_batches: Coalescer[target_pb2.VerifyRequest, target_pb2.VerifyReply] = Coalescer(
            self._verify_batch
        )

    @property
    def busy(self) -> bool:
        """Whether a call is in flight or waits for its batch: closing now would cut it off."""
        return self._in_flight > 0 or self._verify_batches.busy

    async def prefill_with_hidden(
        self,
        tokens: list[int],
        remaining_s: float | None,
        with_hidden: bool,
        fence: int = 0,
        feed_now: bool = False,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[CacheRef, HiddenChunk | None]:
        """``prefill``, also returning the hidden states of the fed positions (and the outputs of
        ``side_layers``) when ``with_hidden``; ``feed_now`` forbids a busy target to defer feeding the prompt."""
        ref, hidden, _ = await self._prefill(tokens, remaining_s, with_hidden, fence, feed_now, side_layers)
        return ref, hidden

    async def prefill_scored(
        self,
        tokens: list[int],
        remaining_s: float | None,
        top: int,
        with_hidden: bool,
        fence: int = 0,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[CacheRef, HiddenChunk | None, list[TokenLogprob]]:
        """``prefill_with_hidden`` fed now into a fresh cache, also returning the logprob of each of
        ``tokens[1:]`` under the target with ``top`` alternatives (``PrefillRequest.prompt_logprobs``)."""
        return await self._prefill(tokens, remaining_s, with_hidden, fence, True, side_layers, top)

    async def _prefill(
        self,
        tokens: list[int],
        remaining_s: float | None,
        with_hidden: bool,
        fence: int,
        feed_now: bool,
        side_layers: tuple[int, ...],
        prompt_logprobs: int | None = None,
    ) -> tuple[CacheRef, HiddenChunk | None, list[TokenLogprob]]:
        """One Prefill call: the cache, the fed hidden states (when ``with_hidden``) and the prompt's
        logprobs (empty unless ``prompt_logprobs`` asked for them)."""
        request = common_pb2.PrefillRequest(
            tokens=tokens,
            return_hidden=with_hidden,
            fence=fence,
            feed_now=feed_now,
            hidden_side_layers=side_layers if with_hidden else (),
            prompt_logprobs=prompt_logprobs,
        )
        reply = await self._call(self._stub.Prefill, request, remaining_s)
        ref = CacheRef(self.address, reply.cache_id, reply.committed, fence)
        hidden = hidden_from_message(reply.hidden) if with_hidden else None
        return ref, hidden, logprobs_from_pb(reply.prompt_logprobs)

    async def verify(
        self,
        ref: CacheRef,
        committed: list[int],
        draft: DraftResult | None,
        sampling: Sampling,
        round_index: int,
        remaining_s: float | None,
        with_hidden: bool = False,
        side_layers: tuple[int, ...] = (),
        top_logprobs: int | None = None,
    ) -> VerifyResult:
        """Syncs the cache to ``committed``, verifies the draft tokens, commits accepted + 1 (returning the
        fed positions' hidden states, then the outputs of ``side_layers``, when ``with_hidden``; each
        committed token's logprob with ``top_logprobs`` alternatives, when set)."""
        request = target_pb2.VerifyRequest(
            sync=_sync(ref, committed),
            sampling=sampling_to_pb(sampling),
            round=round_index,
            return_hidden=with_hidden,
            hidden_side_layers=side_layers if with_hidden else (),
            top_logprobs=top_logprobs,
        )
        if draft is not None:
            request.draft_tokens.extend(draft.tokens)
            request.q.extend(draft_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in draft.q)
            request.draft_parents.extend(draft.parents)
        reply = await self._verify_one(request, remaining_s)
        load = None
        if reply.HasField("load"):
            load = pass_load_from_pb(reply.load)
        return VerifyResult(
            reply.accepted,
            list(reply.tokens),
            reply.committed,
            hidden_from_message(reply.hidden) if with_hidden else None,
            load,
            tuple(reply.accepted_nodes) if draft is not None and not is_chain(draft.parents) else None,
            logprobs_from_pb(reply.logprobs) if top_logprobs is not None else None,
        )

    async def _verify_one(self, request: target_pb2.VerifyRequest, remaining_s: float | None) -> target_pb2.VerifyReply:
        """Verifies ``request`` in the next VerifyBatch call (``coordinator.coalescing``), with its
        round's trace context and its own deadline."""
        request.trace_context.update(trace_carrier())
        timeout_s = self._deadline(remaining_s)
        try:
            return await self._verify_batches.call(request, timeout_s)
        except TimeoutError:
            detail = f"DEADLINE_EXCEEDED: no verdict in {timeout_s:.3g} s"
            raise BackendUnavailable(self.service, self.address, detail) from None

    async def _verify_batch(
        self, requests: list[target_pb2.VerifyRequest], timeout_s: float
    ) -> list[target_pb2.VerifyReply | Exception]:
        """One VerifyBatch call: each request's reply, or the error a Verify of it alone would raise."""
        batch = target_pb2.VerifyBatchRequest(requests=requests)
        reply = await self._call(self._stub.VerifyBatch, batch, timeout_s, traced=False)
        return [
            result.reply
            if result.HasField("reply")
            else _translate(
                self.service,
                self.address,
                _STATUS_BY_NUMBER.get(result.error.code, grpc.StatusCode.UNKNOWN),
                result.error.message,
            )
            for result in reply.results
        ]
