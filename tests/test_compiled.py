"""The compiled pass (``specdec.compiled``): batch-invariant in every bucket and across pieces, close to
the eager pass, and an engine that switches to it drops its caches and stays exact."""

from __future__ import annotations

import os
import time

import pytest
import torch
from opentelemetry import trace
from test_invariance import invariance_failures
from test_round_loop import request, run

from coordinator.policy import SpeculationConfig, SpeculationPolicy
from coordinator.rounds import RoundLoop
from coordinator.routing import Router
from coordinator.sessions import MemorySessionStore
from coordinator.turns import Turns
from draft_service.engine import ModelDrafter
from draft_service.inprocess import InProcessDraft
from specdec.compiled import CompiledPass, compile_unsupported, pieces
from specdec.config import ModelConfig, TargetConfig
from specdec.errors import CacheNotFound
from specdec.kvcache import GrowableCache
from specdec.models import load_model
from specdec.ragged import RaggedItem, ragged_forward
from specdec.sampling import Sampling
from target_service import compile_ahead, server
from target_service.engine import TargetEngine
from target_service.inprocess import InProcessTarget
from target_service.server import compiled_pass

# Small buckets, so that the tests' longer passes (33 rows) run in pieces.
BUCKETS = (2, 8)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def compiled(request, tiny_dir):
    """The tiny target, packed, with its compiled pass built."""
    loaded = load_model(str(tiny_dir / "target"), tiny_dir, dtype=request.param, pack=True)
    compiled = CompiledPass(loaded.model, BUCKETS)
    compiled.compile()
    return loaded, compiled


def test_pieces_fill_groups_in_order_and_keep_a_tree_whole():
    items = [
        RaggedItem(None, [0] * 5, 1),
        RaggedItem(None, [0] * 6, 1, parents=(-1, 0, 0)),  # rows 3 .. 5 are a tree
        RaggedItem(None, [0] * 2, 1),
    ]
    groups = pieces(items, 4)
    assert groups == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(1, 3, 6), (2, 0, 1)], [(2, 1, 2)]]
    assert all(sum(hi - lo for _, lo, hi in g) <= 4 for g in groups)
    with pytest.raises(ValueError, match="token tree of 5 nodes"):
        pieces([RaggedItem(None, [0] * 6, 1, parents=(-1, 0, 1, 2, 3))], 4)


def test_a_model_the_compiled_pass_cannot_run_is_refused(tiny_target):
    assert "packed" in compile_unsupported(tiny_target.model)  # loaded without pack=True
    with pytest.raises(ValueError, match="packed"):
        CompiledPass(tiny_target.model)


@pytest.mark.parametrize("past", [20, 70])
def test_the_compiled_pass_is_batch_invariant(compiled, past):
    """Alone, in chains up to 33 rows (pieces of 8), in a tree and beside other sessions: same bits."""
    loaded, runner = compiled
    assert invariance_failures(loaded.model, past, runner.forward) == []


def test_fed_at_once_or_a_token_a_pass_every_row_scores_the_same(compiled):
    loaded, runner = compiled
    tokens = [(3 + 7 * i) % loaded.vocab_size for i in range(19)]
    whole, stepwise = GrowableCache(), GrowableCache()
    logits, hidden = runner.forward([RaggedItem(whole, tokens, len(tokens), (0,))])
    for i, token in enumerate(tokens):
        row_logits, row_hidden = runner.forward([RaggedItem(stepwise, [token], 1, (0,))])
        assert torch.equal(row_logits[0][0], logits[0][i]) and torch.equal(row_hidden[0][0], hidden[0][i])


def test_the_compiled_pass_computes_what_the_eager_pass_does(compiled):
    """Not the same bits (inductor fuses the small ops), but the same numbers to rounding."""
    loaded, runner = compiled
    tokens = [(3 + 7 * i) % loaded.vocab_size for i in range(30)]
    got, _ = runner.forward([RaggedItem(GrowableCache(), tokens, len(tokens))])
    want, _ = ragged_forward(loaded.model, [RaggedItem(GrowableCache(), tokens, len(tokens))])
    tolerance = 0.1 if loaded.dtype == torch.bfloat16 else 1e-3
    error = (got[0] - want[0]).abs().max()
    assert error < tolerance * want[0].abs().max()
    # The same greedy token wherever the top two are further apart than the rounding could move them.
    top2 = want[0].topk(2, dim=-1).values  # [T, 2]
    clear = (top2[:, 0] - top2[:, 1]) > 2 * error
    assert clear.sum() >= len(tokens) // 2
    assert torch.equal(got[0].argmax(-1)[clear], want[0].argmax(-1)[clear])


def test_the_native_ops_and_wrapper_compute_the_bits_python_does(compiled):
    """The C++ ops a pass calls where the kernels are built (the bf16 product by weight slot, attention
    over the caches a pass hands over once) against the Python ops over the same kernels, and the C++
    wrapper inductor generates against its Python wrapper: prompts fed in pieces, then chains, a token
    tree and sessions side by side, every logit and hidden row equal."""
    loaded, runner = compiled
    assert runner._native_attention  # the kernels build on every machine the tests run on
    python_ops = CompiledPass(loaded.model, BUCKETS, native_ops=False)
    python_ops.compile()
    python_wrapper = CompiledPass(loaded.model, BUCKETS, cpp_wrapper=False)
    python_wrapper.compile()
    vocab = loaded.vocab_size

    def passes(pass_runner: CompiledPass) -> list[torch.Tensor]:
        first, second = GrowableCache(), GrowableCache()
        prompt = [(5 + 11 * i) % vocab for i in range(21)]
        rows = []
        for items in (
            [RaggedItem(first, prompt, len(prompt), (0,)), RaggedItem(second, prompt[:9], 9)],
            [RaggedItem(first, [3, 4, 5], 3, (0,)), RaggedItem(second, [6, 7, 8, 9], 4, parents=(-1, 0, 0, 1))],
            [RaggedItem(second, [10], 1), RaggedItem(first, [11, 12], 2, (0,))],
        ):
            logits, hidden = pass_runner.forward(items)
            rows.extend([*logits, *(h for h in hidden if h is not None)])
        return rows

    native = passes(runner)
    for other in (passes(python_ops), passes(python_wrapper)):
        assert len(native) == len(other) >= 6
        assert all(torch.equal(a, b) for a, b in zip(native, other))


def _loop(target: TargetEngine, target_model, draft_model) -> RoundLoop:
    router = Router([InProcessDraft(ModelDrafter(draft_model, 8, 64))], [InProcessTarget(target)])
    policy = SpeculationPolicy(SpeculationConfig(), live_targets=lambda: 1)
    facts = target_model.facts("target")
    turns = Turns(target_model.tokenizer, facts, MemorySessionStore(3600))
    return RoundLoop(target_model.tokenizer, facts, router, policy, turns, trace.NoOpTracer())


def test_an_engine_switches_between_passes_and_speculation_stays_exact(tiny_dir, tiny_draft):
    loaded = load_model(str(tiny_dir / "target"), tiny_dir, dtype=torch.bfloat16, pack=True)
    runner = CompiledPass(loaded.model, BUCKETS)
    engine = TargetEngine(loaded, 8, compiled=runner)
    before, committed, _ = engine.prefill([2, 3, 4, 5])
    assert not engine.compiled
    runner.compile()
    with pytest.raises(CacheNotFound):  # dropped at the switch: its KV came from the eager pass
        engine.verify(before, committed, [], [6], [], Sampling(), 0)
    assert engine.compiled and engine.caches.ids() == set()
    # A scored prompt (echo's logprobs) is fed by the compiled pass too: the eager engine's figures to rounding.
    prompt = [2, 3, 4, 5, 6, 7, 8, 9]
    got = engine.prefill_scored(prompt, 2)[3]
    want = TargetEngine(loaded, 2).prefill_scored(prompt, 2)[3]
    assert [g.token for g in got] == prompt[1:] and [g.top[0][0] for g in got] == [w.top[0][0] for w in want]
    assert max(abs(g.logprob - w.logprob) for g, w in zip(got, want)) < 0.1
    loop = _loop(engine, loaded, tiny_draft)
    k0, _ = run(loop, request(k=0, max_new_tokens=24))
    for k in (1, 3, None):
        tokens, last = run(loop, request(k=k, max_new_tokens=24))
        assert tokens == k0
        if k:
            assert last.stats.drafted_tokens > 0


def test_the_service_compiles_as_its_mode_says(tiny_dir, tiny_target, monkeypatch, tmp_path, caplog):
    """off: nothing; a model the pass cannot run: nothing, and the log says why; wait: built and ready;
    the artifacts go under the cache directory unless the environment names a place."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    packed = load_model(str(tiny_dir / "target"), tiny_dir, dtype=torch.bfloat16, pack=True)

    def config(mode: str) -> TargetConfig:
        return TargetConfig(model=ModelConfig(cache_dir=tmp_path), compile=mode)

    assert compiled_pass(config("off"), packed) is None
    assert compiled_pass(config("wait"), tiny_target, BUCKETS) is None  # loaded unpacked
    assert "not compiling the pass" in caplog.text and "packed" in caplog.text
    runner = compiled_pass(config("wait"), packed, BUCKETS)
    assert runner is not None and runner.ready and runner.compile_s is not None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    with pytest.raises(ValueError, match="compile: must be one of"):
        config("fast")


def test_a_background_build_runs_the_child_first_then_loads_and_switches(tiny_dir, tmp_path, monkeypatch):
    """background: the child build (``target_service.compile_ahead``, here recorded rather than run: it
    is a fresh interpreter compiling from cold) runs first, off the model's thread, then the service's
    own build; the engine serves eager passes meanwhile and switches after."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    packed = load_model(str(tiny_dir / "target"), tiny_dir, dtype=torch.bfloat16, pack=True)
    model = ModelConfig(model=str(tiny_dir / "target"), cache_dir=tmp_path, dtype="bfloat16", threads=1)
    children = []
    monkeypatch.setattr(server, "build_ahead", lambda *args: children.append(args) or True)
    runner = compiled_pass(TargetConfig(model=model, compile="background"), packed, BUCKETS[:1])
    assert runner is not None
    engine = TargetEngine(packed, 4, compiled=runner)
    engine.prefill([2, 3, 4])  # eager meanwhile
    deadline = time.monotonic() + 120
    while not runner.ready and time.monotonic() < deadline:
        time.sleep(0.2)
    assert runner.ready and children == [(model, BUCKETS[:1])]
    engine.prefill([2, 3, 4])
    assert engine.compiled
    command = compile_ahead.argv(model, BUCKETS)
    assert command[1:3] == ["-m", "target_service.compile_ahead"]
    assert command[command.index("--buckets") + 1] == "2,8" and command[command.index("--dtype") + 1] == "bfloat16"
