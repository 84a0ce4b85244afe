"""Prometheus metrics of the three services, each in its own registry, and the HTTP endpoint serving them.

Names follow vLLM's ``vllm:`` metrics (``spec_decode_*``, ``request_success_total``,
``num_requests_running``) under the prefix ``specdec:``. Each process builds one metrics object at
start-up and passes it down; nothing registers into prometheus_client's global default registry, so
several services (or tests) in one process never collide.

Vocabulary, as in vLLM's spec-decode metrics: a *draft* is a round that proposed at least one token;
*accepted* tokens are draft tokens the target kept; a round's *accepted length* counts the tokens it
committed, the accepted draft tokens plus the target's own recovered or bonus token, so its mean is
``Stats.mean_accepted_length``. Positions are 0-based: position 0 is a round's first draft token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "specdec:"
# Finish reasons the round loop reports; their series exist (at 0) before the first request ends.
FINISH_REASONS = ("stop", "length", "context")
# One draft step or verify pass: milliseconds on a GPU, tens to hundreds of milliseconds on this CPU.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
# A whole request or its first token (vLLM's request-latency buckets, cut at ten minutes).
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Committed tokens per round: 1 (nothing accepted) up to MAX_K + 1.
LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 33)


class CoordinatorMetrics:
    """The coordinator's request and round metrics; the round loop records into it as it goes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.num_drafts = Counter(
            f"{PREFIX}spec_decode_num_drafts", "Rounds that proposed at least one draft token.", registry=r
        )
        self.num_draft_tokens = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted_tokens = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", registry=r
        )
        self.num_draft_tokens_per_pos = Counter(
            f"{PREFIX}spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed, by 0-based draft position.",
            ["position"],
            registry=r,
        )
        self.num_accepted_tokens_per_pos = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by 0-based draft position.",
            ["position"],
            registry=r,
        )
        self.num_tree_rounds = Counter(
            f"{PREFIX}spec_decode_num_tree_rounds", "Rounds that verified a token tree.", registry=r
        )
        self.num_tree_nodes = Counter(
            f"{PREFIX}spec_decode_num_tree_nodes", "Tree nodes verified (draft tokens of tree rounds).", registry=r
        )
        self.num_accepted_tree_nodes_per_depth = Counter(
            f"{PREFIX}spec_decode_num_accepted_tree_nodes_per_depth",
            "Accepted tree nodes, by depth (1: a child of the last committed token).",
            ["depth"],
            registry=r,
        )
        self.num_accepted_tree_nodes_per_rank = Counter(
            f"{PREFIX}spec_decode_num_accepted_tree_nodes_per_rank",
            "Accepted tree nodes, by rank among their siblings (0: the draft's first guess).",
            ["rank"],
            registry=r,
        )
        self.accepted_length = Histogram(
            f"{PREFIX}spec_decode_accepted_length",
            "Tokens committed per round: accepted draft tokens plus the target's recovered or bonus token.",
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.target_only_fallbacks = Counter(
            f"{PREFIX}target_only_fallbacks",
            "Rounds meant to draft (k > 0) that ran target-only: the draft failed, or rests after a failure.",
            registry=r,
        )
        self.round_duration = Histogram(
            f"{PREFIX}round_duration_seconds", "One round: draft plus verify.", buckets=STEP_BUCKETS, registry=r
        )
        self.draft_duration = Histogram(
            f"{PREFIX}draft_duration_seconds",
            "One draft call, in rounds that asked for one (failed calls included).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.verify_duration = Histogram(
            f"{PREFIX}verify_duration_seconds",
            "One verify call (a re-prefill after a lost cache included).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.num_requests_running = Gauge(f"{PREFIX}num_requests_running", "Requests being generated.", registry=r)
        self.request_success = Counter(
            f"{PREFIX}request_success", "Finished requests, by finish reason.", ["finish_reason"], registry=r
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(finish_reason=reason)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Wall time of finished requests.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time to the first streamed token of finished requests.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.last_request_tokens_per_second = Gauge(
            f"{PREFIX}last_request_generation_tokens_per_second",
            "Generated tokens per wall-clock second of the last finished request.",
            registry=r,
        )

    def running(self) -> AbstractContextManager:
        """Counts a request in ``num_requests_running`` while the returned context is open."""
        return self.num_requests_running.track_inprogress()

    def observe_round(
        self,
        drafted: int,
        accepted: int,
        committed: int,
        draft_s: float | None,
        verify_s: float,
        round_s: float,
        fallback: bool,
        accepted_ranks: tuple[int, ...] | None = None,
    ) -> None:
        """Records one round; ``draft_s`` is None when the round did not call a draft. A tree round
        gives its accepted nodes' sibling ranks, root to leaf (``accepted_ranks``; None: a chain)."""
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
        if accepted_ranks is not None:
            self.num_tree_rounds.inc()
            self.num_tree_nodes.inc(drafted)
            for depth, rank in enumerate(accepted_ranks, start=1):
                self.num_accepted_tree_nodes_per_depth.labels(depth=str(depth)).inc()
                self.num_accepted_tree_nodes_per_rank.labels(rank=str(rank)).inc()
        elif drafted:
            for position in range(drafted):
                self.num_draft_tokens_per_pos.labels(position=str(position)).inc()
            for position in range(accepted):
                self.num_accepted_tokens_per_pos.labels(position=str(position)).inc()
        self.accepted_length.observe(committed)
        if fallback:
            self.target_only_fallbacks.inc()
        if draft_s is not None:
            self.draft_duration.observe(draft_s)
        self.verify_duration.observe(verify_s)
        self.round_duration.observe(round_s)

    def observe_request(
        self, finish_reason: str, prompt_tokens: int, generated_tokens: int, total_s: float, first_token_s: float | None
    ) -> None:
        """Records one finished request; ``first_token_s`` is None when it streamed no token."""
        self.request_success.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.e2e_request_latency.observe(total_s)
        if first_token_s is not None:
            self.time_to_first_token.observe(first_token_s)
        if total_s > 0:
            self.last_request_tokens_per_second.set(generated_tokens / total_s)


class CacheStats(Protocol):
    """What the cache gauges read from a service's session-cache table (``specdec.kvcache.CacheTable``)."""

    evictions: int

    def __len__(self) -> int: ...

    def kv_bytes(self) -> int: ...


class _CacheCollector(Collector):
    """Reads the cache table at scrape time, so the model's worker thread never pays for metrics."""

    def __init__(self, caches: CacheStats) -> None:
        self._caches = caches

    def _families(self, active: float, kv_bytes: float, evictions: float) -> Iterator[Metric]:
        yield GaugeMetricFamily(f"{PREFIX}active_sessions", "Session caches held.", value=active)
        yield GaugeMetricFamily(
            f"{PREFIX}kv_cache_bytes",
            "Bytes of the key and value buffers of all session caches (capacity, not fill).",
            value=kv_bytes,
        )
        yield CounterMetricFamily(
            f"{PREFIX}kv_cache_evictions",
            "Session caches evicted (least recently used) to make room.",
            value=evictions,
        )

    def describe(self) -> Iterator[Metric]:
        """The families this collector yields, so the registry can refuse duplicate names."""
        return self._families(0, 0, 0)

    def collect(self) -> Iterator[Metric]:
        """Current values, read from the table now."""
        return self._families(len(self._caches), self._caches.kv_bytes(), self._caches.evictions)


class PassStats(Protocol):
    """What the pass counters read from a batching engine (``target_service.engine.TargetEngine``)."""

    passes: int
    verified: int
    pass_seconds: float
    round_rows: int
    prompt_rows: int
    prefill_rows: int
    forked_rows: int
    reused_rows: int


class _PassCollector(Collector):
    """Reads a batching engine's pass totals at scrape time. Rows per pass, seconds per pass and the
    share of prompt rows follow from their rates: how full the batches are, and what prompts cost them."""

    def __init__(self, engine: PassStats) -> None:
        self._engine = engine

    def _families(
        self,
        passes: float,
        rounds: float,
        seconds: float,
        round_rows: float,
        prompt_rows: float,
        prefill_rows: float = 0,
        forked_rows: float = 0,
        reused_rows: float = 0,
    ) -> Iterator[Metric]:
        yield CounterMetricFamily(f"{PREFIX}target_passes", "Batched forward passes of the target.", value=passes)
        yield CounterMetricFamily(f"{PREFIX}target_rounds_verified", "Rounds verified in those passes.", value=rounds)
        yield CounterMetricFamily(f"{PREFIX}target_pass_seconds", "Seconds those passes took.", value=seconds)
        rows = CounterMetricFamily(
            f"{PREFIX}target_pass_rows",
            "Token rows those passes fed: for rounds (pending + draft tokens) or "
            "for prompts (folded into a round, or fed a chunk a pass).",
            labels=["kind"],
        )
        rows.add_metric(["round"], round_rows)
        rows.add_metric(["prompt"], prompt_rows)
        yield rows
        yield CounterMetricFamily(
            f"{PREFIX}target_prefill_rows",
            "Prompt rows prefills fed in passes of their own (not folded or chunked into shared passes).",
            value=prefill_rows,
        )
        yield CounterMetricFamily(
            f"{PREFIX}target_forked_rows",
            "KV rows forks copied from another session's cache instead of computing them "
            "(the choices of a request for several share its prompt's prefill).",
            value=forked_rows,
        )
        yield CounterMetricFamily(
            f"{PREFIX}target_reused_rows",
            "Prompt rows copied from a cache holding the same prefix instead of computing them (prefix reuse: "
            "a shared system prompt, template or earlier prompt).",
            value=reused_rows,
        )

    def describe(self) -> Iterator[Metric]:
        """The families this collector yields."""
        return self._families(0, 0, 0, 0, 0)

    def collect(self) -> Iterator[Metric]:
        """Current totals, read from the engine now."""
        e = self._engine
        return self._families(
            e.passes,
            e.verified,
            e.pass_seconds,
            e.round_rows,
            e.prompt_rows,
            e.prefill_rows,
            e.forked_rows,
            e.reused_rows,
        )


class CacheServiceMetrics:
    """A draft or target service's metrics: its session caches (and a target's passes), read when scraped."""

    def __init__(
        self, caches: CacheStats, registry: CollectorRegistry | None = None, passes: PassStats | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_CacheCollector(caches))
        if passes is not None:
            self.registry.register(_PassCollector(passes))


@dataclass
class MetricsServer:
    """A running metrics endpoint (``/metrics`` and every other path) on a daemon thread."""

    host: str
    port: int
    server: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        """Stops serving and frees the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serves ``registry`` over HTTP on ``host:port`` (0 picks a free port; the bound one is logged and returned)."""
    # gRPC spells IPv6 hosts in brackets ("[::]"); the HTTP server wants the bare address.
    bare = host.strip("[]")
    server, thread = start_http_server(port, addr=bare, registry=registry)
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)
