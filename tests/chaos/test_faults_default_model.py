"""Two faults on what `specdec up` runs: SmolLM2-135M-Instruct with its shipped feature draft, k chosen
per round, the CLI's own deadlines (the draft's 5 s, the target's 30 s).

The same check as tests/chaos/test_faults.py: 16 streams at once (8 prompts, greedy and seeded
sampled), a fault once they have received a random share of their tokens, and every stream equal
to its fault-free output, token for token. Generations are short (16 tokens) to keep the suite
within its time on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import Ask, Cluster, Models
from test_faults import PAIRS, Setup, reference_outputs, run_with_fault

pytestmark = pytest.mark.slow
MAX_NEW = 16
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 42}
PROMPTS = [
    "The history of the printing press begins in",
    "Once upon a time, in a small village by the mountains,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import json\n\ndef load_config(path):\n",
    "The three primary colours are",
    "A hash table stores values by",
    "To make a cup of tea, first",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def setup(default_model, tmp_path_factory) -> Setup:
    """One feature draft (a killed one leaves the sessions target-only), two targets (a killed one
    moves its sessions to the other), two coordinators. ``default_model`` has converted the model
    into the cache the replicas load it from."""
    assert len(PROMPTS) == PAIRS
    models = Models.default(Path.home() / ".cache" / "specdec")  # where default_model converted it
    with Cluster(models, tmp_path_factory.mktemp("chaos-default"), drafts=1, targets=2) as cluster:
        asks = [Ask(p, sampled) for p in PROMPTS for sampled in (False, True)]
        references = reference_outputs(cluster, asks, MAX_NEW, SAMPLED)
        yield Setup(cluster, references, PROMPTS, MAX_NEW, SAMPLED, "default")


def test_target_killed_with_a_second_replica(setup):
    # The target holding the most sessions (new sessions go to the least busy one, so both may not
    # hold some). Not restarted: the sessions go on on the other, and the draft fault below runs there.
    c = setup.cluster
    run_with_fault(
        "target SIGKILL (default model, feature draft)",
        setup,
        lambda: c.kill(c.busiest("target")),
        evidence="moving the session",
    )


def test_feature_draft_killed_mid_stream(setup):
    # The only draft: the sessions go on target-only. Not restarted either (the cluster closes next).
    c = setup.cluster
    run_with_fault(
        "draft SIGKILL (default model, feature draft)", setup, lambda: c.kill("draft0"), evidence="draft failed"
    )
