"""One forward pass over many sessions at once, each with its own KV cache and its own length.

Continuous batching at round granularity needs a pass that takes, for every session in the batch,
a different number of new tokens on top of a different cached length. Padding every session's cache
to the longest one would copy each cache into a batch tensor on every pass (on this model about
46 KB per cached token) and waste attention on padding. Instead the sessions' new tokens are
concatenated into one ragged row block ``[N, D]``:

- every linear layer (q/k/v/o projections, the MLP, the LM head) runs once over all N rows, which is
  where a batch saves time: the weights are read once per pass instead of once per session;
- attention runs per session against that session's own cache (its own GrowableCache buffers, the
  same ones the single-session path uses), so no cache is ever copied or padded.

This is the layout of vLLM's "varlen" attention without paging: caches stay per session because a
session's cache already grows in place (``specdec.kvcache.GrowableLayer``), so blocks would buy
nothing here but indirection.

The services run a lone session through it too. Its plain loop over the layers computes the same
ops in the same order as transformers' forward (bit-identical logits, ``tests/test_batching.py``)
once the model attends with ``specdec.invariance`` (``use_invariant_attention``), without the generic
per-call work around them: mask building, cache objects and output classes. Every kernel it calls
keeps a row's bits whatever else shares the pass (``specdec.invariance``), so a position scores the
same alone, in a chain, in a tree or beside other sessions.

The decoder families it runs are those whose layers share Llama's shape: pre-norm, rotary positions,
grouped-query attention, a gated MLP (``RAGGED_FAMILIES``). What differs between them comes from the
model's own modules, so the pass computes each family's forward math:

- norms, activations and the MLP are the layer's own modules (Gemma's ``1 + w`` RMSNorm and GELU,
  Phi-3's fused gate/up), and the embedding module scales its output itself (Gemma: by sqrt(D));
- Gemma 3 norms both sides of each sublayer: ``post_attention_layernorm`` on the attention output,
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP (``finish_layer``);
- projections carry their biases (Qwen2); Phi-3's one fused ``qkv_proj`` is split like its own code
  splits it; Qwen3's and Gemma 3's per-head ``q_norm`` / ``k_norm`` run before the rotary embedding;
- attention scales scores by the module's own ``scaling`` (Gemma 3: ``query_pre_attn_scalar ** -0.5``);
- the rotary embedding is the family's own ``apply_rotary_pos_emb`` (Phi-3 rotates part of a head),
  its tables the family's own too: Gemma 3 keeps one per layer type, a local base for sliding layers
  (``layer_ropes``);
- a sliding attention window (Mistral, Phi-3, Qwen2/3 and Gemma 3 layers typed ``sliding_attention``)
  masks keys further back than the window, as transformers' sliding-window mask does. The caches keep
  every entry, so a window only narrows the mask.

``supports_ragged`` says whether a model qualifies (``ragged_unsupported`` says why not), and callers
fall back to one pass per session otherwise.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from specdec.attention_kernel import kernel_applies, ragged_attention
from specdec.invariance import (
    BatchPlan,
    attend_batch,
    batch_plan,
    batched_products_invariant,
    has_gaps,
    invariant_attention,
)
from specdec.kvcache import GrowableCache
from specdec.side_layers import with_sides
from specdec.tree_verify import tree_mask
from specdec.trees import depths

RAGGED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "phi3")
"""Model types (``config.model_type``) whose decoder layers the ragged pass runs (``gemma3_text``: Gemma 3's
text model, ``Gemma3ForCausalLM``)."""
# Families whose forward picks each layer's mask by ``config.layer_types``; the others apply one
# window (or none) to every layer, whatever ``layer_types`` a config may carry.
_TYPED_LAYERS = ("qwen2", "qwen3", "gemma3_text")
_ATTENTION_TYPES = {"full_attention", "sliding_attention"}
# Config fields that change the forward math in ways this pass does not compute (the family's own
# forward reads them): soft-capped scores or logits, and attention that also looks ahead.
_UNSUPPORTED_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention")


def ragged_unsupported(config) -> str | None:
    """Why a model with ``config`` cannot run ragged, or None when it can."""
    family = getattr(config, "model_type", None)
    if family not in RAGGED_FAMILIES:
        return f"model family {family!r} has no ragged pass (it has one for {', '.join(RAGGED_FAMILIES)})"
    types = set(getattr(config, "layer_types", None) or ()) if family in _TYPED_LAYERS else set()
    if not types <= _ATTENTION_TYPES:
        return f"layer types {sorted(types - _ATTENTION_TYPES)} have no ragged pass"
    for name in _UNSUPPORTED_FIELDS:
        if getattr(config, name, None):
            return f"{name} is set ({getattr(config, name)!r}), which the ragged pass does not compute"
    return None


def supports_ragged(model: PreTrainedModel) -> bool:
    """True when ``model`` is a decoder this module can run ragged (see ``RAGGED_FAMILIES``)."""
    return ragged_unsupported(model.config) is None


def layer_windows(config) -> tuple[int | None, ...]:
    """Each decoder layer's sliding attention window (None: full attention), as the family's own
    forward masks it."""
    window = getattr(config, "sliding_window", None)
    layers = int(config.num_hidden_layers)
    if getattr(config, "model_type", None) in _TYPED_LAYERS and getattr(config, "layer_types", None):
        return tuple(window if t == "sliding_attention" else None for t in config.layer_types[:layers])
    return (window,) * layers


@dataclass(frozen=True)
class RaggedItem:
    """One session in a ragged pass: its cache, the tokens to feed, and how many last logits to keep."""

    cache: Cache
    tokens: list[int]
    logits_to_keep: int
    side_layers: tuple[int, ...] = ()
    """Layers whose outputs follow the final-norm hidden states in its rows (``specdec.side_layers``)."""
    parents: tuple[int, ...] | None = None
    """A token tree: the last ``len(parents)`` tokens are its nodes (``specdec.trees``), the ones before
    them a chain whose last is the tree's root. None: every token is a chain row."""


def _causal_mask(fed: int, past: int, device: torch.device | str, window: int | None = None) -> torch.Tensor | None:
    """``[fed, past + fed]`` bool mask letting each new token see the cache and the new tokens before it,
    or with ``window`` only the last ``window`` of them, itself included (None: every key is seen)."""
    if fed == 1 and (window is None or past < window):
        return None  # one query sees every key
    keys = torch.arange(past + fed, device=device)
    queries = past + torch.arange(fed, device=device)
    mask = keys[None, :] <= queries[:, None]  # [fed, past + fed]
    if window is not None:
        mask &= keys[None, :] > queries[:, None] - window
    return mask


def _tree_mask(
    parents: tuple[int, ...], fed: int, past: int, device: torch.device | str, window: int | None = None
) -> torch.Tensor:
    """``[fed, past + fed]`` mask of a block whose last ``len(parents)`` rows are a token tree: the chain
    rows before it see the cache causally, a node sees the cache, the chain and its own ancestors
    (within the last ``window`` positions, when given)."""
    lead = fed - len(parents)
    block = tree_mask(parents, lead).to(device)  # [fed, fed]
    mask = torch.cat([torch.ones(fed, past, dtype=torch.bool, device=device), block], dim=1)
    if window is not None:
        rows = _tree_positions(parents, fed, past, device)  # [fed]
        keys = torch.cat([torch.arange(past, device=device), rows])  # [past + fed]
        mask &= keys[None, :] > rows[:, None] - window
    return mask


def _tree_positions(parents: tuple[int, ...], fed: int, start: int, device: torch.device | str) -> torch.Tensor:
    """Positions ``[fed]`` of a block of chain rows then tree nodes: a node sits at its root's position
    plus its depth."""
    lead = fed - len(parents)
    chain = torch.arange(start, start + lead, device=device)
    nodes = torch.tensor(depths(parents), dtype=torch.long, device=device) + (start + lead - 1)
    return torch.cat([chain, nodes])


@dataclass(frozen=True)
class RaggedLayout:
    """Where each session's rows sit in a ragged block, and what each may attend to."""

    bounds: list[int]  # rows of session i are bounds[i] .. bounds[i + 1]
    masks: list[torch.Tensor | None]
    positions: torch.Tensor  # [N] absolute position of every row
    # Per sliding window (of the layers that have one): each session's mask under that window.
    windowed: dict[int, list[torch.Tensor | None]] | None = None

    @classmethod
    def of(
        cls,
        lengths: list[int],
        pasts: list[int],
        starts: list[int] | None = None,
        device: torch.device | str = "cpu",
        windows: tuple[int | None, ...] = (),
        trees: list[tuple[int, ...] | None] | None = None,
    ) -> RaggedLayout:
        """The layout of sessions feeding ``lengths`` rows on top of ``pasts`` cached entries, its
        tensors on the model's ``device``.

        ``starts`` are the rows' first positions when they differ from the cache length (a cache that
        holds only a window of the sequence); by default each session's rows follow its cache.
        ``windows`` are the layers' sliding windows (``layer_windows``; None: full attention).
        ``trees`` gives, per session, the parents of the token tree its rows end with (None: a chain).
        """
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        starts = pasts if starts is None else starts
        trees = trees or [None] * len(lengths)

        def mask(n: int, past: int, tree: tuple[int, ...] | None, window: int | None) -> torch.Tensor | None:
            if tree:
                return _tree_mask(tree, n, past, device, window)
            return _causal_mask(n, past, device, window)

        positions = torch.cat(
            [
                _tree_positions(t, n, s, device) if t else torch.arange(s, s + n, device=device)
                for s, n, t in zip(starts, lengths, trees)
            ]
        )
        windowed = {
            w: [mask(n, p, t, w) for n, p, t in zip(lengths, pasts, trees)]
            for w in sorted({w for w in windows if w is not None})
        }
        masks = [mask(n, p, t, None) for n, p, t in zip(lengths, pasts, trees)]
        return cls(bounds, masks, positions, windowed or None)

    @functools.cached_property
    def sizes(self) -> list[int]:
        """Rows each session feeds."""
        return [hi - lo for lo, hi in itertools.pairwise(self.bounds)]

    @functools.cached_property
    def gaps(self) -> list[bool]:
        """Per session: whether its mask hides keys between visible ones (a token tree's rows), which
        the batch-invariant attention must gather (``specdec.invariance.invariant_attention``)."""
        return [has_gaps(mask) for mask in self.masks]

    @functools.cached_property
    def chain_groups(self) -> list[list[int]]:
        """The chain sessions grouped for attention (``row_groups``), once per pass, not per layer."""
        return row_groups(self.sizes, self.gaps)

    @functools.cached_property
    def tree_sessions(self) -> list[int]:
        """The sessions whose rows end with a token tree (attending one at a time)."""
        return [i for i, gap in enumerate(self.gaps) if gap]

    @functools.cached_property
    def plans(self) -> dict[tuple[int, int | None], BatchPlan]:
        """Per chain group and sliding window: its batched attention's plan, made by the pass's first
        layer of that window and read by the others (every layer's keys grow alike)."""
        return {}

    @functools.cached_property
    def _orders(self) -> dict[bool, torch.Tensor | None]:
        return {}

    def row_order(self, batched: bool) -> torch.Tensor | None:
        """Where each of the pass's rows lies among the attention's parts (``attend_rows``: the chain
        groups, padded to their longest session when ``batched``, then the trees), or None when the
        parts hold them in order already; worked out once per pass."""
        if batched not in self._orders:
            self._orders[batched] = self._row_order(batched)
        return self._orders[batched]

    def _row_order(self, batched: bool) -> torch.Tensor | None:
        sizes = self.sizes
        where: list[list[int]] = [[] for _ in sizes]
        at = 0
        for chains in self.chain_groups:
            width = max(sizes[i] for i in chains) if batched else None
            for i in chains:
                where[i] = list(range(at, at + sizes[i]))
                at += width or sizes[i]
        for i in self.tree_sessions:
            where[i] = list(range(at, at + sizes[i]))
            at += sizes[i]
        order = [r for rows in where for r in rows]
        if order == list(range(at)):
            return None
        return torch.tensor(order, device=self.positions.device)

    def masks_for(self, window: int | None) -> list[torch.Tensor | None]:
        """The sessions' masks for a layer with sliding ``window`` (None: full attention)."""
        return self.masks if window is None or self.windowed is None else self.windowed[window]


def layer_ropes(
    rotary: nn.Module, config, x: torch.Tensor, positions: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each decoder layer's rotary ``(cos, sin)`` ``[B, N, rd]`` for rows ``x [..., N, D]`` at ``positions
    [B, N]``, from the family's own rotary module ``rotary`` and the model's ``config``.

    Most families share one table across layers. Gemma 3's module keeps one per layer type (its
    ``layer_types``; the sliding layers' with a local base) and takes the type as an argument: each
    type's table is computed once, as its own forward does.
    """
    layers = int(config.num_hidden_layers)
    if getattr(rotary, "layer_types", None) is None:
        return [rotary(x, positions)] * layers
    types = list(config.layer_types[:layers])
    tables = {t: rotary(x, positions, t) for t in sorted(set(types))}
    return [tables[t] for t in types]


def rotary_of(attn: nn.Module) -> Callable:
    """The ``apply_rotary_pos_emb`` of the attention module's own family (Phi-3's rotates part of a head)."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def project_qkv(
    attn: nn.Module, h: torch.Tensor, qkv: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[..., Hq, hd]``, keys and values ``[..., Hkv, hd]`` of normed rows ``h [..., D]``, before
    RoPE, as the attention module's own forward computes them.

    ``qkv`` computes the three projections as one product ``[..., (Hq + 2 Hkv) hd]`` (a compiled pass
    calls the packed kernel that way); by default the module's own layers do.
    """
    hd = attn.head_dim
    if qkv is None and hasattr(attn, "qkv_proj"):  # Phi-3: one fused product, split as its own forward splits it
        qkv = attn.qkv_proj
    if qkv is not None:
        qkv = qkv(h)  # [N, (Hq + 2 Hkv) hd]
        kv_width = attn.config.num_key_value_heads * hd
        q, k, v = qkv.split([qkv.shape[-1] - 2 * kv_width, kv_width, kv_width], dim=-1)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    q, k, v = (t.view(*h.shape[:-1], -1, hd) for t in (q, k, v))
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head, before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def ragged_decoder_layer(
    layer,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: list[Cache],
    layout: RaggedLayout,
    layer_idx: int,
    window: int | None = None,
) -> torch.Tensor:
    """One decoder layer over a ragged block ``x [N, D]``; each session attends to its own cache, within
    the layer's sliding ``window`` when it has one.

    ``rope`` is ``(cos, sin)`` ``[1, N, rd]`` for the rows' positions. The caches grow by the rows fed.
    """
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q, k, v = (t.transpose(0, 1)[None] for t in project_qkv(attn, h))  # [1, H, N, hd] each
    q, k = rotary_of(attn)(q, k, *rope)
    return finish_layer(layer, x, attn.o_proj(attend_rows(attn, q, k, v, caches, layout, layer_idx, window)))


def row_groups(rows: list[int], gaps: list[bool]) -> list[list[int]]:
    """The chain sessions (no ``gaps``) grouped by row count up to the next power of two: sessions that
    attend in one call. Grouping never changes a row's bits (``attend_sessions`` is batch-invariant)."""
    groups: dict[int, list[int]] = {}
    for i, (n, gap) in enumerate(zip(rows, gaps)):
        if not gap:
            groups.setdefault(1 << max(0, n - 1).bit_length(), []).append(i)
    return [groups[size] for size in sorted(groups)]


def attend_rows(
    attn: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: list[Cache],
    layout: RaggedLayout,
    layer_idx: int,
    window: int | None = None,
) -> torch.Tensor:
    """The attention of a ragged block's rows, before the output projection: queries ``q [1, Hq, N', hd]``,
    keys and values ``[1, Hkv, N', hd]`` (rotated), each session's appended to its own cache, which it
    then attends to (within ``window``). Returns ``[N', Hq hd]``: rows past the layout's N (a compiled
    pass's padding) attend to nothing and come back as zeros."""
    masks = layout.masks_for(window)
    if kernel_applies(q, k, v) and all(isinstance(cache, GrowableCache) for cache in caches):
        # Every session's rows in one call, which also writes their keys and values into the caches.
        claims = [cache.layer(layer_idx).claim(k, n) for cache, n in zip(caches, layout.sizes)]
        return ragged_attention(
            q[0, :, : layout.bounds[-1]].transpose(0, 1),  # [N, Hq, hd]
            [claim[0] for claim in claims],
            [claim[1] for claim in claims],
            layout.bounds,
            masks,
            attn.scaling,
            lengths=[start + n for (_, _, start), n in zip(claims, layout.sizes)],
            new=(k, v),
            rows=q.shape[2],
        )
    n = layout.bounds[-1]
    if q.shape[2] > n:  # a compiled pass's padding rows
        out = attend_rows(attn, q[:, :, :n], k[:, :, :n], v[:, :, :n], caches, layout, layer_idx, window)
        return F.pad(out, (0, 0, 0, q.shape[2] - n))
    bounds = list(itertools.pairwise(layout.bounds))
    grown = [
        cache.update(k.narrow(2, lo, hi - lo), v.narrow(2, lo, hi - lo), layer_idx)
        for cache, (lo, hi) in zip(caches, bounds)
    ]
    if kernel_applies(q, k, v):  # caches of another kind: they grow first, then the kernel reads them
        return ragged_attention(
            q[0].transpose(0, 1), [g[0] for g in grown], [g[1] for g in grown], layout.bounds, masks, attn.scaling
        )
    parts: list[torch.Tensor] = []  # [rows, Hq hd] each, in the order of ``layout.part_sessions``
    # Chains of like length attend together in one call (each padded to the longest of its call, so a
    # prompt's rows never pad every one-row session), laid out once per pass; a tree's rows gather
    # their ancestors' keys, one session at a time.
    batched = batched_products_invariant(q.dtype, str(q.device))
    for group, chains in enumerate(layout.chain_groups):
        if not batched:
            parts.extend(_attend_alone(attn, q, grown[i], masks[i], bounds[i]) for i in chains)
            continue
        plan = layout.plans.get((group, window))
        if plan is None:
            plan = layout.plans[(group, window)] = batch_plan(
                [bounds[i][0] for i in chains],
                [bounds[i][1] - bounds[i][0] for i in chains],
                [grown[i][0].shape[2] for i in chains],
                [masks[i] for i in chains],
                k.shape[1],
                q.device,
            )
        parts.append(attend_batch(q, [grown[i][0] for i in chains], [grown[i][1] for i in chains], plan, attn.scaling))
    parts.extend(_attend_alone(attn, q, grown[i], masks[i], bounds[i], gaps=True) for i in layout.tree_sessions)
    block = parts[0] if len(parts) == 1 else torch.cat(parts)
    order = layout.row_order(batched)
    return block if order is None else block.index_select(0, order)


def _attend_alone(
    attn: nn.Module,
    q: torch.Tensor,
    grown: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    rows: tuple[int, int],
    gaps: bool = False,
) -> torch.Tensor:
    """One session's rows ``rows`` of ``q`` over its cache's keys and values ``grown``: ``[n, Hq hd]``."""
    lo, hi = rows
    out = invariant_attention(q[:, :, lo:hi], *grown, mask, attn.scaling, gaps)  # [1, Hq, n, hd]
    return out[0].transpose(0, 1).reshape(hi - lo, -1)


def finish_layer(
    layer: nn.Module, x: torch.Tensor, attended: torch.Tensor, mlp: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """The rest of a decoder layer once its attention is done: rows ``x [..., D]`` in, the attention's
    projected output ``attended [..., D]``; returns the layer's output ``[..., D]``. ``mlp`` stands in
    for the layer's own MLP module (a compiled pass calls its packed kernels directly).

    Gemma 3 (any layer with a ``pre_feedforward_layernorm``) norms the attention output before the
    residual add and norms the MLP's input and output; the other families add the attention output as
    it is and norm only the MLP's input, with the layer's ``post_attention_layernorm``. The ops run in
    the order of the family's own forward, so the rows keep its bits.
    """
    mlp = mlp or layer.mlp
    if getattr(layer, "pre_feedforward_layernorm", None) is not None:
        x = x + layer.post_attention_layernorm(attended)
        return x + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(x)))
    x = x + attended
    return x + mlp(layer.post_attention_layernorm(x))


@torch.inference_mode()
def ragged_forward(
    model: PreTrainedModel, items: list[RaggedItem], layout: RaggedLayout | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Feeds every item's tokens into its own cache in one pass over the model's weights.

    Returns, per item, the logits ``[logits_to_keep, V]`` (float32) of its last positions and the
    final-norm hidden states ``[n_i, D]`` of every position it fed, followed by the outputs of the
    item's side layers (``[n_i, D * (1 + S_i)]``). The caches grow by the fed tokens, exactly as a
    single-session forward would grow them.

    ``layout`` replaces the masks and positions the items imply (chains, or trees fed whole), for a
    caller that grows a tree level by level over rows already in the caches
    (``draft_service.tree_draft.level_layout``).
    """
    decoder = model.get_decoder()
    device = model.device
    windows = layer_windows(model.config)
    layout = layout or RaggedLayout.of(
        [len(item.tokens) for item in items],
        [item.cache.get_seq_length() for item in items],
        device=device,
        windows=windows,
        trees=[item.parents for item in items],
    )
    input_ids = torch.tensor([t for item in items for t in item.tokens], dtype=torch.long, device=device)  # [N]
    caches = [item.cache for item in items]

    x = decoder.embed_tokens(input_ids)  # [N, D]; Gemma's embedding module scales by sqrt(D) itself
    ropes = layer_ropes(decoder.rotary_emb, model.config, x, layout.positions[None])  # [1, N, rd] each
    wanted = {j for item in items for j in item.side_layers}
    sides: dict[int, torch.Tensor] = {}
    for layer_idx, layer in enumerate(decoder.layers[: model.config.num_hidden_layers]):
        x = ragged_decoder_layer(layer, x, ropes[layer_idx], caches, layout, layer_idx, windows[layer_idx])
        if layer_idx in wanted:
            sides[layer_idx] = x  # [N, D]
    hidden = decoder.norm(x)  # [N, D]

    return item_outputs(model, items, layout.bounds, hidden, sides)


def item_outputs(
    model: PreTrainedModel,
    items: list[RaggedItem],
    bounds: list[int],
    hidden: torch.Tensor,
    sides: dict[int, torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``ragged_forward``'s result from a pass's final-norm rows ``hidden [N, D]`` and the outputs
    ``sides`` of the layers some item asked for, rows of item i at ``bounds[i] .. bounds[i + 1]``: per
    item its last ``logits_to_keep`` logits (float32) and its rows with their side layers."""
    keep = torch.cat(
        [torch.arange(hi - item.logits_to_keep, hi, device=hidden.device) for item, hi in zip(items, bounds[1:])]
    )
    logits = model.get_output_embeddings()(hidden[keep]).float()  # [sum keep, V]
    per_item_logits = list(torch.split(logits, [item.logits_to_keep for item in items]))
    per_item_hidden = [
        with_sides(hidden[lo:hi], {j: out[lo:hi] for j, out in sides.items()}, item.side_layers)
        for item, (lo, hi) in zip(items, itertools.pairwise(bounds))
    ]
    return per_item_logits, per_item_hidden
