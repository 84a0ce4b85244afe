"""Traces leave every service by OTLP/gRPC, as Jaeger would receive them (a Python collector stands in)."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from specdec import Client
from specdec.stack import LocalStack, StackConfig


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span with the service.name of its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def test_otlp_export_carries_services_tree_and_round_attributes(tiny_dir, tmp_path):
    collector = Collector()
    server = grpc.server(ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    model = str(tiny_dir / "target")
    config = StackConfig(
        target_model=model,
        draft_kind="ngram",  # no draft model named: n-gram lookup speaks the target's tokenizer
        cache_dir=tmp_path,
        target_threads=1,
        otlp_endpoint=f"127.0.0.1:{port}",
        default_k=2,
    )
    try:
        with LocalStack(config, log_dir=tmp_path) as stack, Client(stack.address) as client:
            result = client.complete("w1 w2 w3 w1 w2", max_new_tokens=10)
        # The stack has stopped: every service flushed its spans on the way out.
    finally:
        server.stop(1)
    by_service = defaultdict(list)
    for service, span in collector.spans:
        by_service[service].append(span)
    assert {"specdec-coordinator", "specdec-draft", "specdec-target"} <= set(by_service)
    roots = [s for s in by_service["specdec-coordinator"] if s.name == "specdec.generate"]
    assert len(roots) == 1
    root = roots[0]
    trace_spans = [s for _, s in collector.spans if s.trace_id == root.trace_id]
    rounds = [s for s in trace_spans if s.name == "specdec.round"]
    assert len(rounds) == result.stats.rounds and all(r.parent_span_id == root.span_id for r in rounds)
    round_ids = {r.span_id for r in rounds}
    # The request's verifies, each under its round (the coordinator's start-up probe verifies too, in
    # traces of its own).
    verifies = [
        s for s in by_service["specdec-target"] if s.name == "TargetService/Verify" and s.trace_id == root.trace_id
    ]
    assert len(verifies) == result.stats.rounds and all(v.parent_span_id in round_ids for v in verifies)
    attrs = {a.key for a in rounds[0].attributes}
    assert {"specdec.k", "specdec.accepted", "specdec.draft_ms", "specdec.verify_ms"} <= attrs
    root_attrs = {a.key: a.value for a in root.attributes}
    assert root_attrs["gen_ai.usage.output_tokens"].int_value == len(result.token_ids)
