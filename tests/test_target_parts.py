"""The draft service reads what it needs of the target from the checkpoint files: the hash equals the
loaded model's (and the shipped cards' pins), the embedding and head are the model's, and no target
model is built."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import CACHE_DIR
from tiny import FAMILY_TRAITS, make_family_model, save_draft_with_card

from draft_service.engine import FeatureDrafter, ModelDrafter
from draft_service.feature_draft import KIND as FEATURE_KIND
from draft_service.feature_draft import FeatureDraftArch, build_feature_draft
from draft_service.server import build_drafter
from draft_service.target_parts import BorrowedTarget, checkpoint_weights_hash, read_target
from draft_service.token_draft import (
    CARD_FILE,
    TokenDraftArch,
    build_token_draft,
    target_weights_hash,
)
from specdec.config import DraftConfig, ModelConfig, shipped_draft
from specdec.models import load_model
from specdec.sampling import Sampling
from specdec.vocab import resolve_model_path

FAMILIES = sorted(FAMILY_TRAITS)


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2"])
def test_the_checkpoint_hash_is_the_loaded_models(family, tmp_path):
    folder = make_family_model(tmp_path / family, family, seed=0)
    loaded = load_model(str(folder), tmp_path)
    assert checkpoint_weights_hash(folder) == target_weights_hash(loaded.model)


def test_the_hash_holds_for_shards_and_half_precision_checkpoints(tmp_path):
    """A sharded checkpoint hashes as one file; a bf16 one as the fp32 model loaded from it (upcasting
    is exact)."""
    folder = make_family_model(tmp_path / "qwen2", "qwen2", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert checkpoint_weights_hash(tmp_path / "sharded") == target_weights_hash(model)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    upcast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    assert checkpoint_weights_hash(tmp_path / "bf16") == target_weights_hash(upcast)
    assert target_weights_hash(model) == target_weights_hash(upcast)  # bf16 in memory hashes as its fp32 upcast


def test_the_default_targets_files_hash_to_the_shipped_cards_pins():
    folder = resolve_model_path("default", CACHE_DIR)
    digest = checkpoint_weights_hash(folder)
    for name in ("smollm2-135m-feature", "smollm2-135m-token"):
        card = json.loads((shipped_draft(name) / CARD_FILE).read_text())
        assert digest == card["target"]["weights_sha256"], name


@pytest.mark.parametrize("family", ["llama", "gemma"])  # an untied head, and one tied to the embedding
def test_read_target_borrows_the_models_embedding_head_and_facts(family, tmp_path):
    folder = make_family_model(tmp_path / family, family, seed=0)
    full = load_model(str(folder), tmp_path)
    borrowed, digest = read_target(str(folder), tmp_path)
    assert isinstance(borrowed.model, BorrowedTarget)
    assert digest == target_weights_hash(full.model)
    assert borrowed.facts("x") == full.facts("x")
    assert torch.equal(borrowed.model.get_input_embeddings().weight, full.model.get_input_embeddings().weight)
    head = full.model.get_output_embeddings().weight
    if family == "gemma":
        assert borrowed.model.get_output_embeddings() is None  # tied: the embedding is the head
        assert borrowed.model.get_input_embeddings().scalar_embed_scale == full.model.config.hidden_size**0.5
    else:
        assert torch.equal(borrowed.model.get_output_embeddings().weight, head)
    half, _ = read_target(str(folder), tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.model.get_input_embeddings().weight.dtype == torch.bfloat16


def test_read_target_loads_a_checkpoint_it_cannot_read_whole(tmp_path):
    """Pickled weights (no safetensors file) are not read here: the whole target is loaded, and hashed
    as before."""
    folder = make_family_model(tmp_path / "llama", "llama", seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            (pickled / path.name).write_bytes(path.read_bytes())
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    assert checkpoint_weights_hash(pickled) is None
    borrowed, digest = read_target(str(pickled), tmp_path)
    assert not isinstance(borrowed.model, BorrowedTarget)
    assert digest == target_weights_hash(model)


def _draft_folders(tmp_path, target_folder):
    """A token and a feature draft (random, with cards) for the target in ``target_folder``."""
    target = load_model(str(target_folder), tmp_path)
    digest = target_weights_hash(target.model)
    torch.manual_seed(0)
    token = build_token_draft(target.model, torch.arange(2, 28), TokenDraftArch(1, (1,), 26))
    save_draft_with_card(token, tmp_path / "token", digest)
    feature = build_feature_draft(target.model, torch.arange(2, 28), FeatureDraftArch(head_size=26))
    save_draft_with_card(feature, tmp_path / FEATURE_KIND, digest)
    return target


@pytest.mark.parametrize("family", ["qwen3", "gemma"])
def test_the_draft_service_builds_distilled_drafts_without_the_target_model(family, tmp_path, monkeypatch):
    """Token and feature drafts served from the borrowed parts propose what they propose around the
    whole target."""
    target_folder = make_family_model(tmp_path / family, family, seed=0)
    target = _draft_folders(tmp_path, target_folder)
    whole = {
        "model": ModelDrafter(_whole(tmp_path / "token", target), 4, 4),
        FEATURE_KIND: _whole_feature(tmp_path / FEATURE_KIND, target),
    }

    def refuse(*args, **kwargs):
        raise AssertionError("the draft service built the whole target")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    for kind, folder in (("model", "token"), (FEATURE_KIND, FEATURE_KIND)):
        config = DraftConfig(
            kind=kind,
            target_model=str(target_folder),
            int8_head=False,
            lookup_min=0,
            model=ModelConfig(model=str(tmp_path / folder), cache_dir=tmp_path, pack=False),
        )
        served = build_drafter(config)
        assert served.facts.vocab_size == target.vocab_size
        proposals = _proposals(served)
        assert proposals == _proposals(whole[kind]) and all(len(p) == 3 for p in proposals), kind


def _whole(folder, target):
    from draft_service.token_draft import load_token_draft

    return load_token_draft(folder, target)


def _whole_feature(folder, target) -> FeatureDrafter:
    from draft_service.feature_draft import load_feature_draft

    draft = load_feature_draft(folder, target.model, target_weights_hash(target.model))
    return FeatureDrafter(draft, target.facts(FEATURE_KIND), 4, 4, lookup_min=0)


def _proposals(engine) -> list[list[int]]:
    """Greedy proposals of 3 tokens after a few prompts (a feature draft reads fixed hidden rows)."""
    out = []
    g = torch.Generator().manual_seed(0)
    for prompt in ([3, 4, 5], [9, 9, 10, 11, 12, 2]):
        cache_id, committed = engine.prefill(prompt)
        hidden = None
        if engine.hidden_size:
            from specdec.kvcache import HiddenRows

            hidden = HiddenRows(0, torch.randn(committed - 1, engine.hidden_size, generator=g))
        out.append(engine.propose(cache_id, committed, [], 3, Sampling(), 0, hidden).tokens)
    return out
