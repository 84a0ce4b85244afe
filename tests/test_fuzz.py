"""Property-based fuzzing of the coordinator in process, and of every service over real gRPC (tiny models).

In process, Hypothesis draws 10,000 requests at the coordinator's own request handlers (the lenient
parsing, the servicer, validation, turns and the round loop over in-process tiny backends), hundreds
a second: 8,000 structured GenerateRequests for both methods and 2,000 raw byte strings. A request
that is not valid gets INVALID_ARGUMENT; the only other statuses are NOT_FOUND for a session id that
names no session and FAILED_PRECONDITION for a resume of a turn that is not running. Never UNKNOWN,
INTERNAL or an exception out of a handler.

Over real gRPC (real Redis), Hypothesis draws every field of the coordinator's, the target's and the
draft's requests, and raw bytes for every method. Whatever comes in, the answer is OK or a documented
status, never UNKNOWN or INTERNAL; every service stays SERVING and still gives the right answer afterwards.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import pytest
from cluster import write_report
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import InProcessStack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace

from coordinator.admission import Admission
from coordinator.policy import SpeculationConfig, SpeculationPolicy
from coordinator.rounds import RoundLoop
from coordinator.routing import Router
from coordinator.server import CoordinatorServicer, register
from coordinator.sessions import MemorySessionStore
from coordinator.turns import Turns
from draft_service.engine import ModelDrafter
from draft_service.inprocess import InProcessDraft
from specdec import Client
from specdec.config import AdmissionLimits
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, target_pb2
from target_service.engine import TargetEngine
from target_service.inprocess import InProcessTarget

# What a caller may be told. UNAVAILABLE is not here: no service may go away under fuzzing.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
}
# Over gRPC: SPECDEC_FUZZ=full draws 10,200 requests; the default run draws half, to keep the suite within
# its time. In process: 10,000 requests on every run.
_FULL = {"coordinator": 3200, "target": 1500, "draft": 1500, "raw": 4000}
EXAMPLES = _FULL if os.environ.get("SPECDEC_FUZZ") == "full" else {k: n // 2 for k, n in _FULL.items()}
IN_PROCESS = {"fields": 8000, "bytes": 2000}  # requests; drawn PER_EXAMPLE at a time
_sent: dict[str, int] = {}
_grpc_seconds: list[float] = []


@contextmanager
def _grpc_timer():
    """Adds the block's seconds to the gRPC fuzzing's time."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        _grpc_seconds.append(time.monotonic() - t0)


_common = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


def fuzz(what: str) -> settings:
    """Deterministic settings (the same cases on every run) drawing EXAMPLES[what] requests."""
    return settings(_common, max_examples=EXAMPLES[what])


def fuzz_in_process(what: str) -> settings:
    """As ``fuzz``, for IN_PROCESS[what] requests drawn PER_EXAMPLE to an example."""
    return settings(_common, max_examples=-(-IN_PROCESS[what] // PER_EXAMPLE))


u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
# Mostly small values, so the valid requests among them finish fast; the rest span the whole type.
small_or_any = st.one_of(st.integers(0, 6), u32)
token_ids = st.lists(st.one_of(st.integers(0, 40), i32), max_size=12)


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_draft, tiny_dir, redis_url):
    s = InProcessStack(TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url)
    s.start()
    yield s
    s.close()


def _call(channel: grpc.Channel, method: str, request: bytes, what: str) -> grpc.StatusCode:
    """Sends serialized ``request`` to ``method``, reading a stream to its end; returns the status."""
    _sent[what] = _sent.get(what, 0) + 1
    streaming = method.endswith("/Generate")
    rpc = (channel.unary_stream if streaming else channel.unary_unary)(method)
    try:
        reply = rpc(request, timeout=5)
        if streaming:
            for _ in reply:
                pass
    except grpc.RpcError as exc:
        assert exc.code() in DOCUMENTED, f"{method}: {exc.code()} {exc.details()}"
        return exc.code()
    return grpc.StatusCode.OK


sampling = st.builds(
    common_pb2.SamplingParams, temperature=floats, top_k=i32, top_p=floats, seed=st.integers(0, 2**64 - 1)
)
messages = st.lists(
    st.builds(
        coordinator_pb2.ChatMessage,
        role=st.sampled_from(["user", "system", "assistant", "", "x"]),
        content=st.text(max_size=30),
    ),
    max_size=3,
)


@st.composite
def generate_requests(draw) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=draw(small_or_any),
        temperature=draw(floats),
        top_k=draw(i32),
        stop=draw(st.lists(st.text(max_size=5), max_size=3)),
        session_id=draw(st.one_of(st.just(""), st.text(max_size=20))),
        request_id=draw(st.text(max_size=10)),
    )
    prompt = draw(st.sampled_from(["text", "messages", "none"]))
    if prompt == "text":
        request.text = draw(
            st.one_of(st.text(max_size=40), st.lists(st.sampled_from(["w1", "w2", "w9"]), max_size=8).map(" ".join))
        )
    elif prompt == "messages":
        request.messages.messages.extend(draw(messages))
        request.messages.SetInParent()
    for name, strategy in (("top_p", floats), ("seed", st.integers(0, 2**64 - 1)), ("k", i32)):
        if draw(st.booleans()):
            setattr(request, name, draw(strategy))
    if draw(st.booleans()):
        request.resume.tokens, request.resume.text_chars = draw(small_or_any), draw(small_or_any)
    return request


def sync(draw) -> common_pb2.CacheSync:
    return common_pb2.CacheSync(
        cache_id=draw(st.text(max_size=12)),
        start=draw(small_or_any),
        tokens=draw(token_ids),
        fence=draw(st.integers(0, 2**64 - 1)),
    )


@st.composite
def verify_requests(draw) -> target_pb2.VerifyRequest:
    q = [
        draft_pb2.SparseDistribution(token_ids=draw(token_ids), probs=draw(st.lists(floats, max_size=4)))
        for _ in range(draw(st.integers(0, 3)))
    ]
    return target_pb2.VerifyRequest(
        sync=sync(draw),
        draft_tokens=draw(token_ids),
        q=q,
        sampling=draw(sampling),
        round=draw(u32),
        return_hidden=draw(st.booleans()),
    )


@st.composite
def propose_requests(draw) -> draft_pb2.ProposeRequest:
    hidden = common_pb2.HiddenStates(start=draw(u32), dim=draw(u32), fp16=draw(st.binary(max_size=64)))
    return draft_pb2.ProposeRequest(
        sync=sync(draw),
        k=draw(small_or_any),
        sampling=draw(sampling),
        round=draw(u32),
        hidden=hidden,
        min_confidence=draw(floats),
    )


@st.composite
def prefill_requests(draw) -> common_pb2.PrefillRequest:
    return common_pb2.PrefillRequest(
        tokens=draw(token_ids), return_hidden=draw(st.booleans()), fence=draw(st.integers(0, 2**64 - 1))
    )


def test_coordinator_fields(stack):
    with grpc.insecure_channel(stack.address) as channel:

        @fuzz("coordinator")
        @given(request=generate_requests(), streaming=st.booleans())
        def run(request, streaming):
            method = "/specdec.v1.Coordinator/" + ("Generate" if streaming else "Complete")
            _call(channel, method, request.SerializeToString(), "coordinator")

        with _grpc_timer():
            run()


# --- the coordinator in process: 10,000 requests at its own handlers, no network ----------------


class _Abort(Exception):
    """What ``context.abort`` raises, as grpc.aio's does: the handler ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the coordinator's handlers use: an open coordinator's
    caller on loopback, no deadline."""

    def invocation_metadata(self):
        return ()

    def auth_context(self):
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, metadata) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise _Abort(code, details)


class InProcessCoordinator:
    """The coordinator's registered handlers (lenient parsing, servicer, round loop) over in-process
    tiny backends and an in-memory store, called directly with request bytes."""

    def __init__(self, target_model, draft_model) -> None:
        target = InProcessTarget(TargetEngine(target_model, 64))
        router = Router([InProcessDraft(ModelDrafter(draft_model, 64, 64))], [target])
        policy = SpeculationPolicy(SpeculationConfig(), live_targets=lambda: 1)
        facts = target_model.facts("target")
        turns = Turns(target_model.tokenizer, facts, MemorySessionStore(3600))
        loop = RoundLoop(target_model.tokenizer, facts, router, policy, turns, trace.NoOpTracer())
        servicer = CoordinatorServicer(loop, facts.max_context, Admission(AdmissionLimits()))
        server = SimpleNamespace(handlers=[])
        server.add_generic_rpc_handlers = server.handlers.extend
        register(servicer)(server)
        (generic,) = server.handlers
        self._handlers = {
            name: generic.service(SimpleNamespace(method=f"/specdec.v1.Coordinator/{name}", invocation_metadata=()))
            for name in ("Generate", "Complete")
        }
        self._loop = asyncio.new_event_loop()

    def call(self, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
        """The status (and details) of one call with serialized ``payload``; an exception out of the
        handler propagates (the test fails on it)."""
        handler = self._handlers[method]
        request = handler.request_deserializer(payload)

        async def run():
            if handler.unary_stream is not None:
                async for reply in handler.unary_stream(request, _Context()):
                    handler.response_serializer(reply)
            else:
                handler.response_serializer(await handler.unary_unary(request, _Context()))

        try:
            self._loop.run_until_complete(run())
        except _Abort as abort:
            return abort.code, abort.details
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        self._loop.close()


@pytest.fixture(scope="module")
def in_process(tiny_target, tiny_draft):
    coordinator = InProcessCoordinator(tiny_target, tiny_draft)
    # A real session, so that some requests continue (or try to resume) one that exists.
    reply = coordinator_pb2.CompleteReply()
    handler = coordinator._handlers["Complete"]
    request = coordinator_pb2.GenerateRequest(text="w1 w2 w3", max_new_tokens=2)

    async def first():
        return await handler.unary_unary(request, _Context())

    reply = coordinator._loop.run_until_complete(first())
    coordinator.session_id = reply.session_id
    yield coordinator
    coordinator.close()


_in_process_seen: dict[str, dict[str, int]] = {}
# Requests one drawn example carries: Hypothesis draws one byte string per example and the requests
# are read from it (FuzzedDataProvider style), so the per-example cost of drawing is shared.
PER_EXAMPLE = 16
CHUNK = 40  # bytes each structured request reads; past a chunk's end it reads zeros

_FLOATS = [
    0.0,
    -0.0,
    1e-45,
    1e-38,
    1e-5,
    1e-4,
    0.5,
    0.9,
    1.0,
    1.5,
    2.0,
    100.0,
    3.4e38,
    -1.0,
    -1e-4,
    float("inf"),
    float("-inf"),
    float("nan"),
]
_INTS = [0, 1, 2, 3, 4, 5, 8, 31, 32, 33, 64, 255, 256, 1000, 2**31 - 1, -1, -2, -(2**31)]
_TEXTS = [
    "",
    "w1",
    "w1 w2 w3",
    "w9 w9 w9 w9 w9 w9 w9 w9",
    " ".join(["w3"] * 300),
    "\x00",
    "\x00w1",
    "é ü ∂",
    "<eos>",
    "<eos> w1",
    "w1\nw2\tw3",
    "x" * 300,
    "\ud7ff",
    "w1 <unk> w2",
    "   ",
    "w29 w28",
]
_ROLES = ["user", "system", "assistant", "", "User", "tool", "\x00"]


class Reader:
    """Reads a request's fields from fuzzer bytes: each field takes one selector byte, choosing an
    interesting value (boundaries, extremes, NaN) most of the time and a raw value of the field's
    whole type otherwise; past the end it reads zeros."""

    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def take(self, n: int) -> bytes:
        chunk = self._data[self._at : self._at + n]
        self._at += n
        return chunk.ljust(n, b"\0")

    def byte(self) -> int:
        return self.take(1)[0]

    def pick(self, pool: list):
        return pool[self.byte() % len(pool)]

    def chance(self, percent: int) -> bool:
        return self.byte() * 100 < percent * 256

    def int32(self) -> int:
        return self.pick(_INTS) if self.chance(80) else int.from_bytes(self.take(4), "little", signed=True)

    def uint32(self) -> int:
        return abs(self.pick(_INTS)) if self.chance(80) else int.from_bytes(self.take(4), "little")

    def float32(self) -> float:
        return self.pick(_FLOATS) if self.chance(80) else struct.unpack("<f", self.take(4))[0]

    def text(self) -> str:
        return self.pick(_TEXTS) if self.chance(80) else self.take(self.byte() % 24).decode("utf-8", "replace")


FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "k", "stop", "session_id", "resume")


def read_request(r: Reader, real_session: str) -> coordinator_pb2.GenerateRequest:
    """One GenerateRequest (``real_session``: an existing session's id). One in twenty has every field
    sane (valid requests, which generate), six in twenty all but one field, the rest none: each wild
    field is anything its type holds, with interesting values weighted up."""
    mode = r.byte() % 20
    wild = set() if mode == 0 else {r.pick(FIELDS)} if mode <= 6 else set(FIELDS)

    def field(name: str, sane, fuzzed):
        return fuzzed() if name in wild else sane()

    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=field(
            "max_new_tokens", lambda: 1 + r.byte() % 4, lambda: r.uint32() if r.chance(50) else r.byte() % 8
        ),
        temperature=field("temperature", lambda: r.pick([0.0, 0.0, 0.7, 1.0]), r.float32),
        top_k=field("top_k", lambda: r.pick([0, 0, 5]), r.int32),
    )
    prompt = field("prompt", lambda: r.byte() % 2, lambda: r.byte() % 3)
    if prompt == 0:
        request.text = field("prompt", lambda: r.pick(["w1", "w1 w2 w3", "w9 w8 w7 w6"]), r.text)
    elif prompt == 1:
        request.messages.SetInParent()
        for _ in range(field("prompt", lambda: 1 + r.byte() % 2, lambda: r.byte() % 4)):
            role, content = field(
                "prompt", lambda: ("user", r.pick(["w1 w2", "w5"])), lambda: (r.pick(_ROLES), r.text())
            )
            request.messages.messages.add(role=role, content=content)
    optional = (
        ("top_p", lambda: r.pick([0.9, 1.0]), r.float32),
        ("seed", lambda: int.from_bytes(r.take(8), "little"), lambda: int.from_bytes(r.take(8), "little")),
        ("k", lambda: r.byte() % 5, r.int32),
    )
    for name, sane, fuzzed in optional:
        if r.chance(50):
            setattr(request, name, field(name, sane, fuzzed))
    request.stop.extend(
        field("stop", lambda: r.pick([[], [], ["w3"]]), lambda: [r.text() for _ in range(r.pick([0, 0, 1, 2, 17]))])
    )
    request.session_id = field(
        "session_id",
        lambda: r.pick(["", "", real_session]),
        lambda: r.pick(["", real_session, "0" * 32, "not-a-session", real_session[:-1] + "x"]),
    )
    if "resume" in wild and r.chance(50):
        request.resume.tokens, request.resume.text_chars = r.uint32() % 40, r.uint32() % 40
    request.request_id = r.text()[:10]
    return request


def mutate(r: Reader, payload: bytes) -> bytes:
    """``payload`` with a few bytes flipped, inserted or cut off, as the reader's bytes say."""
    data = bytearray(payload)
    for _ in range(1 + r.byte() % 3):
        at = r.byte() % (len(data) + 1)
        op = r.byte() % 3
        if op == 0 and at < len(data):
            data[at] ^= 1 + r.byte() % 255
        elif op == 1:
            data.insert(at, r.byte())
        else:
            del data[at:]
    return bytes(data)


def _check_in_process(
    coordinator: InProcessCoordinator, method: str, payload: bytes, session_id: str | None, what: str, shown: object
) -> None:
    code, details = coordinator.call(method, payload)
    seen = _in_process_seen.setdefault(what, {})
    seen[code.name] = seen.get(code.name, 0) + 1
    if not session_id:
        allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
    elif session_id == coordinator.session_id:
        allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
    else:  # no such session: NOT_FOUND, unless a field is invalid first
        allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
    assert code in allowed, f"{method}: {code.name} {details} for {shown!r}"


def test_coordinator_in_process_fields(in_process):
    """8,000 structured requests, both methods: each field anything its type holds."""
    t0 = time.monotonic()

    @fuzz_in_process("fields")
    @given(data=st.binary(min_size=PER_EXAMPLE * CHUNK, max_size=PER_EXAMPLE * CHUNK))
    def run(data):
        for i in range(PER_EXAMPLE):
            reader = Reader(data[i * CHUNK : (i + 1) * CHUNK])
            method = "Generate" if reader.chance(50) else "Complete"
            request = read_request(reader, in_process.session_id)
            _check_in_process(in_process, method, request.SerializeToString(), request.session_id, "fields", request)

    run()
    seen = _report_in_process("fields", "in process, structured", t0)
    assert sum(seen.values()) >= IN_PROCESS["fields"], seen
    # The drawing reaches the model, not only the validation: some requests generate.
    assert seen.get("OK", 0) >= 200 and seen.get("INVALID_ARGUMENT", 0) >= 1000, seen


def _report_in_process(kind: str, label: str, t0: float) -> dict[str, int]:
    """The statuses one in-process fuzz drew, written to the chaos report under ``label`` and printed."""
    seen = _in_process_seen[kind]
    seconds = time.monotonic() - t0
    write_report(
        os.environ.get("SPECDEC_CHAOS_REPORT"),
        "fuzz",
        {label: {"requests": sum(seen.values()), "statuses": seen, "seconds": round(seconds, 1)}},
    )
    print(f"in-process {kind}", seen, f"{sum(seen.values()) / seconds:.0f} requests/s")
    return seen


def test_coordinator_in_process_raw_bytes(in_process):
    """2,000 byte strings, both methods: half random bytes, half valid requests' bytes mutated. Most do
    not parse (INVALID_ARGUMENT); the rest are arbitrary requests."""
    t0 = time.monotonic()

    @fuzz_in_process("bytes")
    @given(data=st.binary(min_size=PER_EXAMPLE * 64, max_size=PER_EXAMPLE * 64))
    def run(data):
        for i in range(PER_EXAMPLE):
            r = Reader(data[i * 64 : (i + 1) * 64])
            method = "Generate" if r.chance(50) else "Complete"
            if r.chance(50):
                payload = r.take(r.byte() % 60)
            else:
                payload = mutate(r, read_request(r, in_process.session_id).SerializeToString())
            try:
                session_id = coordinator_pb2.GenerateRequest.FromString(payload).session_id
            except Exception:  # noqa: BLE001 - bytes that do not parse carry no session
                session_id = None
            _check_in_process(in_process, method, payload, session_id, "bytes", payload)

    run()
    seen = _report_in_process("bytes", "in process, raw bytes", t0)
    assert sum(seen.values()) >= IN_PROCESS["bytes"], seen


# Per service: its gRPC service name, its round method, and what draws that method's requests.
ROUND_METHODS = {
    "target": ("TargetService", "Verify", verify_requests),
    "draft": ("DraftService", "Propose", propose_requests),
}


@pytest.mark.parametrize("service", ["target", "draft"])
def test_service_fields(stack, service):
    name, method, requests = ROUND_METHODS[service]
    address = stack.target_address if service == "target" else stack.draft_address
    with grpc.insecure_channel(address) as channel:
        # A real cache, so that some calls get past the lookup to the model.
        prefill = common_pb2.PrefillRequest(tokens=[3, 4, 5])
        cache_id = common_pb2.PrefillReply.FromString(
            channel.unary_unary(f"/specdec.v1.{name}/Prefill")(prefill.SerializeToString(), timeout=10)
        ).cache_id

        @fuzz(service)
        @given(request=requests(), real_cache=st.booleans(), prefill=prefill_requests(), round_call=st.booleans())
        def run(request, real_cache, prefill, round_call):
            if round_call:
                if real_cache:
                    request.sync.cache_id = cache_id
                _call(channel, f"/specdec.v1.{name}/{method}", request.SerializeToString(), service)
            else:
                _call(channel, f"/specdec.v1.{name}/Prefill", prefill.SerializeToString(), service)

        with _grpc_timer():
            run()


def _verify(cache_id: str, drafts: list[int], temperature: float, sides: list[int] = ()) -> target_pb2.VerifyRequest:
    """A round on the cache prefilled with [3, 4, 5]; a sampled one carries a point-mass q per draft token."""
    q = [draft_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in drafts] if temperature else []
    return target_pb2.VerifyRequest(
        sync=common_pb2.CacheSync(cache_id=cache_id, start=3),
        draft_tokens=drafts,
        q=q,
        sampling=common_pb2.SamplingParams(temperature=temperature, seed=1),
        return_hidden=bool(sides),
        hidden_side_layers=sides,
    )


def _propose(cache_id: str, k: int, temperature: float = 0.0, ahead: int = 0) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        sync=common_pb2.CacheSync(cache_id=cache_id, start=3),
        k=k,
        ahead=ahead,
        sampling=common_pb2.SamplingParams(temperature=temperature, seed=1),
    )


# Requests the fuzzer seldom draws that once got INTERNAL (a temperature whose logits overflow float32)
# or held a service's model thread (an unbounded k, drafting ahead or prompt): each is refused up front,
# naming its field.
LIMITS = {
    "tiny temperature": ("target", "Verify", lambda c: _verify(c, [6, 7], 1e-40), "sampling.temperature"),
    "infinite temperature": ("target", "Verify", lambda c: _verify(c, [6], float("inf")), "sampling.temperature"),
    "33 draft tokens": ("target", "Verify", lambda c: _verify(c, [6] * 33, 0.0), "draft_tokens"),
    "huge k": ("draft", "Propose", lambda c: _propose(c, 2**32 - 1), "k"),
    "huge ahead": ("draft", "Propose", lambda c: _propose(c, 2, ahead=2**32 - 1), "ahead"),
    "NaN temperature": ("draft", "Propose", lambda c: _propose(c, 2, float("nan")), "sampling.temperature"),
    "prompt past the context": ("draft", "Prefill", lambda c: common_pb2.PrefillRequest(tokens=[3] * 256), "tokens"),
    "side layer past the target's": (
        "target",
        "Verify",
        lambda c: _verify(c, [6], 0.0, sides=[0, 99]),
        "hidden_side_layers",
    ),
    "five side layers": (
        "target",
        "Prefill",
        lambda c: common_pb2.PrefillRequest(tokens=[3, 4], return_hidden=True, hidden_side_layers=[0, 1, 0, 1, 0]),
        "hidden_side_layers",
    ),
}


@pytest.mark.parametrize("case", list(LIMITS))
def test_requests_past_a_services_limits_are_invalid_argument(stack, case):
    service, method, build, field = LIMITS[case]
    name = ROUND_METHODS[service][0]
    address = stack.target_address if service == "target" else stack.draft_address
    with grpc.insecure_channel(address) as channel:
        prefill = common_pb2.PrefillRequest(tokens=[3, 4, 5]).SerializeToString()
        cache_id = common_pb2.PrefillReply.FromString(
            channel.unary_unary(f"/specdec.v1.{name}/Prefill")(prefill, timeout=10)
        ).cache_id
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(f"/specdec.v1.{name}/{method}")(build(cache_id).SerializeToString(), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field), (
            err.value.details()
        )
        # The session is intact: a valid round on it still succeeds.
        good = _verify(cache_id, [6], 0.0) if service == "target" else _propose(cache_id, 2)
        channel.unary_unary(f"/specdec.v1.{name}/{ROUND_METHODS[service][1]}")(good.SerializeToString(), timeout=10)


METHODS = [
    ("coordinator", "/specdec.v1.Coordinator/Generate"),
    ("coordinator", "/specdec.v1.Coordinator/Complete"),
    ("target", "/specdec.v1.TargetService/Verify"),
    ("target", "/specdec.v1.TargetService/VerifyBatch"),
    ("target", "/specdec.v1.TargetService/Prefill"),
    ("target", "/specdec.v1.TargetService/Release"),
    ("draft", "/specdec.v1.DraftService/Propose"),
    ("draft", "/specdec.v1.DraftService/Prefill"),
    ("draft", "/specdec.v1.DraftService/Release"),
]


def test_raw_bytes_on_the_wire(stack):
    addresses = {"coordinator": stack.address, "target": stack.target_address, "draft": stack.draft_address}
    channels = {name: grpc.insecure_channel(address) for name, address in addresses.items()}
    try:

        @fuzz("raw")
        @given(method=st.sampled_from(METHODS), payload=st.binary(max_size=200))
        def run(method, payload):
            service, path = method
            _call(channels[service], path, payload, "raw")

        with _grpc_timer():
            run()
    finally:
        for channel in channels.values():
            channel.close()


def test_every_service_still_serves_and_answers_right(stack, tiny_target):
    """Runs after the fuzzing above: nothing died, health is SERVING, answers are still exact."""
    if len(_sent) == 4:  # every fuzz test above ran
        assert sum(_sent.values()) >= 0.98 * sum(EXAMPLES.values()), _sent  # hypothesis may skip a few duplicates
        write_report(
            os.environ.get("SPECDEC_CHAOS_REPORT"),
            "fuzz",
            {
                "over gRPC": {
                    "requests": sum(_sent.values()),
                    "by_service": dict(_sent),
                    "seconds": round(sum(_grpc_seconds), 1),
                }
            },
        )
    for address in (stack.address, stack.target_address, stack.draft_address):
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    from test_e2e_tiny import hf_greedy

    with Client(stack.address, timeout=30) as client:
        assert client.complete("w1 w2 w3", max_new_tokens=12, k=3).token_ids == hf_greedy(tiny_target, "w1 w2 w3", 12)
