"""``--dtype`` and ``--device`` for target and draft: half precision stays exact against target-only
decoding in the same dtype (on this CPU: torch runs bf16 and fp16 here), and the draft's tensors live
where its model does (checked on the meta device, as no GPU runs here)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from harness import InProcessStack
from test_e2e_tiny import PROMPTS, hf_greedy
from test_model_families import engine_greedy
from tiny import FAMILY_TRAITS, make_family_model, save_draft_with_card
from transformers import AutoConfig

import draft_service.engine
import draft_service.feature_draft
import specdec.models
from draft_service.engine import FeatureDrafter, ModelDrafter
from draft_service.feature_draft import KIND as FEATURE_KIND
from draft_service.feature_draft import FeatureDraftArch, build_feature_draft, load_feature_draft
from draft_service.server import build_drafter
from draft_service.target_parts import read_target
from draft_service.token_draft import TokenDraftArch, build_token_draft, load_token_draft, target_weights_hash
from specdec import Client
from specdec.cli import _parser, model_config
from specdec.config import DraftConfig, ModelConfig
from specdec.models import load_model, resolve_dtype
from specdec.sampling import Sampling
from target_service.engine import TargetEngine

HALF = ["bfloat16", "float16"]
NEW_TOKENS = 40


def test_auto_takes_bf16_on_a_cpu_that_computes_it_and_the_checkpoints_dtype_on_a_gpu(monkeypatch):
    config = AutoConfig.for_model("llama", dtype="bfloat16")
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(specdec.models, "native_bf16", lambda device, native=native: native)
        assert resolve_dtype("auto", "cpu", config) == want
    monkeypatch.undo()
    assert resolve_dtype("auto", "cuda", config) == torch.bfloat16
    assert resolve_dtype("auto", "cuda:1", AutoConfig.for_model("llama")) == torch.float32  # says none
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="half")


def test_serve_flags_take_a_dtype_and_a_device_each(monkeypatch):
    for name in ("SPECDEC_DEVICE", "SPECDEC_DTYPE", "SPECDEC_DRAFT_DEVICE", "SPECDEC_DRAFT_DTYPE"):
        monkeypatch.delenv(name, raising=False)
    target = model_config(_parser().parse_args(["serve-target"]), "default")
    assert (target.device, target.dtype) == ("cpu", "auto")
    target = model_config(_parser().parse_args(["serve-target", "--device", "cuda", "--dtype", "bfloat16"]), "x")
    assert (target.device, target.dtype) == ("cuda", "bfloat16")
    monkeypatch.setenv("SPECDEC_DTYPE", "float16")  # the target's variable: the draft keeps its own
    monkeypatch.setenv("SPECDEC_DRAFT_DEVICE", "cuda:1")
    draft = model_config(_parser().parse_args(["serve-draft"]), "x")
    assert (draft.device, draft.dtype) == ("cuda:1", "auto")
    assert model_config(_parser().parse_args(["serve-target"]), "x").dtype == "float16"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve-draft", "--dtype", "int8"])


@pytest.fixture(scope="module")
def half_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("half")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("family", sorted(FAMILY_TRAITS))
def test_half_precision_verify_equals_generate_in_the_same_dtype(family, dtype, half_dir):
    folder = half_dir / family
    if not folder.exists():
        make_family_model(folder, family, seed=0)
    loaded = load_model(str(folder), half_dir, dtype=dtype)
    assert loaded.model.dtype == getattr(torch, dtype) == loaded.dtype
    prompts = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    references = [hf_greedy(loaded, p, NEW_TOKENS) for p in PROMPTS]
    assert engine_greedy(TargetEngine(loaded, 16), prompts, references) == references


def _feature_draft_folder(target_folder, root):
    """A random feature draft for the target in ``target_folder``, with its card."""
    target = load_model(str(target_folder), root, dtype=torch.float32)  # weights hash: float32 values
    draft = build_feature_draft(target.model, torch.arange(2, 30), FeatureDraftArch(head_size=28))
    return save_draft_with_card(draft, root / "feature-draft", target_weights_hash(target.model), jitter_seed=3)


def test_a_bfloat16_stack_with_a_bfloat16_feature_draft_equals_generate(half_dir, redis_url):
    """Target and draft both in bf16 (the draft built by the draft service from the target's files),
    through the gRPC stack at concurrency 1 and 4: greedy output is bf16 target-only generate's."""
    target_folder = make_family_model(half_dir / "qwen3-stack", "qwen3", seed=0)
    draft_folder = _feature_draft_folder(target_folder, half_dir)
    target = load_model(str(target_folder), half_dir, dtype="bfloat16")
    drafter = build_drafter(
        DraftConfig(
            kind=FEATURE_KIND,
            target_model=str(target_folder),
            model=ModelConfig(model=str(draft_folder), cache_dir=half_dir, dtype="bfloat16"),
        )
    )
    assert drafter._draft_model.norm.weight.dtype == torch.bfloat16
    references = [hf_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    stack = InProcessStack(TargetEngine(target, 16), drafter, target_folder, redis_url).start()
    try:
        with Client(stack.address, timeout=120) as client:
            alone = [client.complete(p, max_new_tokens=NEW_TOKENS, k=3) for p in PROMPTS]
            with ThreadPoolExecutor(4) as pool:
                together = list(pool.map(lambda p: client.complete(p, max_new_tokens=NEW_TOKENS, k=3), PROMPTS))
    finally:
        stack.close()
    assert [r.token_ids for r in alone] == references
    assert [r.token_ids for r in together] == references
    assert sum(r.stats.drafted_tokens for r in alone) > 0
    # The target's features are kept as the draft reads them: in bf16, half the wire's float32.
    kept = [drafter.caches.peek(i).features for i in drafter.caches.ids()]
    assert any(f is not None for f in kept) and all(f.dtype == torch.bfloat16 for f in kept if f is not None)


@pytest.fixture()
def host_logits_as_zeros(monkeypatch):
    """Picking reads values, which the meta device has none of: the logits reach the host as zeros
    (every pick takes token 0), after every tensor before them was made where the draft lives."""

    def zeros(logits: torch.Tensor) -> torch.Tensor:
        assert logits.device.type == "meta"
        return torch.zeros(logits.shape)

    monkeypatch.setattr(draft_service.engine, "on_host", zeros)
    monkeypatch.setattr(draft_service.feature_draft, "on_host", zeros)


def test_a_draft_computes_where_its_target_parts_live(half_dir, host_logits_as_zeros):
    """A draft whose borrowed target parts are on the meta device (as on ``--device cuda``): warm-up,
    batched proposals, sampled and greedy, and drafting ahead make every tensor there, none on the CPU."""
    target_folder = make_family_model(half_dir / "llama-meta", "llama", seed=0)
    draft_folder = _feature_draft_folder(target_folder, half_dir / "meta")
    borrowed, digest = read_target(str(target_folder), half_dir, device="meta")
    draft = load_feature_draft(draft_folder, borrowed.model, digest)
    assert draft.device.type == "meta" and draft.fc.weight.device.type == "meta"
    engine = FeatureDrafter(draft, borrowed.facts(FEATURE_KIND), 4, 4, lookup_min=0)
    engine.warmup()
    from draft_service.engine import ProposeCall
    from specdec.kvcache import HiddenRows

    calls = []
    for prompt, sampling in (([3, 4, 5, 6], Sampling()), ([7, 8], Sampling(temperature=0.8, seed=1))):
        cache_id, committed = engine.prefill(prompt)
        hidden = HiddenRows(0, torch.zeros(committed - 1, engine.hidden_size))  # on the host, as off the wire
        calls.append(ProposeCall(cache_id, committed, [], 3, sampling, 0, hidden, ahead=2))
    greedy, sampled = engine.propose_batch(calls)
    # All-zero logits over the head: the tie goes to the head's lowest id, as a full row's argmax gives it.
    lowest = int(draft.host_head_ids.min())
    assert greedy.tokens == [lowest] * 3 and len(sampled.tokens) == 3 and len(sampled.q) == 3
    assert engine.draft_ahead(calls[0]) == 2

    target = load_model(str(target_folder), half_dir)
    token = build_token_draft(target.model, torch.arange(2, 30), TokenDraftArch(1, (0,), 28))
    folder = save_draft_with_card(token, half_dir / "token-draft", digest)
    loaded = load_token_draft(folder, borrowed, target_hash=digest)
    assert loaded.model.device.type == "meta"
    drafter = ModelDrafter(loaded, 4, 4)
    cache_id, committed = drafter.prefill([3, 4, 5])
    assert drafter.propose(cache_id, committed, [], 2, Sampling(), 0).tokens == [0, 0]


def test_native_bf16_reads_the_cpus_flags(monkeypatch, tmp_path):
    """A CPU counts as computing bf16 when /proc/cpuinfo lists avx512_bf16 or amx_bf16."""
    real = Path.read_text
    for flags, want in (
        ("fpu avx512f avx512_bf16", True),
        ("fpu amx_bf16 amx_tile", True),
        ("fpu avx2 avx512f", False),
    ):
        monkeypatch.setattr(Path, "read_text", lambda self, flags=flags: f"flags\t: {flags}\n")
        assert specdec.models.native_bf16("cpu") is want
    monkeypatch.setattr(Path, "read_text", real)
    assert specdec.models.native_bf16("cuda")
