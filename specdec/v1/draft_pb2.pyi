from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("sync", "k", "sampling", "round", "hidden", "min_confidence", "ahead", "tree")
    SYNC_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    sync: _common_pb2.CacheSync
    k: int
    sampling: _common_pb2.SamplingParams
    round: int
    hidden: _common_pb2.HiddenStates
    min_confidence: float
    ahead: int
    tree: TreeShape
    def __init__(self, sync: _Optional[_Union[_common_pb2.CacheSync, _Mapping]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., round: _Optional[int] = ..., hidden: _Optional[_Union[_common_pb2.HiddenStates, _Mapping]] = ..., min_confidence: _Optional[float] = ..., ahead: _Optional[int] = ..., tree: _Optional[_Union[TreeShape, _Mapping]] = ...) -> None: ...

class TreeShape(_message.Message):
    __slots__ = ("nodes", "depth", "width")
    NODES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    depth: int
    width: int
    def __init__(self, nodes: _Optional[int] = ..., depth: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("tokens", "q", "committed", "from_ahead", "looked_up", "parents")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    FROM_AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    committed: int
    from_ahead: bool
    looked_up: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., committed: _Optional[int] = ..., from_ahead: _Optional[bool] = ..., looked_up: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...
