"""The draft service's gRPC face: decode each request, call the drafter, encode the reply."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from opentelemetry import trace

from draft_service.engine import DraftEngine, FeatureDrafter, ModelDrafter, NgramDrafter, Proposal, ProposeCall
from draft_service.feature_draft import KIND as FEATURE_KIND
from draft_service.feature_draft import load_feature_draft
from draft_service.scheduler import DraftScheduler
from draft_service.target_parts import read_target
from draft_service.token_draft import CARD_FILE, load_token_draft
from draft_service.tree_draft import TREE_BEAM
from specdec.cache_servicer import CacheServicer
from specdec.config import DraftConfig
from specdec.hidden_wire import hidden_from_pb
from specdec.metrics import CacheServiceMetrics, start_metrics_server
from specdec.model_thread import model_executor, on_model_thread
from specdec.models import LoadedModel, load_config, load_model, max_context, resolve_dtype
from specdec.packed_linear import pack_linears
from specdec.rpc import RunningServer, guarded, lenient_service, serve_forever, start_server
from specdec.tracing import server_span
from specdec.trees import TreeShape
from specdec.v1 import draft_pb2, draft_pb2_grpc
from specdec.vocab import ModelFacts, load_tokenizer, resolve_model_path, tokenizer_fingerprint
from specdec.wire import sampling_from_pb

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def propose_call_from_pb(request: draft_pb2.ProposeRequest, hidden_size: int | None) -> ProposeCall:
    """The engine's call for a Propose request (hidden states read at ``hidden_size`` wide, when the
    drafter reads any); raises ValueError for invalid sampling settings or malformed hidden states."""
    return ProposeCall(
        request.sync.cache_id,
        request.sync.start,
        list(request.sync.tokens),
        request.k,
        sampling_from_pb(request.sampling),
        request.round,
        hidden_from_pb(request.hidden, hidden_size) if hidden_size else None,
        request.sync.fence,
        request.min_confidence,
        request.ahead,
        tree_shape_from_pb(request),
    )


def tree_shape_from_pb(request: draft_pb2.ProposeRequest) -> TreeShape | None:
    """The tree a Propose request asks for, or None for a chain."""
    if not request.HasField("tree") or request.tree.nodes == 0:
        return None
    return TreeShape(request.tree.nodes, request.tree.depth, request.tree.width)


class DraftServicer(CacheServicer, draft_pb2_grpc.DraftServiceServicer):
    """Thin servicer over a DraftScheduler (batching, drafting ahead) and its DraftEngine."""

    def __init__(
        self,
        engine: DraftEngine,
        tracer: trace.Tracer,
        max_batch_rows: int = 256,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__(engine, tracer, "DraftService", executor)
        self._draft = engine
        self._scheduler = DraftScheduler(engine, self._executor, max_batch_rows)

    def session_idle(self, cache_id: str) -> None:
        """The session's turn ended: the next draft batch does not wait for it."""
        self._scheduler.idle(cache_id)

    async def _propose(self, request: draft_pb2.ProposeRequest) -> Proposal:
        """Decodes a request inside the guarded call (its hidden states may be malformed) and drafts it."""
        return await self._scheduler.propose(propose_call_from_pb(request, self._draft.hidden_size))

    async def Propose(self, request: draft_pb2.ProposeRequest, context) -> draft_pb2.ProposeReply:
        """Proposes a round's draft tokens, batched with the proposals that arrive with it."""
        with server_span(self._tracer, "DraftService/Propose", context) as span:
            span.set_attribute("specdec.k", request.k)
            proposal = await guarded(context, self._propose(request), "DraftService/Propose")
            span.set_attribute("specdec.proposed", len(proposal.tokens))
            span.set_attribute("specdec.from_ahead", proposal.from_ahead)
            span.set_attribute("specdec.looked_up", proposal.looked_up)
            return draft_pb2.ProposeReply(
                tokens=proposal.tokens,
                q=[draft_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in proposal.q],
                committed=proposal.committed,
                from_ahead=proposal.from_ahead,
                looked_up=proposal.looked_up,
                parents=proposal.parents,
            )


def _draft_dtype(config: DraftConfig, spec: str) -> torch.dtype:
    """What the draft computes in: ``--dtype``, with ``auto`` taking (on a GPU) the dtype of the
    checkpoint ``spec`` (the target a distilled draft borrows from, or a plain draft model itself)."""
    model = config.model
    checkpoint = None
    if model.dtype == "auto" and model.device != "cpu":
        checkpoint = load_config(resolve_model_path(spec, model.cache_dir))
    return resolve_dtype(model.dtype, model.device, checkpoint)


def _prepacks(config: DraftConfig, dtype: torch.dtype) -> bool:
    """Whether the draft's linear layers are prepacked: oneDNN's fp32 and bf16 kernels, on a CPU only."""
    return config.model.device == "cpu" and dtype in (torch.float32, torch.bfloat16)


def load_draft_model(config: DraftConfig) -> LoadedModel:
    """A model draft: a distilled token draft (a folder with a draft card) or any causal LM folder/file.

    A token draft is built around the target's own embedding and head, read from the target's files
    with the hash its card pins (``draft_service.target_parts``), not around the whole target.
    """
    path = resolve_model_path(config.model.model, config.model.cache_dir)
    if not (path / CARD_FILE).is_file():
        dtype = _draft_dtype(config, config.model.model)
        return load_model(
            config.model.model,
            config.model.cache_dir,
            dtype=dtype,
            pack=config.model.pack and _prepacks(config, dtype),
            device=config.model.device,
        )
    dtype = _draft_dtype(config, config.target_model)
    target, weights_hash = read_target(config.target_model, config.model.cache_dir, dtype, config.model.device)
    loaded = load_token_draft(path, target, target_hash=weights_hash)
    if config.model.pack and _prepacks(config, dtype):
        pack_linears(loaded.model)
    return loaded


def load_feature_drafter(config: DraftConfig) -> FeatureDrafter:
    """A distilled feature draft around the part of its target it borrows (embedding and head rows,
    read from the target's files with the hash its card pins: ``draft_service.target_parts``)."""
    dtype = _draft_dtype(config, config.target_model)
    target, weights_hash = read_target(config.target_model, config.model.cache_dir, dtype, config.model.device)
    path = resolve_model_path(config.model.model, config.model.cache_dir)
    draft = load_feature_draft(path, target.model, weights_hash)
    if config.int8_head and _prepacks(config, dtype) and dtype == torch.float32:  # int8 kernels take fp32 rows
        draft.quantize_head_int8()
    if config.model.pack and _prepacks(config, dtype):
        draft.pack_for_cpu()
    facts = replace(target.facts(FEATURE_KIND), name=str(path))
    drafter = FeatureDrafter(
        draft,
        facts,
        config.model.max_sessions,
        config.sample_top_k,
        lookup_min=config.lookup_min,
        tree_beam=config.tree_beam or TREE_BEAM,
        **config.model.cache_limits(),
    )
    drafter.grammar_tokenizer = target.tokenizer  # masks a constrained request's q as the target masks p
    return drafter


# The size under which a draft keeps one torch thread when its threads are "auto": the shipped
# feature and token drafts (a few million parameters of their own) step in a few milliseconds on one
# core, and a second thread would take a core the target needs.
SMALL_DRAFT_PARAMETERS = 200_000_000


def auto_draft_threads(parameters: int, cores: int, passive_wait: bool) -> int:
    """Torch threads for a draft of ``parameters`` parameters (0: n-gram lookup) on a process that may
    run on ``cores`` cores: 1 under ``SMALL_DRAFT_PARAMETERS``; for a model draft, every core when its
    idle threads sleep (``passive_wait``: it idles while the target verifies, so it takes nothing
    from the target then), else half of them, leaving the rest to a target beside it.

    A model draft is as compute-bound per token as the target (a 0.5B draft for a 1.5B target ran
    1.14x faster on 2 threads than on 1 on a 2-core machine).
    """
    if parameters < SMALL_DRAFT_PARAMETERS:
        return 1
    return max(1, cores if passive_wait else cores // 2)


def _take_auto_threads(config: DraftConfig, loaded: LoadedModel) -> None:
    """Sets torch's threads from the loaded draft's size, when the config leaves them to the draft
    (``DraftConfig.auto_threads``); called on the model's thread, as ``specdec.model_thread`` sets them."""
    if not config.auto_threads:
        return
    parameters = sum(p.numel() for p in loaded.model.parameters())
    threads = auto_draft_threads(parameters, config.cores, config.passive_wait)
    torch.set_num_threads(threads)
    log.info("draft threads: %d (auto: %.0fM parameters, %d cores)", threads, parameters / 1e6, config.cores)


def build_drafter(config: DraftConfig) -> DraftEngine:
    """The drafter a deployment asked for: a model or feature draft, or n-gram lookup in the model's
    tokenizer. A model draft whose threads are auto sets torch's threads once loaded; the other
    kinds are small (``auto_draft_threads``) and keep the one they start with."""
    if config.kind == "model":
        loaded = load_draft_model(config)
        _take_auto_threads(config, loaded)
        return ModelDrafter(
            loaded,
            config.model.max_sessions,
            config.sample_top_k,
            tree_beam=config.tree_beam or 1,
            **config.model.cache_limits(),
        )
    if config.kind == FEATURE_KIND:
        return load_feature_drafter(config)
    if config.kind != "ngram":
        raise ValueError(f"unknown draft kind {config.kind!r} (expected 'ngram', 'model' or 'feature')")
    path = resolve_model_path(config.model.model, config.model.cache_dir)
    tokenizer = load_tokenizer(path)
    model_config = load_config(path)
    facts = ModelFacts(
        name=f"ngram:{config.model.model}",
        kind="ngram",
        vocab_size=int(model_config.vocab_size),
        max_context=max_context(model_config),
        eos_token_ids=(),
        fingerprint=tokenizer_fingerprint(tokenizer),
    )
    return NgramDrafter(
        facts, config.model.max_sessions, config.ngram_max, config.ngram_min, **config.model.cache_limits()
    )


async def start_draft(
    config: DraftConfig, engine: DraftEngine, tracer: trace.Tracer, executor: ThreadPoolExecutor | None = None
) -> RunningServer:
    """Starts the draft gRPC server over a ready drafter (on ``executor``'s thread, see
    ``specdec.model_thread``) and reports it ready."""
    servicer = DraftServicer(engine, tracer, executor=executor)
    running = await start_server(
        config.server,
        lenient_service(servicer, draft_pb2.DESCRIPTOR.services_by_name["DraftService"]),
        (SERVICE_NAME,),
    )
    servicer.sweep_idle_caches(config.model.cache_idle_s)
    await running.set_serving()
    return running


def main(config: DraftConfig) -> None:
    """Entry point of ``specdec serve-draft``: load, warm, serve until SIGTERM, the model on one worker
    thread (``specdec.model_thread``)."""
    executor = model_executor("DraftService")

    def build() -> DraftEngine:
        engine = build_drafter(config)
        engine.warmup()
        return engine

    # Auto threads start at one, the count of every small draft; a model draft takes more once loaded.
    engine = on_model_thread(executor, 1 if config.auto_threads else config.model.threads, build)
    if config.server.metrics_port is not None:
        metrics = CacheServiceMetrics(engine.caches)
        start_metrics_server(metrics.registry, config.server.host, config.server.metrics_port)
    asyncio.run(serve_forever(config.server, "draft", lambda tracer: start_draft(config, engine, tracer, executor)))
