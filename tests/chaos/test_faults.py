"""Chaos on loopback: real processes, real redis-server, faults injected mid-stream (tiny models).

Each fault runs 16 client streams at once through the SDK (pointed at both coordinators): 8 prompts,
each greedy and seeded sampled. Seeded sampled output depends only on (seed, committed prefix), so
both modes are checked the same way: every stream must equal the fault-free output of its request,
token for token, and none may fail. The fault lands once the streams have received a random share
of their tokens. Set SPECDEC_CHAOS_REPORT to a path (reports/chaos.json) to get the table (streams,
streams in flight at the fault as measured, failures, mismatches, recovery) as JSON.

tests/chaos/test_faults_default_model.py runs two of these faults on the real default model with
its shipped feature draft.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from cluster import Ask, Cluster, Models, Streams, write_report
from tiny import WORDS

from specdec import Aborted, Client, RetryPolicy, SpecdecError, Unavailable

MAX_NEW = 24
PAIRS = 8  # prompts per fault, each streamed greedy and seeded sampled: 16 streams
SAMPLED = {"temperature": 0.9, "seed": 1234}
_CANDIDATES = [" ".join(f"w{(7 * i + 3 * j) % 30}" for j in range(4 + i % 3)) for i in range(24)]
REPORT = os.environ.get("SPECDEC_CHAOS_REPORT")


@dataclass
class Setup:
    """A running cluster, the fault-free output of every request it is asked, and how to ask."""

    cluster: Cluster
    references: dict[Ask, list[int]]
    prompts: list[str]
    max_new: int
    sampling: dict
    model: str


def reference_outputs(cluster: Cluster, asks: list[Ask], max_new: int, sampling: dict) -> dict[Ask, list[int]]:
    """Each ask's output without faults, asked as the fault runs ask: all at once."""
    runs = Streams(cluster.coordinators, asks, max_new, sampling).start().join()
    failed = [r.error for r in runs if r.error is not None]
    assert not failed, failed
    return {r.ask: r.tokens for r in runs}


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory) -> Setup:
    with Cluster(Models.tiny(tiny_dir), tmp_path_factory.mktemp("chaos")) as cluster:
        with Client(cluster.coordinators[0], timeout=60) as client:
            # Prompts whose greedy answers run the full length, so a fault can land mid-stream.
            long = [p for p in _CANDIDATES if len(client.complete(p, max_new_tokens=MAX_NEW).token_ids) == MAX_NEW]
        assert len(long) >= PAIRS + 2, "too few tiny prompts run long enough to inject a fault mid-stream"
        prompts = long[: PAIRS + 4]
        asks = [Ask(p, sampled) for p in prompts for sampled in (False, True)]
        yield Setup(cluster, reference_outputs(cluster, asks, MAX_NEW, SAMPLED), prompts, MAX_NEW, SAMPLED, "tiny")


def run_with_fault(
    name: str,
    s: Setup,
    inject: Callable[[], None],
    after: Callable[[], None] | None = None,
    evidence: str | None = None,
    keep_streaming: bool = False,
) -> dict:
    """Streams 16 requests, injects ``inject`` at a random point mid-stream, checks and records the outcome.

    ``evidence`` is a line the coordinators must have logged after the fault, so a fault that missed
    every session cannot pass; with ``keep_streaming`` the clients send request after request until
    ``inject`` returns.
    """
    rng = random.Random(name)
    asks = [Ask(p, sampled) for p in rng.sample(s.prompts, PAIRS) for sampled in (False, True)]
    cluster = s.cluster
    logged_before = cluster.logs("coordinator").count(evidence) if evidence else 0
    until = threading.Event() if keep_streaming else None
    streams = Streams(cluster.coordinators, asks, s.max_new, s.sampling, until).start()
    total = len(asks) * s.max_new
    threshold = rng.randint(total // 8, total // 3)
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
    failed = [(r.ask, r.error) for r in runs if r.error is not None]
    mismatched = [r.ask for r in runs if r.error is None and r.tokens != s.references[r.ask]]
    in_flight = [r for r in runs if r.in_flight_at(moment)]
    # Recovery: for each stream in flight at the fault, the wait from the fault to its next chunk.
    gaps = [g for r in in_flight if (g := r.gap_after(moment)) is not None]
    entry = {
        "model": s.model,
        "streams": len(asks),
        "seeded_sampled": sum(a.sampled for a in asks),
        "max_new_tokens": s.max_new,
        "requests": len(runs),
        "in_flight_at_fault": len(in_flight),
        "failed": len(failed),
        "mismatched": len(mismatched),
        "mismatched_sampled": sum(a.sampled for a in mismatched),
        "recovery_p50_s": round(statistics.median(gaps), 3) if gaps else None,
        "recovery_max_s": round(max(gaps), 3) if gaps else None,
        "fault_after_tokens": threshold,
    }
    write_report(REPORT, "faults", {name: entry})
    print(name, entry)
    assert not failed, failed
    assert not mismatched, f"streams differ from the fault-free output: {mismatched}"
    assert in_flight, "the fault landed when no stream was running"
    if evidence:
        assert cluster.logs("coordinator").count(evidence) > logged_before, f"the fault missed: no {evidence!r}"
    return entry


def test_draft_killed_mid_stream(setup):
    c = setup.cluster
    killed = []

    def kill() -> None:
        # The replica holding the most sessions: a fixed one may hold none by then, and the fault miss.
        killed.append(c.busiest("draft"))
        c.kill(killed[0])

    run_with_fault("draft SIGKILL", setup, kill, after=lambda: c.restart(killed[0]), evidence="draft failed")


def test_draft_hangs_past_the_deadline(setup):
    # A frozen process keeps its socket open: only the draft deadline (--draft-timeout) tells the coordinator.
    c = setup.cluster
    hung = []

    def hang() -> None:
        hung.append(c.busiest("draft"))  # as above: the replica whose hang the most sessions see
        c.signal(hung[0], signal.SIGSTOP)

    run_with_fault(
        "draft hang (deadline)",
        setup,
        hang,
        after=lambda: c.signal(hung[0], signal.SIGCONT),
        evidence="DEADLINE_EXCEEDED",
    )


def test_target_killed_with_a_second_replica(setup):
    c = setup.cluster
    killed = []

    def kill() -> None:
        killed.append(c.busiest("target"))  # the one holding the most sessions
        c.kill(killed[0])

    run_with_fault("target SIGKILL", setup, kill, after=lambda: c.restart(killed[0]), evidence="moving the session")


def test_coordinator_killed_sdk_resumes(setup):
    c = setup.cluster
    run_with_fault(
        "coordinator SIGKILL", setup, lambda: c.kill("coordinator0"), after=lambda: c.restart("coordinator0")
    )


def test_redis_restarted_mid_stream(setup):
    c = setup.cluster

    def outage():
        c.kill("redis")
        # A new request meanwhile waits through bounded retries, then gets UNAVAILABLE.
        t0 = time.monotonic()
        with Client(c.coordinators[1], timeout=30, retry=RetryPolicy(attempts=1)) as client:
            with pytest.raises(Unavailable, match="session store"):
                client.complete("w1 w2", max_new_tokens=4)
        assert time.monotonic() - t0 < 15
        c.restart("redis")

    run_with_fault("redis-server restart", setup, outage, evidence="session store unreachable")


def test_sigterm_drains_in_flight_streams(setup):
    c = setup.cluster

    def drain():
        c.signal("coordinator0", signal.SIGTERM)
        # While it drains, and after, the draining coordinator takes no new call: UNAVAILABLE, or
        # CANCELLED for a call that raced the start of the shutdown; the SDK moves on after either.
        with Client(c.coordinators[0], timeout=10, retry=RetryPolicy(attempts=1)) as client:
            with pytest.raises(SpecdecError) as refused:
                for _ in range(50):
                    client.complete("w1 w2", max_new_tokens=2)
                    time.sleep(0.05)
        assert refused.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), refused.value

    run_with_fault("coordinator SIGTERM drain", setup, drain, after=lambda: c.restart("coordinator0"))


def test_rolling_restart_under_load_fails_nothing(setup):
    c = setup.cluster

    restarts = {}

    def roll():
        for name in ("coordinator0", "coordinator1", "target0"):
            t0 = time.monotonic()
            c.restart(name)
            restarts[name] = round(time.monotonic() - t0, 1)

    # SIGTERM and a fresh start, one process at a time, while clients keep sending requests.
    entry = run_with_fault("rolling restart (both coordinators, a target)", setup, roll, keep_streaming=True)
    print("rolling restart: seconds per restart", restarts)
    assert entry["requests"] > entry["streams"]
    for name in c.members:
        assert c.alive(name), c.log_tail(name)


RACE_NEW = 64
LATER, AFTER = "w5 w6", "w7"


def _words(tokens: list[int]) -> str:
    """Tiny-model token ids as the text that encodes to exactly them (a whitespace word vocabulary)."""
    return " ".join(WORDS[t] for t in tokens)


def _race(c0: str, c1: str, ask: Ask) -> dict:
    """One session, two coordinators: a second turn streams on c0 while a later turn of the same
    session, sent to c1, takes its lease. Returns what each turn produced."""
    options = SAMPLED if ask.sampled else {}
    with Client(c0, timeout=60) as first, Client(c1, timeout=60) as second:
        turn1 = first.complete(ask.prompt, max_new_tokens=4, **options)
        session = turn1.session_id
        stream = first.stream(ask.prompt, max_new_tokens=RACE_NEW, session_id=session, **options)
        received = list(next(stream).token_ids)
        later = second.complete(LATER, max_new_tokens=8, session_id=session, **options)
        aborted = None
        try:
            for chunk in stream:
                received += chunk.token_ids
        except Aborted as exc:
            aborted = str(exc)
        after = second.complete(AFTER, max_new_tokens=4, session_id=session, **options)
    return {
        "turn1": turn1.token_ids,
        "received": received,
        "aborted": aborted,
        "later": later,
        "after": after,
        "session": session,
    }


def _replay(address: str, ask: Ask, race: dict) -> str | None:
    """The same turns without a race, on fresh sessions: what each turn of ``race`` should have been.
    Returns a problem, or None."""
    options = SAMPLED if ask.sampled else {}
    words = len(ask.prompt.split())
    with Client(address, timeout=60) as client:
        turn1 = client.complete(ask.prompt, max_new_tokens=4, **options)
        if turn1.token_ids != race["turn1"]:
            return "first turn differs"
        full = client.complete(ask.prompt, max_new_tokens=RACE_NEW, session_id=turn1.session_id, **options).token_ids
        received = race["received"]
        if received != full[: len(received)] or (race["aborted"] is None and received != full):
            return f"the overtaken turn streamed {received}, not a prefix of {full}"
        # The later turn ran on the session's committed tokens: the first turn, the second turn's
        # prompt and the part of its answer committed before the later turn took the lease.
        later = race["later"]
        committed = later.stats.prompt_tokens - (2 * words + len(turn1.token_ids) + len(LATER.split()))
        if not 0 <= committed <= len(full):
            return f"the later turn ran on {later.stats.prompt_tokens} tokens"
        again = client.complete(ask.prompt, max_new_tokens=4, **options)
        text = " ".join(filter(None, [ask.prompt, _words(full[:committed]), LATER]))
        expected = client.complete(text, max_new_tokens=8, session_id=again.session_id, **options)
        if expected.stats.prompt_tokens != later.stats.prompt_tokens or expected.token_ids != later.token_ids:
            return f"the later turn answered {later.token_ids}, the same context without a race {expected.token_ids}"
    return None


def test_two_coordinators_racing_for_one_session(setup):
    """16 sessions at once (greedy and seeded sampled), each with a turn streaming on one coordinator
    overtaken by a later turn on the other. The later turn wins and the older one gets ABORTED; what
    each turn produced is checked against the same turns run without a race: the overtaken turn's
    tokens are a prefix of its fault-free answer, and the later turn's answer equals the fault-free
    answer to the context it ran on (the committed part of the overtaken turn included)."""
    c0, c1 = setup.cluster.coordinators
    asks = [Ask(p, sampled) for p in random.Random("race").sample(setup.prompts, PAIRS) for sampled in (False, True)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(asks)) as pool:
        races = list(pool.map(lambda a: _race(c0, c1, a), asks))
    seconds = time.monotonic() - t0
    with ThreadPoolExecutor(len(asks)) as pool:
        problems = [p for p in pool.map(lambda pair: _replay(c0, *pair), zip(asks, races)) if p]
    aborted = [r for r in races if r["aborted"] is not None]
    entry = {
        "model": setup.model,
        "streams": len(asks),
        "seeded_sampled": PAIRS,
        "max_new_tokens": RACE_NEW,
        "requests": 4 * len(asks),
        "in_flight_at_fault": len(aborted),
        "failed": 0,
        "mismatched": len(problems),
        "aborted_as_expected": len(aborted),
        "seconds": round(seconds, 1),
    }
    write_report(REPORT, "faults", {"two coordinators racing for one session": entry})
    print("race", entry)
    assert all("newer turn" in r["aborted"] for r in aborted), [r["aborted"] for r in aborted]
    # Nearly every overtaken turn is still streaming when the later one arrives; one that finished
    # first was no race, and its whole answer is checked instead.
    assert len(aborted) >= len(asks) - 2, len(aborted)
    for race in races:
        assert race["later"].session_id == race["after"].session_id == race["session"]
        assert race["after"].token_ids
    assert problems == []


def second_half_growth(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each sampled process's RSS growth over the second half of the run: the median of the last three
    samples against the median of the three at the midpoint (none with fewer than 8 samples).

    A leak grows through the whole run; memory that fills a bounded cache (oneDNN's kernels, one per
    batch shape met: ``specdec.packed_linear``) grows only until the cache is full. Medians, because a
    target's RSS moves some 15 MiB up and down from one sample to the next as passes come and go."""
    if len(samples) < 8:
        return {}
    mid = len(samples) // 2

    def median(rows: list[dict[str, float]], name: str) -> float:
        return statistics.median(row[name] for row in rows)

    return {n: round(median(samples[-3:], n) / median(samples[mid - 1 : mid + 2], n) - 1, 3) for n in samples[0]}


def test_soak_no_errors_flat_memory_caches_released(setup):
    """Many clients, many requests each: no error, every answer right, each process's resident memory
    within 10% of its post-warm-up value (and the targets' within 5% over the run's second half), and
    every cache released once the sessions expire.
    `make soak` (SPECDEC_SOAK=full) runs 32 clients x 100 requests; the default is smaller."""
    clients, per_client = (32, 100) if os.environ.get("SPECDEC_SOAK") == "full" else (8, 12)
    new_tokens = 12
    cluster = setup.cluster
    prompts = setup.prompts
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
                if got != setup.references[Ask(prompt)][:new_tokens]:
                    problems.append(f"{prompt}: wrong tokens")
        return problems

    def wave(requests: int) -> list[str]:
        with ThreadPoolExecutor(clients) as pool:
            return [p for problems in pool.map(lambda i: client_run(i, requests), range(clients)) for p in problems]

    # Warm-up: every process meets the full load long enough for its heap to settle.
    assert wave(10 if clients == 32 else 4) == []
    before = {n: cluster.rss_bytes(n) for n in services}
    t0 = time.monotonic()
    # The targets' resident memory through the run, every 5 s.
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(5.0):
            samples.append({n: round(cluster.rss_bytes(n) / 2**20, 1) for n in services if n.startswith("target")})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        problems = wave(per_client)
    finally:
        done.set()
        sampler.join()
    seconds = time.monotonic() - t0
    after = {n: cluster.rss_bytes(n) for n in services}
    growth = {n: round(after[n] / before[n] - 1, 3) for n in services}
    late = second_half_growth(samples)
    deadline = time.monotonic() + 60
    held = {}
    while time.monotonic() < deadline:
        held = {n: cluster.metric(n, "specdec:active_sessions") for n in services if not n.startswith("coord")}
        if not any(held.values()):
            break
        time.sleep(1)
    entry = {
        "clients": clients,
        "requests": clients * per_client,
        "new_tokens": new_tokens,
        "errors": len(problems),
        "seconds": round(seconds, 1),
        "rss_mb_before": {n: round(v / 2**20, 1) for n, v in before.items()},
        "rss_mb_after": {n: round(v / 2**20, 1) for n, v in after.items()},
        "rss_growth": growth,
        "target_rss_growth_second_half": late,
        "target_rss_mb_every_5s": samples,
        "caches_held_after_expiry": held,
    }
    write_report(REPORT, "soak", {"full" if clients == 32 else "short": entry})
    print("soak", entry)
    assert problems == []
    assert all(g <= 0.10 for g in growth.values()), growth
    assert all(g <= 0.05 for g in late.values()), late
    assert not any(held.values()), held
