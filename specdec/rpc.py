"""gRPC plumbing the three services share: options, TLS, health, reflection, errors, and shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

# The client-side channel helpers; the services import them from here too.
from specdec.channels import (  # noqa: F401
    RECONNECT_BACKOFF,
    aio_channel,
    channel_credentials,
    channel_options,
    read_pem,
)
from specdec.config import ServerConfig
from specdec.errors import CacheBehind, CacheBudgetExceeded, CacheNotFound, StaleFence
from specdec.tracing import make_tracer_provider
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

# gRPC status for each error the cores raise; anything else is a bug and surfaces as INTERNAL.
_STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (CacheNotFound, grpc.StatusCode.NOT_FOUND),
    (CacheBehind, grpc.StatusCode.FAILED_PRECONDITION),
    (StaleFence, grpc.StatusCode.ABORTED),
    (CacheBudgetExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(
    exc: BaseException, table: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = _STATUS_OF
) -> grpc.StatusCode | None:
    """The gRPC status an exception maps to in ``table`` (by default the cores' errors), or None for
    an unexpected one."""
    for kind, code in table:
        if isinstance(exc, kind):
            return code
    return None


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Message-size limits and keepalives for a server."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config's PEM files (demanding client certificates when a client CA
    is set), or None to serve plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    client_ca = read_pem(config.tls_client_ca)
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


async def call_core(context: grpc.aio.ServicerContext, executor: Executor, fn: Callable[[], T]) -> T:
    """Runs a core call on the model's executor, turning its errors into gRPC statuses."""
    return await guarded(context, asyncio.get_running_loop().run_in_executor(executor, fn), fn)


async def guarded(context: grpc.aio.ServicerContext, work: Awaitable[T], what: object) -> T:
    """Awaits core work, turning its errors into gRPC statuses (``what`` names it in the log)."""
    try:
        return await work
    except Exception as exc:  # noqa: BLE001 - every error must reach the caller as a status
        await context.abort(error_status(exc, what), str(exc))
        raise AssertionError("unreachable") from exc


def error_status(exc: Exception, what: object) -> grpc.StatusCode:
    """The status a core error is answered with: its own (``status_of``), or INTERNAL for an
    unexpected one, which is logged with its traceback (``what`` names the call)."""
    code = status_of(exc)
    if code is None:
        log.exception("unexpected error in %s", getattr(what, "__qualname__", what), exc_info=exc)
        code = grpc.StatusCode.INTERNAL
    return code


async def batch_item(work: Awaitable[T], what: object) -> T | common_pb2.CallError:
    """Awaits one request of a batched call: its result, or the ``CallError`` its error would have
    ended a call of it alone with (see ``guarded``)."""
    try:
        return await work
    except Exception as exc:  # noqa: BLE001 - every error must reach the caller as a status
        return common_pb2.CallError(code=error_status(exc, what).value[0], message=str(exc))


@dataclass
class RunningServer:
    """A started gRPC server with its health servicer and the port it bound."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]
    # The plaintext health-only server and its port, when the config asks for one.
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None

    async def set_serving(self) -> None:
        """Reports every service ready (call once the model is loaded and warmed)."""
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Graceful stop: health goes NOT_SERVING, in-flight calls get ``grace_s`` to finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the call can be answered INVALID_ARGUMENT."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(message_type) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, RuntimeError, ValueError) as exc:
            return _Undecodable(str(exc) or "malformed protobuf")

    return parse


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: could not parse: {request.error}")


def _guarded_unary(method):
    async def handle(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        return await method(request, context)

    return handle


def _guarded_stream(method):
    async def handle(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        async for reply in method(request, context):
            yield reply

    return handle


def lenient_service(servicer: object, service: ServiceDescriptor) -> Callable[[grpc.aio.Server], None]:
    """Registers ``servicer``'s implementation of every method of ``service`` so that request bytes
    that do not parse get INVALID_ARGUMENT; gRPC's own parsing would answer INTERNAL."""
    handlers = {}
    for method in service.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        implementation = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _guarded_stream(implementation), _lenient(request_type), serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _guarded_unary(implementation), _lenient(request_type), serialize
            )

    def register(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))

    return register


async def start_server(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    service_names: tuple[str, ...],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RunningServer:
    """Starts an aio server with health (NOT_SERVING until told) and reflection registered, over TLS
    when the config names a certificate; ``interceptors`` see every call, health and reflection included."""
    server = grpc.aio.server(interceptors=interceptors, options=server_options(config.max_message_bytes))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{config.host}:{config.port}"
    credentials = server_credentials(config)
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    await server.start()
    health_server, health_port = None, None
    if config.health_port is not None:
        # Kubelet's gRPC probes speak plaintext only: health alone is served there, from the same
        # servicer, so the probes see exactly what TLS clients see and nothing else is exposed.
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(f"{config.host}:{config.health_port}")
        if health_port == 0:
            await server.stop(0)
            raise OSError(f"could not bind the health port {config.host}:{config.health_port}")
        await health_server.start()
    running = RunningServer(server, health_servicer, port, service_names, health_server, health_port)
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return running


async def serve_until_signal(running: RunningServer, grace_s: float) -> None:
    """Blocks until SIGINT or SIGTERM, then stops gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received; draining for up to %.1fs", grace_s)
    await running.stop(grace_s)


async def serve_forever(
    config: ServerConfig, label: str, start: Callable[[trace.Tracer], Awaitable[RunningServer]]
) -> None:
    """Runs one service process: tracing from config, start, announce the port, drain on SIGTERM."""
    provider = make_tracer_provider(f"specdec-{label}", config.otlp_endpoint)
    running = await start(provider.get_tracer(f"specdec.{label}"))
    log.info("%s service ready on %s:%d", label, config.host, running.port)
    # The launcher reads this line to learn the bound port.
    print(f"READY {config.host}:{running.port}", flush=True)
    try:
        await serve_until_signal(running, config.grace_s)
    finally:
        provider.shutdown()


async def wait_ready(
    address: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None, tls_name: str | None = None
) -> None:
    """Polls an address's health service until it reports SERVING, or raises TimeoutError.

    The short reconnect backoff matters here: with gRPC's default, a replica still loading its model
    for 15 s was found serving 11 s after it was (default target, this machine).
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aio_channel(address, RECONNECT_BACKOFF, credentials, tls_name) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        last = "no answer yet"
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            except grpc.aio.AioRpcError as error:
                # Kept for the timeout message: a TLS mismatch otherwise looks like a slow start.
                last = f"{error.code().name}: {error.details()}"
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} did not become ready within {timeout_s:.0f}s ({last})")
            await asyncio.sleep(0.2)
