"""Clients of the draft and target services, speaking core types to the round loop.

This is the coordinator's one conversion module for internal calls: the round loop never sees a
protocol message. Every call carries a deadline and the current trace context.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from specdec.batching import PassLoad
from specdec.vocab import ModelFacts
from specdec.rpc import aio_channel, channel_options
from specdec.sampling_params import Sampling
from specdec.tracing import outgoing_metadata
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.wire import facts_from_pb, pass_load_from_pb, sampling_to_pb


class BackendUnavailable(RuntimeError):
    """A draft or target replica did not answer in time or refused the connection."""

    def __init__(self, service: str, address: str, detail: str) -> None:
        super().__init__(f"{service} service at {address} is unavailable: {detail}")
        self.service = service
        self.address = address


class CacheLost(RuntimeError):
    """The replica no longer holds the session's cache as expected; prefill again."""


class Fenced(RuntimeError):
    """A newer turn holds the session (its fencing token is newer): this turn's writes and cache
    operations are stale and refused."""


class BackendRejected(RuntimeError):
    """The replica refused the call for a reason that retrying will not fix."""

    def __init__(self, code: grpc.StatusCode, detail: str, address: str = "") -> None:
        super().__init__(detail)
        self.code = code
        self.address = address


R = TypeVar("R", bound="_Replica")
# Seconds a replica that failed a call rests before it gets work again.
REST_S = 5.0


class ReplicaSet(Generic[R]):
    """One service's replicas: which failed lately, and how many of this coordinator's requests each
    holds a cache for right now.

    A replica that failed rests ``rest_s``, then gets work again (its next call is the probe). A new
    cache goes to the healthy replica holding the fewest running requests, ties taken in turn.

    Members may join and leave (discovery). One that left is retired: never usable or picked again,
    so its sessions move, but its channel stays open until no call is in flight on it.
    """

    def __init__(self, replicas: Sequence[R], rest_s: float = REST_S) -> None:
        self.by_address: dict[str, R] = {r.address: r for r in replicas}
        self._rest_s = rest_s
        self._down_until: dict[str, float] = {}
        self._running: Counter[str] = Counter()
        self._turn = 0
        self._retired: list[R] = []

    def __len__(self) -> int:
        return len(self.by_address)

    def add(self, replica: R) -> None:
        """A replica joins; it takes work at once."""
        if replica.address in self.by_address:
            raise ValueError(f"{replica.address} is already a member")
        self.by_address[replica.address] = replica
        self._down_until.pop(replica.address, None)

    def retire(self, address: str) -> R | None:
        """The replica at ``address`` leaves (None when it is no member)."""
        replica = self.by_address.pop(address, None)
        if replica is not None:
            self._retired.append(replica)
            self._down_until.pop(address, None)
            if not self._running[address]:
                # Kept while requests still hold it: their release must balance the count.
                del self._running[address]
        return replica

    def find(self, address: str) -> R | None:
        """The member at ``address``, else a retired replica there whose channel is still open (a
        call already placed there may finish), else None."""
        member = self.by_address.get(address)
        if member is not None:
            return member
        return next((r for r in reversed(self._retired) if r.address == address), None)

    def sweep(self) -> list[R]:
        """Retired replicas with no call in flight, dropped from the set for the caller to close."""
        idle = [r for r in self._retired if not r.busy]
        self._retired = [r for r in self._retired if r.busy]
        return idle

    def everyone(self) -> list[R]:
        """Members and retired replicas not yet swept: every open channel."""
        return [*self.by_address.values(), *self._retired]

    def failed(self, address: str) -> None:
        """Rests ``address`` from now (a replica that already left needs no rest)."""
        if address in self.by_address:
            self._down_until[address] = time.monotonic() + self._rest_s

    def usable(self, address: str) -> bool:
        """True for a known replica that is not resting."""
        return address in self.by_address and time.monotonic() >= self._down_until.get(address, 0.0)

    def stays(self, address: str) -> bool:
        """Whether a session keeps its cache on ``address``: the replica is healthy, or it rests while
        no member is healthy (it may well be back, and its cache with it; leaving would only rebuild
        the cache on a replica resting as long)."""
        return self.usable(address) or (address in self.by_address and not any(map(self.usable, self.by_address)))

    def pick(self, current: CacheRef | None, probe: bool = False) -> R | None:
        """The replica holding ``current`` while it is healthy, else the least busy healthy one for a
        new cache. When every replica rests: with ``probe`` the one whose rest ends first (one failed
        call rests a replica that may be back at once, and with no other one to go to, not trying it
        would fail every session on it), else None."""
        if current is not None and self.usable(current.address):
            return self.by_address[current.address]
        healthy = [a for a in self.by_address if self.usable(a)]
        if not healthy:
            if probe and self.by_address:
                return self.by_address[min(self.by_address, key=lambda a: self._down_until.get(a, 0.0))]
            return None
        self._turn += 1
        fewest = min(self._running[a] for a in healthy)
        least = [a for a in healthy if self._running[a] == fewest]
        return self.by_address[least[self._turn % len(least)]]

    def hold(self, old: str | None, new: str | None) -> None:
        """A running request moved from replica ``old`` to ``new`` (None: none)."""
        if old != new:
            if old is not None:
                self._running[old] -= 1
                if not self._running[old] and old not in self.by_address:
                    del self._running[old]
            if new is not None:
                self._running[new] += 1


@dataclass(frozen=True)
class CacheRef:
    """Where a session's cache lives on one service, and how many committed tokens it holds."""

    address: str
    cache_id: str
    committed: int
    # The fencing token of the turn that uses this cache; services refuse older ones.
    fence: int = 0


@dataclass(frozen=True)
class DraftResult:
    """Tokens a draft proposed and, when sampling, the sparse q of each."""

    tokens: list[int]
    q: list[tuple[list[int], list[float]]]
    committed: int
    # Drafted ahead, while the target verified the round before.
    from_ahead: bool = False
    # Prompt lookup answered in the draft service in place of its model (``ProposeReply.looked_up``).
    looked_up: bool = False


@dataclass(frozen=True)
class VerifyResult:
    """What the target committed this round, and the hidden states it fed when asked for them."""

    accepted: int
    tokens: list[int]
    committed: int
    hidden: common_pb2.HiddenStates | None = None
    # The batched pass it ran in; None from a target that reports none.
    load: PassLoad | None = None


def _translate(service: str, address: str, error: grpc.aio.AioRpcError) -> Exception:
    code = error.code()
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        return CacheLost(f"{service} at {address}: {error.details()}")
    if code == grpc.StatusCode.ABORTED:
        return Fenced(f"{service} at {address}: {error.details()}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return BackendUnavailable(service, address, f"{code.name}: {error.details()}")
    return BackendRejected(code, f"{service} at {address}: {error.details()}", address)


class _Replica:
    """One channel to one replica, with the calls draft and target share."""

    service = ""

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, tls_name: str | None = None) -> None:
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

    async def _call(self, method, request, remaining_s: float | None):
        if self._closed:
            # A replica that left and was closed between two calls of one round: like an outage.
            raise BackendUnavailable(self.service, self.address, "the replica left")
        self._in_flight += 1
        try:
            return await method(request, timeout=self._deadline(remaining_s), metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as error:
            raise _translate(self.service, self.address, error) from None
        finally:
            self._in_flight -= 1

    async def prefill(self, tokens: list[int], remaining_s: float | None = None, fence: int = 0) -> CacheRef:
        """Creates a cache over the committed ``tokens`` for the turn holding fencing token ``fence``."""
        request = common_pb2.PrefillRequest(tokens=tokens, fence=fence)
        reply = await self._call(self._stub.Prefill, request, remaining_s)
        return CacheRef(self.address, reply.cache_id, reply.committed, fence)

    async def release(self, cache_id: str, remaining_s: float | None = None) -> None:
        """Drops a cache (best effort)."""
        await self._call(self._stub.Release, common_pb2.ReleaseRequest(cache_id=cache_id), remaining_s)

    async def facts(self, remaining_s: float | None = None) -> ModelFacts:
        """The replica's model facts."""
        return facts_from_pb(await self._call(self._stub.GetModelInfo, common_pb2.ModelInfoRequest(), remaining_s))

    async def close(self) -> None:
        """Closes the channel."""
        self._closed = True
        await self._channel.close()


def _sync(ref: CacheRef, committed: list[int]) -> common_pb2.CacheSync:
    start = min(ref.committed, len(committed))
    return common_pb2.CacheSync(cache_id=ref.cache_id, start=start, tokens=committed[start:], fence=ref.fence)


class DraftReplica(_Replica):
    """A draft service replica."""

    service = "draft"

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, tls_name: str | None = None) -> None:
        super().__init__(address, timeout_s, max_message_bytes, credentials, tls_name)
        self._stub = draft_pb2_grpc.DraftServiceStub(self._channel)

    async def propose(
        self, ref: CacheRef, committed: list[int], k: int, sampling: Sampling, round_index: int,
        remaining_s: float | None, hidden: common_pb2.HiddenStates | None = None, min_confidence: float = 0.0,
        ahead: int = 0,
    ) -> DraftResult:
        """Syncs the cache to ``committed`` (and hands over target hidden states) and asks for up to
        ``k`` tokens, fewer where the draft's confidence falls below ``min_confidence``; then up to
        ``ahead`` tokens drafted ahead while the target verifies (``ProposeRequest.ahead``)."""
        request = draft_pb2.ProposeRequest(
            sync=_sync(ref, committed), k=k, sampling=sampling_to_pb(sampling), round=round_index, hidden=hidden,
            min_confidence=min_confidence, ahead=ahead,
        )
        reply = await self._call(self._stub.Propose, request, remaining_s)
        q = [(list(d.token_ids), list(d.probs)) for d in reply.q]
        return DraftResult(list(reply.tokens), q, reply.committed, reply.from_ahead, reply.looked_up)


class TargetReplica(_Replica):
    """A target service replica."""

    service = "target"

    def __init__(self, address: str, timeout_s: float, max_message_bytes: int,
                 credentials: grpc.ChannelCredentials | None = None, tls_name: str | None = None) -> None:
        super().__init__(address, timeout_s, max_message_bytes, credentials, tls_name)
        self._stub = target_pb2_grpc.TargetServiceStub(self._channel)

    async def prefill_with_hidden(
        self, tokens: list[int], remaining_s: float | None, with_hidden: bool, fence: int = 0, feed_now: bool = False,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[CacheRef, common_pb2.HiddenStates | None]:
        """``prefill``, also returning the hidden states of the fed positions (and the outputs of
        ``side_layers``) when ``with_hidden``; ``feed_now`` forbids a busy target to defer feeding the prompt."""
        request = common_pb2.PrefillRequest(tokens=tokens, return_hidden=with_hidden, fence=fence, feed_now=feed_now,
                                            hidden_side_layers=side_layers if with_hidden else ())
        reply = await self._call(self._stub.Prefill, request, remaining_s)
        return CacheRef(self.address, reply.cache_id, reply.committed, fence), (reply.hidden if with_hidden else None)

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
    ) -> VerifyResult:
        """Syncs the cache to ``committed``, verifies the draft tokens, commits accepted + 1 (returning the
        fed positions' hidden states, then the outputs of ``side_layers``, when ``with_hidden``)."""
        request = target_pb2.VerifyRequest(
            sync=_sync(ref, committed), sampling=sampling_to_pb(sampling), round=round_index, return_hidden=with_hidden,
            hidden_side_layers=side_layers if with_hidden else (),
        )
        if draft is not None:
            request.draft_tokens.extend(draft.tokens)
            request.q.extend(draft_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in draft.q)
        reply = await self._call(self._stub.Verify, request, remaining_s)
        load = None
        if reply.HasField("load"):
            load = pass_load_from_pb(reply.load)
        return VerifyResult(
            reply.accepted, list(reply.tokens), reply.committed, reply.hidden if with_hidden else None, load
        )
