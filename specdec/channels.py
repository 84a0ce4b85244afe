"""Client-side gRPC channels: options, reconnect backoff and TLS credentials.

The client SDK needs these and nothing else of ``specdec.rpc``, which also holds the servers' health,
reflection and tracing, so they live apart: ``import specdec.client`` needs only grpcio and protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from specdec.config import TlsClientConfig

# gRPC's reconnect backoff grows to minutes while a peer is down; a restarted coordinator or replica,
# or a service that finishes loading its model, must be found within a second, inside any caller's
# retry budget.
RECONNECT_BACKOFF = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Message-size limits and keepalives for a client channel."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        *RECONNECT_BACKOFF,
    ]


def read_pem(path: Path | str | None) -> bytes | None:
    """A PEM file's bytes (a plain string path is accepted too), or None when no path is set."""
    return None if path is None else Path(path).read_bytes()


def channel_credentials(tls: TlsClientConfig | None) -> grpc.ChannelCredentials | None:
    """Client TLS credentials from PEM files, or None for a plaintext channel."""
    if tls is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca), private_key=read_pem(tls.key), certificate_chain=read_pem(tls.cert)
    )


def aio_channel(
    address: str,
    options: Sequence[tuple[str, int | str]] = (),
    credentials: grpc.ChannelCredentials | None = None,
    tls_name: str | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel: TLS when ``credentials`` are given, plaintext otherwise.

    ``tls_name`` is the name the server's certificate must carry when it differs from the address's
    host (a replica found by discovery is dialled by IP, but its certificate names its Service).
    """
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls_name:
        options = [*options, ("grpc.ssl_target_name_override", tls_name)]
    return grpc.aio.secure_channel(address, credentials, options=options)
