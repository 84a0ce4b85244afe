"""Runs target, draft and coordinator servers in this process, on one background event loop.

Servers bind 127.0.0.1:0; tests talk to them with the real SDK over real gRPC. Every span goes to
one in-memory exporter so tests can check trace shape across all three services.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator.rounds import RoundLoop
from coordinator.server import start_coordinator
from draft_service.engine import DraftEngine
from draft_service.server import start_draft
from specdec.config import CoordinatorConfig, DraftConfig, ModelConfig, ServerConfig, TargetConfig
from specdec.metrics import CoordinatorMetrics
from target_service.engine import TargetEngine
from target_service.server import start_target


class InProcessStack:
    """Target, draft and any number of coordinators on a private event loop thread."""

    def __init__(
        self,
        target: TargetEngine,
        draft: DraftEngine,
        tokenizer_path: Path,
        redis_url: str,
        services: ServerConfig | None = None,
        target_config: TargetConfig | None = None,
    ) -> None:
        """``services`` is how target and draft listen (for example over TLS); default: plaintext loopback.
        ``target_config`` sets the target servers' other settings (its ``server`` is ``services``)."""
        self.target_engine = target
        self._services = services or ServerConfig()
        self._target_config = replace(target_config or TargetConfig(), server=self._services)
        self.draft_engine = draft
        self.exporter = InMemorySpanExporter()
        self._provider = TracerProvider(resource=Resource.create({"service.name": "specdec-test"}))
        self._provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self._tokenizer_path = tokenizer_path
        self._redis_url = redis_url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._servers = []
        self._round_loops = []
        self.target_address = self.draft_address = ""
        self.coordinators: list[str] = []

    def run(self, coro, timeout: float = 120.0):
        """Runs a coroutine on the stack's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, **coordinator) -> InProcessStack:
        """Starts target, draft and one coordinator (``coordinator``: CoordinatorConfig overrides)."""
        self.target_address = self.add_target(self.target_engine)
        self.draft_address = self.add_draft(self.draft_engine)
        self.add_coordinator(**coordinator)
        return self

    def add_target(self, engine: TargetEngine) -> str:
        """Starts one more target server over ``engine``; returns its address."""
        tracer = self._provider.get_tracer("specdec.target")
        running = self.run(start_target(self._target_config, engine, tracer))
        self._servers.append(running)
        return f"127.0.0.1:{running.port}"

    def add_draft(self, engine: DraftEngine) -> str:
        """Starts one more draft server over ``engine``; returns its address."""
        tracer = self._provider.get_tracer("specdec.draft")
        running = self.run(start_draft(DraftConfig(server=self._services), engine, tracer))
        self._servers.append(running)
        return f"127.0.0.1:{running.port}"

    def add_coordinator(self, metrics: CoordinatorMetrics | None = None, kubernetes_api=None, **overrides) -> str:
        """Starts one more coordinator over the same services and Redis (recording into ``metrics``
        when given, discovering k8s:/// replicas through ``kubernetes_api``); returns its address."""
        config = CoordinatorConfig(
            draft_addresses=overrides.pop("draft_addresses", (self.draft_address,)),
            target_addresses=overrides.pop("target_addresses", (self.target_address,)),
            tokenizer=ModelConfig(model=str(self._tokenizer_path)),
            redis_url=self._redis_url,
            startup_timeout_s=overrides.pop("startup_timeout_s", 30.0),
            **overrides,
        )
        tracer = self._provider.get_tracer("specdec.coordinator")
        running, round_loop = self.run(
            start_coordinator(config, tracer, metrics=metrics, kubernetes_api=kubernetes_api)
        )
        self._servers.append(running)
        self._round_loops.append(round_loop)
        address = f"127.0.0.1:{running.port}"
        self.coordinators.append(address)
        return address

    @property
    def round_loops(self) -> list[RoundLoop]:
        """The round loop of each coordinator, in start order."""
        return list(self._round_loops)

    @property
    def address(self) -> str:
        """The first coordinator's address."""
        return self.coordinators[0]

    def close(self) -> None:
        """Stops every server and the loop."""

        async def stop_all():
            for running in reversed(self._servers):
                await running.stop(0.5)
            for round_loop in self._round_loops:
                await round_loop.close()
            # Background tasks (the services' idle-cache sweepers) end with the stack, as asyncio.run
            # ends them in a real process.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            self.run(stop_all())
        finally:
            self._provider.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
