"""specdec: speculative decoding split across gRPC services.

The client SDK lives here: ``from specdec import Client, AsyncClient``.
"""

from specdec.client import (
    Aborted,
    AsyncClient,
    Chunk,
    Client,
    Completion,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    RetryPolicy,
    SessionNotFound,
    SpecdecError,
    Stats,
    Unauthenticated,
    Unavailable,
)
from specdec.config import TlsClientConfig

__all__ = [
    "Aborted",
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "InvalidArgument",
    "ResourceExhausted",
    "RetryPolicy",
    "SessionNotFound",
    "SpecdecError",
    "Stats",
    "TlsClientConfig",
    "Unauthenticated",
    "Unavailable",
]
