"""The peer benchmark's pure helpers (``bench/peers.py``): no server, no vLLM."""

from __future__ import annotations

from pathlib import Path

from bench.peers import (
    abba_order,
    add_identity,
    answer_of,
    cross_identity,
    find_libiomp,
    has_flag,
    identity,
    ratios,
    request_for,
    stream_orders,
    summarise,
    tokens_per_s,
)
from bench.single import BenchPrompt


def test_abba_order() -> None:
    assert abba_order(["A", "B"]) == ["A", "B", "B", "A"]
    assert abba_order(["A", "B", "C"]) == ["A", "B", "C", "C", "B", "A"]


def test_stream_orders_send_every_prompt_once_from_spread_starts() -> None:
    orders = stream_orders(12, 8)
    assert len(orders) == 8
    assert all(sorted(o) == list(range(12)) for o in orders)
    assert [o[0] for o in orders] == [0, 1, 3, 4, 6, 7, 9, 10]
    assert stream_orders(0, 2) == [[], []]
    assert stream_orders(3, 1) == [[0, 1, 2]]


def test_tokens_per_s() -> None:
    assert tokens_per_s(100, 4.0) == 25.0
    assert tokens_per_s(100, 0.0) == 0.0


def test_identity_counts_and_skips_prompts_without_reference() -> None:
    reference = {"a": "x", "b": "y"}
    got = identity(reference, [("a", "x"), ("a", "x"), ("b", "z"), ("c", "x")])
    assert got == {"equal": 2, "total": 3, "differing_prompts": ["b"]}
    assert add_identity(got, {"equal": 1, "total": 1, "differing_prompts": ["a"]}) == {
        "equal": 3,
        "total": 4,
        "differing_prompts": ["a", "b"],
    }


def _run(server: str, one: tuple[int, float], many: tuple[int, float], equal: int, **extra) -> dict:
    return {
        "server": server,
        "ready_s": 10.0,
        "one_stream": {"tokens": one[0], "seconds": one[1]},
        "streams": {"tokens": many[0], "seconds": many[1]},
        "identity_streams_vs_one": {"equal": equal, "total": 4, "differing_prompts": [] if equal == 4 else ["p"]},
        **extra,
    }


def test_summarise_pools_turns_and_ratios() -> None:
    runs = [
        _run("vllm-bf16", (100, 4.0), (400, 2.0), 2),
        _run("specdec", (100, 2.0), (400, 4.0), 4),
        _run(
            "specdec",
            (100, 2.0),
            (400, 4.0),
            4,
            identity_one_vs_first_turn={"equal": 1, "total": 1, "differing_prompts": []},
        ),
        {"server": "vllm-bf16", "ready_s": None, "error": "TimeoutError: slow"},
    ]
    summary = summarise(runs)
    v, s = summary["vllm-bf16"], summary["specdec"]
    assert v["turns"] == 2 and v["failed_turns"] == 1 and v["ready_s"] == [10.0]
    assert v["one_stream"]["tok_s"] == 25.0 and v["streams"]["tok_s"] == 200.0
    assert s["one_stream"]["tok_s"] == 50.0 and s["one_stream"]["per_turn_tok_s"] == [50.0, 50.0]
    assert s["identity_streams_vs_one"]["equal"] == 8 and s["identity_streams_vs_one"]["total"] == 8
    assert s["identity_one_vs_first_turn"]["equal"] == 1
    assert v["identity_streams_vs_one"] == {"equal": 2, "total": 4, "differing_prompts": ["p"]}
    assert ratios(summary, "specdec", "vllm-bf16") == {"one_stream": 2.0, "8_streams": 0.5}
    assert ratios(summary, "specdec", "vllm-fp32") == {"one_stream": None, "8_streams": None}


def test_request_for_chat_and_plain_prompts() -> None:
    chat = BenchPrompt("c", [{"role": "user", "content": "hi"}])
    path, body = request_for(chat, "m", 64)
    assert path == "/v1/chat/completions"
    assert body == {"model": "m", "max_tokens": 64, "temperature": 0.0, "stream": False, "messages": chat.prompt}
    plain = BenchPrompt("p", "def f():\n")
    assert request_for(plain, "m", 8)[0] == "/v1/completions"
    assert request_for(plain, "m", 8)[1]["prompt"] == "def f():\n"
    path, body = request_for(plain, "m", 8, plain_as="chat")
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "def f():\n"}]


def test_answer_of_chat_and_text_replies() -> None:
    usage = {"usage": {"completion_tokens": 3}}
    assert answer_of({"choices": [{"message": {"content": "abc"}}], **usage}) == ("abc", 3)
    assert answer_of({"choices": [{"text": "xyz"}], **usage}) == ("xyz", 3)
    assert answer_of({"choices": [{"message": {"content": None}}], **usage}) == ("", 3)


def test_has_flag() -> None:
    text = "usage: specdec up [-h] [--port PORT] [--dtype DTYPE]\n  --dtype DTYPE  float32 or bfloat16"
    assert has_flag(text, "--dtype")
    assert not has_flag(text, "--dt")
    assert not has_flag("usage: specdec up [--dtype-x X]", "--dtype")


def test_find_libiomp(tmp_path: Path) -> None:
    assert find_libiomp(tmp_path) is None
    deep = tmp_path / "lib" / "python3.11" / "site-packages" / "torch" / "lib" / "libiomp5.so"
    deep.parent.mkdir(parents=True)
    deep.touch()
    assert find_libiomp(tmp_path) == deep
    top = tmp_path / "lib" / "libiomp5.so"
    top.touch()
    assert find_libiomp(tmp_path) == top


def test_cross_identity() -> None:
    got = cross_identity({"b": {"p": "1", "q": "2"}, "a": {"p": "1", "q": "3"}})
    assert got == {"a vs b": {"equal": 1, "total": 2, "differing_prompts": ["q"]}}
