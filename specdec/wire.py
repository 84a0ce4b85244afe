"""Conversions between protocol messages and core types that more than one service uses."""

from __future__ import annotations

from specdec.models import ModelFacts
from specdec.sampling import Sampling
from specdec.v1 import common_pb2


def sampling_from_pb(msg: common_pb2.SamplingParams) -> Sampling:
    """Core sampling settings from the wire; top_p 0 (unset) reads as 1 (off)."""
    top_p = msg.top_p if msg.top_p > 0 else 1.0
    if msg.temperature < 0:
        raise ValueError("sampling.temperature must be >= 0")
    if msg.top_k < 0:
        raise ValueError("sampling.top_k must be >= 0")
    if top_p > 1:
        raise ValueError("sampling.top_p must lie in (0, 1]")
    return Sampling(temperature=msg.temperature, top_k=msg.top_k, top_p=top_p, seed=msg.seed)


def sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    """Wire form of sampling settings."""
    return common_pb2.SamplingParams(
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed
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
    )
