"""Sessions belong to the API key that created them; traces never carry a session id."""

from __future__ import annotations

import pytest
from harness import InProcessStack

from coordinator.auth import hash_key
from coordinator.identity import caller_of, span_session
from draft_service.engine import ModelDrafter
from specdec import Client
from specdec.client import ResourceExhausted, SessionNotFound
from specdec.config import AdmissionLimits
from target_service.engine import TargetEngine

OWNER, OTHER = "owner-key", "other-key"


@pytest.fixture(scope="module")
def keyed(tiny_target, tiny_draft, tiny_dir, redis_url):
    stack = InProcessStack(
        TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url
    )
    stack.start(api_key_hashes=(hash_key(OWNER), hash_key(OTHER)))
    yield stack
    stack.close()


def test_another_key_cannot_continue_or_resume_a_session(keyed):
    with Client(keyed.address, timeout=30, api_key=OWNER) as owner:
        first = owner.complete("w1 w2", max_new_tokens=3)
    with Client(keyed.address, timeout=30, api_key=OTHER) as other:
        with pytest.raises(SessionNotFound) as stolen:
            other.complete("w3", max_new_tokens=3, session_id=first.session_id)
        with pytest.raises(SessionNotFound) as unknown:
            other.complete("w3", max_new_tokens=3, session_id="0" * 32)
    # Refused exactly as an unknown id is: the answer tells nothing of whether the id exists.
    assert str(stolen.value).replace(first.session_id, "ID") == str(unknown.value).replace("0" * 32, "ID")
    with Client(keyed.address, timeout=30, api_key=OWNER) as owner:
        again = owner.complete("w3", max_new_tokens=3, session_id=first.session_id)
    assert again.session_id == first.session_id


def test_traces_carry_a_digest_of_the_session_id_not_the_id(keyed):
    keyed.exporter.clear()
    with Client(keyed.address, timeout=30, api_key=OWNER) as owner:
        result = owner.complete("w1 w2", max_new_tokens=3)
    spans = keyed.exporter.get_finished_spans()
    values = [str(v) for span in spans for v in (span.attributes or {}).values()]
    assert spans and not any(result.session_id in v for v in values)
    generate = next(s for s in spans if s.name == "specdec.generate")
    assert generate.attributes["specdec.session"] == span_session(result.session_id)


def test_client_identity_comes_from_what_the_caller_proved():
    assert caller_of("k", None, "10.0.0.1").client == caller_of("k", None, "10.0.0.2").client
    assert caller_of("k", None, "h").client != caller_of("k2", None, "h").client
    assert caller_of(None, "CN=svc", "h") == caller_of(None, "CN=svc", "h2")
    open_caller = caller_of(None, None, "h")
    assert open_caller.owner == "" and open_caller.client == "peer:h"


def test_a_self_chosen_client_label_does_not_escape_the_session_limit(tiny_target, tiny_draft, tiny_dir, redis_url):
    stack = InProcessStack(
        TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url
    )
    stack.start(api_key_hashes=(hash_key("limited-key"),), admission=AdmissionLimits(max_sessions_per_client=1))
    try:
        with Client(stack.address, timeout=30, api_key="limited-key", client_id="first") as c:
            c.complete("w1", max_new_tokens=2)
        with Client(stack.address, timeout=30, api_key="limited-key", client_id="a-new-name") as c:
            with pytest.raises(ResourceExhausted, match="live sessions"):
                c.complete("w2", max_new_tokens=2)
    finally:
        stack.close()
