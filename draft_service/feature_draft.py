"""The feature-level draft (EAGLE-style): it drafts from the target's last hidden states and the tokens.

At position i the draft reads the pair (f_i, t_{i+1}): the target's final-norm hidden state at i (the
vector the LM head turns into the distribution of token i + 1) and the token that followed. It
predicts f_{i+1}; the target's own LM head rows (a reduced vocabulary, as in the token draft) turn
that into the distribution of t_{i+2}. Drafting further positions feeds the draft's predicted
feature back in place of the target's, which the target only supplies for committed tokens.

Layout: ``fc`` (2D -> D) over [embedding(t_{i+1}); f_i] -> one decoder layer -> RMSNorm, the layer and
norm of the target's own family (``token_draft.family_modules``: a Llama layer for a Llama target).

The embedding and head rows are the target's own (frozen, read from the target's files at start-up by
``draft_service.target_parts``); the draft's files hold only ``fc``, the layer, the norm, the head ids
and a head bias.

With ``side_layers`` (the EAGLE-3 idea) the target also sends its residual stream after those of its
layers, each RMS-normalised and read by ``fc`` beside f_i: lower layers keep context that the last
one has already narrowed down to its own next token. The target sends them for committed positions
only, so a step that reads the draft's own predicted feature reads zeros there, as in training.

``FeatureSession`` keeps one session's features and the draft's KV cache in step with the committed
tokens (the committed-prefix invariant of ``specdec.kvcache``, extended to features).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask

from draft_service.picking import HeadLogits, take_next
from draft_service.token_draft import (
    WEIGHTS_FILE,
    _output_weight,
    add_reduced_head,
    check_target,
    draft_config,
    embed,
    embed_scale,
    family_modules,
    quantize_linears,
    read_card,
    save_draft_weights,
)
from specdec.config import FEATURE_KIND
from specdec.kvcache import GrowableCache, check_sync, common_prefix_len, copy_kv
from specdec.packed_linear import invariant_product, pack_linears
from specdec.ragged import RaggedLayout, layer_ropes, ragged_decoder_layer

KIND = FEATURE_KIND


def on_host(logits: torch.Tensor) -> torch.Tensor:
    """Draft logits ``[B, V]`` as float32 on the CPU, where tokens are picked: a sampled pick draws with a
    CPU generator, so a seeded request draws the same tokens whichever device drafted."""
    return logits.float().cpu()


@dataclass(frozen=True)
class FeatureDraftArch:
    """What a feature draft is made of; the target's config supplies every other dimension."""

    head_size: int = 8192
    """N: the head scores the N most frequent target tokens of the distillation data."""
    init_from: int = -1
    """Target layer the draft's decoder layer starts from (-1: the last)."""
    side_layers: tuple[int, ...] = ()
    """Target layers (0-based) whose outputs the draft reads besides the final-norm feature."""

    def to_json(self) -> dict:
        """The architecture as it goes into the card."""
        sides = "".join(f"; rms(h{j}_i)" for j in self.side_layers)
        return {
            **asdict(self),
            "side_layers": list(self.side_layers),
            "layers": 1,
            "input": f"fc([embedding(t_{{i+1}}); f_i{sides}])",
            "head": "frozen rows of the target LM head (tied embedding) + trainable bias",
        }

    @classmethod
    def from_json(cls, data: dict) -> FeatureDraftArch:
        """Reads the card's ``architecture`` entry."""
        return cls(
            head_size=int(data["head_size"]),
            init_from=int(data["init_from"]),
            side_layers=tuple(int(j) for j in data.get("side_layers", ())),
        )


class FeatureDraft(nn.Module):
    """Predicts the target's next hidden state from its current one and the next token."""

    def __init__(
        self,
        target_config: PretrainedConfig,
        embedding: nn.Embedding,
        output_weight: torch.Tensor,
        head_ids: torch.Tensor,
        arch: FeatureDraftArch,
    ) -> None:
        super().__init__()
        self.arch = arch
        config = draft_config(target_config, 1)
        self.config = config
        dim = int(config.hidden_size)
        self.hidden_size = dim
        self.vocab_size = int(embedding.weight.shape[0])
        # Kept out of the module tree so the target's matrix is neither trained nor saved with the draft.
        self.__dict__["embedding"] = embedding
        self.__dict__["_head_kernel"] = None  # a faster kernel for the head, once chosen (quantized or packed)
        self.embed_scale = embed_scale(embedding)
        self.feature_width = dim * (1 + len(arch.side_layers))
        """Width of the rows the target sends: f_i, then its side layers' outputs."""
        self.fc = nn.Linear(dim + self.feature_width, dim, bias=True)
        family = family_modules(config)  # the target family's own layer, norm and rotary embedding
        self.layer = family.layer(config, 0)
        self.norm = family.norm(dim, config.rms_norm_eps)
        self.rotary_emb = family.rotary(config=config)
        add_reduced_head(self, output_weight, head_ids, self.vocab_size)
        # The head's ids in increasing order, as picks read them (``HeadLogits``), on the host whatever
        # device the draft computes on, and where its rows go in that order; kept from here, as loading
        # or moving the draft never changes which tokens its head scores.
        host = head_ids.detach().to("cpu", torch.long)
        self.__dict__["_id_order"] = torch.argsort(host)  # [N]
        self.__dict__["host_head_ids"] = host[self._id_order]  # [N], increasing

    @property
    def device(self) -> torch.device:
        """Where the draft computes."""
        return self.head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        """What the draft computes in: its borrowed embedding's dtype, which ``fc`` reads features in."""
        return self.embedding.weight.dtype

    def init_from_target(self, target: nn.Module) -> None:
        """Starts the decoder layer and norm from the target's; ``fc`` passes the feature through (and
        the side layers' outputs start unread)."""
        base = target.get_decoder()
        self.layer.load_state_dict(base.layers[self.arch.init_from].state_dict())
        self.norm.load_state_dict(base.norm.state_dict())
        dim = self.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :dim].copy_(torch.eye(dim) * 0.5)
            self.fc.weight[:, dim : 2 * dim].copy_(torch.eye(dim) * 0.5)
            self.fc.bias.zero_()

    def predict(
        self, features: torch.Tensor, tokens: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Predicted next features ``[B, T, D]`` from features ``[B, T, D]`` and next tokens ``[B, T]``."""
        x = self._fc(tokens, features)  # [B, T, D]
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(tokens.shape[1], device=tokens.device) + past).unsqueeze(0)  # [1, T]
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=None, cache=cache, position_ids=position_ids
        )
        rope = self.rope(x, position_ids)
        h = self.layer(
            x,
            attention_mask=mask,
            position_embeddings=rope,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        return self.norm(h)

    def predict_ragged(
        self, features: torch.Tensor, tokens: torch.Tensor, caches: list, layout: RaggedLayout
    ) -> torch.Tensor:
        """``predict`` for many sessions at once: rows ``[N, D]`` and ``[N]`` laid out by ``layout``,
        each session attending to its own cache (see ``specdec.ragged``)."""
        x = self._fc(tokens, features)  # [N, D]
        rope = self.rope(x, layout.positions[None])  # [1, N, hd] each
        return self.norm(ragged_decoder_layer(self.layer, x, rope, caches, layout, 0))  # [N, D]

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft layer's rotary ``(cos, sin)`` ``[B, T, hd]`` for rows ``x [..., T, D]`` at ``positions
        [B, T]`` (its family's table for its layer type: Gemma 3 keeps one per type)."""
        return layer_ropes(self.rotary_emb, self.config, x, positions)[0]

    def _fc(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``fc`` over [embedding(tokens); features], features ``[..., W]`` from the target or ``[..., D]``
        predicted by the draft (its side inputs then zero)."""
        embeds = embed(tokens, self.embedding, self.embed_scale)  # [..., D], frozen
        features = features.to(embeds.device, embeds.dtype)
        dim, sides = self.hidden_size, len(self.arch.side_layers)
        if features.shape[-1] == dim and sides:
            features = torch.cat([features, features.new_zeros(*features.shape[:-1], sides * dim)], dim=-1)
        elif sides:
            side = features[..., dim:].unflatten(-1, (sides, dim))  # [..., S, D]; the residual stream has outliers
            side = side * torch.rsqrt(side.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
            features = torch.cat([features[..., :dim], side.flatten(-2)], dim=-1)
        return self.fc(torch.cat([embeds, features], dim=-1))  # [..., D]

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary logits ``[..., N]`` of (predicted or true) features ``[..., D]``."""
        if self._head_kernel is not None:
            return self._head_kernel(features)
        return nn.functional.linear(features, self.head_weight, self.head_bias)

    def quantize_head_int8(self) -> FeatureDraft:
        """Inference only: int8 dynamic quantization of the head.

        A one-token draft step on a CPU is bound by the weight bytes it reads, and the head's rows are
        most of them: int8 makes a step about a third cheaper (5 -> 3.3 ms here). ``fc`` and the layer
        stay fp32: the features' outliers make int8 activations coarse there (held-out mean accepted
        length, 24 sequences: fp32 1.76, int8 head 1.74; everything int8 cost 7%). q is still exactly
        the distribution each token is drawn from, so speculation stays exact.
        """
        head = nn.Linear(self.hidden_size, len(self.head_ids))
        head.weight.data.copy_(self.head_weight)
        head.bias.data.copy_(self.head_bias.detach())
        self.__dict__["_head_kernel"] = quantize_linears(head)
        return self

    def pack_for_cpu(self) -> FeatureDraft:
        """Inference only, on a CPU: the layer's, ``fc``'s and the head's products on oneDNN-prepacked
        kernels (``specdec.packed_linear``), as the target runs its own; a draft step is a handful of
        small products, whose plain bf16 kernels cost up to twice the packed ones. Keeps an int8 head."""
        pack_linears(self)
        if self._head_kernel is None:
            self.__dict__["_head_kernel"] = invariant_product(self.head_weight.detach(), self.head_bias.detach())
        return self

    def head_rows(self, features: torch.Tensor) -> HeadLogits:
        """The head's logits of ``features [B, D]`` on the host, over its own tokens only, as a pick reads
        them (``on_host``); ``full_logits`` spreads them over the vocabulary."""
        rows = on_host(self.head_logits(features))[:, self._id_order]  # [B, N], in increasing id order
        return HeadLogits(rows, self.host_head_ids, self.vocab_size)

    def full_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[..., V]``, ``-inf`` outside the head: q is exactly zero there."""
        reduced = self.head_logits(features)  # [..., N]
        logits = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        logits[..., self.head_ids] = reduced
        return logits


def build_feature_draft(target: nn.Module, head_ids: torch.Tensor, arch: FeatureDraftArch) -> FeatureDraft:
    """A fresh draft around a loaded target (a HF causal LM)."""
    draft = FeatureDraft(target.config, target.get_input_embeddings(), _output_weight(target), head_ids, arch)
    draft.init_from_target(target)
    return draft.float()


def save_feature_draft(draft: FeatureDraft, folder: Path) -> Path:
    """Writes the draft's own weights (fp16; never the target's) into ``folder``; returns the file."""
    return save_draft_weights(draft.state_dict(), folder, KIND, draft.arch.to_json())


def load_feature_draft(draft_dir: Path, target_model: nn.Module, target_hash: str | None = None) -> FeatureDraft:
    """The draft in ``draft_dir`` around a loaded (unpacked) target, or the part of it a draft borrows
    (``target_parts.read_target``), ready for inference in the dtype and on the device of the target's
    embedding.

    With ``target_hash`` given (the target's ``target_weights_hash``), checks it against the card.
    """
    card = read_card(draft_dir)
    if card.get("kind") != KIND:
        raise ValueError(f"{draft_dir} holds a draft of kind {card.get('kind')!r}, not {KIND!r}")
    if target_hash is not None:
        check_target(card, draft_dir, target_hash)
    arch = FeatureDraftArch.from_json(card["architecture"])
    tensors = load_file(str(Path(draft_dir) / WEIGHTS_FILE))
    embedding = target_model.get_input_embeddings()
    draft = FeatureDraft(target_model.config, embedding, _output_weight(target_model), tensors["head_ids"], arch)
    draft.load_state_dict({k: (v.float() if v.is_floating_point() else v.long()) for k, v in tensors.items()})
    return draft.to(embedding.weight.device, embedding.weight.dtype).eval().requires_grad_(False)


def warm_start(draft: FeatureDraft, source_dir: Path, target_hash: str) -> dict:
    """Starts ``draft`` from the feature draft in ``source_dir`` (distilled for the same target, with
    the same head and a prefix of ``draft``'s side layers); returns the source's identity for a card.

    Every tensor is copied; ``fc``'s columns for side layers the source did not read stay zero, so
    the draft starts out proposing exactly what the source proposes and training adds the new inputs.
    """
    card = read_card(source_dir)
    if card.get("kind") != KIND:
        raise ValueError(f"{source_dir} holds a draft of kind {card.get('kind')!r}, not {KIND!r}")
    check_target(card, source_dir, target_hash)
    source = FeatureDraftArch.from_json(card["architecture"])
    if draft.arch.side_layers[: len(source.side_layers)] != source.side_layers:
        raise ValueError(
            f"{source_dir} reads side layers {list(source.side_layers)}: the draft's "
            f"{list(draft.arch.side_layers)} must start with them"
        )
    path = Path(source_dir) / WEIGHTS_FILE
    tensors = load_file(str(path))
    if not torch.equal(tensors["head_ids"].long(), draft.head_ids):
        raise ValueError(f"{source_dir} scores another head: start from its head ids (source_head_ids)")
    state = draft.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            if name == "fc.weight":  # [D, width of the source's inputs]: a prefix of the draft's columns
                state[name][:, : value.shape[1]].copy_(value.float())
            else:
                state[name].copy_(value.to(state[name].dtype))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    recipe = card.get("recipe", {})  # a hand-made card may have none
    return {
        "path": str(source_dir),
        "weights_sha256": digest,
        "command": recipe.get("command"),
        "seed": recipe.get("seed"),
        "side_layers": list(source.side_layers),
    }


def source_head_ids(source_dir: Path) -> torch.Tensor:
    """The head ids ``[N]`` of the draft stored in ``source_dir``."""
    return load_file(str(Path(source_dir) / WEIGHTS_FILE))["head_ids"].long()


@dataclass(frozen=True)
class DraftTail:
    """Where the draft's model stopped after a proposal: enough to go on drafting past it.

    ``predicted`` (``[1, D]``) gives the next position's logits once ``pending`` (a token still to
    feed, or None) is fed at ``position``, on top of a KV cache of ``kv_length`` entries.
    """

    base: int
    """Committed tokens when the proposal was made."""
    proposal: list[int]
    predicted: torch.Tensor
    pending: int | None
    position: int
    kv_length: int


@dataclass(frozen=True)
class AheadDraft:
    """Tokens drafted ahead: the proposal that follows once ``path`` is committed past ``base``."""

    base: int
    path: list[int]
    """The proposal that was being verified, then the draft's guess of the target's own token."""
    tokens: list[int]
    q: list


@dataclass
class FeatureSession:
    """One session's committed tokens, the target's features for a window of them, and the draft's KV.

    ``features[j]`` is the target's hidden state at position ``window + j``. The draft's KV cache holds
    pairs (f_i, t_{i+1}) for ``i = window .. window + kv_pairs - 1`` computed from true features, then
    possibly speculative entries from the last proposal, which the next call crops. A gap in the
    features (a restarted draft cache, a new turn the target has not fed yet) starts a new window: the
    draft then attends only to what it has features for, which costs acceptance, never exactness.
    """

    committed: list[int]
    window: int = 0
    features: torch.Tensor | None = None
    """A view of ``_store``'s first rows: a round's new rows are written after those kept, not copied
    with them (a long context's features are megabytes)."""
    _store: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    kv: GrowableCache = field(default_factory=GrowableCache)
    kv_pairs: int = 0
    # The highest fencing token a caller showed (see SessionCache.sync).
    fence: int = 0
    # After a proposal the model drafted, until the next sync: where drafting ahead starts.
    tail: DraftTail | None = None
    # Drafted ahead, until the next sync serves or drops it.
    ahead: AheadDraft | None = None
    # A constrained session's grammar state at its committed tokens (``specdec.constrain.SessionGrammar``).
    grammar: Any = None

    @property
    def feature_end(self) -> int:
        """One past the last position with a target feature."""
        return self.window + (0 if self.features is None else len(self.features))

    def sync(self, start: int, new_tokens: list[int], fence: int = 0) -> None:
        """Crops to ``start`` committed tokens and appends ``new_tokens`` (see ``CacheSync``); refuses a
        caller with an older fencing token than seen."""
        self.fence = check_sync(self.fence, len(self.committed), start, len(new_tokens), fence)
        self.tail = None  # drafting ahead continues only the proposal just made, before any sync
        old = self.committed
        self.committed = old[:start] + list(new_tokens)
        # The feature at position i depends on tokens 0..i; the pair at i also on token i + 1.
        # A feature at the last committed position has no next token to pair with yet: drop it too.
        same = min(common_prefix_len(old, self.committed), len(self.committed) - 1)
        self._keep(same - self.window, same - 1 - self.window)

    def reusable(self, tokens: list[int]) -> int:
        """Positions of ``tokens`` a fork of this session holds a target feature for (its window's)."""
        if self.features is None or not len(self.features):
            return 0
        same = min(common_prefix_len(self.committed, tokens), len(tokens) - 1, self.feature_end)
        return max(0, same - self.window)

    def fork(self, tokens: list[int], fence: int = 0) -> FeatureSession:
        """A new session over the committed ``tokens`` with a copy of this one's features and KV pairs
        where its tokens match (then synced to ``tokens`` as any sync crops: no speculative entry, no
        feature at the last position); the draft's catch-up feeds only what the copy lacks."""
        pairs = min(self.kv_pairs, self.kv.get_seq_length())
        clone = FeatureSession(list(self.committed), self.window, kv=copy_kv(self.kv, pairs), kv_pairs=pairs)
        if self.features is not None:
            clone._write_rows(0, self.features)
        common = common_prefix_len(self.committed, tokens)
        clone.sync(common, tokens[common:], fence)
        return clone

    @property
    def copied_end(self) -> int:
        """One past the last committed position whose state the session holds (a target feature)."""
        return self.feature_end if self.features is not None and len(self.features) else 0

    def add_features(self, start: int, rows: torch.Tensor) -> None:
        """Takes the target's features ``[n, D]`` for positions ``start .. start + n - 1``."""
        if len(rows) == 0:
            return
        if self.features is None or not self.window <= start <= self.feature_end:
            self.window, self._store = start, None
            self._write_rows(0, rows)
            self.reset_kv()
        else:
            self._keep(start - self.window, start - self.window)
            self._write_rows(start - self.window, rows)
        # A pair needs the token after its feature: only committed positions before the last count.
        last = len(self.committed) - 1 - self.window
        self._keep(last, last)

    def _write_rows(self, at: int, rows: torch.Tensor) -> None:
        """Features from row ``at`` on become ``rows [n, W]``; the store doubles when it runs out of room."""
        end = at + len(rows)
        store = self._store
        if store is None or end > len(store) or store.dtype != rows.dtype or store.device != rows.device:
            grown = rows.new_empty(max(end, 2 * (0 if store is None else len(store)), 64), rows.shape[1])
            if at:
                grown[:at] = self.features[:at]
            self._store = store = grown
        store[at:end] = rows
        self.features = store[:end]

    def _keep(self, features: int, pairs: int) -> None:
        """Keeps at most the first ``features`` features and ``pairs`` cached pairs."""
        if self.features is not None and features < len(self.features):
            self.features = self.features[: max(0, features)]
        self.kv_pairs = min(self.kv_pairs, max(0, pairs))

    def reset_kv(self) -> None:
        self.kv = GrowableCache()
        self.kv_pairs = 0

    def ready(self) -> bool:
        """Whether the last committed token has a feature before it, the start every proposal needs."""
        return self.features is not None and len(self.features) > 0 and self.feature_end == len(self.committed) - 1

    def catch_up(self) -> tuple[torch.Tensor, list[int], int]:
        """Crops the last proposal's speculative KV entries and returns the pairs a proposal must feed
        first: true features ``[m, D]``, the tokens after them, and the position of the first pair.

        At least the last pair is fed again: its output, the first draft feature, is not kept.
        """
        n = len(self.features)
        first = min(self.kv_pairs, n - 1)
        drop = self.kv.get_seq_length() - first
        if drop > 0:
            self.kv.crop(-drop)
        self.kv_pairs = n
        return (
            self.features[first:n],
            self.committed[self.window + first + 1 : self.window + n + 1],
            self.window + first,
        )

    @torch.inference_mode()
    def propose(self, draft: FeatureDraft, k: int, pick) -> tuple[list[int], list]:
        """Drafts up to ``k`` tokens; ``pick(logits [1, V]) -> (token, q or None)`` chooses each one, or
        returns None to stop early (see ``draft_service.picking``)."""
        device = draft.device
        feats, next_tokens, start = self.catch_up()
        positions = torch.arange(start, start + len(feats), device=device).unsqueeze(0)  # [1, m]
        predicted = draft.predict(feats.unsqueeze(0), torch.tensor([next_tokens], device=device), self.kv, positions)[
            :, -1:
        ]  # [1, 1, D]
        tokens, qs = [], []
        position = start + len(feats)
        for i in range(k):
            if not take_next(pick, on_host(draft.full_logits(predicted[0])), tokens, qs):
                break
            if i + 1 < k:
                predicted = draft.predict(
                    predicted,
                    torch.tensor([[tokens[-1]]], device=device),
                    self.kv,
                    torch.tensor([[position]], device=device),
                )
                position += 1
        return tokens, qs
