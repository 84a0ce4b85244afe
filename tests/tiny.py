"""Tiny random Llama models over a 32-word vocabulary, sharing one tokenizer, for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(30)]
EOS_ID = 1


def make_tokenizer(folder: Path, words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``<unk>``, ``<eos>`` and ``words``, saved to ``folder``."""
    vocab = WORDS if words is None else ["<unk>", "<eos>", *words]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def make_model(
    folder: Path, seed: int, layers: int = 2, logit_scale: float = 15.0, words: list[str] | None = None
) -> Path:
    """A random Llama saved with the shared tokenizer; ``logit_scale`` sharpens its distributions."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    make_tokenizer(folder, words)
    return folder


# Per family: the config fields that give its tiny model the traits the ragged pass must reproduce.
# Windows of 8 tokens are far shorter than the tests' contexts, so the sliding masks are exercised.
FAMILY_TRAITS: dict[str, dict] = {
    "llama": {"attention_bias": True},
    "mistral": {"sliding_window": 8, "head_dim": 8},
    # Layer 1 slides (layers from max_window_layers on do), layer 0 sees everything: a mixed model.
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 8, "hidden_activation": "gelu_pytorch_tanh"},
    # Gemma 3: layer 0 slides (a local rope base), layer 1 sees everything (the global base); scores
    # scaled by query_pre_attn_scalar ** -0.5, which differs from head_dim ** -0.5 here.
    "gemma3_text": {"head_dim": 8, "sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    "phi3": {
        "sliding_window": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
}


def make_family_model(
    folder: Path, family: str, seed: int, layers: int = 2, logit_scale: float = 15.0, hidden: int = 32, **overrides
) -> Path:
    """A random model of a transformers decoder family (traits from ``FAMILY_TRAITS``, then ``overrides``),
    saved with the shared tokenizer.

    Every 1-d weight (norms, biases) is perturbed: initialised as transformers does, they are ones or
    zeros, and a pass that skipped a bias or a per-head norm would go unnoticed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = {
        "vocab_size": len(WORDS),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "eos_token_id": EOS_ID,
        "bos_token_id": None,
        "pad_token_id": EOS_ID,
        **FAMILY_TRAITS.get(family, {}),
        **overrides,
    }
    config = AutoConfig.for_model(family, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
        head = model.get_output_embeddings().weight
        if not config.tie_word_embeddings:
            head.mul_(logit_scale)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    make_tokenizer(folder)
    return folder


def save_draft_with_card(draft, folder: Path, target_hash: str, jitter_seed: int | None = None) -> Path:
    """Writes a token or feature draft and a card pinning ``target_hash`` to ``folder``, as ``specdec
    distill`` leaves one; with ``jitter_seed``, its trainable weights are first nudged off their start."""
    import json

    from draft_service.feature_draft import FeatureDraft, save_feature_draft
    from draft_service.token_draft import CARD_FILE, save_token_draft

    if jitter_seed is not None:
        torch.manual_seed(jitter_seed)
        with torch.no_grad():
            for param in draft.parameters():
                if param.requires_grad:
                    param.add_(0.05 * torch.randn_like(param))
    feature = isinstance(draft, FeatureDraft)
    (save_feature_draft if feature else save_token_draft)(draft, folder)
    card = {
        "kind": "feature" if feature else "token",
        "target": {"name": "tiny", "weights_sha256": target_hash},
        "architecture": draft.arch.to_json(),
    }
    (folder / CARD_FILE).write_text(json.dumps(card))
    return folder


def make_deeper_copy(source: Path, folder: Path, extra_layers: int) -> Path:
    """The Llama at ``source`` with ``extra_layers`` more decoder layers that add nothing (their
    attention and MLP output projections are zero), saved with the shared tokenizer: a bigger, slower
    model whose every output equals the source's, so the source drafts for it with acceptance 1.0."""
    small = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = LlamaConfig.from_pretrained(source)
    config.num_hidden_layers += extra_layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    big = LlamaForCausalLM(config)
    missing, unexpected = big.load_state_dict(small.state_dict(), strict=False)
    assert not unexpected and all(".layers." in name for name in missing)
    with torch.no_grad():
        for layer in big.model.layers[-extra_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    big.generation_config = small.generation_config
    folder.mkdir(parents=True, exist_ok=True)
    big.save_pretrained(folder)
    make_tokenizer(folder)
    return folder
