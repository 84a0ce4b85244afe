"""Chaos on loopback: real processes, real redis-server, faults injected mid-stream.

Each test runs several client streams through the SDK (pointed at both coordinators), injects one
fault once the streams have received a random number of tokens, and checks every stream against
the fault-free output of the same request: no failed request, no missing or duplicated token.
Set SPECDEC_CHAOS_REPORT to a path to get the table (streams, failures, mismatches, recovery) as JSON.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster import Cluster, Streams

from specdec import Aborted, Client, RetryPolicy, SpecdecError, Unavailable

MAX_NEW = 160
STREAMS = 4
SAMPLED = {"temperature": 0.9, "seed": 1234}
_CANDIDATES = [" ".join(f"w{(7 * i + 3 * j) % 30}" for j in range(4 + i % 3)) for i in range(24)]
_report: dict[str, dict] = {}


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    with Cluster(tiny_dir, tmp_path_factory.mktemp("chaos")) as running:
        yield running
    path = os.environ.get("SPECDEC_CHAOS_REPORT")
    if path:
        with open(path, "w") as out:
            json.dump(_report, out, indent=2)


@pytest.fixture(scope="module")
def references(cluster) -> dict[tuple[str, bool], list[int]]:
    """Fault-free outputs of long-running prompts, greedy and seeded sampled."""
    out: dict[tuple[str, bool], list[int]] = {}
    with Client(cluster.coordinators[0], timeout=60) as client:
        for prompt in _CANDIDATES:
            greedy = client.complete(prompt, max_new_tokens=MAX_NEW).token_ids
            if len(greedy) >= MAX_NEW // 2:
                out[(prompt, False)] = greedy
                out[(prompt, True)] = client.complete(prompt, max_new_tokens=MAX_NEW, **SAMPLED).token_ids
            if len(out) == 2 * (STREAMS + 2):
                break
    assert len(out) >= 2 * STREAMS, "too few tiny prompts run long enough to inject a fault mid-stream"
    return out


def _prompts(references, count: int = STREAMS) -> list[str]:
    prompts = sorted({p for p, _ in references})
    return random.Random(len(_report)).sample(prompts, count)


def _run_with_fault(
    name: str,
    cluster: Cluster,
    references,
    inject: Callable[[], None],
    sampled: bool = False,
    after: Callable[[], None] | None = None,
    evidence: str | None = None,
    keep_streaming: bool = False,
) -> None:
    """Streams, injects ``inject`` at a random point mid-stream, checks and records the outcome.

    ``evidence`` is a line the coordinators must have logged after the fault, so a fault that missed
    every session cannot pass; with ``keep_streaming`` the clients send request after request until
    ``inject`` returns.
    """
    prompts = _prompts(references)
    logged_before = cluster.logs("coordinator").count(evidence) if evidence else 0
    until = threading.Event() if keep_streaming else None
    streams = Streams(cluster.coordinators, prompts, MAX_NEW, until, **(SAMPLED if sampled else {})).start()
    threshold = random.Random(name).randint(STREAMS * 4, STREAMS * 30)
    streams.wait_received(threshold)
    moment = time.monotonic()
    try:
        inject()
    finally:
        if until is not None:
            until.set()
    try:
        runs = streams.join()
    finally:
        if after is not None:
            after()
    failed = [r.error for _, r in runs if r.error is not None]
    mismatched = [p for p, r in runs if r.error is None and r.tokens != references[(p, sampled)]]
    # Recovery: for each stream in flight at the fault, the wait for its next chunk.
    gaps = [g for _, r in runs if r.arrivals and r.arrivals[0] < moment and (g := r.gap_after(moment)) is not None]
    _report[name] = {
        "requests": len(runs),
        "in_flight_at_fault": len(prompts),
        "failed": len(failed),
        "mismatched": len(mismatched),
        "recovery_p50_s": round(statistics.median(gaps), 3) if gaps else None,
        "recovery_max_s": round(max(gaps), 3) if gaps else None,
        "fault_after_tokens": threshold,
    }
    print(name, _report[name])
    assert not failed, failed
    assert not mismatched, f"streams differ from the fault-free output: {mismatched}"
    if evidence:
        assert cluster.logs("coordinator").count(evidence) > logged_before, f"the fault missed: no {evidence!r}"


def test_draft_killed_mid_stream(cluster, references):
    _run_with_fault(
        "draft SIGKILL",
        cluster,
        references,
        lambda: cluster.kill("draft0"),
        after=lambda: cluster.restart("draft0"),
        evidence="draft failed",
    )


def test_draft_hangs_past_the_deadline(cluster, references):
    # A frozen process keeps its socket open: only the deadline tells the coordinator.
    _run_with_fault(
        "draft hang (deadline)",
        cluster,
        references,
        lambda: cluster.signal("draft1", signal.SIGSTOP),
        after=lambda: cluster.signal("draft1", signal.SIGCONT),
        evidence="DEADLINE_EXCEEDED",
    )


def test_target_killed_with_a_second_replica(cluster, references):
    _run_with_fault(
        "target SIGKILL",
        cluster,
        references,
        lambda: cluster.kill("target0"),
        after=lambda: cluster.restart("target0"),
        evidence="moving the session",
    )


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampled"])
def test_coordinator_killed_sdk_resumes(cluster, references, sampled):
    _run_with_fault(
        f"coordinator SIGKILL ({'seeded sampled' if sampled else 'greedy'})",
        cluster,
        references,
        lambda: cluster.kill("coordinator0"),
        sampled=sampled,
        after=lambda: cluster.restart("coordinator0"),
    )


def test_redis_restarted_mid_stream(cluster, references):
    def outage():
        cluster.kill("redis")
        # A new request meanwhile waits through bounded retries, then gets UNAVAILABLE.
        t0 = time.monotonic()
        with Client(cluster.coordinators[1], timeout=30, retry=RetryPolicy(attempts=1)) as client:
            with pytest.raises(Unavailable, match="session store"):
                client.complete("w1 w2", max_new_tokens=4)
        assert time.monotonic() - t0 < 15
        cluster.restart("redis")

    _run_with_fault("redis-server restart", cluster, references, outage, evidence="session store unreachable")


def test_sigterm_drains_in_flight_streams(cluster, references):
    def drain():
        cluster.signal("coordinator0", signal.SIGTERM)
        # While it drains, and after, the draining coordinator takes no new call: UNAVAILABLE, or
        # CANCELLED for a call that raced the start of the shutdown; the SDK moves on after either.
        with Client(cluster.coordinators[0], timeout=10, retry=RetryPolicy(attempts=1)) as client:
            with pytest.raises(SpecdecError) as refused:
                for _ in range(50):
                    client.complete("w1 w2", max_new_tokens=2)
                    time.sleep(0.05)
        assert refused.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), refused.value

    _run_with_fault(
        "coordinator SIGTERM drain", cluster, references, drain, after=lambda: cluster.restart("coordinator0")
    )


def test_rolling_restart_under_load_fails_nothing(cluster, references):
    def roll():
        for name in ("coordinator0", "coordinator1", "target0"):
            cluster.restart(name)

    # SIGTERM and a fresh start, one process at a time, while clients keep sending requests.
    _run_with_fault("rolling restart (both coordinators, a target)", cluster, references, roll, keep_streaming=True)
    for name in cluster.members:
        assert cluster.alive(name), cluster.log_tail(name)


def test_two_coordinators_racing_for_one_session(cluster, references):
    prompt = _prompts(references, 1)[0]
    c0, c1 = cluster.coordinators
    with Client(c0, timeout=60) as first, Client(c1, timeout=60) as second:
        session = first.complete(prompt, max_new_tokens=4).session_id
        stream = first.stream(prompt, max_new_tokens=MAX_NEW, session_id=session)
        received = next(stream).token_ids
        # A second turn of the same session, on the other coordinator, takes the session's lease.
        later = second.complete("w5 w6", max_new_tokens=8, session_id=session)
        assert later.session_id == session and later.token_ids
        with pytest.raises(Aborted, match="newer turn"):
            for chunk in stream:
                received += chunk.token_ids
        # The stale turn stopped short of its answer; the session goes on with the later turn.
        assert len(received) < MAX_NEW
        after = second.complete("w7", max_new_tokens=4, session_id=session)
        assert after.session_id == session


def test_soak_no_errors_flat_memory_caches_released(cluster, references):
    """Many clients, many requests each: no error, every answer right, each process's resident memory
    within 10% of its post-warm-up value, and every cache released once the sessions expire.
    SPECDEC_SOAK=full runs the 32 clients x 100 requests of the closing note; the default is smaller."""
    clients, per_client = (32, 100) if os.environ.get("SPECDEC_SOAK") == "full" else (8, 12)
    new_tokens = 12
    prompts = sorted({p for p, _ in references})
    services = [n for n in cluster.members if n != "redis"]

    def client_run(index: int, requests: int) -> list[str]:
        problems = []
        with Client(cluster.coordinators, timeout=120, retry=RetryPolicy(attempts=1)) as client:
            for i in range(requests):
                prompt = prompts[(index + i) % len(prompts)]
                try:
                    got = client.complete(prompt, max_new_tokens=new_tokens).token_ids
                except Exception as exc:  # noqa: BLE001 - every failure is reported
                    problems.append(f"{prompt}: {exc}")
                    continue
                if got != references[(prompt, False)][:new_tokens]:
                    problems.append(f"{prompt}: wrong tokens")
        return problems

    def wave(requests: int) -> list[str]:
        with ThreadPoolExecutor(clients) as pool:
            return [p for problems in pool.map(lambda i: client_run(i, requests), range(clients)) for p in problems]

    # Warm-up: every process meets the full load long enough for its heap to settle.
    assert wave(10 if clients == 32 else 4) == []
    before = {n: cluster.rss_bytes(n) for n in services}
    t0 = time.monotonic()
    problems = wave(per_client)
    seconds = time.monotonic() - t0
    after = {n: cluster.rss_bytes(n) for n in services}
    growth = {n: round(after[n] / before[n] - 1, 3) for n in services}
    deadline = time.monotonic() + 60
    held = {}
    while time.monotonic() < deadline:
        held = {n: cluster.metric(n, "specdec:active_sessions") for n in services if not n.startswith("coord")}
        if not any(held.values()):
            break
        time.sleep(1)
    _report["soak"] = {
        "clients": clients,
        "requests": clients * per_client,
        "errors": len(problems),
        "seconds": round(seconds, 1),
        "rss_mb_before": {n: round(v / 2**20, 1) for n, v in before.items()},
        "rss_mb_after": {n: round(v / 2**20, 1) for n, v in after.items()},
        "caches_held_after_expiry": held,
    }
    print("soak", _report["soak"])
    assert problems == []
    assert all(g <= 0.10 for g in growth.values()), growth
    assert not any(held.values()), held
