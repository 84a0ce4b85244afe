from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "session_id", "k", "resume", "request_id", "tree_nodes", "prompt_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "response_format", "top_logprobs", "n")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: Messages
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    k: int
    resume: Resume
    request_id: str
    tree_nodes: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    response_format: str
    top_logprobs: int
    n: int
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ..., k: _Optional[int] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., request_id: _Optional[str] = ..., tree_nodes: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., response_format: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("tokens", "text_chars")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    text_chars: int
    def __init__(self, tokens: _Optional[int] = ..., text_chars: _Optional[int] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "draft_ms", "verify_ms", "other_ms", "total_ms", "time_to_first_token_ms", "drafted_at_position", "accepted_at_position", "prefill_ms", "ahead_rounds", "judged_tokens", "tree_rounds", "tree_nodes", "accepted_at_depth", "accepted_at_rank", "tree_depths", "tree_levels_judged")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    OTHER_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_AT_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_AT_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    JUDGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_AT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_AT_RANK_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    TREE_LEVELS_JUDGED_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    draft_ms: float
    verify_ms: float
    other_ms: float
    total_ms: float
    time_to_first_token_ms: float
    drafted_at_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_at_position: _containers.RepeatedScalarFieldContainer[int]
    prefill_ms: float
    ahead_rounds: int
    judged_tokens: int
    tree_rounds: int
    tree_nodes: int
    accepted_at_depth: _containers.RepeatedScalarFieldContainer[int]
    accepted_at_rank: _containers.RepeatedScalarFieldContainer[int]
    tree_depths: int
    tree_levels_judged: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., other_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., time_to_first_token_ms: _Optional[float] = ..., drafted_at_position: _Optional[_Iterable[int]] = ..., accepted_at_position: _Optional[_Iterable[int]] = ..., prefill_ms: _Optional[float] = ..., ahead_rounds: _Optional[int] = ..., judged_tokens: _Optional[int] = ..., tree_rounds: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., accepted_at_depth: _Optional[_Iterable[int]] = ..., accepted_at_rank: _Optional[_Iterable[int]] = ..., tree_depths: _Optional[int] = ..., tree_levels_judged: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "session_id", "logprobs", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerationStats
    session_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., session_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class CompleteReply(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "session_id", "logprobs", "choices")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: GenerationStats
    session_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    choices: _containers.RepeatedCompositeFieldContainer[CompleteReply]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., session_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[CompleteReply, _Mapping]]] = ...) -> None: ...
