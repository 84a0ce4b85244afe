from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "coupled", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "output_start", "response_format")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COUPLED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    coupled: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    output_start: int
    response_format: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., coupled: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., output_start: _Optional[int] = ..., response_format: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_ids", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class CacheSync(_message.Message):
    __slots__ = ("cache_id", "start", "tokens", "fence")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    fence: int
    def __init__(self, cache_id: _Optional[str] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., fence: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "max_context", "eos_token_ids", "tokenizer_fingerprint", "kind", "side_layers", "trees")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIDE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_fingerprint: str
    kind: str
    side_layers: _containers.RepeatedScalarFieldContainer[int]
    trees: bool
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_fingerprint: _Optional[str] = ..., kind: _Optional[str] = ..., side_layers: _Optional[_Iterable[int]] = ..., trees: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("tokens", "return_hidden", "fence", "feed_now", "hidden_side_layers", "prompt_logprobs", "fork_of")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    FEED_NOW_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIDE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    return_hidden: bool
    fence: int
    feed_now: bool
    hidden_side_layers: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    fork_of: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., return_hidden: _Optional[bool] = ..., fence: _Optional[int] = ..., feed_now: _Optional[bool] = ..., hidden_side_layers: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., fork_of: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("cache_id", "committed", "hidden", "prompt_logprobs", "copied")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COPIED_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    committed: int
    hidden: HiddenStates
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    copied: int
    def __init__(self, cache_id: _Optional[str] = ..., committed: _Optional[int] = ..., hidden: _Optional[_Union[HiddenStates, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., copied: _Optional[int] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("start", "dim", "fp16")
    START_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    FP16_FIELD_NUMBER: _ClassVar[int]
    start: int
    dim: int
    fp16: bytes
    def __init__(self, start: _Optional[int] = ..., dim: _Optional[int] = ..., fp16: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("cache_id", "keep_cache")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_CACHE_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    keep_cache: bool
    def __init__(self, cache_id: _Optional[str] = ..., keep_cache: _Optional[bool] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
