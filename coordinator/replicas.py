"""What the round loop knows of draft and target replicas: core types, errors and the replica set.

No gRPC here. ``coordinator.backends`` implements the backends over gRPC; each service's
``inprocess`` module implements them over its engine in the same process, so the round loop and the
speculation policy run in tests without a network.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

from specdec.batching import PassLoad
from specdec.errors import CacheBehind, CacheBudgetExceeded, CacheNotFound, StaleFence
from specdec.sampling_params import Sampling, TokenLogprob
from specdec.trees import TreeShape
from specdec.vocab import ModelFacts


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
    """The replica refused the call for a reason that retrying will not fix.

    ``status`` is the replica's status name (``"INVALID_ARGUMENT"``, ``"RESOURCE_EXHAUSTED"``, ...),
    which the coordinator's own reply repeats.
    """

    def __init__(self, status: str, detail: str, address: str = "") -> None:
        super().__init__(detail)
        self.status = status
        self.address = address


R = TypeVar("R", bound="Replica")
# Seconds a replica that failed a call rests before it is probed.
REST_S = 5.0
# The longest rest, in multiples of the first: reached after four failures in a row.
MAX_REST_FACTOR = 8


class ReplicaSet(Generic[R]):
    """One service's replicas: which failed lately, and how many of this coordinator's requests each
    holds a cache for right now.

    A replica that failed rests, ``rest_s`` after its first failure and twice as long after each
    further one in a row (up to ``MAX_REST_FACTOR`` times), so a hung replica draws a stall now and
    then, not every few seconds. When its rest ends it is on probation: no new or running session's
    call goes to it (unless no member is healthy) until a probe (``probes_due``, a cheap call with a
    short deadline) or any other call succeeds. A new cache goes to the healthy replica holding the
    fewest running requests, ties taken in turn.

    Members may join and leave (discovery). One that left is retired: never usable or picked again,
    so its sessions move, but its channel stays open until no call is in flight on it.
    """

    def __init__(self, replicas: Sequence[R], rest_s: float = REST_S) -> None:
        self.by_address: dict[str, R] = {r.address: r for r in replicas}
        self._rest_s = rest_s
        self._down_until: dict[str, float] = {}
        self._failures: Counter[str] = Counter()  # failed calls in a row, until one succeeds
        self._probing: set[str] = set()
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
        self._failures.pop(replica.address, None)

    def retire(self, address: str) -> R | None:
        """The replica at ``address`` leaves (None when it is no member)."""
        replica = self.by_address.pop(address, None)
        if replica is not None:
            self._retired.append(replica)
            self._down_until.pop(address, None)
            self._failures.pop(address, None)
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
        """Rests ``address`` from now, longer for each failure in a row (a replica that already left
        needs no rest)."""
        if address in self.by_address:
            self._failures[address] += 1
            factor = min(2 ** (self._failures[address] - 1), MAX_REST_FACTOR)
            self._down_until[address] = time.monotonic() + self._rest_s * factor

    def succeeded(self, address: str) -> None:
        """A call to ``address`` succeeded: it is healthy again."""
        if address in self._failures:
            del self._failures[address]
            self._down_until.pop(address, None)

    def rest_s(self, address: str) -> float:
        """Seconds left of the replica's rest (0 when it takes work or awaits its probe)."""
        return max(0.0, self._down_until.get(address, 0.0) - time.monotonic())

    def probes_due(self) -> list[R]:
        """Members whose rest has ended and that await a probe; each is marked as being probed until
        ``probed`` reports the outcome."""
        now = time.monotonic()
        due = [
            a
            for a in self._failures
            if a in self.by_address and a not in self._probing and now >= self._down_until.get(a, 0.0)
        ]
        self._probing.update(due)
        return [self.by_address[a] for a in due]

    def probed(self, address: str, ok: bool) -> None:
        """A probe of ``address`` ended: it is healthy again, or rests longer."""
        self._probing.discard(address)
        if ok:
            self.succeeded(address)
        else:
            self.failed(address)

    def usable(self, address: str) -> bool:
        """True for a known replica that neither rests nor awaits its probe."""
        return address in self.by_address and not self._failures.get(address)

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
class Forked:
    """A cache a fork created, and the committed positions (from the first) whose state it copied
    rather than computed (a feature draft's: the positions it holds target features for)."""

    ref: CacheRef
    copied: int


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
    # A token tree: each token's parent (``specdec.trees``); empty for a chain.
    parents: tuple[int, ...] = ()


@dataclass(frozen=True)
class VerifyResult:
    """What the target committed this round, and the hidden states it fed when asked for them."""

    accepted: int
    tokens: list[int]
    committed: int
    hidden: HiddenChunk | None = None
    # The batched pass it ran in; None from a target that reports none.
    load: PassLoad | None = None
    # A tree's accepted nodes, root to leaf; None for a chain.
    path: tuple[int, ...] | None = None
    # When asked for: each committed token's logprob under the target, in order.
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class HiddenChunk:
    """Consecutive target hidden-state rows from position ``start``, each ``dim`` fp16 values, as the
    bytes they travel in (row-major). The coordinator passes them on undecoded."""

    start: int
    dim: int
    fp16: bytes

    @property
    def rows(self) -> int:
        """Rows held."""
        return len(self.fp16) // (2 * self.dim) if self.dim else 0


class Replica(Protocol):
    """What every replica offers, whichever service it belongs to."""

    address: str

    @property
    def busy(self) -> bool:
        """Whether a call is in flight: closing it now would cut that call off."""

    async def prefill(self, tokens: list[int], remaining_s: float | None = None, fence: int = 0) -> CacheRef:
        """Creates a cache over the committed ``tokens`` for the turn holding fencing token ``fence``."""

    async def fork(
        self, source: CacheRef, tokens: list[int], remaining_s: float | None = None, fence: int = 0
    ) -> Forked:
        """Creates a cache over the committed ``tokens`` on this replica (the one holding ``source``)
        that copies ``source``'s state where their tokens match (``PrefillRequest.fork_of``), for the
        turn holding fencing token ``fence``. CacheLost when ``source`` is gone."""

    async def release(self, cache_id: str, remaining_s: float | None = None) -> None:
        """Drops a cache (best effort)."""

    async def idle(self, cache_id: str, remaining_s: float | None = None) -> None:
        """Tells the replica that the session holding ``cache_id`` has no round in flight (its turn
        ended), so its batched passes stop waiting for it; the cache stays (best effort)."""

    async def facts(self, remaining_s: float | None = None) -> ModelFacts:
        """The replica's model facts."""

    async def close(self) -> None:
        """Releases the connection (or whatever the replica holds)."""


class DraftBackend(Replica, Protocol):
    """A draft replica: proposes tokens after a session's committed ones."""

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
        """Syncs the cache to ``committed`` (taking in target hidden states) and proposes up to ``k``
        tokens, fewer where the draft's confidence falls below ``min_confidence``; then drafts up to
        ``ahead`` tokens ahead while the target verifies. With ``tree``, proposes a token tree of that
        shape instead (``specdec.trees``)."""


class TargetBackend(Replica, Protocol):
    """A target replica: verifies proposals and commits tokens."""

    async def prefill_with_hidden(
        self,
        tokens: list[int],
        remaining_s: float | None,
        with_hidden: bool,
        fence: int = 0,
        feed_now: bool = False,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[CacheRef, HiddenChunk | None]:
        """``prefill``, also returning the fed positions' hidden states when ``with_hidden``;
        ``feed_now`` forbids a busy target to defer feeding the prompt."""

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
        """Syncs the cache to ``committed``, verifies the draft's tokens and commits accepted + 1 (with
        each committed token's logprob and ``top_logprobs`` alternatives, when set)."""


@runtime_checkable
class PromptScorer(Protocol):
    """A target replica that also reports a prompt's logprobs from its prefill pass (gRPC and in process);
    one that does not cannot serve a request for them."""

    async def prefill_scored(
        self,
        tokens: list[int],
        remaining_s: float | None,
        top: int,
        with_hidden: bool,
        fence: int = 0,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[CacheRef, HiddenChunk | None, list[TokenLogprob]]:
        """``prefill_with_hidden`` into a fresh cache fed now, also returning the logprob of each of
        ``tokens[1:]`` under the target (with ``top`` alternatives)."""


def core_error(service: str, address: str, exc: Exception) -> Exception:
    """The round loop's view of an error a service's engine raised in this process: what the gRPC
    client makes of the status ``specdec.rpc`` would have sent for it."""
    if isinstance(exc, (CacheNotFound, CacheBehind)):
        return CacheLost(f"{service} at {address}: {exc}")
    if isinstance(exc, StaleFence):
        return Fenced(f"{service} at {address}: {exc}")
    if isinstance(exc, CacheBudgetExceeded):
        return BackendRejected("RESOURCE_EXHAUSTED", f"{service} at {address}: {exc}", address)
    if isinstance(exc, ValueError):
        return BackendRejected("INVALID_ARGUMENT", f"{service} at {address}: {exc}", address)
    return exc
