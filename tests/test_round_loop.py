"""The round loop and the speculation policy in one process: real tiny models, no gRPC, no Redis.

The backends are the engines' in-process adapters and the store is the in-memory one, so these tests
pin the loop's own behaviour: exact greedy output, seeded repeats, failover and the policy's plans.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch
from opentelemetry import trace
from tiny import make_deeper_copy, make_model

from coordinator.policy import RoundPlan, SpeculationConfig, SpeculationPolicy
from coordinator.replicas import BackendRejected, BackendUnavailable, CacheRef, ReplicaSet
from coordinator.rounds import RoundLoop
from coordinator.routing import Router
from coordinator.sessions import MemorySessionStore, SessionRecord, StoreUnavailable, TurnState
from coordinator.turns import GenerationRequest, Stats, Turn, Turns
from draft_service.engine import ModelDrafter
from draft_service.inprocess import InProcessDraft
from specdec.batching import PassLoad
from specdec.grammar import GrammarCompiler, parse_response_format
from specdec.models import load_model
from specdec.sampling_params import Sampling
from target_service.engine import TargetEngine
from target_service.inprocess import InProcessTarget


def hf_greedy(loaded, prompt: str, max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with HF generate: the reference."""
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def make_loop(target_model, draft_model, drafts=None, **speculation) -> RoundLoop:
    """A loop over in-process backends and an in-memory store."""
    target = InProcessTarget(TargetEngine(target_model, 8))
    if drafts is None:
        drafts = [InProcessDraft(ModelDrafter(draft_model, 8, 64))]
    return loop_over(target_model, Router(drafts, [target]), SpeculationPolicy(SpeculationConfig(**speculation)))


def loop_over(target_model, router: Router, policy: SpeculationPolicy) -> RoundLoop:
    """A loop over ``router``'s replicas, steered by ``policy``, with an in-memory store."""
    facts = target_model.facts("target")
    turns = Turns(target_model.tokenizer, facts, MemorySessionStore(3600))
    return RoundLoop(target_model.tokenizer, facts, router, policy, turns, trace.NoOpTracer())


def run(loop: RoundLoop, request: GenerationRequest):
    """Token ids, the final chunk and its stats of one request."""

    async def collect():
        chunks = [chunk async for chunk in loop.generate(request, lambda: None)]
        return [t for c in chunks for t in c.token_ids], chunks[-1]

    return asyncio.run(collect())


def request(prompt="w1 w2 w3", max_new_tokens=16, **fields) -> GenerationRequest:
    return GenerationRequest(prompt, None, max_new_tokens, **fields)


@pytest.mark.parametrize("k", [0, 1, 3, None])
def test_greedy_output_equals_target_only(tiny_target, tiny_draft, k):
    loop = make_loop(tiny_target, tiny_draft, free_lookup_min=3, confidence_cutoff=True)
    tokens, last = run(loop, request(k=k))
    assert tokens == hf_greedy(tiny_target, "w1 w2 w3", 16)
    assert last.finish_reason == "length" and last.stats.generated_tokens == 16
    if k:
        assert last.stats.drafted_tokens > 0


def test_a_draft_equal_to_the_target_is_always_accepted(tiny_target):
    tokens, last = run(make_loop(tiny_target, tiny_target), request(k=3, max_new_tokens=16))
    assert tokens == hf_greedy(tiny_target, "w1 w2 w3", 16)
    assert last.stats.acceptance_rate == 1.0 and last.stats.mean_accepted_length == 4.0


def test_seeded_sampling_repeats_on_a_fresh_loop(tiny_target, tiny_draft):
    sampled = request(k=2, temperature=1.0, top_p=0.9, seed=7, max_new_tokens=20)
    first, _ = run(make_loop(tiny_target, tiny_draft), sampled)
    again, _ = run(make_loop(tiny_target, tiny_draft), sampled)
    other, _ = run(make_loop(tiny_target, tiny_draft), replace(sampled, seed=8))
    assert first == again and len(first) == 20
    assert other != first


class FailingDraft(InProcessDraft):
    """A draft replica that is unreachable."""

    def __init__(self, engine):
        super().__init__(engine, "inprocess:failing-draft")
        self.calls = 0

    async def prefill(self, *args, **kwargs):
        self.calls += 1
        raise BackendUnavailable("draft", self.address, "UNAVAILABLE: gone")


def test_a_failing_draft_costs_speed_not_the_answer(tiny_target, tiny_draft):
    failing = FailingDraft(ModelDrafter(tiny_draft, 8, 64))
    loop = make_loop(tiny_target, tiny_draft, drafts=[failing])
    tokens, last = run(loop, request(k=2))
    assert tokens == hf_greedy(tiny_target, "w1 w2 w3", 16)
    assert failing.calls == 1  # the replica then rests: later rounds run target-only without calling it
    assert not loop.router.drafts.usable(failing.address) and last.stats.drafted_tokens == 0


def test_a_continued_session_reuses_its_caches_and_a_lost_one_is_rebuilt(tiny_target, tiny_draft):
    loop = make_loop(tiny_target, tiny_draft)
    _, first = run(loop, request(k=2, max_new_tokens=6))
    record = asyncio.run(loop._turns.store.get(first.session_id))
    engine = loop.router.targets.by_address["inprocess:target"]._engine
    engine.release(record.target.cache_id)  # evicted between turns
    tokens, second = run(loop, request("w4 w5", k=2, max_new_tokens=6, session_id=first.session_id))
    history = record.tokens + tiny_target.tokenizer.encode(" w4 w5", add_special_tokens=False)
    assert second.session_id == first.session_id
    with torch.inference_mode():
        out = tiny_target.model.generate(torch.tensor([history]), max_new_tokens=6, do_sample=False)
    assert tokens == out[0, len(history) :].tolist()


def make_turn(sampling: Sampling | None = None, k=None, committed=(3, 4, 5, 3, 4)) -> Turn:
    sampling = sampling or Sampling()
    record = SessionRecord("s" * 32, tokens=list(committed), turn=TurnState("", 2, 0))
    target = CacheRef("t:1", "c", len(committed))
    return Turn(GenerationRequest("", None, 32, k=k), record, False, sampling, Stats(), lambda: None, None, target)


def test_the_policy_measures_an_unknown_load_before_drafting():
    policy = SpeculationPolicy(SpeculationConfig(max_auto_k=4, draft_ahead=2), live_targets=lambda: 1)
    turn = make_turn()
    policy.start(turn)
    assert policy.plan(turn, room=32) == RoundPlan(0)  # no pass seen on the target yet
    policy.loads.note("t:1", PassLoad(1, 1, 0, 50.0, [50.0 + n for n in range(6)], [50.0 + n for n in range(6)]))
    plan = policy.plan(turn, room=32)
    assert plan.k > 0 and plan.ahead == 2  # alone on the target, the draft drafts ahead
    assert policy.plan(turn, room=2).k <= 1  # never more than the room after the target's own token


def test_tokens_the_grammar_forces_are_proposed_alone_and_teach_no_acceptance():
    """A greedy constrained turn whose grammar allows one token next proposes the forced run itself
    (no draft call, whatever the load), held to the room; its round feeds neither acceptance tracker.
    Where a value is open the plan drafts as before."""
    tokens = [b"<eos>", b"{", b"}", b'"', b"a", b"b", b":", b" ", b",", b"1", b"2"]
    grammar = GrammarCompiler.from_token_bytes(tokens, [0], vocab_size=len(tokens))
    schema = {"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"]}
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
    policy = SpeculationPolicy(SpeculationConfig(max_auto_k=4), live_targets=lambda: 1)
    turn = make_turn(committed=(3, 4))  # its output starts after these two prompt tokens
    turn.grammar = grammar.matcher(fmt)
    policy.start(turn)
    run = turn.grammar.forced(4)  # '{"ab": ' one character a token: all forced
    assert [tokens[t] for t in run] == [b"{", b'"', b"a", b"b"]
    assert policy.plan(turn, room=32) == RoundPlan(0, run, forced=True)
    assert policy.plan(turn, room=3).lookup == run[:2]
    turn.committed[2:] = run + [3, 6, 7, 9]  # '{"ab": 1': digits or the end of the object may follow
    assert policy.plan(turn, room=32) == RoundPlan(0)  # drafts as before (no load seen yet: measures)
    tried = list(turn.stats.positions.tried)
    turn.stats.add_round(4, 4, 5, looked_up=True, forced=True)
    assert turn.stats.positions.tried == tried and not turn.stats.lookup.tried and turn.stats.rounds == 1


def test_sampled_plans_follow_fixed_priors_and_never_draft_ahead():
    policy = SpeculationPolicy(SpeculationConfig(max_auto_k=4, draft_ahead=2), live_targets=lambda: 1)
    turn = make_turn(Sampling(temperature=1.0, seed=1))
    policy.start(turn)
    before = policy.plan(turn, room=32)
    for _ in range(20):  # measured costs that would change a greedy plan
        policy.costs.record_verify(500.0, 2)
    assert policy.plan(turn, room=32) == before and before.ahead == 0 and before.k > 0


def test_coupled_plans_follow_measured_costs():
    """A coupled request's tokens depend on no k: where drafting is measured not to pay (a cheap target
    pass, a dear draft call) it runs target-only, where an uncoupled sampled request keeps drafting."""
    policy = SpeculationPolicy(SpeculationConfig(max_auto_k=4), live_targets=lambda: 1)
    policy.batching_targets = False  # costs measured call by call
    coupled, uncoupled = (
        make_turn(Sampling(temperature=1.0, seed=1, coupled=True)),
        make_turn(Sampling(temperature=1.0)),
    )
    for turn in (coupled, uncoupled):
        policy.start(turn)
    for k in range(1, 5):
        policy.costs.record_draft(40.0 + k, k)
    for tokens in range(1, 6):
        policy.costs.record_verify(10.0 + tokens, tokens)
    assert policy.plan(coupled, room=32).k == 0
    assert policy.plan(uncoupled, room=32).k > 0


def test_a_fixed_k_is_planned_as_asked_and_lookup_only_when_adaptive():
    policy = SpeculationPolicy(SpeculationConfig(free_lookup_min=2), live_targets=lambda: 1)
    policy.batching_targets = False  # a target that reports no load: costs are measured call by call
    repeating = (3, 4, 5, 6, 3, 4, 5, 6, 3, 4)
    assert policy.plan(make_turn(k=3, committed=repeating), room=32) == RoundPlan(3)
    adaptive = make_turn(committed=repeating)
    policy.start(adaptive)
    plan = policy.plan(adaptive, room=32)
    assert plan.k == 0 and plan.lookup and plan.lookup[0] == 5  # the repeat continues with 5


class RefusingDraft(InProcessDraft):
    """A draft replica that refuses every call of one session's (a bad field, a full KV budget)."""

    def __init__(self, engine):
        super().__init__(engine, "inprocess:refusing-draft")
        self.calls = 0

    async def prefill(self, *args, **kwargs):
        self.calls += 1
        raise BackendRejected("RESOURCE_EXHAUSTED", "draft: KV budget full")


def test_a_refusal_of_one_sessions_call_rests_no_replica(tiny_target, tiny_draft):
    refusing = RefusingDraft(ModelDrafter(tiny_draft, 8, 64))
    loop = make_loop(tiny_target, tiny_draft, drafts=[refusing])
    tokens, last = run(loop, request(k=1, max_new_tokens=12))
    assert tokens == hf_greedy(tiny_target, "w1 w2 w3", 12)
    assert loop.router.drafts.usable(refusing.address)  # everyone else's calls still go to it
    assert refusing.calls == 2  # the session itself stops asking for REFUSED_ROUNDS rounds


def test_rest_grows_with_failures_in_a_row_and_a_probe_ends_it():
    replicas = ReplicaSet([InProcessDraft(None, "a"), InProcessDraft(None, "b")], rest_s=0.05)
    replicas.failed("a")
    first = replicas.rest_s("a")
    replicas.probed("a", ok=False)  # the probe failed: a longer rest
    assert replicas.rest_s("a") > 1.5 * first
    time.sleep(replicas.rest_s("a") + 0.01)
    assert not replicas.usable("a") and replicas.pick(None).address == "b"  # rested, not yet probed
    assert [r.address for r in replicas.probes_due()] == ["a"] and replicas.probes_due() == []
    replicas.probed("a", ok=True)
    assert replicas.usable("a") and replicas.rest_s("a") == 0.0


def test_a_replica_is_probed_once_its_rest_ends_and_then_takes_work(tiny_target, tiny_draft):
    draft = InProcessDraft(ModelDrafter(tiny_draft, 8, 64))
    loop = make_loop(tiny_target, tiny_draft, drafts=[draft])
    loop.router.drafts._rest_s = 0.01
    loop.router.drafts.failed(draft.address)
    time.sleep(0.02)
    _, first = run(loop, request(k=2, max_new_tokens=4))  # starts the probe; this turn runs target-only
    assert first.stats.drafted_tokens == 0 and loop.router.drafts.usable(draft.address)
    _, second = run(loop, request(k=2, max_new_tokens=8))
    assert second.stats.drafted_tokens > 0


def test_a_session_that_moves_releases_the_cache_it_left(tiny_target, tiny_draft):
    engines = [TargetEngine(tiny_target, 8), TargetEngine(tiny_target, 8)]
    targets = [InProcessTarget(e, f"inprocess:target-{i}") for i, e in enumerate(engines)]
    router = Router([InProcessDraft(ModelDrafter(tiny_draft, 8, 64))], targets)
    loop = loop_over(tiny_target, router, SpeculationPolicy(SpeculationConfig()))

    async def turns():
        first = [c async for c in loop.generate(request(k=2, max_new_tokens=4), lambda: None)][-1]
        held = next(i for i, e in enumerate(engines) if len(e.caches))
        router.targets.failed(targets[held].address)
        follow_up = request("w4", k=2, max_new_tokens=4, session_id=first.session_id)
        [c async for c in loop.generate(follow_up, lambda: None)]
        await asyncio.sleep(0)  # the release runs in the background
        await asyncio.sleep(0)
        return held

    held = asyncio.run(turns())
    assert len(engines[held].caches) == 0 and len(engines[1 - held].caches) == 1


class LastWriteFails(MemorySessionStore):
    """A store that is unreachable for the last record of a turn."""

    async def put(self, record):
        if record.turn is not None and record.turn.finish is not None:
            raise StoreUnavailable("session store unreachable: connection refused")
        await super().put(record)


def test_a_fully_streamed_turn_completes_when_its_last_record_fails(tiny_target, tiny_draft):
    loop = make_loop(tiny_target, tiny_draft)
    loop._turns.store = LastWriteFails(3600)
    tokens, last = run(loop, request(k=2, max_new_tokens=10))
    assert last.finish_reason == "length" and tokens == hf_greedy(tiny_target, "w1 w2 w3", 10)
    # The next turn starts from the last record that was written (a checkpoint of the first turn).
    follow_up, again = run(loop, request("w4", k=2, max_new_tokens=4, session_id=last.session_id))
    assert again.session_id == last.session_id and len(follow_up) == 4


def test_a_prompt_too_long_for_any_context_is_refused_before_tokenizing(tiny_target, tiny_draft):
    loop = make_loop(tiny_target, tiny_draft)
    loop._tokenizer = loop._turns._tokenizer = None  # tokenizing would fail loudly
    with pytest.raises(ValueError, match="cannot fit"):
        run(loop, request("w1 " * 10_000))


def test_seeded_sampled_output_depends_on_no_draft_and_no_outage(tiny_target, tiny_draft):
    """A seeded sampled request samples coupled: the same tokens with a working draft, a draft that
    fails (the state a coordinator that rests its draft replica is in), and no draft at all, so a
    stream resumed on another coordinator replays exactly what its client saw."""
    sampled = request(k=3, temperature=1.0, top_p=0.95, seed=11, max_new_tokens=24)
    drafted, with_draft = run(make_loop(tiny_target, tiny_draft), sampled)
    failing = [FailingDraft(ModelDrafter(tiny_draft, 8, 64))]
    outage, _ = run(make_loop(tiny_target, tiny_draft, drafts=failing), sampled)
    alone, _ = run(make_loop(tiny_target, tiny_draft), replace(sampled, k=0))
    same_as_target, by_target = run(make_loop(tiny_target, tiny_target), sampled)
    assert drafted == outage == alone == same_as_target and len(drafted) == 24
    assert with_draft.stats.accepted_tokens > 0 and by_target.stats.acceptance_rate == 1.0


class PacedTarget(InProcessTarget):
    """A target whose verify pass takes as long as a model's several times the draft's size would: a
    fixed cost and a little per row (as on an accelerator), reported as its batched pass's cost curve."""

    PASS_MS, ROW_MS = 20.0, 0.5

    def pass_ms(self, rows: int) -> float:
        return self.PASS_MS + self.ROW_MS * (rows - 1)

    async def verify(self, ref, committed, draft, *args, **kwargs):
        verdict = await super().verify(ref, committed, draft, *args, **kwargs)
        rows = 1 + (len(draft.tokens) if draft is not None else 0)
        await asyncio.sleep(self.pass_ms(rows) / 1000)
        curve = [self.pass_ms(n) for n in range(1, 18)]
        return replace(verdict, load=PassLoad(1, rows, 0, self.pass_ms(rows), curve, curve, 0.0, rows))


class PacedDraft(InProcessDraft):
    """A model draft: each proposed token costs a good share of the target's pass."""

    TOKEN_MS = 6.0

    async def propose(self, ref, committed, k, *args, **kwargs):
        proposal = await super().propose(ref, committed, k, *args, **kwargs)
        await asyncio.sleep(self.TOKEN_MS * max(1, len(proposal.tokens)) / 1000)
        return proposal


def test_a_fresh_coordinator_drafts_as_far_as_a_warm_one(tmp_path):
    """The start-up probe (``RoundLoop.probe``) measures the draft and target: a model draft that is
    accepted every time is given long drafts from the first request on, not after the fleet's
    acceptance has been learned over several requests.

    The draft is the target without its last six layers, which add nothing, so the two agree on
    every token while the target costs more per pass; with this seed and these prompts neither ends
    before 48 tokens. Costs are paced (a draft token about a third of a pass, the pass nearly flat in
    its rows), so the choice of k does not hang on the machine's load.
    """
    draft_model = load_model(str(make_model(tmp_path / "draft", seed=1)), tmp_path)
    target_model = load_model(str(make_deeper_copy(tmp_path / "draft", tmp_path / "target", 6)), tmp_path)
    drafter, target = ModelDrafter(draft_model, 8, 64), TargetEngine(target_model, 8)
    router = Router([PacedDraft(drafter)], [PacedTarget(target)])
    policy = SpeculationPolicy(SpeculationConfig(), live_targets=lambda: 1)  # chains of an adaptive k only
    facts = target_model.facts("target")
    turns = Turns(target_model.tokenizer, facts, MemorySessionStore(3600))
    loop = RoundLoop(target_model.tokenizer, facts, router, policy, turns, trace.NoOpTracer())
    assert asyncio.run(loop.probe(30.0)) == 8
    assert len(drafter.caches) == len(target.caches) == 0  # the probe's session leaves nothing behind
    assert policy.fleet.counts.tried[0] == 8 and not policy.costs._draft_calls  # priors, not measurements

    generated, rounds = [], []
    for i in range(13):
        _, last = run(loop, request(f"w{i} w{(7 * i) % 30} w{(3 * i + 1) % 30}", max_new_tokens=48))
        assert last.stats.acceptance_rate == 1.0
        generated.append(last.stats.generated_tokens)
        rounds.append(last.stats.rounds)
    fresh = sum(generated[:3]) / sum(rounds[:3])
    warm = sum(generated[10:]) / sum(rounds[10:])
    assert warm >= 5.0  # warm, it drafts long: the comparison below means something
    assert fresh >= 0.9 * warm, (generated, rounds)


class RecordsIdle:
    """Mixed into an in-process replica: records the sessions it is told have ended their turn."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.idled: list[str] = []

    async def idle(self, cache_id: str, remaining_s: float | None = None) -> None:
        self.idled.append(cache_id)


class IdleTarget(RecordsIdle, InProcessTarget):
    pass


class IdleDraft(RecordsIdle, InProcessDraft):
    pass


def test_a_finished_turn_tells_its_replicas_that_its_session_is_idle(tiny_target, tiny_draft):
    """Batching replicas wait for the sessions of their last pass; a turn that ended must say so, or
    every request's end would hold the next pass a whole gathering window."""
    target_engine, draft_engine = TargetEngine(tiny_target, 8), ModelDrafter(tiny_draft, 8, 64)
    target, draft = IdleTarget(target_engine), IdleDraft(draft_engine)
    loop = loop_over(tiny_target, Router([draft], [target]), SpeculationPolicy(SpeculationConfig()))

    async def turn():
        chunks = [chunk async for chunk in loop.generate(request(k=3, max_new_tokens=12), lambda: None)]
        for _ in range(3):  # the notices go out in the background
            await asyncio.sleep(0)
        return chunks

    chunks = asyncio.run(turn())
    assert chunks[-1].finish_reason == "length"
    # Each replica heard of the one cache it holds for the session, once.
    assert target.idled == list(target_engine.caches.ids())
    assert draft.idled == list(draft_engine.caches.ids())


def test_rounds_that_cannot_draft_leave_the_target_features_behind():
    """On the draft's cores a greedy turn that shares its target's passes never drafts, so its rounds
    do not ask for the target's hidden states; nor do a fixed k of 0's. Alone, with a fixed k, on
    separate cores, or coupled (its k reads no load, so it drafts beside others too), they do."""
    curve = [50.0 + n for n in range(6)]

    def plan_for(colocated: bool, sessions: int, k: int | None = None, sampling: Sampling | None = None) -> RoundPlan:
        policy = SpeculationPolicy(SpeculationConfig(max_auto_k=4, draft_colocated=colocated), live_targets=lambda: 1)
        turn = make_turn(sampling, k=k)
        policy.start(turn)
        policy.loads.note("t:1", PassLoad(sessions, sessions, sessions - 1, 50.0, curve, curve))
        return policy.plan(turn, room=32)

    shared = plan_for(colocated=True, sessions=4)
    assert shared.k == 0 and not shared.features
    assert plan_for(colocated=True, sessions=1).features
    assert plan_for(colocated=False, sessions=4).features
    assert plan_for(colocated=True, sessions=4, k=3).features
    assert not plan_for(colocated=False, sessions=1, k=0).features
    assert plan_for(colocated=True, sessions=4, sampling=Sampling(temperature=1.0, seed=1, coupled=True)).features


class RecordsHidden(InProcessTarget):
    """An in-process target that records whether each verify asked for hidden states."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[bool] = []

    async def verify(self, ref, committed, draft, sampling, round_index, remaining_s, with_hidden=False, *rest, **kw):
        self.asked.append(with_hidden)
        return await super().verify(ref, committed, draft, sampling, round_index, remaining_s, with_hidden, *rest, **kw)


class NoFeatures(SpeculationPolicy):
    """A policy whose rounds never want the target's features."""

    @staticmethod
    def wants_features(fixed, costs, load) -> bool:
        return False


def test_a_round_that_wants_no_features_asks_the_target_for_none(tiny_target, tiny_draft):
    for policy_type, asked in ((SpeculationPolicy, True), (NoFeatures, False)):
        target = RecordsHidden(TargetEngine(tiny_target, 8))
        router = Router([InProcessDraft(ModelDrafter(tiny_draft, 8, 64))], [target], want_hidden=True)
        loop = loop_over(tiny_target, router, policy_type(SpeculationConfig(default_k=2)))

        async def turn(loop=loop):
            return [chunk async for chunk in loop.generate(request(max_new_tokens=6), lambda: None)]

        assert asyncio.run(turn())[-1].finish_reason == "length"
        assert target.asked and set(target.asked) == {asked}
