"""The small token-level draft: a few decoder layers of the target's own family (Llama's for a Llama)
over the target's frozen embedding, with a reduced-vocabulary head (the FR-Spec / EAGLE-3 idea).

- The embedding is the target's own matrix, read from the target's files at start-up
  (``draft_service.target_parts``) and never stored in the draft's files.
- The head scores only the N most frequent target tokens (``head_ids``). Its rows are cut from the
  target's LM head (the tied embedding for SmolLM2) at start-up (only the ids are stored), plus a
  small trainable bias.
- ``forward`` is drop-in for a Hugging Face causal LM as ``ModelDrafter`` drives it: it takes
  ``input_ids``, a ``cache`` (any transformers ``Cache``, e.g. ``GrowableCache``) and
  ``logits_to_keep``, and returns full-vocabulary logits with ``-inf`` outside the head's ids, so the
  draft's q is exactly zero there and speculative sampling stays exact.

Files of a draft folder: ``draft.safetensors`` (layer weights, final norm, head ids and bias; fp16)
and ``draft_card.json`` (kind, target identity, recipe, held-out metrics; see ``draft_service.distill``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PretrainedConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from draft_service.target_parts import hash_entry
from specdec.models import LoadedModel
from specdec.ragged import RaggedLayout, layer_ropes, ragged_decoder_layer

KIND = "token"
CARD_FILE = "draft_card.json"
WEIGHTS_FILE = "draft.safetensors"
STORED_DTYPE = torch.float16


@dataclass(frozen=True)
class TokenDraftArch:
    """What a token draft is made of; the target's config supplies every other dimension."""

    layers: int = 2
    """Decoder layers (1 or 2 keeps a step at a few ms)."""
    init_from: tuple[int, ...] = (0, 1)
    """Target layers the draft's layers were initialised from, one per layer (recorded, for the card)."""
    head_size: int = 8192
    """N: the head scores the N most frequent target tokens of the distillation data."""

    def to_json(self) -> dict:
        """The architecture as it goes into the card."""
        return {
            **asdict(self),
            "init_from": list(self.init_from),
            "head": "frozen rows of the target LM head (tied embedding) + trainable bias",
        }

    @classmethod
    def from_json(cls, data: dict) -> TokenDraftArch:
        """Reads the card's ``architecture`` entry."""
        return cls(
            layers=int(data["layers"]),
            init_from=tuple(int(i) for i in data["init_from"]),
            head_size=int(data["head_size"]),
        )


def target_weights_hash(model: nn.Module) -> str:
    """SHA-256 over the target's state dict: every entry's name, dtype, shape and bytes, in name order.

    Tied tensors (embedding and LM head) are hashed under each name, and floating ones as float32
    (``target_parts.hash_entry``). Call it on the model as loaded for drafting (linear layers not
    prepacked): prepacked linears keep no weight in the state dict, so they are refused rather than
    hashed to a different value. ``target_parts.checkpoint_weights_hash`` gives the same digest from
    the checkpoint files without building the model.
    """
    if any(hasattr(m, "packed_weight") for m in model.modules()):
        raise ValueError("target_weights_hash needs the unpacked target (load it with pack=False)")
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        hash_entry(digest, name, tensor)
    return digest.hexdigest()


def quantize_linears(module: nn.Module) -> nn.Module:
    """``module`` with every ``nn.Linear`` (itself included) int8 dynamically quantized, for inference."""
    with warnings.catch_warnings():  # torch.ao is deprecated in favour of torchao, but works in the pinned torch
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        if isinstance(module, nn.Linear):
            return quantize_dynamic(nn.Sequential(module), {nn.Linear}, dtype=torch.qint8)
        return quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)


def add_reduced_head(module: nn.Module, output_weight: torch.Tensor, head_ids: torch.Tensor, vocab_size: int) -> None:
    """Gives ``module`` a head over the ``head_ids`` rows of the target's LM head.

    Registers ``head_ids [N]`` (stored), ``head_weight [N, D]`` (cut from the target at start-up, never
    stored), a trainable ``head_bias [N]``, and ``vocab_to_head [V]`` (each id's row, -1 outside).
    """
    head_ids = head_ids.to(torch.long)
    if head_ids.ndim != 1 or len(head_ids) == 0 or len(set(head_ids.tolist())) != len(head_ids):
        raise ValueError("head_ids must be distinct token ids")
    if int(head_ids.min()) < 0 or int(head_ids.max()) >= vocab_size:
        raise ValueError(f"head_ids must lie in [0, {vocab_size})")
    module.register_buffer("head_ids", head_ids, persistent=True)  # [N]
    module.register_buffer("head_weight", output_weight.detach()[head_ids].clone(), persistent=False)  # [N, D]
    module.head_bias = nn.Parameter(torch.zeros(len(head_ids)))  # [N]
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[head_ids] = torch.arange(len(head_ids))
    module.register_buffer("vocab_to_head", index, persistent=False)  # [V]


def save_draft_weights(state: dict[str, torch.Tensor], folder: Path, kind: str, arch: dict) -> Path:
    """Writes a draft's own tensors (floats as fp16, ids as int32) to ``folder``; returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        tensors[name] = tensor.to(STORED_DTYPE) if tensor.is_floating_point() else tensor.to(torch.int32)
    path = folder / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"kind": kind, "arch": json.dumps(arch)})
    return path


def draft_config(target_config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """The target's config cut to a draft of ``layers`` decoder layers that attend to their whole context.

    A draft has no sliding window, whatever its target's: it is trained and served with full causal
    attention, and transformers' sliding masks would need the window-holding cache layers the draft's
    ``GrowableCache`` does not make.
    """
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * layers
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    config.use_cache = True
    return config


@dataclass(frozen=True)
class FamilyModules:
    """The module classes a draft builds its layers from: its target family's own (Llama's for a Llama)."""

    layer: type[nn.Module]
    """Decoder layer, built as ``layer(config, layer_idx)``."""
    norm: type[nn.Module]
    """RMSNorm, built as ``norm(dim, eps)`` (Gemma's scales by ``1 + w``)."""
    rotary: type[nn.Module]
    """Rotary embedding, built as ``rotary(config=config)``."""


def family_modules(config: PretrainedConfig) -> FamilyModules:
    """The decoder layer, norm and rotary classes of ``config``'s model family, read off its base
    model built on the meta device (no weights behind it)."""
    with torch.device("meta"):
        base = AutoModel.from_config(draft_config(config, 1))
    return FamilyModules(type(base.layers[0]), type(base.norm), type(base.rotary_emb))


def embed_scale(embedding: nn.Module) -> float:
    """What the target's embedding module multiplies its rows by (Gemma: sqrt(D)), 1.0 for most families."""
    return float(getattr(embedding, "scalar_embed_scale", 1.0))


def embed(ids: torch.Tensor, embedding: nn.Embedding, scale: float) -> torch.Tensor:
    """Rows ``[..., D]`` of the frozen target embedding for ``ids``, scaled as the target scales them."""
    rows = nn.functional.embedding(ids, embedding.weight.detach())  # [..., D]
    # Gemma rounds its scale to the weights' dtype before multiplying: the same numbers as its module.
    return rows if scale == 1.0 else rows * torch.tensor(scale, dtype=rows.dtype)


class TokenDraft(nn.Module):
    """A causal LM: frozen target embedding → ``layers`` decoder layers of the target's family → RMSNorm
    → reduced head."""

    def __init__(
        self,
        target_config: PretrainedConfig,
        embedding: nn.Embedding,
        output_weight: torch.Tensor,
        head_ids: torch.Tensor,
        arch: TokenDraftArch,
    ) -> None:
        super().__init__()
        if len(arch.init_from) != arch.layers:
            raise ValueError(f"init_from names {len(arch.init_from)} target layers for {arch.layers} draft layers")
        self.arch = arch
        self.config = draft_config(target_config, arch.layers)
        self.vocab_size = int(embedding.weight.shape[0])
        # Kept out of the module tree so the target's matrix is neither trained nor saved with the draft.
        self.__dict__["embedding"] = embedding
        self.__dict__["_int8_head"] = None
        self.embed_scale = embed_scale(embedding)
        family = family_modules(self.config)
        self.layers = nn.ModuleList(family.layer(self.config, i) for i in range(arch.layers))
        self.norm = family.norm(self.config.hidden_size, self.config.rms_norm_eps)
        self.rotary_emb = family.rotary(config=self.config)
        add_reduced_head(self, output_weight, head_ids, self.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    def init_from_target(self, target: nn.Module) -> None:
        """Copies the target layers ``arch.init_from`` and the target's final norm into the draft."""
        base = target.get_decoder()
        for layer, src in zip(self.layers, self.arch.init_from):
            layer.load_state_dict(base.layers[src].state_dict())
        self.norm.load_state_dict(base.norm.state_dict())

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What the draft's files hold: its state dict (layers, final norm, head ids and bias); the
        target-derived embedding and head rows are not part of it."""
        return {k: v for k, v in self.state_dict().items()}

    def hidden(
        self,
        input_ids: torch.Tensor,
        cache=None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-norm hidden states ``[B, T, D]``."""
        embeds = embed(input_ids, self.embedding, self.embed_scale)  # [B, T, D], frozen
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)  # [1, T]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        ropes = layer_ropes(self.rotary_emb, self.config, embeds, position_ids)  # [1, T, hd] each, per layer
        h = embeds
        for layer, rope in zip(self.layers, ropes):
            h = layer(
                h,
                attention_mask=mask,
                position_embeddings=rope,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
            )
        return self.norm(h)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary logits ``[..., N]`` of final-norm hidden states ``[..., D]``."""
        if self._int8_head is not None:
            return self._int8_head(hidden)
        return torch.nn.functional.linear(hidden, self.head_weight, self.head_bias)

    def quantize_int8(self) -> TokenDraft:
        """Inference only: int8 dynamic quantization of every linear layer and the head (in place).

        A draft step reads about a quarter of the bytes, which is what a one-token step on a CPU is
        bound by. The draft's logits change slightly (its card's figures were measured in fp32);
        exactness of speculative decoding does not depend on them.
        """
        for i, layer in enumerate(self.layers):
            self.layers[i] = quantize_linears(layer)
        head = nn.Linear(self.head_weight.shape[1], self.head_weight.shape[0], bias=True)
        head.weight.data.copy_(self.head_weight)
        head.bias.data.copy_(self.head_bias.detach())
        self.__dict__["_int8_head"] = quantize_linears(head)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        cache=None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        **_: object,
    ) -> CausalLMOutputWithPast:
        """Full-vocabulary logits ``[B, m, V]`` of the last ``logits_to_keep`` positions (0: all).

        Ids outside the head get ``-inf``, so softmax gives them probability exactly zero.
        """
        cache = cache if cache is not None else past_key_values
        hidden = self.hidden(input_ids, cache, use_cache, attention_mask, position_ids)  # [B, T, D]
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]  # [B, m, D]
        return CausalLMOutputWithPast(logits=self.full_logits(hidden), cache=cache if use_cache else None)

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[..., V]`` of final-norm hidden states ``[..., D]``, ``-inf`` outside
        the head."""
        reduced = self.head_logits(hidden)  # [..., N]
        logits = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        logits[..., self.head_ids] = reduced
        return logits

    def ragged_logits(self, input_ids: torch.Tensor, caches: list, layout: RaggedLayout) -> torch.Tensor:
        """Full-vocabulary logits ``[N, V]`` of ragged rows ``input_ids [N]`` laid out by ``layout``, each
        session attending to its own cache, which grows by its rows (``specdec.ragged``)."""
        h = embed(input_ids, self.embedding, self.embed_scale)  # [N, D], frozen
        ropes = layer_ropes(self.rotary_emb, self.config, h, layout.positions[None])  # [1, N, hd] each, per layer
        for i, layer in enumerate(self.layers):
            h = ragged_decoder_layer(layer, h, ropes[i], caches, layout, i)
        return self.full_logits(self.norm(h))  # [N, V]


def _output_weight(target: nn.Module) -> torch.Tensor:
    """The target's LM head matrix ``[V, D]`` (for tied models, the embedding itself)."""
    head = target.get_output_embeddings()
    return (head if head is not None else target.get_input_embeddings()).weight


def build_token_draft(target: nn.Module, head_ids: torch.Tensor, arch: TokenDraftArch) -> TokenDraft:
    """A fresh draft around a loaded target (a HF causal LM), its layers copied from the target."""
    draft = TokenDraft(target.config, target.get_input_embeddings(), _output_weight(target), head_ids, arch)
    draft.init_from_target(target)
    return draft.float()


def save_token_draft(draft: TokenDraft, folder: Path) -> Path:
    """Writes the draft's own weights (fp16; never the target's) into ``folder``; returns the file."""
    return save_draft_weights(draft.trainable_state(), folder, KIND, draft.arch.to_json())


def read_card(folder: Path) -> dict:
    """The draft card of a draft folder."""
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a draft folder")
    return json.loads(path.read_text())


def check_target(card: dict, draft_dir: Path, actual: str) -> None:
    """Raises ``ValueError`` naming both hashes when a draft was distilled for other target weights."""
    expected = card["target"]["weights_sha256"]
    if actual != expected:
        raise ValueError(
            f"draft {draft_dir} was distilled for target {card['target'].get('name', '?')} with weights "
            f"sha256 {expected}, but the loaded target has weights sha256 {actual}; "
            "serve the matching target or distill a draft for this one (specdec distill)"
        )


def load_token_draft(
    draft_dir: Path, target: LoadedModel, *, int8: bool = False, target_hash: str | None = None
) -> LoadedModel:
    """Builds the draft stored in ``draft_dir`` around an already loaded (unpacked) target, or the
    part of it a draft borrows (``target_parts.read_target``, which gives ``target_hash`` too).

    Checks that the target's weights hash (``target_hash``, else ``target_weights_hash`` of its model)
    to the card's ``target.weights_sha256`` and raises ``ValueError`` naming both hashes when they
    differ. The result shares the target's tokenizer and facts; its ``model`` is the draft (eval mode,
    no gradients, in the dtype and on the device of the target's embedding), or with ``int8`` its int8
    dynamically quantized form (CPU and fp32 only; about 3x cheaper per step on CPU, agreement about
    0.01 lower).
    """
    draft_dir = Path(draft_dir)
    card = read_card(draft_dir)
    if card.get("kind") != KIND:
        raise ValueError(f"{draft_dir} holds a draft of kind {card.get('kind')!r}, not {KIND!r}")
    check_target(card, draft_dir, target_hash if target_hash is not None else target_weights_hash(target.model))
    draft = load_token_draft_module(draft_dir, target.model, card)
    if int8:
        draft.quantize_int8()
    return wrap_token_draft(draft, target, str(draft_dir))


def load_token_draft_module(draft_dir: Path, target_model: nn.Module, card: dict | None = None) -> TokenDraft:
    """The draft module from ``draft_dir`` (no identity check), ready for inference in the dtype and on
    the device of the target's embedding (the stored fp16 weights upcast first, then cast to it)."""
    card = card if card is not None else read_card(draft_dir)
    arch = TokenDraftArch.from_json(card["architecture"])
    tensors = load_file(str(Path(draft_dir) / WEIGHTS_FILE))
    embedding = target_model.get_input_embeddings()
    draft = TokenDraft(target_model.config, embedding, _output_weight(target_model), tensors["head_ids"], arch)
    state = {k: (v.float() if v.is_floating_point() else v.long()) for k, v in tensors.items()}
    draft.load_state_dict(state, strict=True)
    return draft.to(embedding.weight.device, embedding.weight.dtype).eval().requires_grad_(False)


def wrap_token_draft(draft: TokenDraft, target: LoadedModel, name: str) -> LoadedModel:
    """A ``LoadedModel`` for the draft that shares the target's tokenizer and facts."""
    return LoadedModel(
        name=name,
        model=draft,
        tokenizer=target.tokenizer,
        vocab_size=target.vocab_size,
        max_context=target.max_context,
        eos_token_ids=target.eos_token_ids,
        fingerprint=target.fingerprint,
        dtype=target.dtype,
    )
