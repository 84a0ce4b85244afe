"""specdec: speculative decoding split across gRPC services.

The client SDK lives here: ``from specdec import Client, AsyncClient``.
"""

from specdec.client import (
    AsyncClient,
    Chunk,
    Client,
    Completion,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    SessionNotFound,
    SpecdecError,
    Stats,
    Unauthenticated,
    Unavailable,
)
from specdec.config import TlsClientConfig

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "InvalidArgument",
    "ResourceExhausted",
    "SessionNotFound",
    "SpecdecError",
    "Stats",
    "TlsClientConfig",
    "Unauthenticated",
    "Unavailable",
]
