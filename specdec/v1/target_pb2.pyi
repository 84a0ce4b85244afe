from specdec.v1 import common_pb2 as _common_pb2
from specdec.v1 import draft_pb2 as _draft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("sync", "draft_tokens", "q", "sampling", "round", "return_hidden", "hidden_side_layers", "draft_parents", "top_logprobs", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SYNC_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIDE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    sync: _common_pb2.CacheSync
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_draft_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    round: int
    return_hidden: bool
    hidden_side_layers: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, sync: _Optional[_Union[_common_pb2.CacheSync, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_draft_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., round: _Optional[int] = ..., return_hidden: _Optional[bool] = ..., hidden_side_layers: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyBatchReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyBatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyBatchResult, _Mapping]]] = ...) -> None: ...

class VerifyBatchResult(_message.Message):
    __slots__ = ("reply", "error")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reply: VerifyReply
    error: _common_pb2.CallError
    def __init__(self, reply: _Optional[_Union[VerifyReply, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.CallError, _Mapping]] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("accepted", "tokens", "committed", "hidden", "load", "accepted_nodes", "logprobs")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    committed: int
    hidden: _common_pb2.HiddenStates
    load: PassLoad
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, accepted: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., committed: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., load: _Optional[_Union[PassLoad, _Mapping]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PassLoad(_message.Message):
    __slots__ = ("sessions", "rows", "others_committed", "pass_ms", "curve_ms", "alone_ms", "queue_ms", "fed_rows")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    OTHERS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    PASS_MS_FIELD_NUMBER: _ClassVar[int]
    CURVE_MS_FIELD_NUMBER: _ClassVar[int]
    ALONE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FED_ROWS_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    rows: int
    others_committed: int
    pass_ms: float
    curve_ms: _containers.RepeatedScalarFieldContainer[float]
    alone_ms: _containers.RepeatedScalarFieldContainer[float]
    queue_ms: float
    fed_rows: int
    def __init__(self, sessions: _Optional[int] = ..., rows: _Optional[int] = ..., others_committed: _Optional[int] = ..., pass_ms: _Optional[float] = ..., curve_ms: _Optional[_Iterable[float]] = ..., alone_ms: _Optional[_Iterable[float]] = ..., queue_ms: _Optional[float] = ..., fed_rows: _Optional[int] = ...) -> None: ...
