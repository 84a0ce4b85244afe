"""specdec: speculative decoding split across gRPC services.

The client SDK lives here: ``from specdec import Client, AsyncClient``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def __getattr__(name: str):
    """The SDK's names, imported on first use: code that imports only the model modules (a draft's
    training on a GPU machine, say) needs neither grpc nor protobuf."""
    if name not in __all__:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    module = "specdec.config" if name == "TlsClientConfig" else "specdec.client"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
