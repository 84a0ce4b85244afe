"""Prometheus metrics: scraped over HTTP from an in-process stack, they match the request's own stats."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from harness import InProcessStack
from prometheus_client.parser import text_string_to_metric_families

from draft_service.engine import ModelDrafter, NgramDrafter
from specdec import Client
from specdec.cli import _parser, server_config
from specdec.client import build_request
from specdec.metrics import CacheServiceMetrics, CoordinatorMetrics, start_metrics_server
from specdec.v1 import coordinator_pb2_grpc
from target_service.engine import TargetEngine

MAX_SESSIONS = 2

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample the endpoint serves, by name and sorted labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; a series not yet created counts as 0."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    """How much a sample grew between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_dir, redis_url):
    """A stack whose target and draft hold at most MAX_SESSIONS caches, with an endpoint per service.

    The n-gram draft gets some tokens accepted and some rejected on the tiny target (the random tiny
    model draft gets none), so accepted and drafted counts differ.
    """
    target = TargetEngine(tiny_target, MAX_SESSIONS)
    draft = NgramDrafter(tiny_target.facts("ngram"), MAX_SESSIONS, 3, 1)
    coordinator_metrics = CoordinatorMetrics()
    servers = {
        "coordinator": start_metrics_server(coordinator_metrics.registry, "127.0.0.1", 0),
        "target": start_metrics_server(CacheServiceMetrics(target.caches, passes=target).registry, "127.0.0.1", 0),
        "draft": start_metrics_server(CacheServiceMetrics(draft.caches).registry, "127.0.0.1", 0),
    }
    s = InProcessStack(target, draft, tiny_dir / "target", redis_url)
    try:
        s.start(metrics=coordinator_metrics)
        s.metrics_ports = {role: server.port for role, server in servers.items()}
        yield s
    finally:
        s.close()
        for server in servers.values():
            server.close()


def test_counters_match_the_request_stats(stack):
    ports = stack.metrics_ports
    before, target_before = scrape(ports["coordinator"]), scrape(ports["target"])
    with Client(stack.address, timeout=60) as client:
        result = client.complete("w7 w7 w8 w9 w10", max_new_tokens=24, k=3)
    after = scrape(ports["coordinator"])
    stats = result.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens, stats

    assert delta(after, before, "specdec:spec_decode_num_draft_tokens_total") == stats.drafted_tokens
    assert delta(after, before, "specdec:spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    # Every round that drafted proposed a token at position 0.
    assert delta(after, before, "specdec:spec_decode_num_drafts_total") == stats.drafted_at_position[0]
    assert delta(after, before, "specdec:generation_tokens_total") == stats.generated_tokens
    assert delta(after, before, "specdec:prompt_tokens_total") == stats.prompt_tokens
    assert delta(after, before, "specdec:round_duration_seconds_count") == stats.rounds
    assert delta(after, before, "specdec:verify_duration_seconds_count") == stats.rounds
    assert delta(after, before, "specdec:spec_decode_accepted_length_count") == stats.rounds
    committed = delta(after, before, "specdec:spec_decode_accepted_length_sum")
    assert committed / stats.rounds == pytest.approx(stats.mean_accepted_length)
    for position, drafted in enumerate(stats.drafted_at_position):
        name = "specdec:spec_decode_num_draft_tokens_per_pos_total"
        assert delta(after, before, name, position=str(position)) == drafted
    for position, accepted in enumerate(stats.accepted_at_position):
        name = "specdec:spec_decode_num_accepted_tokens_per_pos_total"
        assert delta(after, before, name, position=str(position)) == accepted
    assert delta(after, before, "specdec:request_success_total", finish_reason=result.finish_reason) == 1
    assert delta(after, before, "specdec:e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "specdec:target_only_fallbacks_total") == 0
    assert value(after, "specdec:num_requests_running") == 0
    assert value(after, "specdec:last_request_generation_tokens_per_second") > 0

    target = scrape(ports["target"])
    assert value(target, "specdec:active_sessions") > 0
    # The lone session's rounds, one pass each, fed its pending token and its draft tokens.
    assert delta(target, target_before, "specdec:target_passes_total") == stats.rounds
    assert delta(target, target_before, "specdec:target_rounds_verified_total") == stats.rounds
    assert delta(target, target_before, "specdec:target_pass_rows_total", kind="round") == (
        stats.rounds + stats.drafted_tokens
    )
    assert delta(target, target_before, "specdec:target_pass_rows_total", kind="prompt") == 0
    assert delta(target, target_before, "specdec:target_pass_seconds_total") > 0
    assert value(target, "specdec:kv_cache_bytes") > 0
    assert value(scrape(ports["draft"]), "specdec:active_sessions") > 0  # an n-gram draft's caches hold no KV


def test_prompt_rows_count_a_long_prompts_chunks(stack):
    """A prompt longer than the target's chunk (128) is fed by passes of its own rows: they count as
    prompt rows, all but its last token (which its first round feeds). With no session running it
    takes one pass (the budget is 256 rows)."""
    port = stack.metrics_ports["target"]
    time.sleep(1.2)  # no round within the last second: no session runs
    before = scrape(port)
    with Client(stack.address, timeout=60) as client:
        result = client.complete(" ".join(f"w{i % 30}" for i in range(200)), max_new_tokens=4, k=0)
    after = scrape(port)
    assert result.stats.prompt_tokens > 128
    assert delta(after, before, "specdec:target_pass_rows_total", kind="prompt") == result.stats.prompt_tokens - 1
    assert delta(after, before, "specdec:target_passes_total") == 1 + result.stats.rounds
    assert delta(after, before, "specdec:target_rounds_verified_total") == result.stats.rounds


def test_model_draft_kv_bytes_follow_its_caches(tiny_draft):
    engine = ModelDrafter(tiny_draft, MAX_SESSIONS, 64)
    registry = CacheServiceMetrics(engine.caches).registry
    cache_id, _ = engine.prefill([1, 2, 3, 4])
    assert registry.get_sample_value("specdec:active_sessions") == 1
    assert registry.get_sample_value("specdec:kv_cache_bytes") > 0
    engine.release(cache_id)
    assert registry.get_sample_value("specdec:active_sessions") == 0
    assert registry.get_sample_value("specdec:kv_cache_bytes") == 0


def test_evictions_count_caches_beyond_max_sessions(stack):
    ports = stack.metrics_ports
    before = {role: scrape(ports[role]) for role in ("target", "draft")}
    new_sessions = MAX_SESSIONS + 1
    with Client(stack.address, timeout=60) as client:
        for i in range(new_sessions):
            client.complete(f"w{i + 1} w2 w3", max_new_tokens=4, k=2)
    for role in ("target", "draft"):
        after = scrape(ports[role])
        held = value(before[role], "specdec:active_sessions")
        # Each request opened a new session: one new cache per service, the oldest evicted past the cap.
        expected = held + new_sessions - MAX_SESSIONS
        assert delta(after, before[role], "specdec:kv_cache_evictions_total") == expected, role
        assert value(after, "specdec:active_sessions") == MAX_SESSIONS, role


def test_metrics_port_flag_reaches_the_server_config(monkeypatch):
    monkeypatch.delenv("SPECDEC_METRICS_PORT", raising=False)
    for command in ("serve-target", "serve-draft", "serve-coordinator"):
        assert server_config(_parser().parse_args([command])).metrics_port is None
        assert server_config(_parser().parse_args([command, "--metrics-port", "9400"])).metrics_port == 9400
    monkeypatch.setenv("SPECDEC_METRICS_PORT", "9401")
    assert server_config(_parser().parse_args(["serve-target"])).metrics_port == 9401


def test_resuming_a_finished_turn_counts_the_request_once(stack):
    """A client whose stream broke after the turn had finished resumes it and gets what it missed; the
    request was counted when it finished, not again."""
    request = build_request("w7 w7 w8 w9 w10", max_new_tokens=12)
    request.request_id = "counted-once"
    before = scrape(stack.metrics_ports["coordinator"])
    with grpc.insecure_channel(stack.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        chunks = list(stub.Generate(request, timeout=60))
        request.session_id, request.resume.tokens = chunks[0].session_id, 2
        resumed = list(stub.Generate(request, timeout=60))
    after = scrape(stack.metrics_ports["coordinator"])
    assert resumed[-1].finish_reason == chunks[-1].finish_reason
    assert delta(after, before, "specdec:request_success_total", finish_reason=chunks[-1].finish_reason) == 1
    assert delta(after, before, "specdec:e2e_request_latency_seconds_count") == 1
    assert delta(after, before, "specdec:generation_tokens_total") == sum(len(c.token_ids) for c in chunks)
