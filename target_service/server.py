"""The target service's gRPC face: decode each request, call the engine, encode the reply."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from opentelemetry import trace

from specdec.batching import PassBatcher
from specdec.cache_servicer import CacheServicer
from specdec.config import TargetConfig
from specdec.metrics import CacheServiceMetrics, start_metrics_server
from specdec.model_thread import model_executor, on_model_thread
from specdec.models import LoadedModel, load_model
from specdec.packed_linear import pack_linears
from specdec.rpc import (
    RunningServer,
    call_core,
    guarded,
    lenient_service,
    serve_forever,
    start_server,
)
from specdec.tracing import server_span
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.hidden_wire import hidden_to_pb
from specdec.wire import pass_load_to_pb, sampling_from_pb
from specdec.kvcache import HiddenRows
from specdec.token_lists import common_prefix_len
from target_service.engine import (
    PREFILL_HIDDEN_ROWS,
    SparseQ,
    TargetEngine,
    VerifyCall,
    feed_call,
    newest_hidden,
    stamp_queue_wait,
)
from target_service.tensor_parallel import (
    LeaderEngine,
    become_follower,
    follow,
    follower_engine,
    join_group,
    shard_llama,
)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
# Sessions count as running while a round is in flight or ended within this many seconds (see
# TargetServicer._next_chunk).
_RUNNING_WINDOW_S = 1.0


class TargetServicer(CacheServicer, target_pb2_grpc.TargetServiceServicer):
    """Thin servicer over a TargetEngine."""

    def __init__(self, engine: TargetEngine | LeaderEngine, tracer: trace.Tracer, max_batch_rows: int,
                 fold_prefills: bool = True, prefill_chunk: int = 0, executor: ThreadPoolExecutor | None = None) -> None:
        super().__init__(engine, tracer, "TargetService", executor)
        self._target = engine
        self._batcher = PassBatcher(engine.verify_batch, self._executor, self._rows_of, max_batch_rows,
                                    stamp_queue_wait)
        # A longer prompt is fed this many tokens a pass while other sessions run, in passes shared with
        # their rounds (0: in one pass of its own, which every other session waits for: 6.5 s for 2048
        # tokens of the default target on 2 cores); with none running, up to the pass budget a pass.
        self._chunk_rows = min(prefill_chunk, max_batch_rows - 1) if engine.batches else 0
        self._pass_rows = max_batch_rows - 1  # a chunk while no session runs (see _next_chunk)
        self._rounds_in_flight = 0
        self._last_round_end = float("-inf")  # event-loop time
        # Prompts of at most this many tokens that arrive while passes run are fed by their session's
        # first verify pass (0: never); their caches' unfed rows count in that pass's row budget, and
        # their hidden rows return in one reply, as a prefill's would. A chunked prompt's tail folds too.
        self._fold_rows = (min(max_batch_rows - 1, PREFILL_HIDDEN_ROWS, self._chunk_rows or max_batch_rows)
                           if fold_prefills and engine.batches else 0)
        self._prefilling = 0  # prefills running or queued with a pass of their own

    def _rows_of(self, call: VerifyCall) -> int:
        """Rows the call's pass feeds: its draft tokens and its cache's pending committed tokens (one, or
        a deferred prompt's), or a prompt chunk's rows."""
        if call.feed_rows:
            return call.feed_rows
        cache = self._target.caches.peek(call.cache_id)
        pending = len(cache.pending()) if cache is not None else 1
        return len(call.draft_tokens) + max(1, pending)

    async def Prefill(self, request: common_pb2.PrefillRequest, context) -> common_pb2.PrefillReply:
        with server_span(self._tracer, "TargetService/Prefill", context) as span:
            tokens = list(request.tokens)
            side_layers = tuple(request.hidden_side_layers)
            # Under load a prompt's own pass would stall every running session for its length; fed
            # beside their one-token rows it costs about the prompt alone (compute-bound rows). A burst
            # of prompts counts as load too: the first gets a pass, the rest share verify passes.
            busy = self._batcher.busy or self._prefilling > 0
            fold = busy and not request.feed_now and self._fold_rows > 0
            chunked = 0 < self._chunk_rows < len(tokens)
            deferred = fold and (chunked or len(tokens) <= self._fold_rows)  # (its tail) fed by round 1
            defer = chunked or deferred  # this call's own pass feeds nothing
            span.set_attributes({"specdec.tokens": len(tokens), "specdec.deferred": deferred,
                                 "specdec.chunked": chunked})
            self._prefilling += not defer
            try:
                cache_id, committed, hidden = await call_core(
                    context, self._executor,
                    lambda: self._target.prefill(tokens, request.return_hidden, request.fence, defer=defer,
                                                 side_layers=side_layers),
                )
            finally:
                self._prefilling -= not defer
            if chunked:
                leave = self._fold_rows if deferred else 1  # pending tokens left to the first round
                try:
                    rows = await guarded(
                        context, self._feed_chunks(cache_id, len(tokens), leave, request.return_hidden,
                                                   side_layers=side_layers),
                        "TargetService/Prefill",
                    )
                except BaseException:
                    self._executor.submit(self._target.release, cache_id)  # a half-fed cache serves no one
                    raise
                hidden = await self._on_model_thread(newest_hidden, rows)
            reply = common_pb2.PrefillReply(cache_id=cache_id, committed=committed)
            if hidden is not None:
                reply.hidden.CopyFrom(hidden_to_pb(hidden))
            return reply

    async def _feed_chunks(self, cache_id: str, pending: int, leave: int, with_hidden: bool,
                           sync: VerifyCall | None = None, side_layers: tuple[int, ...] = ()) -> list[HiddenRows]:
        """Feeds a cache's ``pending`` tokens through the batcher, a chunk a pass, until ``leave`` are
        left, so running sessions' rounds share those passes instead of waiting for all of them (the
        first chunk applies ``sync``, a round's call, first). Returns the fed rows' hidden states."""
        rows, first = [], True
        while pending > leave:
            n = min(self._next_chunk(), pending - 1)  # the last committed token is always a round's to feed
            outcome = await self._batcher.submit(feed_call(cache_id, n, with_hidden, sync if first else None,
                                                           side_layers))
            first, pending = False, pending - n
            if outcome.hidden is not None:
                rows.append(outcome.hidden)
        return rows

    def _next_chunk(self) -> int:
        """Rows of a prompt's next chunk: the configured chunk while sessions are running (a round in
        flight, or one that ended within the last second), else the whole pass budget. With no one to
        wait, a larger chunk only saves weight reads: 1024 tokens of the default target took 3.0 s in
        256-row passes, 3.8 s in 128-row passes and 3.3 s in one pass (2 cores)."""
        ended = asyncio.get_running_loop().time() - self._last_round_end
        idle = not self._rounds_in_flight and ended > _RUNNING_WINDOW_S
        return self._pass_rows if idle else self._chunk_rows

    def _pending_after(self, call: VerifyCall) -> int:
        """Tokens the call's pass would feed before its draft tokens once its sync applies, when that
        sync brings more new tokens than a chunk (a long new turn); else 0, at the cost of one check."""
        if len(call.new_tokens) <= self._chunk_rows:
            return 0
        cache = self._target.caches.peek(call.cache_id)
        if cache is None:
            return 0  # the round's own call reports the lost cache
        committed = cache.committed[: call.start] + call.new_tokens
        return len(committed) - min(common_prefix_len(cache.kv_tokens, committed), len(committed) - 1)

    async def _verify(self, request: target_pb2.VerifyRequest):
        """Decodes a request (its sampling settings may be invalid) and verifies it in the next pass;
        a long new turn is fed a chunk a pass first, like a long prompt."""
        call = VerifyCall(
            request.sync.cache_id,
            request.sync.start,
            list(request.sync.tokens),
            list(request.draft_tokens),
            [SparseQ(list(d.token_ids), list(d.probs)) for d in request.q],
            sampling_from_pb(request.sampling),
            request.round,
            request.return_hidden,
            request.sync.fence,
            side_layers=tuple(request.hidden_side_layers),
        )
        rows = []
        if self._chunk_rows and (pending := self._pending_after(call)) > self._chunk_rows:
            rows = await self._feed_chunks(call.cache_id, pending, self._chunk_rows, call.with_hidden, call,
                                           call.side_layers)
        self._rounds_in_flight += 1
        try:
            outcome = await self._batcher.submit(call)
        finally:
            self._rounds_in_flight -= 1
            self._last_round_end = asyncio.get_running_loop().time()
        if rows and outcome.hidden is not None:
            outcome = replace(outcome, hidden=await self._on_model_thread(newest_hidden, [*rows, outcome.hidden]))
        return outcome

    async def Verify(self, request: target_pb2.VerifyRequest, context) -> target_pb2.VerifyReply:
        with server_span(self._tracer, "TargetService/Verify", context) as span:
            span.set_attribute("specdec.k", len(request.draft_tokens))
            outcome = await guarded(context, self._verify(request), "TargetService/Verify")
            span.set_attribute("specdec.accepted", outcome.accepted)
            reply = target_pb2.VerifyReply(accepted=outcome.accepted, tokens=outcome.tokens, committed=outcome.committed)
            if outcome.load is not None:
                load = outcome.load
                span.set_attributes({"specdec.batch_sessions": load.sessions, "specdec.batch_rows": load.rows})
                reply.load.CopyFrom(pass_load_to_pb(load))
            if outcome.hidden is not None:
                reply.hidden.CopyFrom(hidden_to_pb(outcome.hidden))
            return reply


async def start_target(config: TargetConfig, engine: TargetEngine | LeaderEngine, tracer: trace.Tracer,
                       executor: ThreadPoolExecutor | None = None) -> RunningServer:
    """Starts the target gRPC server over a loaded engine (on ``executor``'s thread, see
    ``specdec.model_thread``) and reports it ready."""
    servicer = TargetServicer(engine, tracer, config.max_batch_rows, config.fold_prefills, config.prefill_chunk,
                              executor)
    running = await start_server(
        config.server, lenient_service(servicer, target_pb2.DESCRIPTOR.services_by_name["TargetService"]),
        (SERVICE_NAME,),
    )
    servicer.sweep_idle_caches(config.model.cache_idle_s)
    await running.set_serving()
    return running


def load_shard(config: TargetConfig) -> LoadedModel:
    """The target model, or with tensor parallelism this rank's shard of it."""
    loaded = load_model(config.model.model, config.model.cache_dir, device=config.model.device)
    if config.tp.world_size > 1:
        shard_llama(loaded.model, config.tp.rank, config.tp.world_size)
    if config.model.pack and config.model.device == "cpu":  # after sharding: each rank packs its own slices
        pack_linears(loaded.model)
    return loaded


def main(config: TargetConfig) -> None:
    """Entry point of ``specdec serve-target``: load, warm, serve until SIGTERM.

    With tensor parallelism every rank runs this; rank 0 serves and the others follow its passes.
    Rank 0 loads and runs its model on one worker thread (``specdec.model_thread``).
    """
    tp = config.tp
    if tp.rank > 0:
        torch.set_num_threads(config.model.threads)
        become_follower(tp.launcher_pid)
        join_group(tp)
        follow(follower_engine(load_shard(config)))
        return
    if tp.world_size > 1:
        join_group(tp)
    executor = model_executor("TargetService")

    def build() -> tuple[TargetEngine, TargetEngine | LeaderEngine]:
        core = TargetEngine(load_shard(config), config.model.max_sessions, **config.model.cache_limits())
        engine = LeaderEngine(core) if tp.world_size > 1 else core
        try:
            engine.warmup()
        except BaseException:
            if isinstance(engine, LeaderEngine):
                engine.close()
            raise
        return core, engine

    core, engine = on_model_thread(executor, config.model.threads, build)
    try:
        if config.server.metrics_port is not None:
            metrics = CacheServiceMetrics(core.caches, passes=core)
            start_metrics_server(metrics.registry, config.server.host, config.server.metrics_port)
        asyncio.run(serve_forever(config.server, "target",
                                  lambda tracer: start_target(config, engine, tracer, executor)))
    finally:
        if isinstance(engine, LeaderEngine):
            executor.submit(engine.close).result()
