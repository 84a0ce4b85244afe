"""The target service's gRPC face: decode each request, call the scheduler or engine, encode the reply.

Which passes feed a prompt or a round is ``target_service.scheduler``'s to decide.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from opentelemetry import trace

from specdec.cache_servicer import CacheServicer
from specdec.compiled import ROW_BUCKETS, CompiledPass, compile_unsupported, keep_artifacts_in
from specdec.config import TargetConfig
from specdec.hidden_wire import hidden_to_pb
from specdec.metrics import CacheServiceMetrics, start_metrics_server
from specdec.model_thread import model_executor, on_model_thread
from specdec.models import LoadedModel, load_model
from specdec.packed_linear import pack_linears
from specdec.rpc import (
    RunningServer,
    batch_item,
    call_core,
    guarded,
    lenient_service,
    serve_forever,
    start_server,
)
from specdec.tracing import carried_span, server_span
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from specdec.wire import logprobs_to_pb, pass_load_to_pb, sampling_from_pb
from target_service.compile_ahead import build_ahead
from target_service.engine import SparseQ, TargetEngine, VerifyCall
from target_service.scheduler import TargetScheduler
from target_service.tensor_parallel import (
    LeaderEngine,
    become_follower,
    follow,
    follower_engine,
    join_group,
    shard_llama,
)

log = logging.getLogger("specdec.target")

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


def verify_call_from_pb(request: target_pb2.VerifyRequest) -> VerifyCall:
    """The engine's call for a Verify request; raises ValueError for invalid sampling settings."""
    return VerifyCall(
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
        draft_parents=tuple(request.draft_parents),
        top_logprobs=request.top_logprobs if request.HasField("top_logprobs") else None,
    )


def _scoring(engine: object) -> TargetEngine:
    """The engine that computes prompt logprobs: a single-rank target's (a tensor-parallel leader has
    no such pass for its followers to mirror)."""
    if not isinstance(engine, TargetEngine):
        raise ValueError("prompt_logprobs: not served by a tensor-parallel target")
    return engine


class TargetServicer(CacheServicer, target_pb2_grpc.TargetServiceServicer):
    """Thin servicer over a TargetScheduler (which passes feed what) and its TargetEngine."""

    def __init__(
        self,
        engine: TargetEngine | LeaderEngine,
        tracer: trace.Tracer,
        max_batch_rows: int,
        fold_prefills: bool = True,
        prefill_chunk: int = 0,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__(engine, tracer, "TargetService", executor)
        self._scheduler = TargetScheduler(engine, self._executor, max_batch_rows, fold_prefills, prefill_chunk)

    def session_idle(self, cache_id: str) -> None:
        """The session's turn ended: the next verify pass does not wait for it."""
        self._scheduler.idle(cache_id)

    async def Prefill(self, request: common_pb2.PrefillRequest, context) -> common_pb2.PrefillReply:
        """Creates a session cache over a prompt, fed now or in shared passes as the scheduler plans,
        or (``fork_of``) copied from another cache."""
        if request.fork_of:
            return await self._fork(request, context)
        if request.HasField("prompt_logprobs"):
            return await self._prefill_scored(request, context)
        with server_span(self._tracer, "TargetService/Prefill", context) as span:
            tokens = list(request.tokens)
            plan = self._scheduler.plan_prefill(len(tokens), request.feed_now)
            span.set_attributes(
                {"specdec.tokens": len(tokens), "specdec.deferred": plan.deferred, "specdec.chunked": plan.chunked}
            )
            cache_id, committed, hidden = await guarded(
                context,
                self._scheduler.prefill(
                    tokens, request.return_hidden, request.fence, plan, tuple(request.hidden_side_layers)
                ),
                "TargetService/Prefill",
            )
            reply = common_pb2.PrefillReply(cache_id=cache_id, committed=committed)
            if hidden is not None:
                reply.hidden.CopyFrom(hidden_to_pb(hidden))
            return reply

    async def _fork(self, request: common_pb2.PrefillRequest, context) -> common_pb2.PrefillReply:
        """A Prefill that forks ``fork_of``: the KV is copied on the model's thread, no pass runs (what
        the copy lacks, the session's first Verify feeds)."""
        with server_span(self._tracer, "TargetService/Prefill", context) as span:
            span.set_attributes({"specdec.tokens": len(request.tokens), "specdec.forked": True})
            if request.HasField("prompt_logprobs"):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "fork_of: a prefill that scores the prompt (prompt_logprobs) computes every position",
                )
            cache_id, committed, copied = await call_core(
                context,
                self._executor,
                lambda: self._engine.fork(request.fork_of, list(request.tokens), request.fence),
            )
            span.set_attribute("specdec.copied", copied)
            return common_pb2.PrefillReply(cache_id=cache_id, committed=committed, copied=copied)

    async def _prefill_scored(self, request: common_pb2.PrefillRequest, context) -> common_pb2.PrefillReply:
        """A Prefill that asks for prompt logprobs: fed now, in a pass of its own, past the scheduler
        (which would defer, chunk or fold it); refused by a tensor-parallel target."""
        with server_span(self._tracer, "TargetService/Prefill", context) as span:
            span.set_attributes({"specdec.tokens": len(request.tokens), "specdec.prompt_logprobs": True})
            cache_id, committed, hidden, scored = await call_core(
                context,
                self._executor,
                lambda: _scoring(self._engine).prefill_scored(
                    list(request.tokens),
                    request.prompt_logprobs,
                    request.return_hidden,
                    request.fence,
                    tuple(request.hidden_side_layers),
                ),
            )
            reply = common_pb2.PrefillReply(cache_id=cache_id, committed=committed)
            if hidden is not None:
                reply.hidden.CopyFrom(hidden_to_pb(hidden))
            logprobs_to_pb(scored, reply.prompt_logprobs)
            return reply

    async def Verify(self, request: target_pb2.VerifyRequest, context) -> target_pb2.VerifyReply:
        """Verifies a round's draft tokens in the next shared pass."""
        with server_span(self._tracer, "TargetService/Verify", context) as span:
            return await guarded(context, self._verify(request, span), "TargetService/Verify")

    async def VerifyBatch(self, request: target_pb2.VerifyBatchRequest, context) -> target_pb2.VerifyBatchReply:
        """Verifies several sessions' rounds, submitted together so they share the next pass; each
        gets its own reply or error, and a span of its own parented on its round."""
        results = await asyncio.gather(*(self._verify_carried(r) for r in request.requests))
        reply = target_pb2.VerifyBatchReply()
        for result in results:
            if isinstance(result, common_pb2.CallError):
                reply.results.add(error=result)
            else:
                reply.results.add(reply=result)
        return reply

    async def _verify_carried(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyReply | common_pb2.CallError:
        with carried_span(self._tracer, "TargetService/Verify", tuple(request.trace_context.items())) as span:
            result = await batch_item(self._verify(request, span), "TargetService/VerifyBatch")
            if isinstance(result, common_pb2.CallError):  # the span of a lone call that failed says so too
                span.set_status(trace.Status(trace.StatusCode.ERROR, result.message))
            return result

    async def _verify(self, request: target_pb2.VerifyRequest, span: trace.Span) -> target_pb2.VerifyReply:
        """Decodes a request (its sampling settings may be invalid), verifies it in the next shared
        pass and encodes the outcome, noting it on ``span``."""
        span.set_attribute("specdec.k", len(request.draft_tokens))
        outcome = await self._scheduler.verify(verify_call_from_pb(request))
        span.set_attribute("specdec.accepted", outcome.accepted)
        reply = target_pb2.VerifyReply(
            accepted=outcome.accepted,
            tokens=outcome.tokens,
            committed=outcome.committed,
            accepted_nodes=outcome.path or (),
        )
        if outcome.load is not None:
            load = outcome.load
            span.set_attributes(
                {
                    "specdec.batch_sessions": load.sessions,
                    "specdec.batch_rows": load.rows,
                    "specdec.pass_ms": load.pass_ms,
                }
            )
            reply.load.CopyFrom(pass_load_to_pb(load))
        if outcome.hidden is not None:
            reply.hidden.CopyFrom(hidden_to_pb(outcome.hidden))
        logprobs_to_pb(outcome.logprobs or (), reply.logprobs)
        return reply


async def start_target(
    config: TargetConfig,
    engine: TargetEngine | LeaderEngine,
    tracer: trace.Tracer,
    executor: ThreadPoolExecutor | None = None,
) -> RunningServer:
    """Starts the target gRPC server over a loaded engine (on ``executor``'s thread, see
    ``specdec.model_thread``) and reports it ready."""
    servicer = TargetServicer(
        engine, tracer, config.max_batch_rows, config.fold_prefills, config.prefill_chunk, executor
    )
    running = await start_server(
        config.server,
        lenient_service(servicer, target_pb2.DESCRIPTOR.services_by_name["TargetService"]),
        (SERVICE_NAME,),
    )
    servicer.sweep_idle_caches(config.model.cache_idle_s)
    await running.set_serving()
    return running


def load_shard(config: TargetConfig) -> LoadedModel:
    """The target model, or with tensor parallelism this rank's shard of it."""
    model = config.model
    loaded = load_model(model.model, model.cache_dir, dtype=model.dtype, device=model.device)
    if config.tp.world_size > 1:
        shard_llama(loaded.model, config.tp.rank, config.tp.world_size)
    if config.model.pack and config.model.device == "cpu":  # after sharding: each rank packs its own slices
        pack_linears(loaded.model, stream=config.model.stream_weights)
    return loaded


def compiled_pass(
    config: TargetConfig, loaded: LoadedModel, buckets: tuple[int, ...] = ROW_BUCKETS
) -> CompiledPass | None:
    """The target's compiled pass over row ``buckets`` as ``config.compile`` asks (None: off, or a model
    it cannot run), built now (``wait``) or beside serving (``background``, ``_compile_beside``), its
    artifacts cached under the cache directory."""
    if config.compile == "off":
        return None
    reason = compile_unsupported(loaded.model)
    if reason is not None:
        log.warning("target %s: not compiling the pass: %s", loaded.name, reason)
        return None
    keep_artifacts_in(config.model.cache_dir)
    compiled = CompiledPass(loaded.model, buckets)
    if config.compile == "wait":
        compiled.compile()
    else:
        thread = threading.Thread(target=_compile_beside, args=(compiled, config, buckets), name="compile", daemon=True)
        thread.start()
    return compiled


def _compile_beside(compiled: CompiledPass, config: TargetConfig, buckets: tuple[int, ...]) -> None:
    """The background build: a low-priority child process fills inductor's cache
    (``target_service.compile_ahead``), then this process loads every graph from it."""
    try:
        build_ahead(config.model, buckets)
        compiled.compile()
    except Exception:  # the eager pass keeps serving: say why the compiled one never came
        log.exception("compiling the target's pass failed; passes stay eager")


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
        loaded = load_shard(config)
        compiled = compiled_pass(config, loaded) if tp.world_size == 1 else None
        limits = config.model.cache_limits()
        if tp.world_size > 1:
            # Every rank must run the same passes; a follower copies no prefix, so rank 0 copies none either.
            limits["reuse_min"] = 0
        core = TargetEngine(loaded, config.model.max_sessions, **limits, compiled=compiled)
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
        asyncio.run(
            serve_forever(config.server, "target", lambda tracer: start_target(config, engine, tracer, executor))
        )
    finally:
        if isinstance(engine, LeaderEngine):
            executor.submit(engine.close).result()
