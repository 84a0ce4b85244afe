"""OpenTelemetry set-up and W3C trace-context propagation over gRPC metadata.

Each service builds its own TracerProvider from config and passes tracers down; nothing here touches
the global provider, so tests can give every in-process server one in-memory exporter.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


def make_tracer_provider(
    service_name: str, otlp_endpoint: str | None, exporter: SpanExporter | None = None
) -> TracerProvider:
    """A provider for one service: exports by OTLP/gRPC when an endpoint is set, else not at all.

    ``exporter`` overrides the OTLP one (tests pass an in-memory exporter).
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None and otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return provider


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata for an outgoing call."""
    return tuple(trace_carrier().items())


def trace_carrier() -> dict[str, str]:
    """The current trace context as W3C headers (``traceparent``, ``tracestate``)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def incoming_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's trace context, read from a call's invocation metadata."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return propagate.extract(carrier)


def server_span(tracer: trace.Tracer, name: str, context: grpc.aio.ServicerContext):
    """A SERVER span for one RPC, parented on the caller's span when the call carries one."""
    return carried_span(tracer, name, context.invocation_metadata())


def carried_span(tracer: trace.Tracer, name: str, carrier: Sequence[tuple[str, str | bytes]] | None):
    """A SERVER span parented on the trace context ``carrier`` holds (a call's metadata, or the
    ``trace_context`` a request of a batched call carries), if any."""
    return tracer.start_as_current_span(name, context=incoming_context(carrier), kind=trace.SpanKind.SERVER)
