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
# Under the cache directory: GGUF files converted to safetensors folders, one per file content.
CONVERTED = "converted"
_HASH_CHUNK = 1 << 24


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


def converted(folder: Path) -> Path | None:
    """``folder`` when it holds a whole converted model (config, weights, tokenizer), else None."""
    weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    if weights and (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    return None


def default_model_folder(cache_dir: Path) -> Path | None:
    """The converted default model under ``cache_dir``, or None before its first conversion."""
    return converted(cache_dir / DEFAULT_MODEL_FOLDER)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's content, read in chunks (a GGUF file may be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def converted_folder(gguf: Path, cache_dir: Path) -> Path:
    """Where ``gguf``'s conversion lives under ``cache_dir``: named by its stem and content hash, so a
    changed file converts anew and a copy of it elsewhere finds the conversion already made."""
    return cache_dir / CONVERTED / f"{gguf.stem}-{file_sha256(gguf)[:16]}"


def resolve_model_path(spec: str, cache_dir: Path) -> Path:
    """Turns a model spec (``default``, a folder, or a ``.gguf`` file) into a folder to load.

    A GGUF file is dequantized once into a safetensors folder under ``cache_dir`` (``converted_folder``)
    and every later load, by any process or command, reads that folder: dequantizing takes far longer
    than loading safetensors.
    """
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
    if path.suffix != ".gguf":
        return path
    ready = converted(converted_folder(path, cache_dir))
    if ready is not None:
        return ready
    from specdec.models import convert_gguf

    return convert_gguf(path, cache_dir)


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
