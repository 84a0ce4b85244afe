"""Conversions between protocol messages and core types that more than one service uses (no torch:
the coordinator uses them too; hidden states convert in ``specdec.hidden_wire``)."""

from __future__ import annotations

from specdec.batching import PassLoad
from specdec.sampling_params import Sampling, check_sampling
from specdec.v1 import common_pb2, target_pb2
from specdec.vocab import ModelFacts


def sampling_from_pb(msg: common_pb2.SamplingParams) -> Sampling:
    """Core sampling settings from the wire; top_p 0 (unset) reads as 1 (off)."""
    top_p = msg.top_p if msg.top_p > 0 else 1.0
    check_sampling(msg.temperature, msg.top_k, top_p, "sampling.")
    return Sampling(temperature=msg.temperature, top_k=msg.top_k, top_p=top_p, seed=msg.seed, coupled=msg.coupled)


def sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    """Wire form of sampling settings."""
    return common_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        coupled=sampling.coupled,
    )


def facts_to_pb(facts: ModelFacts) -> common_pb2.ModelInfo:
    """Wire form of model facts."""
    return common_pb2.ModelInfo(
        name=facts.name,
        kind=facts.kind,
        vocab_size=facts.vocab_size,
        max_context=facts.max_context,
        eos_token_ids=list(facts.eos_token_ids),
        tokenizer_fingerprint=facts.fingerprint,
        side_layers=list(facts.side_layers),
        trees=facts.trees,
    )


def facts_from_pb(msg: common_pb2.ModelInfo) -> ModelFacts:
    """Model facts from the wire."""
    return ModelFacts(
        name=msg.name,
        kind=msg.kind,
        vocab_size=msg.vocab_size,
        max_context=msg.max_context,
        eos_token_ids=tuple(msg.eos_token_ids),
        fingerprint=msg.tokenizer_fingerprint,
        side_layers=tuple(msg.side_layers),
        trees=msg.trees,
    )


def pass_load_to_pb(load: PassLoad) -> target_pb2.PassLoad:
    """A verdict's pass load for the wire."""
    return target_pb2.PassLoad(
        sessions=load.sessions,
        rows=load.rows,
        others_committed=load.others_committed,
        pass_ms=load.pass_ms,
        curve_ms=load.curve_ms,
        alone_ms=load.alone_ms,
        queue_ms=load.queue_ms,
        fed_rows=load.fed_rows,
    )


def pass_load_from_pb(msg: target_pb2.PassLoad) -> PassLoad:
    """A verdict's pass load from the wire."""
    return PassLoad(
        msg.sessions,
        msg.rows,
        msg.others_committed,
        msg.pass_ms,
        list(msg.curve_ms),
        list(msg.alone_ms),
        msg.queue_ms,
        msg.fed_rows,
    )
