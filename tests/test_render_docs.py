"""bench/render_docs.py: tables from reports, and the committed pages fresh against the committed reports."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("render_docs", ROOT / "bench" / "render_docs.py")
render_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_docs)

BENCH = {
    "config": {"n": 2, "max_new_tokens": 8, "temperature": 0.0, "k": "auto", "draft_kinds": ["feature"]},
    "modes": {
        "hf-target": {"tokens": 16, "seconds": 1.6, "tokens_per_s": 10.0, "speedup_vs_hf_target": 1.0},
        "hf-assisted": {"tokens": 16, "seconds": 2.0, "tokens_per_s": 8.0, "exact": "2/2"},
        "specdec-k0": {
            "tokens": 16,
            "seconds": 1.0,
            "tokens_per_s": 16.0,
            "rounds": 16,
            "per_round_ms": {
                "draft": 0.0,
                "verify": 50.0,
                "other": 0.5,
                "prefill_per_request": 200.0,
                "median_other": 0.4,
            },
            "exact": "2/2",
        },
        "specdec": {
            "tokens": 16,
            "seconds": 0.8,
            "tokens_per_s": 20.0,
            "rounds": 8,
            "per_round_ms": {
                "draft": 10.0,
                "verify": 60.0,
                "other": 0.6,
                "prefill_per_request": 210.0,
                "median_other": 0.5,
            },
            "acceptance_rate": 0.5,
            "mean_k": 2.0,
            "mean_accepted_length": 2.0,
            "tokens_per_target_pass": 2.0,
            "acceptance_by_position": [0.75, 0.25],
            "per_token_acceptance": 0.6,
            "predicted_speedup_vs_k0": 1.3,
            "measured_speedup_vs_k0": 1.25,
            "efficiency": 0.962,
            "exact": "2/2",
            "exact_vs_k0": "2/2",
        },
    },
    "created": "2030-01-02T03:04:05Z",
    "host": {"cpu": "Test CPU", "cores": 2},
}


def _level(tps: float, **extra) -> dict:
    return {
        "tokens": 10,
        "seconds": 1.0,
        "tokens_per_s": tps,
        "ttft_ms": {"p50": 100.0, "p95": 200.0},
        "per_token_ms": {"p50": 40.0, "p95": 50.0},
        **extra,
    }


LOAD = {
    "config": {"n": 4, "max_new_tokens": 8, "requests_per_level": {"1": 4, "16": 16}, "repeats": 2},
    # Levels out of order in the file: the tables sort them by number.
    "modes": {
        "hf-batched": {"16": _level(40.0), "1": _level(10.0)},
        "specdec-k0": {"16": _level(50.0, mean_k=0.0, exact="16/16"), "1": _level(20.0, mean_k=0.0, exact="4/4")},
        "specdec": {
            "16": _level(55.0, mean_k=0.2, acceptance_rate=0.5, exact="16/16"),
            "1": _level(25.0, mean_k=2.0, acceptance_rate=0.4, exact="4/4"),
        },
    },
    "specdec_vs_k0": {"1": 1.25, "16": 1.1},
    "scaling_vs_single_session": {"specdec": {"1": 1.0, "16": 2.2}},
}

GRID = {
    "config": {"threads": 2, "repeats": 3, "accept": 0.5},
    "pass_ms": {"1": [100.0, 110.0, 120.0], "4": [200.0, 260.0, 300.0]},
    "ceiling": {"1": {"gain": 1.5, "k": 2}, "4": {"gain": 1.1, "k": 1}},
}


def _option(nodes: int, depth: int, width: int, tokens: float, tps: float) -> dict:
    return {
        "nodes": nodes,
        "depth": depth,
        "width": width,
        "tokens_per_pass": tokens,
        "tokens_per_s": tps,
        "vs_generate": tps / 10,
    }


TREES = {
    "config": {"goal_tokens": 2.3, "measured_tree": {"nodes": 32, "depth": 8}},
    "measured": {
        "pass_ms_by_rows": [50.0, 52.0],
        "tokens_per_round": 2.2,
        "model_tokens_per_round": 2.1,
        "draft_ms_per_level": 5.0,
        "generate_tokens_per_s": 10.0,
    },
    "free_draft": {
        "draft_ms_per_level": 0.0,
        "best_chain": _option(2, 2, 1, 1.5, 20.0),
        "best_tree": _option(4, 3, 2, 1.7, 21.0),
        "tree_vs_chain": 1.05,
    },
    "at_measured_draft": {
        "draft_ms_per_level": 5.0,
        "best_chain": _option(0, 0, 0, 1.0, 18.0),
        "best_tree": _option(2, 1, 2, 1.5, 18.9),
        "tree_vs_chain": 1.05,
        "reaching_goal": _option(30, 6, 4, 2.31, 9.0),
    },
    "most_over_draft_costs": {"tree_vs_chain": 1.08, "draft_ms_per_level": 9.5},
}

LONG = {
    "config": {"chunks": "128,0", "tokens": 1500},
    "runs": [
        {"prefill_chunk": 128, "trials": [{"long_ttft_s": 6.0, "max_gap_s": 0.5, "median_gap_during_s": 0.3}]},
        {"prefill_chunk": 0, "trials": [{"long_ttft_s": 5.0, "max_gap_s": 5.0, "median_gap_during_s": 0.1}]},
    ],
}

CARD = {
    "kind": "feature",
    "architecture": {"layers": 1, "side_layers": [2, 15]},
    "training": {"steps": 10, "seconds": 120.0},
    "recipe": {"data": {"train_generated_tokens": 12345}},
    "metrics": {
        "held_out": {"top1_agreement": 0.6, "acceptance_by_position": [0.5, 0.25], "mean_accepted_length": 1.75},
        "held_out_with_lookup": {"mean_accepted_length": 2.0},
        "extra:prompts.jsonl": {"top1_agreement": 0.45, "mean_accepted_length": 1.5},
    },
}

README = "# demo\n\nintro\n\n<!-- results:begin -->\nold table\n<!-- results:end -->\n\nafter\n"


def _tree(tmp_path: Path, reports: dict[str, dict]) -> Path:
    root = tmp_path / "repo"
    (root / "reports").mkdir(parents=True)
    for name, report in reports.items():
        (root / "reports" / name).write_text(json.dumps(report))
    (root / "drafts" / "tiny-feature").mkdir(parents=True)
    (root / "drafts" / "tiny-feature" / "draft_card.json").write_text(json.dumps(CARD))
    (root / "README.md").write_text(README)
    return root


def test_tables_come_from_the_reports(tmp_path):
    reports = {"bench.json": BENCH, "bench-load.json": LOAD, "pass-grid.json": GRID, "long-prompt.json": LONG}
    root = _tree(tmp_path, reports | {"tree-ceiling.json": TREES})
    assert render_docs.main(["--root", str(root)]) == 0
    page = (root / "docs" / "benchmarks.md").read_text()
    # Single stream: ratios side by side, the speculative mode's acceptance and efficiency, the split.
    assert "| `specdec` | 20.00 | 2.00× | 2.50× | 1.25× | 2/2 |" in page
    assert "| `hf-target` | 10.00 | 1.00× | 1.25× | 0.62× | — |" in page
    assert "| `specdec` | 8 | 2.00 | 2.00 | 0.50 | 0.60 | 1.30 | 1.25 | 0.96 |" in page
    assert "| `specdec` | 0.75 | 0.25 |" in page
    assert "| `specdec` | 10.00 | 60.00 | 0.60 | 0.50 | 210.0 |" in page
    # Load: levels in numeric order, the ratio to k0 computed from tokens/s, scaling, latency.
    assert "| C | 1 | 16 |" in page
    assert "| requests | 4 | 16 |" in page
    assert "| **specdec / specdec-k0** | **1.250×** | **1.100×** |" in page
    assert "| `specdec` scaling vs C = 1 | 1.00× | 2.20× |" in page
    assert "| `specdec` | 16 | 100 / 200 | 40.0 / 50.0 | 16/16 |" in page
    # The ceiling, pass costs relative to k = 0.
    assert "| 4 | 200.0 | 1.30× | 1.50× | **1.10×** (k = 1) |" in page
    # The tree ceiling: the best chain and tree by draft cost, their ratio, the most over draft costs.
    assert "| free draft (0.00 ms/level) | best tree | 4 nodes, 3 deep, 2 wide | 1.70 | 21.00 | 2.10× |" in page
    assert "| measured draft (5.00 ms/level) | best chain | target-only | 1.00 | 18.00 | 1.80× |" in page
    assert (
        "| measured draft (5.00 ms/level) | best ≥ 2.3 tokens | 30 nodes, 6 deep, 4 wide | 2.31 | 9.00 | 0.90× |"
        in page
    )
    assert "| free draft | **tree / chain** | — | — | — | **1.050×** |" in page
    assert "trees beat chains by at most **1.080×** (at 9.50 ms a level)" in page
    # Long prompts: per setting, and against the unchunked one.
    assert (
        "| `--prefill-chunk 128` | 1 | 0.50 (0.50–0.50) | 0.30 (0.30–0.30) | 6.00 (6.00–6.00) | 0.10× | 1.20× |"
    ) in page
    # The drafts' cards, and where the reports came from.
    assert "| `tiny-feature` | feature | 1 layer, reads layers 2, 15 | 0.600 | 0.50, 0.25 | 1.75 | 2.00 |" in page
    assert "- `reports/bench.json` (created: 2030-01-02T03:04:05Z; host: cpu Test CPU, cores 2)" in page

    readme = (root / "README.md").read_text()
    assert "old table" not in readme
    assert readme.startswith("# demo\n\nintro\n\n<!-- results:begin -->\nFrom `reports/bench.json`")
    assert readme.endswith("<!-- results:end -->\n\nafter\n")
    assert "| `specdec` | 20.00 | 2.00× | 1.25× | 2.00 | 2/2 | 2/2 |" in readme


def test_the_tree_ceiling_says_when_no_tree_reaches_the_goal():
    unreached = json.loads(json.dumps(TREES))
    del unreached["at_measured_draft"]["reaching_goal"]
    page = "\n".join(render_docs.tree_ceiling_section(unreached))
    assert "No chain or tree of up to 32 nodes expects 2.3 tokens a pass." in page
    assert "No chain or tree" not in "\n".join(render_docs.tree_ceiling_section(TREES))


def test_same_reports_same_pages_and_missing_reports_say_how_to_make_them(tmp_path):
    root = _tree(tmp_path, {"bench.json": BENCH})
    assert render_docs.main(["--root", str(root)]) == 0
    first = (root / "docs" / "benchmarks.md").read_text(), (root / "README.md").read_text()
    assert render_docs.main(["--root", str(root), "--check"]) == 0
    assert render_docs.main(["--root", str(root)]) == 0
    assert ((root / "docs" / "benchmarks.md").read_text(), (root / "README.md").read_text()) == first
    page = first[0]
    assert "No `reports/bench-load.json` yet: run `make bench-load`." in page
    assert "No `reports/pass-grid.json` yet: run `make pass-grid`." in page
    assert "No `reports/tree-ceiling.json` yet: run `make tree-ceiling`." in page
    assert "No `reports/long-prompt.json` yet: run `make bench-long-prompt`." in page

    # A changed report makes the pages stale, and --check says so without writing.
    changed = json.loads(json.dumps(BENCH))
    changed["modes"]["specdec"]["tokens_per_s"] = 30.0
    (root / "reports" / "bench.json").write_text(json.dumps(changed))
    assert render_docs.main(["--root", str(root), "--check"]) == 1
    assert (root / "docs" / "benchmarks.md").read_text() == page


def test_committed_pages_are_fresh_against_the_committed_reports(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    out = tmp_path / "benchmarks.md"
    assert render_docs.main(["--root", str(ROOT), "--out", str(out), "--readme", str(readme)]) == 0
    stale = "is stale against reports/*.json: run `make docs` (python bench/render_docs.py)"
    assert out.read_text() == (ROOT / "docs" / "benchmarks.md").read_text(), f"docs/benchmarks.md {stale}"
    assert readme.read_text() == (ROOT / "README.md").read_text(), f"README.md's results table {stale}"


def test_the_peers_section_adds_the_speculation_off_run_when_its_report_exists():
    """``reports/peers-k0.json`` (``make bench-peers-k0``) is a run of its own: one line, its own ratios."""

    def report(ours: float, theirs: float) -> dict:
        one = {"tok_s": ours, "per_turn_tok_s": [ours]}
        return {
            "summary": {
                "specdec": {"one_stream": one, "streams": one, "ready_s": [26.0], "identity_streams_vs_one": {}},
                "vllm-bf16": {"one_stream": {"tok_s": theirs}, "streams": {"tok_s": theirs}, "ready_s": [80.0]},
            },
            "ratios": {"specdec/vllm-bf16": {"one_stream": round(ours / theirs, 3)}},
        }

    alone = "\n".join(render_docs.peers_section(report(50.0, 50.0)))
    both = "\n".join(render_docs.peers_section(report(50.0, 50.0), report(42.0, 50.0)))
    assert "speculation off" not in alone
    assert "With speculation off" in both and "specdec 42.0 tok/s" in both and "**0.84×**" in both


def test_the_roofline_puts_each_sweeps_read_rate_beside_its_ratio_of_passes():
    roof = {
        "weights_mb": 269.0,
        "products_ms": {"1": 6.35, "8": 8.26},
        "read_gb_per_s": 42.3,
        "cached_gmacs_per_s": 214.0,
        "rows8_at_cached_rate_ms": 5.03,
        "sweeps": [[31.0, 11.0, 13.2], [45.0, 8.5, 13.6]],
    }
    engines = {"bfloat16-compiled": {"pass_ms": {"1": 9.0, "8": 13.4}, "roofline": roof}, "bfloat16": {"pass_ms": {}}}
    text = "\n".join(render_docs.curve_section({"engines": engines}))
    assert text.count("### What bounds a compiled pass") == 1
    assert "`bfloat16-compiled`:" in text and "`bfloat16`:" not in text
    assert "| 269 | 6.35 ms | 42.3 GB/s | 8.26 ms | 5.03 ms (214 G/s) |" in text
    assert "| 31.0 | 11.0 | 13.2 | 1.20× |" in text and "| 45.0 | 8.5 | 13.6 | 1.60× |" in text
