"""Pure pieces: n-gram lookup, cache syncing, text streaming with stop strings, prompts, sessions."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import numpy as np
import pytest
import torch

from coordinator.checkpoints import Checkpoints
from coordinator.prompts import NoChatTemplate, build_turn
from coordinator.replicas import CacheRef, ReplicaSet
from coordinator.sessions import MemorySessionStore, SessionRecord, StoreUnavailable
from coordinator.textstream import TextStream
from specdec.chat_templates import resolve_chat_template
from specdec.client import InvalidArgument, build_request
from specdec.config import ModelConfig, TargetConfig, TensorParallelConfig
from specdec.errors import CacheBehind, CacheBudgetExceeded, CacheNotFound
from specdec.kvcache import CacheTable, SessionCache, kv_buffer_bytes
from specdec.ngram import propose_ngram, whole_continuation
from specdec.sampling import Sampling, warp_probs
from specdec.sampling_params import check_sampling
from specdec.token_lists import common_prefix_len
from specdec.v1 import common_pb2


def test_ngram_prefers_longest_most_recent_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, 2, 3, 1) == [7, 8]  # suffix [2, 3] last seen before 7, 8
    assert propose_ngram([1, 2, 3, 4], 3, 3, 1) == []
    assert propose_ngram([5, 6, 5], 4, 3, 1) == [6, 5]
    assert propose_ngram([4], 3, 3, 1) == []
    # The last-token check skips non-matches only: a match whose last token recurs elsewhere is found.
    assert propose_ngram([8, 8, 3, 8, 1, 2, 8, 6, 3, 8], 2, 2, 2) == [1, 2]


def _ngram_by_scan(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The lookup rule spelled out: each suffix length from the longest, every start from the latest."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_lookup_follows_the_rule_on_random_contexts():
    r = random.Random(5)
    for _ in range(3000):
        vocab = r.choice([2, 3, 5, 12])  # small vocabularies repeat: long and tied matches
        tokens = [r.randrange(vocab) for _ in range(r.randrange(0, 40))]
        k, max_n, min_n = r.randrange(0, 6), r.randrange(1, 6), r.randrange(0, 7)
        case = (tokens, k, max_n, min_n)
        # A suffix is at least one token long, whatever min_n says.
        assert propose_ngram(*case) == _ngram_by_scan(tokens, k, max_n, max(min_n, 1)), case


def test_common_prefix_len_finds_the_first_difference_wherever_it_lies():
    r = random.Random(6)
    for _ in range(2000):
        a = [r.randrange(3) for _ in range(r.randrange(0, 300))]
        cut = r.randrange(0, len(a) + 1)
        b = a[:cut] + [r.randrange(3) for _ in range(r.randrange(0, 300))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == want == common_prefix_len(b, a)


def test_whole_continuation_needs_all_k_tokens_and_a_long_enough_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert whole_continuation(tokens, 2, min_n=2) == [7, 8]
    assert whole_continuation(tokens, 3, min_n=2) == [7, 8, 5]
    assert whole_continuation([5, 6, 7, 5, 6], 3, min_n=2) == [7, 5, 6]
    assert whole_continuation([5, 6, 7, 5, 6], 4, min_n=2) is None  # fewer than k tokens follow
    assert whole_continuation(tokens, 2, min_n=3) is None  # no earlier match of a 3-token suffix
    assert whole_continuation(tokens, 2, min_n=0) is None  # 0 turns lookup off


def test_session_cache_matches_uncached_forward(tiny_target):
    model = tiny_target.model
    tokens = [3, 4, 5, 6, 7, 8, 9]
    cache = SessionCache(committed=tokens[:4])
    cache.prefill(model)
    assert cache.kv_tokens == tokens[:3]
    # Speculate two wrong tokens, then commit different ones: the stale KV must go.
    cache.forward(model, [20, 21], logits_to_keep=3)
    cache.sync(4, tokens[4:])
    assert cache.kv_tokens == tokens[:4] and cache.pending() == tokens[4:]
    cached = cache.forward(model, [], logits_to_keep=1)
    with torch.inference_mode():
        full = model(torch.tensor([tokens])).logits[0, -1:]
    assert torch.allclose(cached, full, atol=1e-4)


def test_session_cache_keeps_matching_speculation(tiny_target):
    cache = SessionCache(committed=[3, 4, 5])
    cache.prefill(tiny_target.model)
    cache.forward(tiny_target.model, [6, 7], logits_to_keep=1)
    cache.sync(3, [6, 7, 9])
    assert cache.kv_tokens == [3, 4, 5, 6, 7]  # accepted draft tokens stay cached
    with pytest.raises(CacheBehind):
        cache.sync(10, [1])


def test_cache_table_evicts_least_recently_used():
    table = CacheTable(capacity=2)
    a, _ = table.create([1])
    b, _ = table.create([2])
    table.get(a)
    c, _ = table.create([3])
    assert table.get(a) and table.get(c)
    with pytest.raises(CacheNotFound):
        table.get(b)
    assert table.release(a) and not table.release(a)


class CharTokenizer:
    """One token per character; id = code point."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def test_text_stream_holds_back_possible_stop_strings():
    stream = TextStream(CharTokenizer(), ["END"])
    first = stream.push([ord(c) for c in "hello E"])
    assert first.text == "hello" and not first.stopped
    second = stream.push([ord(c) for c in "NDING"])
    assert second.stopped and second.text == " "
    assert stream.text == "hello " and stream.tokens == [ord(c) for c in "hello END"]


def test_text_stream_without_stop_releases_everything():
    stream = TextStream(CharTokenizer(), [])
    assert stream.push([ord("a"), ord("b")]).text == "ab"
    assert stream.push([0]).token_ids == [0]
    assert stream.finish().text == ""


def test_text_stream_finish_flushes_held_text():
    stream = TextStream(CharTokenizer(), ["xyz"])
    assert stream.push([ord(c) for c in "abcx"]).text == "ab"
    assert stream.finish().text == "cx"


class WordTokenizer:
    chat_template = "words"

    def encode(self, text, add_special_tokens=False):
        return [1] * add_special_tokens + [len(w) for w in text.split()]  # 1: a BOS the tokenizer adds

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [100 + len(m["content"]) for m in messages] + [99]


def test_build_turn_text_and_chat():
    tok = WordTokenizer()
    # Text opening a session gets the tokenizer's special tokens, as transformers encodes a prompt; a
    # continuation appends its words alone.
    assert build_turn(tok, [], None, "aa b", None).tokens == [1, 2, 1]
    assert build_turn(tok, [7], None, "ccc", None).tokens == [7, 3]
    chat = build_turn(tok, [], None, None, [{"role": "user", "content": "hi"}])
    assert chat.tokens == [102, 99] and chat.messages == [{"role": "user", "content": "hi"}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"}]
    follow = build_turn(tok, [102, 99, 5], history, None, [{"role": "user", "content": "x"}])
    assert follow.tokens == [102, 103, 101, 99] and len(follow.messages) == 3


def test_chat_without_a_template_is_refused_with_the_way_out():
    tok = WordTokenizer()
    tok.chat_template = None
    with pytest.raises(NoChatTemplate, match="--chat-template") as caught:
        build_turn(tok, [], None, None, [{"role": "user", "content": "hi"}])
    assert isinstance(caught.value, ValueError)  # so the servicer answers INVALID_ARGUMENT
    assert build_turn(tok, [], None, "plain text", None).tokens == [1, 5, 4]


def test_named_chat_templates_render_their_families_turns(default_model):
    tokenizer = default_model.tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Why? "},
    ]
    gemma = tokenizer.apply_chat_template(
        messages, chat_template=resolve_chat_template("gemma"), add_generation_prompt=True, tokenize=False
    )
    assert gemma == (
        f"{tokenizer.bos_token}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
        "<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    )
    chatml = tokenizer.apply_chat_template(
        messages[1:2], chat_template=resolve_chat_template("chatml"), add_generation_prompt=True, tokenize=False
    )
    assert chatml == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_template_is_a_name_or_a_file(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="chatml, gemma"):
        resolve_chat_template("nope")


def test_memory_store_round_trips_records():
    async def scenario():
        store = MemorySessionStore(ttl_s=60)
        record = SessionRecord("s1", [1, 2], None, CacheRef("a:1", "c1", 2), None)
        await store.put(record)
        got = await store.get("s1")
        assert got.tokens == [1, 2] and got.draft == CacheRef("a:1", "c1", 2) and got.target is None
        await store.delete("s1")
        assert await store.get("s1") is None

    asyncio.run(scenario())


def test_replica_set_places_new_caches_on_the_least_busy_healthy_replica():
    class Replica:
        def __init__(self, address: str) -> None:
            self.address = address

    replicas = ReplicaSet([Replica("a"), Replica("b"), Replica("c")], rest_s=60)
    first = replicas.pick(None)
    replicas.hold(None, first.address)
    second = replicas.pick(None)
    assert second.address != first.address
    replicas.hold(None, second.address)
    third = replicas.pick(None)
    assert third.address not in (first.address, second.address)
    # A session keeps its replica while it is healthy; when it rests, the session moves.
    assert replicas.pick(CacheRef(first.address, "c1", 3)) is first
    replicas.failed(first.address)
    moved = replicas.pick(CacheRef(first.address, "c1", 3))
    assert moved is not None and moved is not first
    replicas.hold(second.address, None)
    replicas.hold(None, third.address)
    assert replicas.pick(None) is second  # now the only healthy replica with nothing running
    for r in (second, third):
        replicas.failed(r.address)
    assert replicas.pick(None) is None


def test_cache_table_budget_evicts_idle_caches_then_refuses(tiny_target):
    def prefilled(table: CacheTable, tokens: list[int]) -> str:
        cache_id, cache = table.create(tokens)
        cache.prefill(tiny_target.model)
        table.fit_budget(cache_id)
        return cache_id

    probe = CacheTable(8)
    one = probe.get(prefilled(probe, [3, 4, 5, 6]))
    size = kv_buffer_bytes(one.kv)
    assert size > 0
    # Room for two caches: the third evicts the least recently used idle one.
    idle = CacheTable(8, budget_bytes=int(2.5 * size), active_s=0.0)
    a, b = prefilled(idle, [3, 4, 5, 6]), prefilled(idle, [7, 8, 9, 10])
    idle.get(a)  # a is now more recently used than b
    c = prefilled(idle, [11, 12, 13, 14])
    assert len(idle) == 2 and idle.evictions == 1 and idle.kv_bytes() <= 2.5 * size
    idle.get(a), idle.get(c)
    with pytest.raises(CacheNotFound):
        idle.get(b)
    # Every cache in use: the newcomer is refused, and nobody running loses a cache.
    busy = CacheTable(8, budget_bytes=int(2.5 * size), active_s=60.0)
    kept = [prefilled(busy, [3, 4, 5, 6]), prefilled(busy, [7, 8, 9, 10])]
    with pytest.raises(CacheBudgetExceeded, match="in use"):
        prefilled(busy, [11, 12, 13, 14])
    assert len(busy) == 2 and all(busy.get(k) for k in kept)


def test_cache_table_drops_idle_caches():
    table = CacheTable(8, idle_s=0.2)
    table.create([1, 2])
    time.sleep(0.3)
    fresh, _ = table.create([3, 4])  # creating also sweeps
    assert len(table) == 1 and table.get(fresh)
    time.sleep(0.3)
    assert table.expire_idle() == 1 and len(table) == 0


@pytest.mark.parametrize(
    "prompt,options,field",
    [
        ([{"role": "user"}], {}, "prompt"),
        (b"bytes", {}, "prompt"),
        ("hi", {"max_new_tokens": -1}, "max_new_tokens"),
        ("hi", {"top_k": 2**31}, "top_k"),
        ("hi", {"seed": -1}, "seed"),
        ("hi", {"k": True}, "k"),
        ("hi", {"temperature": "hot"}, "temperature"),
        ("hi", {"stop": ["\n", 3]}, "stop"),
    ],
)
def test_sdk_refuses_what_the_wire_cannot_carry_naming_the_field(prompt, options, field):
    with pytest.raises(InvalidArgument) as err:
        build_request(prompt, **options)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.details.startswith(field)


def test_sdk_takes_one_stop_string_as_one_not_as_characters():
    assert list(build_request("hi", stop="\n\n").stop) == ["\n\n"]
    assert list(build_request("hi", stop=("a", "b")).stop) == ["a", "b"]
    # numpy's integers and floats are integers and numbers too.
    request = build_request("hi", max_new_tokens=np.int64(5), seed=np.uint64(3), temperature=np.float32(0.5))
    assert (request.max_new_tokens, request.seed, request.temperature) == (5, 3, 0.5)


@pytest.mark.parametrize(
    "temperature,ok",
    [
        (0.0, True),
        (1e-4, True),
        (0.7, True),
        (1e-5, False),
        (-1.0, False),
        (float("nan"), False),
        (float("inf"), False),
    ],
)
def test_check_sampling_takes_greedy_or_a_temperature_float32_can_divide_by(temperature, ok):
    # 1e-4 as the wire's float32 holds it lies just below 1e-4 and must still pass.
    wire = common_pb2.SamplingParams(temperature=temperature).temperature
    if ok:
        check_sampling(wire, 0, 1.0)
        logits = torch.tensor([[30.0, -30.0, 0.0]])
        if wire:
            assert torch.isfinite(warp_probs(logits, Sampling(temperature=wire, top_k=2))).all()
    else:
        with pytest.raises(ValueError, match="^temperature"):
            check_sampling(wire, 0, 1.0)


def test_a_session_record_round_trips_and_serializes_as_asdict_would():
    """``to_json`` builds its dict by hand (``asdict`` deep-copies the token list every round); the
    stored form must stay exactly what ``asdict`` gives, nested records included."""
    import json
    from dataclasses import asdict

    from coordinator.sessions import TurnState

    turn = TurnState("f" * 64, 3, 7, [{"role": "user", "content": "hi"}], 4, [4, 2], [2, 1], [4, 2])
    full = SessionRecord(
        "a" * 32,
        tokens=list(range(40)),
        messages=[{"role": "user", "content": "hi"}],
        draft=CacheRef("d:1", "c1", 40, 2),
        target=CacheRef("t:1", "c2", 40, 2),
        turn=turn,
        fence=2,
    )
    for record in (full, SessionRecord("b" * 32)):
        assert record.to_json() == json.dumps(asdict(record), separators=(",", ":"))
        assert SessionRecord.from_json(record.to_json()) == record


def test_checkpoints_report_a_last_record_the_store_did_not_take():
    """A round's checkpoint may be skipped (the next one carries its progress); the turn's last one
    may not, and ``flush(must_write=True)`` says so. A later successful write clears the failure."""

    class FlakyStore(MemorySessionStore):
        down = True

        async def put(self, record):
            if self.down:
                raise StoreUnavailable("redis is restarting")
            await super().put(record)

    async def scenario():
        store = FlakyStore(60)
        checkpoints = Checkpoints(store)
        checkpoints.submit(SessionRecord("s1", tokens=[1]))
        await checkpoints.flush()  # a round's checkpoint: skipped quietly
        with pytest.raises(StoreUnavailable):
            await checkpoints.flush(must_write=True)
        store.down = False
        checkpoints.submit(SessionRecord("s1", tokens=[1, 2]))
        await checkpoints.flush(must_write=True)
        assert (await store.get("s1")).tokens == [1, 2]

    asyncio.run(scenario())


def test_checkpoints_are_spaced_by_the_interval_and_the_last_goes_at_once():
    """A turn's first checkpoint is written at once, later rounds' wait out the interval (the newest
    wins, the ones between are never written), and ``flush`` writes the newest without waiting."""

    class CountingStore(MemorySessionStore):
        def __init__(self, ttl_s: int) -> None:
            super().__init__(ttl_s)
            self.writes: list[list[int]] = []

        async def put(self, record):
            self.writes.append(list(record.tokens))
            await super().put(record)

    async def scenario():
        store = CountingStore(60)
        checkpoints = Checkpoints(store, interval_s=30.0)
        checkpoints.submit(SessionRecord("s1", tokens=[1]))
        await asyncio.sleep(0.05)
        for n in range(2, 6):
            checkpoints.submit(SessionRecord("s1", tokens=list(range(1, n + 1))))
            await asyncio.sleep(0.01)
        assert store.writes == [[1]] and (await store.get("s1")).tokens == [1]
        started = time.perf_counter()
        await checkpoints.flush(must_write=True)
        assert time.perf_counter() - started < 5.0
        assert store.writes == [[1], [1, 2, 3, 4, 5]]

        every = CountingStore(60)
        unspaced = Checkpoints(every)  # interval 0: every round's record, as each write ends
        for n in range(1, 4):
            unspaced.submit(SessionRecord("s2", tokens=list(range(n))))
            await asyncio.sleep(0.01)
        await unspaced.flush()
        assert every.writes == [[0], [0, 1], [0, 1, 2]]

    asyncio.run(scenario())


def test_a_model_computes_on_cpu_or_cuda_and_a_sharded_target_on_cpu():
    assert ModelConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="device"):
        ModelConfig(device="tpu")
    with pytest.raises(ValueError, match="tensor-parallel"):
        TargetConfig(model=ModelConfig(device="cuda"), tp=TensorParallelConfig(world_size=2))
    assert TargetConfig(tp=TensorParallelConfig(world_size=2)).model.device == "cpu"
