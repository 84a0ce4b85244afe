"""What a distilled draft needs of its target, read from the checkpoint files without building the model.

A distilled draft (``draft_service.token_draft``, ``draft_service.feature_draft``) borrows from its
target the embedding matrix and the LM head rows of its reduced vocabulary, and its card pins a hash
of the target's weights (``target_weights_hash``); besides those it needs the target's config,
tokenizer and facts. Building the whole target for that kept every layer's weights resident in the
draft service for nothing. Here the safetensors files are read one tensor at a time (plain reads,
not a memory map): each is hashed
under the name, dtype (float32) and shape the loaded model's state dict would give it, and only the
embedding and head are kept, so the hash equals ``target_weights_hash`` of the loaded model bit for
bit while the layers never stay in memory.

The names come from the model built on the meta device (no memory), which also says which entries
are tied (an LM head tied to the embedding is hashed under both names, as the state dict lists it).
Where the files cannot give every entry by name (pickled weights, a renamed checkpoint, a buffer no
file holds), the whole target is loaded as before. A GGUF file is read from its converted folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from specdec.models import LoadedModel, eos_ids, load_config, load_model, max_context
from specdec.vocab import load_tokenizer, resolve_model_path, tokenizer_fingerprint

log = logging.getLogger("specdec.draft")


def hash_entry(digest, name: str, tensor: torch.Tensor) -> None:
    """Adds one state-dict entry to a weights hash: its name, dtype, shape and bytes.

    Floating entries are hashed as float32, the dtype drafting loads the target in; upcasting is
    exact, so a half-precision checkpoint hashes alike whether it is read as stored or loaded in fp32.
    """
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point():
        tensor = tensor.float()
    tensor = tensor.contiguous()
    digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy())


class BorrowedTarget(nn.Module):
    """The target's embedding and LM head behind the accessors drafts call on a causal LM (``config``,
    ``get_input_embeddings``, ``get_output_embeddings``): the whole model's stand-in in the draft service."""

    def __init__(self, config: PretrainedConfig, embedding: nn.Embedding, head: nn.Linear | None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embedding  # [V, D]
        self.lm_head = head  # [V, D]; None where the embedding is the head (tied)

    def get_input_embeddings(self) -> nn.Embedding:
        """The embedding, as ``PreTrainedModel.get_input_embeddings``."""
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear | None:
        """The LM head, None where it is the embedding (tied)."""
        return self.lm_head


@dataclass(frozen=True)
class _Layout:
    """What the state dict of the loaded target holds: every entry's name and shape, where the files
    keep it, and the names of the embedding and LM head."""

    shapes: dict[str, tuple[int, ...]]
    stored_as: dict[str, str]  # state-dict name -> the checkpoint's tensor name (itself, or a tied twin's)
    files: dict[str, _Stored]  # checkpoint tensor name -> where it lies
    embedding: str
    head: str | None  # None: the model has no head of its own (tied)
    embed_scale: float


# safetensors' dtype names, for the tensors a checkpoint may hold.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offsets of its bytes in the file
    end: int


def _file_tensors(file: Path) -> dict[str, _Stored] | None:
    """The tensors of one safetensors file, from its header (None: a dtype this reader does not know).

    The file is read with plain reads, not memory-mapped as ``safe_open`` does: every page of a map
    that hashing touched would count as resident until the map goes (513 of the default target's
    540 MiB at start-up), where a read holds one tensor at a time.
    """
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            return None
        start, end = entry["data_offsets"]
        out[name] = _Stored(
            file, _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + size + start, 8 + size + end
        )
    return out


def _checkpoint_files(folder: Path) -> dict[str, _Stored] | None:
    """Every tensor of a safetensors checkpoint (one file or shards); None when the folder holds none
    (or one this reader cannot read)."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        return None
    out: dict[str, _Stored] = {}
    for file in files:
        tensors = _file_tensors(file)
        if tensors is None:
            return None
        out.update(tensors)
    return out


def _load(stored: _Stored) -> torch.Tensor:
    """One tensor read from its file (a copy of its bytes, in the stored dtype)."""
    with open(stored.file, "rb") as f:
        f.seek(stored.start)
        data = bytearray(f.read(stored.end - stored.start))
    if not data:
        return torch.empty(stored.shape, dtype=stored.dtype)
    return torch.frombuffer(data, dtype=stored.dtype).reshape(stored.shape)  # little-endian, as stored


def _layout(folder: Path, config: PretrainedConfig) -> _Layout | None:
    """Where each state-dict entry of the target lies in its files, or None where one lies in none."""
    files = _checkpoint_files(folder)
    if files is None:
        return None
    with torch.device("meta"):  # names, shapes and ties, with no memory behind them
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    entries = model.state_dict(keep_vars=True)
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in entries.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    stored_as = {}
    for name, tensor in entries.items():
        twins = [n for n in by_tensor[id(tensor)] if n in files]
        if not twins:
            log.info("%s: no checkpoint tensor holds %s", folder, name)
            return None
        stored_as[name] = name if name in files else twins[0]
    names = {id(t): n for n, t in entries.items()}
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    head_name = None if head is None or head.weight is embedding.weight else names[id(head.weight)]
    return _Layout(
        {n: tuple(t.shape) for n, t in entries.items()},
        stored_as,
        files,
        names[id(embedding.weight)],
        head_name,
        float(getattr(embedding, "scalar_embed_scale", 1.0)),
    )


def checkpoint_weights_hash(folder: Path) -> str | None:
    """``target_weights_hash`` of the target in ``folder``, from its files alone (None where they
    cannot give it: see the module docstring)."""
    folder = Path(folder)
    layout = _layout(folder, load_config(folder))
    read = None if layout is None else _read(layout, torch.float32, "cpu")
    return None if read is None else read[0]


def _read(layout: _Layout, dtype: torch.dtype, device: str) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """One pass over the files: the weights hash, the embedding ``[V, D]`` and the head ``[V, D]`` (None:
    tied), the last two in ``dtype`` on ``device``; None where a tensor's shape is not the model's."""
    digest = hashlib.sha256()
    wanted = {layout.stored_as[layout.embedding]} | ({layout.stored_as[layout.head]} if layout.head else set())
    kept: dict[str, torch.Tensor] = {}
    for name in sorted(layout.shapes):
        source = layout.stored_as[name]
        stored = layout.files[source]
        if stored.shape != layout.shapes[name]:
            log.info(
                "checkpoint tensor %s is %s, the model's %s is %s", source, stored.shape, name, layout.shapes[name]
            )
            return None
        tensor = kept[source] if source in kept else _load(stored)
        hash_entry(digest, name, tensor)
        if source in wanted:
            kept[source] = tensor  # the rest is read, hashed and let go: one tensor at a time
    embedding = kept[layout.stored_as[layout.embedding]].to(device=device, dtype=dtype)
    head = kept[layout.stored_as[layout.head]].to(device=device, dtype=dtype) if layout.head else None
    return digest.hexdigest(), embedding, head


def _generation_eos(folder: Path, config: PretrainedConfig, tokenizer) -> tuple[int, ...]:
    """The EOS ids the loaded model would report (its generation config's, else the tokenizer's)."""
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: transformers derives one from the model config
        generation = GenerationConfig.from_model_config(config)
    return eos_ids(generation, tokenizer)


def read_target(
    spec: str, cache_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[LoadedModel, str]:
    """The target ``spec`` as a draft borrows it, and its ``target_weights_hash``.

    The model of the result is a ``BorrowedTarget`` (embedding and head in ``dtype`` on ``device``),
    read from the checkpoint files; where they cannot serve (see the module docstring) it is the whole
    target, loaded in float32 and hashed, then cast.
    """
    from draft_service.token_draft import target_weights_hash

    path = resolve_model_path(spec, cache_dir)
    config = load_config(path)
    layout = _layout(path, config)  # a folder: resolve_model_path converts GGUF files
    read = None if layout is None else _read(layout, dtype, device)
    if layout is None or read is None:
        log.info("target %s: its files cannot say what the loaded model holds; loading it whole", spec)
        loaded = load_model(spec, cache_dir, dtype=torch.float32)
        weights_hash = target_weights_hash(loaded.model)
        loaded.model.to(device=device, dtype=dtype)
        return replace(loaded, dtype=dtype), weights_hash
    weights_hash, embedding, head = read
    borrowed_embedding = nn.Embedding.from_pretrained(embedding, freeze=True)
    borrowed_embedding.scalar_embed_scale = layout.embed_scale  # as Gemma's scaled embedding names it
    borrowed_head = None
    if head is not None:
        borrowed_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
        borrowed_head.weight = nn.Parameter(head, requires_grad=False)
    tokenizer = load_tokenizer(path)
    loaded = LoadedModel(
        name=spec,
        model=BorrowedTarget(config, borrowed_embedding, borrowed_head),
        tokenizer=tokenizer,
        vocab_size=int(config.vocab_size),
        max_context=max_context(config),
        eos_token_ids=_generation_eos(path, config, tokenizer),
        fingerprint=tokenizer_fingerprint(tokenizer),
        dtype=dtype,
    )
    return loaded, weights_hash
