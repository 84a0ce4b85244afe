"""The load benchmark's parts: closed-loop clients over a real stack, batched HF, and the report."""

from __future__ import annotations

from harness import InProcessStack
from test_e2e_tiny import hf_greedy

from bench.load import LevelResult, level_prompts, run_hf_batched_level, run_specdec_level, summarize_load
from bench.single import BenchPrompt
from draft_service.engine import ModelDrafter
from target_service.engine import TargetEngine

PROMPTS = [BenchPrompt(str(i), f"w{i} w{i + 2} w{(5 * i) % 30}") for i in range(6)]


def test_closed_loop_clients_get_target_greedy_output(tiny_target, tiny_draft, tiny_dir, redis_url):
    engine = TargetEngine(tiny_target, 32)
    stack = InProcessStack(engine, ModelDrafter(tiny_draft, 32, 64), tiny_dir / "target", redis_url).start()
    try:
        result = run_specdec_level("specdec", stack.address, PROMPTS, 3, 12, None)
    finally:
        stack.close()
    assert result.outputs == {p.id: hf_greedy(tiny_target, p.prompt, 12) for p in PROMPTS}
    assert result.tokens == sum(len(v) for v in result.outputs.values())
    assert len(result.ttft_ms) == len(PROMPTS) and result.seconds > 0
    assert engine.largest_pass > 1  # three clients at once shared passes


def test_hf_batched_rows_stop_at_eos_and_match_one_at_a_time(tiny_target):
    alone = run_hf_batched_level(tiny_target, PROMPTS, 1, 12)
    batched = run_hf_batched_level(tiny_target, PROMPTS, 3, 12)
    assert alone.outputs == {p.id: hf_greedy(tiny_target, p.prompt, 12) for p in PROMPTS}
    assert set(batched.outputs) == set(alone.outputs)
    for out in batched.outputs.values():
        assert 1 <= len(out) <= 12 and all(t != 1 for t in out[:-1])  # nothing kept past EOS (id 1)


def test_every_client_of_a_level_sends_as_many_requests():
    """A level's prompt count is N rounded up to a multiple of C, within the prompts there are."""
    prompts = [BenchPrompt(str(i), "x") for i in range(40)]
    assert [len(level_prompts(prompts, 24, c)) for c in (1, 2, 4, 8, 16)] == [24, 24, 24, 24, 32]
    assert len(level_prompts(prompts, 30, 16)) == 32 and len(level_prompts(prompts[:20], 24, 16)) == 20
    assert level_prompts(prompts, 24, 16)[:24] == prompts[:24]


def test_report_has_percentiles_exactness_and_ratios():
    def level(tokens: int, seconds: float, outputs: dict) -> LevelResult:
        return LevelResult(
            tokens=tokens,
            seconds=seconds,
            ttft_ms=[10.0, 20.0, 30.0, 40.0],
            per_token_ms=[5.0, 5.0, 6.0, 9.0],
            outputs=outputs,
        )

    reference = {"a": [1, 2], "b": [3]}
    results = {
        "specdec-k0": {1: level(10, 2.0, reference), 4: level(40, 2.0, reference)},
        "specdec": {1: level(12, 2.0, reference), 4: level(40, 2.0, {"a": [1, 2], "b": [4]})},
    }
    report = summarize_load(results, reference)
    assert report["modes"]["specdec"]["4"]["exact"] == "1/2"
    assert report["modes"]["specdec-k0"]["1"]["ttft_ms"] == {"p50": 25.0, "p95": 38.5}
    assert report["specdec_vs_k0"] == {"1": 1.2, "4": 1.0}
    assert report["scaling_vs_single_session"]["specdec-k0"] == {"1": 1.0, "4": 4.0}


def test_repeated_runs_sum_tokens_and_seconds_and_check_every_output():
    reference = {"a": [1, 2], "b": [3]}
    first = LevelResult(tokens=3, seconds=1.0, ttft_ms=[10.0], outputs=dict(reference), drafted=2, accepted=1, rounds=4)
    second = LevelResult(
        tokens=3, seconds=2.0, ttft_ms=[30.0], outputs={"a": [1, 2], "b": [5]}, drafted=2, accepted=0, rounds=3
    )
    first.absorb(second)
    entry = first.summary(reference)
    assert entry["tokens_per_s"] == 2.0  # 6 tokens over 3 s, not the mean of 3.0 and 1.5
    assert entry["exact"] == "3/4"  # the second run's mismatch counts
    assert entry["mean_k"] == round(4 / 7, 3)
    assert entry["acceptance_rate"] == 0.25  # accepted over drafted tokens, both runs
    assert entry["ttft_ms"]["p50"] == 20.0


def test_report_compares_trees_with_chains_and_counts_tree_rounds():
    chains = {1: LevelResult(tokens=10, seconds=2.0, rounds=5)}
    trees = {1: LevelResult(tokens=11, seconds=2.0, rounds=5, drafted=9, tree_rounds=2, tree_nodes=7)}
    report = summarize_load({"specdec-chain": chains, "specdec": trees}, None)
    assert report["specdec_vs_chains"] == {"1": 1.1}
    assert report["modes"]["specdec"]["1"]["tree_rounds"] == 2
    assert report["modes"]["specdec"]["1"]["mean_tree_nodes"] == 3.5
    assert "tree_rounds" not in report["modes"]["specdec-chain"]["1"]
