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
ops in the same order as transformers' forward (bit-identical logits, ``tests/test_batching.py``),
without the generic per-call work around them: mask building, cache objects, output classes, and
copying grouped KV heads once per query head when a pass has a mask. That made a one-token pass of
the default target 85 instead of 95 ms on the 2-core development CPU.

Only Llama-style decoders (pre-norm, RoPE of any scaling the model's own rotary module computes,
GQA, gated MLP) are supported; ``supports_ragged`` says whether a model qualifies, and callers fall
back to one pass per session otherwise.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.side_layers import with_sides

_RAGGED_TYPES = ("llama",)


def supports_ragged(model: PreTrainedModel) -> bool:
    """True when ``model`` is a decoder this module can run ragged (a plain Llama)."""
    config = model.config
    return (
        getattr(config, "model_type", None) in _RAGGED_TYPES
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
    )


@dataclass(frozen=True)
class RaggedItem:
    """One session in a ragged pass: its cache, the tokens to feed, and how many last logits to keep."""

    cache: Cache
    tokens: list[int]
    logits_to_keep: int
    side_layers: tuple[int, ...] = ()
    """Layers whose outputs follow the final-norm hidden states in its rows (``specdec.side_layers``)."""


def _causal_mask(fed: int, past: int, device: torch.device | str) -> torch.Tensor | None:
    """``[fed, past + fed]`` bool mask letting each new token see the cache and the new tokens before it."""
    if fed == 1:
        return None  # one query sees every key
    keys = torch.arange(past + fed, device=device)
    queries = past + torch.arange(fed, device=device)
    return keys[None, :] <= queries[:, None]


@dataclass(frozen=True)
class RaggedLayout:
    """Where each session's rows sit in a ragged block, and what each may attend to."""

    bounds: list[int]  # rows of session i are bounds[i] .. bounds[i + 1]
    masks: list[torch.Tensor | None]
    positions: torch.Tensor  # [N] absolute position of every row

    @classmethod
    def of(cls, lengths: list[int], pasts: list[int], starts: list[int] | None = None,
           device: torch.device | str = "cpu") -> RaggedLayout:
        """The layout of sessions feeding ``lengths`` rows on top of ``pasts`` cached entries, its
        tensors on the model's ``device``.

        ``starts`` are the rows' first positions when they differ from the cache length (a cache that
        holds only a window of the sequence); by default each session's rows follow its cache.
        """
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        starts = pasts if starts is None else starts
        positions = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lengths)])
        return cls(bounds, [_causal_mask(n, p, device) for n, p in zip(lengths, pasts)], positions)


def ragged_decoder_layer(layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list[Cache],
                         layout: RaggedLayout, layer_idx: int) -> torch.Tensor:
    """One Llama decoder layer over a ragged block ``x [N, D]``; each session attends to its own cache.

    ``rope`` is ``(cos, sin)`` ``[1, N, hd]`` for the rows' positions. The caches grow by the rows fed.
    """
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    n_rows = h.shape[0]
    q = attn.q_proj(h).view(n_rows, -1, attn.head_dim).transpose(0, 1)[None]  # [1, Hq, N, hd]
    k = attn.k_proj(h).view(n_rows, -1, attn.head_dim).transpose(0, 1)[None]  # [1, Hkv, N, hd]
    v = attn.v_proj(h).view(n_rows, -1, attn.head_dim).transpose(0, 1)[None]  # [1, Hkv, N, hd]
    q, k = apply_rotary_pos_emb(q, k, *rope)
    outs = []
    for i, cache in enumerate(caches):
        lo, hi = layout.bounds[i], layout.bounds[i + 1]
        keys, values = cache.update(k[:, :, lo:hi], v[:, :, lo:hi], layer_idx)  # [1, Hkv, T_i, hd]
        out = F.scaled_dot_product_attention(
            q[:, :, lo:hi], keys, values, attn_mask=layout.masks[i], scale=attn.scaling, enable_gqa=True
        )  # [1, Hq, n_i, hd]
        outs.append(out[0].transpose(0, 1).reshape(hi - lo, -1))  # [n_i, Hq * hd]
    x = x + attn.o_proj(torch.cat(outs))
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.inference_mode()
def ragged_forward(model: PreTrainedModel, items: list[RaggedItem]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Feeds every item's tokens into its own cache in one pass over the model's weights.

    Returns, per item, the logits ``[logits_to_keep, V]`` (float32) of its last positions and the
    final-norm hidden states ``[n_i, D]`` of every position it fed, followed by the outputs of the
    item's side layers (``[n_i, D * (1 + S_i)]``). The caches grow by the fed tokens, exactly as a
    single-session forward would grow them.
    """
    decoder = model.get_decoder()
    device = model.device
    layout = RaggedLayout.of([len(item.tokens) for item in items], [item.cache.get_seq_length() for item in items],
                             device=device)
    input_ids = torch.tensor([t for item in items for t in item.tokens], dtype=torch.long, device=device)  # [N]
    caches = [item.cache for item in items]

    x = decoder.embed_tokens(input_ids)  # [N, D]
    rope = decoder.rotary_emb(x, layout.positions[None])  # [1, N, hd] each
    wanted = {j for item in items for j in item.side_layers}
    sides: dict[int, torch.Tensor] = {}
    for layer_idx, layer in enumerate(decoder.layers[: model.config.num_hidden_layers]):
        x = ragged_decoder_layer(layer, x, rope, caches, layout, layer_idx)
        if layer_idx in wanted:
            sides[layer_idx] = x  # [N, D]
    hidden = decoder.norm(x)  # [N, D]

    bounds = layout.bounds
    keep = torch.cat([torch.arange(hi - item.logits_to_keep, hi, device=device) for item, hi in zip(items, bounds[1:])])
    logits = model.get_output_embeddings()(hidden[keep]).float()  # [sum keep, V]
    per_item_logits = list(torch.split(logits, [item.logits_to_keep for item in items]))
    per_item_hidden = [with_sides(hidden[lo:hi], {j: out[lo:hi] for j, out in sides.items()}, item.side_layers)
                       for item, (lo, hi) in zip(items, itertools.pairwise(bounds))]
    return per_item_logits, per_item_hidden
