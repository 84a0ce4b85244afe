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
