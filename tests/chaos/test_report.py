"""reports/chaos.json and docs/reliability.md: the page's figures are rendered from the report, and
the committed page is fresh against the committed report (no cluster needed)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from cluster import write_report

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("render_docs", ROOT / "bench" / "render_docs.py")
render_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_docs)

FAULT = {
    "model": "tiny",
    "streams": 16,
    "seeded_sampled": 8,
    "max_new_tokens": 24,
    "requests": 16,
    "in_flight_at_fault": 15,
    "failed": 0,
    "mismatched": 0,
    "recovery_p50_s": 0.2,
    "recovery_max_s": 1.25,
}
SOAK = {
    "clients": 32,
    "requests": 3200,
    "errors": 0,
    "seconds": 300.0,
    "rss_mb_before": {"target0": 400.0},
    "rss_mb_after": {"target0": 404.0},
    "rss_growth": {"target0": 0.01},
    "caches_held_after_expiry": {"target0": 0},
}


def test_report_sections_merge_and_render(tmp_path):
    report = tmp_path / "repo" / "reports" / "chaos.json"
    write_report(str(report), "faults", {"draft SIGKILL": FAULT})
    write_report(str(report), "fuzz", {"in_process_fields": {"requests": 8000, "seconds": 9.5}})
    write_report(str(report), "soak", {"full": SOAK})
    write_report(str(report), "faults", {"target SIGKILL": dict(FAULT, recovery_max_s=None)})
    data = json.loads(report.read_text())
    assert list(data["faults"]) == ["draft SIGKILL", "target SIGKILL"] and data["soak"]["full"] == SOAK
    block = render_docs.render_reliability(tmp_path / "repo", report.parent)
    assert "| draft SIGKILL | `tiny` | 16 (8 seeded sampled) | 24 | 16 | 15 | 0 | 0 | 0.20 / 1.25 |" in block
    assert "| target SIGKILL | `tiny` | 16 (8 seeded sampled) | 24 | 16 | 15 | 0 | 0 | 0.20 / — |" in block
    assert "8,000 requests: 8,000 in process fields (9.5 s)." in block
    assert "| full | 32 × 100 | 0 | 300.0 | target0 400 → 404 | 1.0% | 0 |" in block


def test_committed_reliability_page_is_fresh_against_the_committed_report(tmp_path):
    page = tmp_path / "reliability.md"
    shutil.copy(ROOT / "docs" / "reliability.md", page)
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    assert (
        render_docs.main(
            [
                "--root",
                str(ROOT),
                "--out",
                str(tmp_path / "benchmarks.md"),
                "--readme",
                str(readme),
                "--reliability",
                str(page),
            ]
        )
        == 0
    )
    assert page.read_text() == (ROOT / "docs" / "reliability.md").read_text(), (
        "docs/reliability.md is stale against reports/chaos.json: run `make docs` (python bench/render_docs.py)"
    )
