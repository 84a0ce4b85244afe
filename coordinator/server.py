"""The coordinator's gRPC face: validate the request, run the round loop, encode chunks."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any

import grpc
from opentelemetry import trace

from coordinator.admission import Admission, Overloaded
from coordinator.auth import ApiKeyInterceptor, bearer_token
from coordinator.backends import DraftReplica, TargetReplica
from coordinator.choices import MAX_CHOICES, ChoiceRuns, choice_requests
from coordinator.discovery import open_source
from coordinator.identity import Caller, caller_of
from coordinator.membership import Membership, Refused
from coordinator.policy import SpeculationConfig, SpeculationPolicy
from coordinator.replicas import REST_S, BackendRejected, BackendUnavailable, Fenced, ReplicaSet
from coordinator.rounds import RoundLoop
from coordinator.routing import Router
from coordinator.sessions import SessionStore, StoreUnavailable, open_store
from coordinator.turns import (
    Chunk,
    GenerationRequest,
    Resume,
    SessionNotFound,
    Stats,
    TooManySessions,
    TurnMismatch,
    Turns,
)
from specdec.config import FEATURE_KIND, MAX_K, MAX_TREE_NODES, CoordinatorConfig
from specdec.grammar import response_format_key
from specdec.metadata import RETRY_AFTER_METADATA
from specdec.metrics import CoordinatorMetrics, start_metrics_server
from specdec.rpc import (
    RunningServer,
    channel_credentials,
    lenient_service,
    serve_forever,
    start_server,
    status_of,
    wait_ready,
)
from specdec.sampling_params import MAX_TOP_LOGPROBS, check_penalties, check_sampling
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.vocab import ModelFacts, load_tokenizer, resolve_model_path, tokenizer_fingerprint
from specdec.wire import logprobs_to_pb

log = logging.getLogger(__name__)
SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
# Retry hint sent with a replica's RESOURCE_EXHAUSTED (its KV budget is full of running sessions).
_BACKEND_RETRY_MS = 1000
# Stop strings a request may name, and their length: generous for real use, bounded for the loop's sake.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def choices_of(request: coordinator_pb2.GenerateRequest) -> int:
    """The number of choices the request asks for (``GenerateRequest.n``), checked."""
    n = request.n or 1
    if n > MAX_CHOICES:
        raise ValueError(f"n: at most {MAX_CHOICES} choices, got {n}")
    if n > 1 and (request.session_id or request.HasField("resume")):
        raise ValueError("n: several choices start sessions of their own; session_id and resume must be unset")
    return n


def validate(request: coordinator_pb2.GenerateRequest, max_context: int) -> GenerationRequest:
    """Checks every field and builds the core request; a ValueError names the offending field."""
    kind = request.WhichOneof("prompt")
    text = messages = token_ids = None
    if request.prompt_token_ids:
        # The ids' range is the core's to check: it knows the served vocabulary (Turns.open).
        if kind is not None:
            raise ValueError("prompt_token_ids: set text, messages or prompt_token_ids, not two of them")
        token_ids = tuple(request.prompt_token_ids)
    elif kind == "text":
        if not request.text:
            raise ValueError("prompt: the prompt is empty")
        text = request.text
    elif kind == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise ValueError("prompt: messages is empty")
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"messages.role: {m['role']!r} is not system, user or assistant")
    else:
        raise ValueError("prompt: set text, messages or prompt_token_ids")
    if request.max_new_tokens <= 0:
        raise ValueError("max_new_tokens: must be at least 1")
    if request.max_new_tokens > max_context:
        raise ValueError(f"max_new_tokens: {request.max_new_tokens} exceeds the model's context of {max_context}")
    top_p = request.top_p if request.HasField("top_p") else 1.0
    check_sampling(request.temperature, request.top_k, top_p)
    repetition = request.repetition_penalty if request.HasField("repetition_penalty") else 1.0
    logit_bias = tuple(sorted(request.logit_bias.items()))
    check_penalties(request.presence_penalty, request.frequency_penalty, repetition, logit_bias, None)
    response_format = ""
    if request.response_format:
        try:
            response_format = response_format_key(json.loads(request.response_format))
        except json.JSONDecodeError:
            raise ValueError("response_format: not valid JSON") from None
    if len(request.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in request.stop):
        # Every round searches the new text for each of them, on the loop that serves every request.
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
    k = request.k if request.HasField("k") else None
    if k is not None and not 0 <= k <= MAX_K:
        raise ValueError(f"k: must lie in [0, {MAX_K}]")
    tree_nodes = request.tree_nodes if request.HasField("tree_nodes") else None
    if tree_nodes is not None and tree_nodes > MAX_TREE_NODES:
        raise ValueError(f"tree_nodes: must lie in [0, {MAX_TREE_NODES}]")
    top_logprobs = request.top_logprobs if request.HasField("top_logprobs") else None
    if top_logprobs is not None and top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs: must lie in [0, {MAX_TOP_LOGPROBS}]")
    resume = None
    if request.HasField("resume"):
        if not request.session_id:
            raise ValueError("resume: needs the session_id of the stream to resume")
        resume = Resume(request.resume.tokens, request.resume.text_chars)
    return GenerationRequest(
        text=text,
        messages=messages,
        prompt_token_ids=token_ids,
        max_new_tokens=request.max_new_tokens,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=top_p,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop),
        session_id=request.session_id or None,
        k=k,
        resume=resume,
        fingerprint=fingerprint(request),
        tree_nodes=tree_nodes,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=repetition,
        logit_bias=logit_bias,
        response_format=response_format,
        top_logprobs=top_logprobs,
    )


def fingerprint(request: coordinator_pb2.GenerateRequest) -> str:
    """A digest of what the request asks for, leaving out the session and resume fields, which
    differ between a request and its resumption."""
    core = coordinator_pb2.GenerateRequest()
    core.CopyFrom(request)
    core.ClearField("session_id")
    core.ClearField("resume")
    return hashlib.sha256(core.SerializeToString(deterministic=True)).hexdigest()[:32]


def _stats_pb(stats: Stats) -> coordinator_pb2.GenerationStats:
    by_position = stats.by_position()
    return coordinator_pb2.GenerationStats(
        prompt_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        rounds=stats.rounds,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        draft_ms=stats.draft_ms,
        verify_ms=stats.verify_ms,
        prefill_ms=stats.prefill_ms,
        other_ms=stats.other_ms,
        total_ms=stats.total_ms,
        time_to_first_token_ms=stats.time_to_first_token_ms,
        drafted_at_position=by_position[0],
        accepted_at_position=by_position[1],
        ahead_rounds=stats.ahead_rounds,
        judged_tokens=stats.judged_tokens,
        tree_rounds=stats.tree_rounds,
        tree_nodes=stats.tree_nodes,
        accepted_at_depth=stats.accepted_at_depth,
        accepted_at_rank=stats.accepted_at_rank,
        tree_depths=stats.tree_depths,
        tree_levels_judged=stats.tree_levels_judged,
    )


def _chunk_pb(chunk: Chunk, index: int = 0) -> coordinator_pb2.GenerateChunk:
    msg = coordinator_pb2.GenerateChunk(
        text=chunk.text, token_ids=chunk.token_ids, session_id=chunk.session_id, index=index
    )
    if chunk.finish_reason is not None:
        msg.finish_reason = chunk.finish_reason
    if chunk.stats is not None:
        msg.stats.CopyFrom(_stats_pb(chunk.stats))
    logprobs_to_pb(chunk.logprobs or (), msg.logprobs)
    return msg


# The status each failure of a request maps to; anything else is a bug and surfaces as INTERNAL.
_STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (TurnMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (Fenced, grpc.StatusCode.ABORTED),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (TooManySessions, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (BackendUnavailable, grpc.StatusCode.UNAVAILABLE),
)


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, BackendRejected):
        return grpc.StatusCode[exc.status], str(exc)
    code = status_of(exc, _STATUS_OF)
    if code is not None:
        return code, str(exc)
    log.exception("request failed unexpectedly")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


def caller_from(context: grpc.aio.ServicerContext) -> Caller:
    """The proven identity of a call: its API key (the interceptor has accepted it), else its client
    certificate's subject, else its peer host (``coordinator.identity``)."""
    metadata = dict(context.invocation_metadata() or ())
    bearer = bearer_token(str(metadata.get("authorization", "")))
    auth = context.auth_context() or {}
    names = auth.get("x509_subject_alternative_name") or auth.get("x509_common_name") or []
    certificate = b",".join(names).decode(errors="replace") if names else None
    peer = context.peer() or ""
    return caller_of(bearer, certificate, peer.rsplit(":", 1)[0])


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin servicer over the round loop, behind admission control."""

    def __init__(self, loop: RoundLoop, max_context: int, admission: Admission) -> None:
        self._loop = loop
        self._max_context = max_context
        self._admission = admission

    async def _admitted(self, request: GenerationRequest, caller: Caller, context) -> AsyncGenerator[Chunk, None]:
        """One choice's chunks, under an admission slot of its own."""
        async with self._admission.slot(caller.client):
            async for chunk in self._loop.generate(request, context.time_remaining):
                yield chunk

    async def _chunks(self, request, context) -> AsyncGenerator[tuple[int, Chunk], None]:
        """Each chunk of the request with its choice's index; several choices run side by side, sharing
        their prompt's prefill (``coordinator.choices``), and a failure of any is the call's status."""
        try:
            caller = caller_from(context)
            n = choices_of(request)
            core_request = replace(validate(request, self._max_context), client=caller.client, owner=caller.owner)
            if n == 1:
                async for chunk in self._admitted(core_request, caller, context):
                    yield 0, chunk
                return
            runs = ChoiceRuns([self._admitted(core, caller, context) for core in choice_requests(core_request, n)])
            try:
                async for index, chunk in runs.chunks():
                    yield index, chunk
            finally:
                await runs.close()
        except Overloaded as exc:
            context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(int(exc.retry_after_s * 1000))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Exception as exc:  # noqa: BLE001 - every failure must reach the client as a status
            code, detail = _status(exc)
            if isinstance(exc, BackendRejected) and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A replica's KV budget is held by running sessions: one finishes within seconds.
                context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(_BACKEND_RETRY_MS)),))
            await context.abort(code, detail)

    async def Generate(self, request, context):
        async for index, chunk in self._chunks(request, context):
            yield _chunk_pb(chunk, index)

    async def Complete(self, request, context):
        replies: dict[int, coordinator_pb2.CompleteReply] = {}
        async for index, chunk in self._chunks(request, context):
            reply = replies.setdefault(index, coordinator_pb2.CompleteReply())
            reply.text += chunk.text
            reply.token_ids.extend(chunk.token_ids)
            logprobs_to_pb(chunk.logprobs or (), reply.logprobs)
            reply.session_id = chunk.session_id
            if chunk.finish_reason is not None:
                reply.finish_reason = chunk.finish_reason
                reply.stats.CopyFrom(_stats_pb(chunk.stats))
        if len(replies) == 1:
            return replies[0]
        whole = coordinator_pb2.CompleteReply()
        whole.CopyFrom(replies[0])
        whole.choices.extend(replies[i] for i in range(len(replies)))
        return whole


def register(servicer: CoordinatorServicer) -> Callable[[grpc.aio.Server], None]:
    """Adds the coordinator service to a server, with lenient request parsing (garbled bytes get
    INVALID_ARGUMENT, not INTERNAL)."""
    return lenient_service(servicer, coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"])


class IncompatibleReplicas(Refused):
    """A replica serves a model whose tokenizer differs from the coordinator's, or a target serves
    another model than the other targets."""


def check_same_target(reference: ModelFacts, facts: ModelFacts, address: str) -> None:
    """Refuses a target whose model differs from the reference target's: a session that moves between
    targets must go on with the same model, and its context and end tokens."""
    mine = (facts.name, facts.vocab_size, facts.max_context, facts.eos_token_ids)
    theirs = (reference.name, reference.vocab_size, reference.max_context, reference.eos_token_ids)
    if mine != theirs:
        raise IncompatibleReplicas(
            f"target at {address} serves {facts.name!r} (vocabulary {facts.vocab_size}, context {facts.max_context}, "
            f"end tokens {list(facts.eos_token_ids)}), the other targets {reference.name!r} (vocabulary "
            f"{reference.vocab_size}, context {reference.max_context}, end tokens {list(reference.eos_token_ids)}): "
            "every target must serve the same model"
        )


def check_same_side_layers(reference: ModelFacts, facts: ModelFacts, address: str) -> None:
    """Refuses a feature draft that reads other target layers than the reference draft: the target
    sends one kind of hidden-state row to whichever draft a session drafts on."""
    if facts.side_layers != reference.side_layers:
        raise IncompatibleReplicas(
            f"feature draft at {address} reads target layers {list(facts.side_layers)} beside the hidden states, "
            f"the other feature drafts {list(reference.side_layers)}: every feature draft must read the same"
        )


async def check_replica(
    fingerprint: str,
    replica: DraftReplica | TargetReplica,
    timeout_s: float,
    credentials: grpc.ChannelCredentials | None = None,
) -> ModelFacts:
    """Waits for one replica to be ready (over TLS with ``credentials``) and refuses it unless it
    shares the coordinator's tokenizer; returns its facts."""
    await wait_ready(replica.address, timeout_s, credentials, replica.tls_name)
    facts = await replica.facts()
    if facts.fingerprint != fingerprint:
        raise IncompatibleReplicas(
            f"{replica.service} at {replica.address} serves {facts.name!r}, whose tokenizer differs from the "
            "coordinator's: draft and target must share one tokenizer"
        )
    return facts


async def start_coordinator(
    config: CoordinatorConfig,
    tracer: trace.Tracer,
    store: SessionStore | None = None,
    metrics: CoordinatorMetrics | None = None,
    kubernetes_api: Any = None,
) -> tuple[RunningServer, RoundLoop]:
    """Connects to the replicas, checks them, and starts the coordinator server (behind API keys
    when the config holds any).

    Listed replicas must all be ready at start-up. With discovery, start-up waits for one target to
    join; drafts that join later are used from then on. ``kubernetes_api`` (a
    ``kubernetes.client.ApiClient``) serves k8s:/// discovery; None: the in-cluster service account.
    """
    has_drafts = bool(config.draft_addresses) or config.draft_discovery is not None
    if not has_drafts or not (config.target_addresses or config.target_discovery is not None):
        raise ValueError("the coordinator needs draft and target replicas: an address or a discovery spec each")
    tokenizer = load_tokenizer(resolve_model_path(config.tokenizer.model, config.tokenizer.cache_dir))
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    max_bytes = config.server.max_message_bytes
    credentials = channel_credentials(config.backend_tls)
    fingerprint = tokenizer_fingerprint(tokenizer)

    # Discovered replicas are dialled by IP; their certificates name the DNS name or Service instead.
    draft_tls_name = config.draft_discovery.tls_name if config.draft_discovery is not None else None
    target_tls_name = config.target_discovery.tls_name if config.target_discovery is not None else None

    def make_draft(address: str) -> DraftReplica:
        # A draft call that takes long is worth less than the round it holds up: its own, short deadline.
        return DraftReplica(address, config.draft_timeout_s, max_bytes, credentials, draft_tls_name)

    def make_target(address: str) -> TargetReplica:
        return TargetReplica(address, config.rpc_timeout_s, max_bytes, credentials, target_tls_name)

    first_target: list[ModelFacts] = []  # the model every target must serve: the first one's

    def admit_target(facts: ModelFacts, address: str) -> None:
        if first_target:
            check_same_target(first_target[0], facts, address)
        else:
            first_target.append(facts)

    first_feature: list[ModelFacts] = []  # the target layers every feature draft reads: the first one's

    def admit_draft(facts: ModelFacts, address: str) -> None:
        if facts.kind != FEATURE_KIND:
            return
        if first_feature:
            check_same_side_layers(first_feature[0], facts, address)
        else:
            first_feature.append(facts)

    async def check_joiner(replica: DraftReplica | TargetReplica) -> ModelFacts:
        # A discovered replica is listed once ready, so a short wait is plenty.
        facts = await check_replica(fingerprint, replica, config.rpc_timeout_s, credentials)
        if isinstance(replica, TargetReplica):
            admit_target(facts, replica.address)
        else:
            admit_draft(facts, replica.address)
        return facts

    drafts = [make_draft(a) for a in config.draft_addresses]
    targets = [make_target(a) for a in config.target_addresses]
    facts = await asyncio.gather(
        *(check_replica(fingerprint, r, config.startup_timeout_s, credentials) for r in [*drafts, *targets])
    )
    draft_facts, target_facts = facts[: len(drafts)], facts[len(drafts) :]
    for target, target_fact in zip(targets, target_facts):
        admit_target(target_fact, target.address)
    for draft, draft_fact in zip(drafts, draft_facts):
        admit_draft(draft_fact, draft.address)
    draft_set, target_set = ReplicaSet(drafts, REST_S), ReplicaSet(targets, REST_S)
    memberships: list[Membership] = []
    try:
        if config.target_discovery is not None:
            source = open_source(config.target_discovery, config.discovery_interval_s, kubernetes_api)
            following = Membership("target", source, target_set, make_target, check_joiner, config.discovery_interval_s)
            memberships.append(following)
            following.start()
            target_facts = [await following.first_facts(config.startup_timeout_s)]
        store = store or open_store(config.redis_url, config.session_ttl_s, config.redis_password, config.redis_ca)
        await store.ping()
        router = Router(
            draft_set,
            target_set,
            want_hidden=bool(first_feature),
            side_layers=first_feature[0].side_layers if first_feature else (),
        )
        speculation = speculation_config(config)
        if not all(f.trees for f in [*draft_facts, *target_facts]):
            # An older service, or a target with no ragged pass: every round is a chain.
            speculation = replace(speculation, tree_nodes=0)
        policy = SpeculationPolicy(speculation, live_targets=lambda: len(target_set))
        turns = Turns(tokenizer, target_facts[0], store, config.admission.max_sessions_per_client)
        loop = RoundLoop(
            tokenizer, target_facts[0], router, policy, turns, tracer, metrics, config.checkpoint_interval_s
        )
        if config.draft_discovery is not None:
            source = open_source(config.draft_discovery, config.discovery_interval_s, kubernetes_api)
            following = Membership(
                "draft",
                source,
                draft_set,
                make_draft,
                check_joiner,
                config.discovery_interval_s,
                on_join=lambda _, f: router.draft_joined(f),
            )
            memberships.append(following)
            following.start()
            # The drafts listed now join before serving; none listed is fine (target-only until one joins).
            if not await following.settled(config.startup_timeout_s):
                log.warning("draft discovery found no usable draft at start-up; running target-only until one joins")
    except BaseException:
        for following in memberships:
            await following.stop()
        await asyncio.gather(*(r.close() for r in [*draft_set.everyone(), *target_set.everyone()]))
        raise
    for following in memberships:
        router.stop_on_close(following.stop)
    # Before serving: the first requests' k then follows what this draft and target cost.
    await loop.probe(config.rpc_timeout_s)
    admission = Admission(config.admission)  # one for gRPC and HTTP: a slot is a slot
    servicer = CoordinatorServicer(loop, target_facts[0].max_context, admission)
    interceptors = [ApiKeyInterceptor(config.api_key_hashes)] if config.api_key_hashes else []
    running = await start_server(config.server, register(servicer), (SERVICE_NAME,), interceptors)
    await running.set_serving()
    if config.http_port is not None:
        # Imported here: it builds on this module, and only a coordinator serving HTTP needs aiohttp.
        from coordinator.openai_api import CoordinatorServers, start_http

        try:
            http = await start_http(loop, config, target_facts[0], admission, tracer)
        except BaseException:
            await running.stop(0)
            await loop.close()
            raise
        running = CoordinatorServers.beside(running, http)
    return running, loop


def speculation_config(config: CoordinatorConfig) -> SpeculationConfig:
    """The speculation policy's part of the coordinator's configuration."""
    return SpeculationConfig(
        config.default_k,
        config.max_auto_k,
        config.draft_colocated,
        config.free_lookup_min,
        config.confidence_cutoff,
        config.draft_ahead,
        config.tree_nodes,
    )


def main(config: CoordinatorConfig) -> None:
    """Entry point of ``specdec serve-coordinator``."""
    metrics = None
    if config.server.metrics_port is not None:
        metrics = CoordinatorMetrics()
        start_metrics_server(metrics.registry, config.server.host, config.server.metrics_port)

    async def serve() -> None:
        loops: list[RoundLoop] = []

        async def start(tracer):
            running, loop = await start_coordinator(config, tracer, metrics=metrics)
            loops.append(loop)
            return running

        try:
            await serve_forever(config.server, "coordinator", start)
        finally:
            # Stops discovery (and its watch thread) before the channels close.
            for loop in loops:
                await loop.close()

    try:
        asyncio.run(serve())
    except (IncompatibleReplicas, TimeoutError, ValueError) as exc:
        raise SystemExit(f"specdec coordinator: {exc}") from None
