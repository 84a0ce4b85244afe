"""The RPCs draft and target services share: Prefill, Release and GetModelInfo over an engine."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from opentelemetry import trace

from specdec.kvcache import CacheTable
from specdec.model_thread import model_executor
from specdec.rpc import call_core
from specdec.tracing import server_span
from specdec.v1 import common_pb2
from specdec.vocab import ModelFacts
from specdec.wire import facts_to_pb


class CacheEngine(Protocol):
    """What the shared RPCs need from a draft or target engine."""

    @property
    def facts(self) -> ModelFacts: ...

    def prefill(self, tokens: list[int], fence: int = 0) -> tuple[str, int]: ...

    def fork(self, source_id: str, tokens: list[int], fence: int = 0) -> tuple[str, int, int]: ...

    def release(self, cache_id: str) -> bool: ...

    @property
    def caches(self) -> CacheTable: ...


class CacheServicer:
    """Mixin servicer: model work runs on one worker thread, since caches and model are not shared."""

    def __init__(
        self, engine: CacheEngine, tracer: trace.Tracer, name: str, executor: ThreadPoolExecutor | None = None
    ) -> None:
        """``executor`` is the thread the engine's model was loaded on (see ``specdec.model_thread``);
        by default a new one."""
        self._engine = engine
        self._tracer = tracer
        self._name = name
        self._executor = executor or model_executor(name)
        self._sweeper: asyncio.Task | None = None

    def sweep_idle_caches(self, idle_s: float) -> None:
        """Drops caches idle for ``idle_s`` even when no call arrives to notice (0: never), so an
        expired session's memory comes back on every replica."""
        if idle_s > 0 and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(idle_s))

    async def _sweep(self, idle_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(30.0, max(0.5, idle_s / 4)))
            await loop.run_in_executor(self._executor, self._engine.caches.expire_idle)

    async def Prefill(self, request: common_pb2.PrefillRequest, context) -> common_pb2.PrefillReply:
        """Creates a session cache over the request's tokens, or (``fork_of``) copied from another cache
        where their tokens match."""
        with server_span(self._tracer, f"{self._name}/Prefill", context) as span:
            span.set_attributes({"specdec.tokens": len(request.tokens), "specdec.forked": bool(request.fork_of)})
            tokens = list(request.tokens)
            if request.fork_of:
                cache_id, committed, copied = await call_core(
                    context, self._executor, lambda: self._engine.fork(request.fork_of, tokens, request.fence)
                )
                return common_pb2.PrefillReply(cache_id=cache_id, committed=committed, copied=copied)
            cache_id, committed = await call_core(
                context, self._executor, lambda: self._engine.prefill(tokens, request.fence)
            )
            return common_pb2.PrefillReply(cache_id=cache_id, committed=committed)

    def session_idle(self, cache_id: str) -> None:
        """The session of ``cache_id`` has no round in flight (its turn ended); a service that batches
        rounds stops waiting for it."""

    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseReply:
        """Drops a session cache; with ``keep_cache``, keeps it and only notes that its session's turn
        ended (``session_idle``)."""
        if request.keep_cache:
            self.session_idle(request.cache_id)
            return common_pb2.ReleaseReply(released=False)
        released = await call_core(context, self._executor, lambda: self._engine.release(request.cache_id))
        return common_pb2.ReleaseReply(released=released)

    async def GetModelInfo(self, request: common_pb2.ModelInfoRequest, context) -> common_pb2.ModelInfo:
        """The facts of the model this service runs."""
        return facts_to_pb(self._engine.facts)
