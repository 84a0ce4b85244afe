"""Replica discovery: spec parsing, DNS re-resolution with a fake resolver, the Kubernetes watch
against a fake API server through the real ``kubernetes`` client, replica sets that follow them, and
a coordinator whose replicas come and go through the Kubernetes API."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
import redis
import torch
from fake_kubernetes import FakeKubernetesApi, endpoint_slice
from harness import InProcessStack

from coordinator.cli import coordinator_config
from coordinator.discovery import DnsSource, KubernetesSource, join_host_port, parse_replicas, parse_spec
from coordinator.membership import Membership, Refused
from coordinator.replicas import CacheRef, ReplicaSet
from coordinator.sessions import SessionRecord
from draft_service.engine import NgramDrafter
from specdec import Client
from specdec.cli import _parser
from specdec.config import CoordinatorConfig, DnsDiscovery, KubernetesDiscovery
from specdec.vocab import ModelFacts
from target_service.engine import TargetEngine

FACTS = ModelFacts("tiny", "target", 32, 256, (1,), "same-tokenizer")


async def until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Waits for ``condition`` on the running loop, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        await asyncio.sleep(0.01)


class FakeReplica:
    """Stands in for a draft or target replica: an address, an in-flight flag, a closed flag."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.busy = False
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def follow(source, replicas: ReplicaSet, check=None, retry_s: float = 0.2) -> tuple[Membership, list[FakeReplica]]:
    """A started membership of fake replicas (every one made is also kept in the returned list)."""
    made: list[FakeReplica] = []

    def make(address: str) -> FakeReplica:
        made.append(FakeReplica(address))
        return made[-1]

    async def accept(replica: FakeReplica) -> ModelFacts:
        return FACTS

    membership = Membership("target", source, replicas, make, check or accept, retry_s)
    membership.start()
    return membership, made


# --- spec strings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10.0.0.1:50052", "10.0.0.1:50052"),
        ("target.serving.svc:50052", "target.serving.svc:50052"),
        ("[::1]:50052", "[::1]:50052"),
        ("dns:///spec-target.serving.svc.cluster.local:5", DnsDiscovery("spec-target.serving.svc.cluster.local", 5)),
        ("dns:///[fd00::1]:7", DnsDiscovery("fd00::1", 7)),
        ("k8s:///serving/spec-target:50052", KubernetesDiscovery("serving", "spec-target", 50052)),
        ("k8s:///serving/spec-target:grpc", KubernetesDiscovery("serving", "spec-target", "grpc")),
    ],
)
def test_specs_parse(text, expected):
    assert parse_spec(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("target", "expected host:port"),
        ("target:", "expected host:port"),
        ("target:http", "port must be a number"),
        ("target:70000", "port must be a number from 1 to 65535"),
        ("::1:50052", "IPv6 address in brackets"),
        ("consul:///target:1", "unknown scheme 'consul'"),
        ("dns://8.8.8.8/target:1", "naming a DNS server is not supported"),
        ("dns:///target", "expected host:port"),
        ("k8s://cluster/ns/svc:1", "naming a cluster is not supported"),
        ("k8s:///spec-target:50052", "not a Kubernetes name"),
        ("k8s:///Serving/spec-target:50052", "namespace 'Serving' is not a Kubernetes name"),
        ("k8s:///serving/spec_target:50052", "service 'spec_target' is not a Kubernetes name"),
        ("k8s:///serving/spec-target:0", "port must be a number from 1 to 65535"),
        ("k8s:///serving/spec-target:Grpc!", "port must be a number or a Service port name"),
    ],
)
def test_bad_specs_are_refused_clearly(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_spec(text)


def test_a_service_has_a_list_or_one_discovery_spec():
    assert parse_replicas(["a:1", "b:2"], "--target") == (("a:1", "b:2"), None)
    assert parse_replicas(["dns:///t:1"], "--target") == ((), DnsDiscovery("t", 1))
    with pytest.raises(ValueError, match="--target: a dns:/// or k8s:/// spec .* give it once"):
        parse_replicas(["dns:///t:1", "a:1"], "--target")
    with pytest.raises(ValueError, match="--draft 'x': expected"):
        parse_replicas(["x"], "--draft")
    with pytest.raises(ValueError, match="list or from discovery, not both"):
        CoordinatorConfig(target_addresses=("a:1",), target_discovery=DnsDiscovery("t", 1))
    with pytest.raises(ValueError, match="discovery interval"):
        CoordinatorConfig(discovery_interval_s=0)


def test_cli_reads_discovery_specs_and_names_the_bad_flag():
    parser = _parser()
    config = coordinator_config(
        parser.parse_args(
            [
                "serve-coordinator",
                "--draft",
                "k8s:///serving/spec-draft:grpc",
                "--target",
                "dns:///spec-target.serving.svc:50052",
                "--discovery-interval",
                "2.5",
            ]
        )
    )
    assert config.draft_discovery == KubernetesDiscovery("serving", "spec-draft", "grpc")
    assert config.target_discovery == DnsDiscovery("spec-target.serving.svc", 50052)
    assert config.draft_addresses == config.target_addresses == () and config.discovery_interval_s == 2.5
    static = coordinator_config(parser.parse_args(["serve-coordinator", "--draft", "d:1", "--target", "t:2"]))
    assert (static.draft_addresses, static.target_addresses, static.target_discovery) == (("d:1",), ("t:2",), None)
    with pytest.raises(SystemExit, match="--target 'dns:///t'"):
        coordinator_config(parser.parse_args(["serve-coordinator", "--target", "dns:///t"]))


# --- replica sets ------------------------------------------------------------------------------


def test_replica_set_membership_changes_move_sessions_and_close_idle_channels():
    replicas = ReplicaSet([FakeReplica("a"), FakeReplica("b")], rest_s=60)
    a = replicas.by_address["a"]
    replicas.hold(None, "a")
    assert replicas.retire("a") is a and replicas.retire("a") is None
    replicas.add(FakeReplica("c"))
    # The departed replica is never usable again; its session moves to the least busy member.
    assert not replicas.usable("a") and replicas.pick(CacheRef("a", "x", 3)).address in ("b", "c")
    assert replicas.find("a") is a  # a call already placed there may still finish
    a.busy = True
    assert replicas.sweep() == [] and a in replicas.everyone()
    a.busy = False
    assert replicas.sweep() == [a] and replicas.find("a") is None and a not in replicas.everyone()
    replicas.hold("a", "c")  # the session moved off the departed replica
    replicas.hold(None, "b")
    # Back again, the address holds nothing: the least busy replica for a new session.
    replicas.add(FakeReplica("a"))
    assert replicas.pick(None).address == "a" and replicas.by_address["a"] is not a
    with pytest.raises(ValueError, match="already a member"):
        replicas.add(FakeReplica("a"))
    for address in ("a", "b", "c"):
        replicas.retire(address)
    assert len(replicas) == 0 and replicas.pick(None) is None


# --- DNS ---------------------------------------------------------------------------------------


def test_dns_follows_joins_and_leaves_and_keeps_the_last_set_through_blips():
    answers: dict[str, object] = {"now": ["10.0.0.1", "10.0.0.2"]}
    asked = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        now = answers["now"]
        if isinstance(now, Exception):
            raise now
        return [join_host_port(ip, port) for ip in now]

    async def scenario():
        replicas: ReplicaSet[FakeReplica] = ReplicaSet([])
        source = DnsSource(DnsDiscovery("spec-target.serving.svc", 50052), 0.05, resolve)
        membership, made = follow(source, replicas)
        try:

            def members() -> set[str]:
                return set(replicas.by_address)

            await until(lambda: members() == {"10.0.0.1:50052", "10.0.0.2:50052"}, what="first lookup")
            assert asked[0] == ("spec-target.serving.svc", 50052)
            answers["now"] = ["10.0.0.2", "10.0.0.3", "fd00::4"]
            await until(lambda: members() == {"10.0.0.2:50052", "10.0.0.3:50052", "[fd00::4]:50052"}, what="join")
            left = next(r for r in made if r.address == "10.0.0.1:50052")
            assert not replicas.usable(left.address)
            await until(lambda: left.closed, what="the idle departed channel closing")
            # A failing or empty lookup is a blip: every known replica stays.
            for blip in (OSError("Temporary failure in name resolution"), []):
                answers["now"] = blip
                seen = len(asked)
                await until(lambda seen=seen: len(asked) >= seen + 3, what="lookups during the blip")
                assert members() == {"10.0.0.2:50052", "10.0.0.3:50052", "[fd00::4]:50052"}
            answers["now"] = ["10.0.0.3"]
            await until(lambda: members() == {"10.0.0.3:50052"}, what="leave")
            assert replicas.pick(CacheRef("10.0.0.2:50052", "x", 1)).address == "10.0.0.3:50052"
        finally:
            await membership.stop()

    asyncio.run(scenario())


# --- membership checks ---------------------------------------------------------------------------


class ScriptedSource:
    """A source the test publishes through."""

    def __init__(self) -> None:
        self.publish = None

    async def run(self, publish) -> None:
        self.publish = publish
        await asyncio.Event().wait()


def test_joining_replicas_are_checked_first_and_mismatches_skipped(caplog):
    verdicts: dict[str, object] = {
        "good:1": FACTS,
        "other-model:1": Refused("tokenizer differs"),
        "flaky:1": OSError("not ready"),
    }
    checks: list[str] = []

    async def check(replica: FakeReplica) -> ModelFacts:
        checks.append(replica.address)
        await asyncio.sleep(0.01)
        verdict = verdicts[replica.address]
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    async def scenario():
        source = ScriptedSource()
        replicas: ReplicaSet[FakeReplica] = ReplicaSet([])
        membership, made = follow(source, replicas, check, retry_s=0.1)
        try:
            await until(lambda: source.publish is not None)
            source.publish(frozenset({"good:1", "other-model:1", "flaky:1"}))
            assert (await membership.first_facts(5.0)) == FACTS
            await until(lambda: checks.count("flaky:1") >= 2, what="the unready replica's retry")
            assert set(replicas.by_address) == {"good:1"}
            assert checks.count("other-model:1") == 1  # refused for good while it stays listed
            # The first three made are the first checks; only the one that joined keeps its channel.
            assert [r.closed for r in made[:3]] == [r.address != "good:1" for r in made[:3]]
            verdicts["flaky:1"] = FACTS
            await until(lambda: "flaky:1" in replicas.by_address, what="the retried replica joining")
            # A replica that leaves while it is being checked never joins.
            verdicts["brief:1"] = FACTS
            source.publish(frozenset({"good:1", "flaky:1", "brief:1"}))
            await until(lambda: "brief:1" in checks)
            source.publish(frozenset({"good:1", "flaky:1"}))
            await asyncio.sleep(0.1)
            assert set(replicas.by_address) == {"good:1", "flaky:1"}
            assert next(r for r in made if r.address == "brief:1").closed
        finally:
            await membership.stop()

    with caplog.at_level(logging.INFO, logger="coordinator.membership"):
        asyncio.run(scenario())
    assert "target replica other-model:1 skipped: tokenizer differs" in caplog.text


def test_start_up_waits_for_a_first_target_and_gives_up_in_time():
    async def scenario():
        source = ScriptedSource()
        membership, _ = follow(source, ReplicaSet([]))
        try:
            await until(lambda: source.publish is not None)
            source.publish(frozenset())
            with pytest.raises(TimeoutError, match="no target replica joined within 0s \\(none listed\\)"):
                await membership.first_facts(0.2)
            assert await membership.settled(1.0)  # an empty answer is an answer
        finally:
            await membership.stop()

    asyncio.run(scenario())


# --- Kubernetes --------------------------------------------------------------------------------


@pytest.fixture
def kube():
    api = FakeKubernetesApi("serving")
    yield api
    api.close()


def test_kubernetes_watch_follows_ready_endpoints(kube):
    kube.put(endpoint_slice("target-a", "spec-target", [("10.0.0.1", True, False)], 50052))
    kube.put(endpoint_slice("draft-a", "spec-draft", [("10.0.9.9", True, False)], 50051))

    async def scenario():
        replicas: ReplicaSet[FakeReplica] = ReplicaSet([])
        source = KubernetesSource(KubernetesDiscovery("serving", "spec-target", 50052), 0.2, kube.api_client())
        membership, made = follow(source, replicas)

        def members() -> set[str]:
            return set(replicas.by_address)

        try:
            await until(lambda: members() == {"10.0.0.1:50052"}, what="the listed replica")
            await until(lambda: kube.open_watches == 1, what="the watch")
            # Joining: a new slice with one ready and one unready endpoint (an unset ready is ready).
            kube.put(
                endpoint_slice("target-b", "spec-target", [("10.0.0.2", None, None), ("10.0.0.3", False, False)], 50052)
            )
            await until(lambda: members() == {"10.0.0.1:50052", "10.0.0.2:50052"}, what="the join")
            session = CacheRef("10.0.0.1:50052", "c1", 5)
            assert replicas.pick(session).address == "10.0.0.1:50052"
            # Becoming unready: the session moves to the other replica.
            kube.put(endpoint_slice("target-a", "spec-target", [("10.0.0.1", False, False)], 50052))
            await until(lambda: members() == {"10.0.0.2:50052"}, what="the unready endpoint leaving")
            assert replicas.pick(session).address == "10.0.0.2:50052"
            # Terminating (even if still ready) leaves; a recovered endpoint joins again.
            kube.put(
                endpoint_slice("target-b", "spec-target", [("10.0.0.2", True, True), ("10.0.0.3", True, False)], 50052)
            )
            await until(lambda: members() == {"10.0.0.3:50052"}, what="the terminating endpoint leaving")
            assert replicas.pick(CacheRef("10.0.0.2:50052", "c2", 5)).address == "10.0.0.3:50052"
            # Leaving: a deleted slice, then an endpoint removed from its slice.
            kube.put(endpoint_slice("target-a", "spec-target", [("10.0.0.1", True, False)], 50052))
            await until(lambda: members() == {"10.0.0.1:50052", "10.0.0.3:50052"}, what="the rejoin")
            kube.delete("target-b")
            await until(lambda: members() == {"10.0.0.1:50052"}, what="the deleted slice leaving")
            kube.put(endpoint_slice("target-a", "spec-target", [], 50052))
            await until(lambda: members() == set(), what="the removed endpoint leaving")
            assert replicas.pick(None) is None
            # Another service's slices never count.
            kube.put(endpoint_slice("draft-b", "spec-draft", [("10.0.9.8", True, False)], 50051))
            await asyncio.sleep(0.2)
            assert members() == set() and "10.0.9.9:50051" not in {r.address for r in made}
            assert kube.lists == 1  # all of it came through one watch
        finally:
            await membership.stop()

    asyncio.run(scenario())


def test_kubernetes_watch_relists_after_expiry_and_errors(kube):
    kube.put(endpoint_slice("target-a", "spec-target", [("fd00::1", True, False)], 7000, address_type="IPv6"))

    async def scenario():
        seen: list[frozenset[str]] = []
        source = KubernetesSource(KubernetesDiscovery("serving", "spec-target", "grpc"), 0.2, kube.api_client())
        task = asyncio.create_task(source.run(seen.append))
        try:
            await until(lambda: seen == [frozenset({"[fd00::1]:7000"})], what="the named port of an IPv6 slice")
            await until(lambda: kube.open_watches == 1, what="the watch")
            # A change the watch never reports, then the watch expires: only a fresh list shows it.
            kube.put_quietly(
                endpoint_slice("target-a", "spec-target", [("fd00::2", True, False)], 7001, address_type="IPv6")
            )
            kube.expire_watches()
            await until(lambda: seen[-1] == frozenset({"[fd00::2]:7001"}), what="the re-list")
            assert kube.lists == 2
            await until(lambda: kube.open_watches == 1, what="the watch resumed")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_kubernetes_watch_retries_an_unreachable_api_with_backoff(kube, caplog):
    kube.close()  # nothing listens there any more
    from kubernetes import client

    async def scenario():
        seen: list[frozenset[str]] = []
        dead = client.ApiClient(client.Configuration(host=kube.url))
        source = KubernetesSource(KubernetesDiscovery("serving", "spec-target", 50052), 0.1, dead)
        task = asyncio.create_task(source.run(seen.append))
        # Wait for two failed lists rather than a fixed time: on a loaded machine each refused
        # connection takes longer, and the test is about retrying, not about its speed.
        for _ in range(200):
            if caplog.text.count("listing again in 0.5s") >= 2:
                break
            await asyncio.sleep(0.05)
        assert not task.done() and seen == []  # still trying, publishing nothing it does not know
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.WARNING, logger="coordinator.discovery"):
        asyncio.run(scenario())
    assert caplog.text.count("listing again in 0.5s") >= 2


# --- a coordinator over replicas found through the Kubernetes API ------------------------------


def _record(redis_url: str, session_id: str) -> SessionRecord:
    return SessionRecord.from_json(redis.Redis.from_url(redis_url).get(f"specdec:session:{session_id}"))


def _greedy(loaded, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_coordinator_moves_sessions_when_replicas_leave(tiny_target, tiny_dir, redis_url, kube):
    facts = tiny_target.facts("ngram")
    stack = InProcessStack(TargetEngine(tiny_target, 8), NgramDrafter(facts, 8, 3, 1), tiny_dir / "target", redis_url)
    try:
        target_a, target_b = stack.add_target(stack.target_engine), stack.add_target(TargetEngine(tiny_target, 8))
        draft_a, draft_b = stack.add_draft(stack.draft_engine), stack.add_draft(NgramDrafter(facts, 8, 3, 1))
        # Each loopback replica has its own port, so each gets its own slice; a named port finds it.
        kube.put(endpoint_slice("target-a", "spec-target", [("127.0.0.1", True, False)], _port(target_a)))
        kube.put(endpoint_slice("draft-a", "spec-draft", [("127.0.0.1", True, False)], _port(draft_a)))
        address = stack.add_coordinator(
            kubernetes_api=kube.api_client(),
            draft_addresses=(),
            target_addresses=(),
            draft_discovery=KubernetesDiscovery("serving", "spec-draft", "grpc"),
            target_discovery=KubernetesDiscovery("serving", "spec-target", "grpc"),
            discovery_interval_s=0.2,
        )
        (loop,) = stack.round_loops
        with Client(address, timeout=30) as client:
            first = client.complete("w1 w2 w3 w1 w2", max_new_tokens=6, k=2)
            record = _record(redis_url, first.session_id)
            assert (record.target.address, record.draft.address) == (target_a, draft_a)
            # Target A turns unready and draft A's slice goes; B of each joins.
            kube.put(endpoint_slice("target-a", "spec-target", [("127.0.0.1", False, False)], _port(target_a)))
            kube.delete("draft-a")
            kube.put(endpoint_slice("target-b", "spec-target", [("127.0.0.1", True, False)], _port(target_b)))
            kube.put(endpoint_slice("draft-b", "spec-draft", [("127.0.0.1", True, False)], _port(draft_b)))
            deadline = time.monotonic() + 10
            while loop.router.members() != ({draft_b}, {target_b}):
                assert time.monotonic() < deadline, loop.members()
                time.sleep(0.02)
            second = client.complete("w4 w5", max_new_tokens=6, k=2, session_id=first.session_id)
        record = _record(redis_url, first.session_id)
        # The session moved: a fresh target cache on B (prefilled from the committed tokens) and a
        # fresh draft cache on draft B; the output is still exactly the target's greedy continuation.
        assert (record.target.address, record.draft.address) == (target_b, draft_b)
        assert second.stats.drafted_tokens > 0
        prompt = record.tokens[: record.turn.prompt_len]
        assert second.token_ids == _greedy(tiny_target, prompt, 6)
    finally:
        stack.close()
