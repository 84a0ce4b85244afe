"""End to end on the real SmolLM2-135M-Instruct: separate processes, real gRPC, real redis-server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from harness import InProcessStack

from coordinator.prompts import render_chat
from draft_service.engine import ModelDrafter, NgramDrafter
from specdec import Client
from specdec.models import load_model, resolve_dtype
from specdec.stack import LocalStack, StackConfig
from target_service.engine import TargetEngine

pytestmark = pytest.mark.slow
CACHE_DIR = Path.home() / ".cache" / "specdec"
NEW_TOKENS = 48

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import json\n\ndef load_config(path):\n",
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three uses of Python."},
    ],
    "The history of the printing press begins in",
    "Once upon a time, in a small village by the mountains,",
    [{"role": "user", "content": "Explain what a hash table is to a beginner."}],
    # Longer than the target's prefill chunk (128 tokens): fed a chunk a pass, folded under load.
    [
        {
            "role": "user",
            "content": "Read the notes below, then say in two sentences what the team decided.\n\n"
            "Monday: the team met to plan the move of the office library to the second floor. Anna said the "
            "shelves on the second floor are shorter, so the atlases and the large art books will not fit. "
            "Marco offered to measure the shelves again before anyone buys new ones. Tuesday: Marco measured "
            "them; the shelves are 30 centimetres tall, and the atlases need 38. The team agreed to keep the "
            "atlases and art books on the ground floor, in the reading corner by the window, and to move "
            "everything else upstairs. Wednesday: Priya asked who would label the boxes. Nobody volunteered, "
            "so the team drew names and Jonas will label them on Friday morning. The move itself is set for "
            "the following Monday, starting at nine, and the café will send coffee at ten. Thursday: Anna "
            "reminded everyone that the lift is out of service until Tuesday, so the boxes must go up the "
            "stairs, and asked that no box weigh more than twelve kilograms.",
        }
    ],
]


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    return render_chat(tokenizer, prompt)


def near_tie(model, context: list[int], threshold: float = 0.02) -> tuple[bool, float]:
    """Whether the target's top two logits after ``context`` are within ``threshold``."""
    with torch.inference_mode():
        logits = model(torch.tensor([context])).logits[0, -1]
    top = torch.topk(logits, 2).values
    gap = float(top[0] - top[1])
    return gap < threshold, gap


def hf_greedy(loaded, prompts, new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target-only greedy continuation by HF generate) of each prompt.

    Called before any server starts, so it may use both cores (the tests run one thread otherwise).
    """
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for prompt in prompts:
            ids = prompt_ids(loaded.tokenizer, prompt)
            with torch.inference_mode():
                gen = loaded.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
            out.append((ids, gen[0, len(ids) :].tolist()))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def served_model():
    """The default target as the stack's target service runs it: its ``--dtype auto`` (bf16 on a CPU
    with AVX-512 BF16), its linear kernels, its batch-invariant attention."""
    return load_model("default", CACHE_DIR, dtype=resolve_dtype("auto", "cpu"), pack=True)


@pytest.fixture(scope="module")
def references(served_model):
    """Target-only greedy output of HF generate in the stack's dtype, computed before any server
    competes for the cores."""
    return hf_greedy(served_model, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def fp32_references(default_model):
    """Target-only greedy output of HF generate in float32, for the in-process fp32 target."""
    return hf_greedy(default_model, PROMPTS[:2], NEW_TOKENS)


@pytest.fixture(scope="module")
def stack(references, tmp_path_factory):
    with LocalStack(StackConfig(default_k=4), log_dir=tmp_path_factory.mktemp("stack")) as s:
        yield s


def test_greedy_speculative_equals_hf_generate(stack, references, served_model):
    accepted = 0
    with Client(stack.address, timeout=300) as client:
        for prompt, (ids, expected) in zip(PROMPTS, references):
            result = client.complete(prompt, max_new_tokens=NEW_TOKENS)
            accepted += result.stats.accepted_tokens
            check_against_reference(result, prompt, ids, expected, served_model.model)
    assert accepted > 0, "the shipped draft never got a token accepted"


def check_against_reference(result, prompt, ids, expected, model) -> None:
    """Asserts token identity. The served target's passes are batch-invariant and the reference runs its
    kernels, so no near-tie of the logits excuses a difference; the gap is reported to help debugging."""
    if result.token_ids != expected:
        at = next(i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b)
        _, gap = near_tie(model, ids + expected[:at])
        pytest.fail(f"prompt {prompt!r}: diverged at token {at}, where the top-2 logit gap is {gap:.4f}")


def test_greedy_under_concurrency_equals_hf_generate(stack, references, served_model):
    """All prompts at once: the target verifies them in shared passes, and the answers stay the target's."""
    with Client(stack.address, timeout=300) as client, ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: client.complete(p, max_new_tokens=NEW_TOKENS), PROMPTS))
    for prompt, (ids, expected), result in zip(PROMPTS, references, results):
        check_against_reference(result, prompt, ids, expected, served_model.model)


def test_greedy_trees_equal_hf_generate_alone_and_at_eight(stack, references, served_model):
    """Every round a token tree of 10 nodes at most 4 deep (the stack's k), verified by the target's
    separate process beside other sessions' trees: the answers stay the target's, one stream at a
    time and eight at once, and siblings do get accepted."""

    def complete(client, prompt):
        return client.complete(prompt, max_new_tokens=NEW_TOKENS, tree_nodes=10)

    with Client(stack.address, timeout=300) as client, ThreadPoolExecutor(8) as pool:
        alone = [complete(client, p) for p in PROMPTS[:3]]
        together = list(pool.map(lambda p: complete(client, p), PROMPTS[:8]))
    for result, prompt, (ids, expected) in [*zip(alone, PROMPTS, references), *zip(together, PROMPTS, references)]:
        check_against_reference(result, prompt, ids, expected, served_model.model)
    results = alone + together
    assert sum(r.stats.tree_rounds for r in results) > 0.8 * sum(r.stats.rounds for r in results)
    assert sum(sum(r.stats.accepted_at_rank[1:]) for r in results) > 0, "no sibling was ever accepted"


def test_seeded_sampling_repeats_on_real_model(stack):
    with Client(stack.address, timeout=300) as client:
        runs = [client.complete(PROMPTS[3], max_new_tokens=24, temperature=0.8, top_p=0.95, seed=42) for _ in range(2)]
        other = client.complete(PROMPTS[3], max_new_tokens=24, temperature=0.8, top_p=0.95, seed=43)
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != other.token_ids


def test_chat_session_continues(stack, served_model):
    first_turn = [{"role": "user", "content": "Name a fruit that is yellow."}]
    with Client(stack.address, timeout=300) as client:
        first = client.complete(first_turn, max_new_tokens=20)
        second = client.complete(
            [{"role": "user", "content": "And one that is red?"}], max_new_tokens=20, session_id=first.session_id
        )
    conversation = [
        *first_turn,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And one that is red?"},
    ]
    ids = render_chat(served_model.tokenizer, conversation)
    assert second.stats.prompt_tokens == len(ids)
    with torch.inference_mode():
        gen = served_model.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert second.token_ids == gen[0, len(ids) :].tolist()


def in_process(default_model, drafter, redis_url) -> InProcessStack:
    """The real target and ``drafter`` over real gRPC in this process (no second load of the model)."""
    # "default" names the embedded model, so the coordinator loads its tokenizer from the same cache.
    return InProcessStack(TargetEngine(default_model, 8), drafter, Path("default"), redis_url).start(default_k=4)


def test_ngram_draft_real_model(fp32_references, default_model, redis_url):
    s = in_process(default_model, NgramDrafter(default_model.facts("ngram"), 8, 3, 1), redis_url)
    try:
        with Client(s.address, timeout=300) as client:
            for prompt, (_, expected) in zip(PROMPTS, fp32_references):
                result = client.complete(prompt, max_new_tokens=NEW_TOKENS)
                assert result.token_ids == expected
    finally:
        s.close()


def test_draft_equal_to_target_real_model(default_model, redis_url):
    k = 3
    s = in_process(default_model, ModelDrafter(default_model, 8, 64), redis_url)
    try:
        with Client(s.address, timeout=300) as client:
            result = client.complete(PROMPTS[0], max_new_tokens=4 * (k + 1), k=k)
    finally:
        s.close()
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.mean_accepted_length == k + 1
