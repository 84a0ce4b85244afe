"""What the coordinator needs of a model, without torch: its tokenizer, and the facts services report.

The coordinator only tokenizes, renders chat turns and streams text; importing torch and the model
side of transformers cost it 8 of its 9 seconds of imports and 270 MiB of its 410 MiB resident
(default model, this 2-core machine). The model services load models through ``specdec.models``,
which builds on this module, so every process loads tokenizers the same way and their fingerprints
compare like for like.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_MODEL_FOLDER = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelFacts:
    """What a service reports about its model; equal fingerprints mean a shared tokenizer."""

    name: str
    kind: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    side_layers: tuple[int, ...] = ()
    """A feature draft: target layers whose outputs it reads besides the final-norm hidden states."""
    trees: bool = False
    """A target: it verifies token trees; a draft: it proposes them (``specdec.trees``)."""


def default_model_folder(cache_dir: Path) -> Path | None:
    """The converted default model under ``cache_dir``, or None before its first conversion."""
    folder = cache_dir / DEFAULT_MODEL_FOLDER
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    return None


def resolve_model_path(spec: str, cache_dir: Path) -> Path:
    """Turns a model spec (``default``, a folder, or a ``.gguf`` file) into a path to load."""
    if spec == DEFAULT_MODEL:
        folder = default_model_folder(cache_dir)
        if folder is not None:
            return folder
        # Only a first run converts, and that needs torch: import the model side then, not before.
        from specdec.models import convert_default_model

        return convert_default_model(cache_dir)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    return path


def load_tokenizer(path: Path):
    """Loads the tokenizer of a model folder (its ``tokenizer.json``) or GGUF file."""
    if path.suffix == ".gguf":
        # A GGUF tokenizer is rebuilt by transformers' GGUF reader, which needs the model side.
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    from transformers.tokenization_utils_fast import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 over the vocabulary and special tokens: equal fingerprints mean equal tokenizers."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
    }
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()
