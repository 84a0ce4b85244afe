"""Conversions between protocol messages and core types that more than one service uses (no torch:
the coordinator uses them too; hidden states convert in ``specdec.hidden_wire``)."""

from __future__ import annotations

from collections.abc import Iterable

from specdec.batching import PassLoad
from specdec.sampling_params import Sampling, TokenLogprob, check_penalties, check_sampling
from specdec.v1 import common_pb2, target_pb2
from specdec.vocab import ModelFacts


def sampling_from_pb(msg: common_pb2.SamplingParams) -> Sampling:
    """Core sampling settings from the wire; top_p and repetition_penalty 0 (unset) read as 1 (off).
    The logit bias's token ids are the engines' to bound: they know their vocabulary."""
    top_p = msg.top_p if msg.top_p > 0 else 1.0
    repetition = msg.repetition_penalty if msg.repetition_penalty != 0 else 1.0
    check_sampling(msg.temperature, msg.top_k, top_p, "sampling.")
    bias = tuple(sorted(msg.logit_bias.items()))
    check_penalties(msg.presence_penalty, msg.frequency_penalty, repetition, bias, None, "sampling.")
    return Sampling(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=top_p,
        seed=msg.seed,
        coupled=msg.coupled,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=repetition,
        logit_bias=bias,
        output_start=msg.output_start,
        response_format=msg.response_format,
    )


def sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    """Wire form of sampling settings."""
    return common_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        coupled=sampling.coupled,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias),
        output_start=sampling.output_start,
        response_format=sampling.response_format,
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


def logprobs_to_pb(entries: Iterable[TokenLogprob], field) -> None:
    """Appends ``entries`` to ``field``, a repeated ``TokenLogprob`` of a message being built."""
    for entry in entries:
        field.add(
            token=entry.token,
            logprob=entry.logprob,
            top_ids=[t for t, _ in entry.top],
            top_logprobs=[lp for _, lp in entry.top],
        )


def logprobs_from_pb(field: Iterable[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    """The ``TokenLogprob`` entries of a repeated message field."""
    return [TokenLogprob(m.token, m.logprob, tuple(zip(m.top_ids, m.top_logprobs))) for m in field]
