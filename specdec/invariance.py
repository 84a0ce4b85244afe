"""Batch-invariant kernels: a position's numbers never depend on what else shares its pass.

Greedy speculation is exact only if the target scores a position to the same bits whether that
position is verified alone (``k=0``), as one row of a chain of k+1, as a node of a token tree, or
beside other sessions' rows in one batched pass. Half-precision serving stacks lose this (vLLM bf16
answers at 8 streams differ from its own one-at-a-time answers), because the kernels they call pick
a different reduction order for a different number of rows. Invariance is a property of the
kernels, so it is designed in here and checked, not hoped for:

- **Attention** (``invariant_attention``). Neither SDPA's CPU flash kernel (bf16 from 8 query rows
  on, fp32 from 2) nor a plain ``bmm`` over all keys (fp32 from 2 rows; bf16 now and then when the
  key count crosses a block) keeps row 0's bits when more query rows or more (masked) keys join.
  This attention pads the key axis to a multiple of ``KEY_BLOCK``, masks the padding, takes the
  softmax in float32, and sums the value product block by block in key order, so a longer key axis
  only appends exact zeros. Its products run batched over the query rows where a probe found that
  row-invariant for the dtype (``batched_products_invariant``), else one query row at a time. A
  token tree's row attends to its own keys gathered in position order, as the same position does in
  a chain; all of a tree's rows in one batched product where a probe finds that each entry of it
  keeps the bits it gets alone (``batched_entries_invariant``).
- **Linear layers** (``row_invariant``). ``specdec.packed_linear.pack_linears`` probes each kernel it
  might use for a weight (oneDNN-packed, packed fed two rows at least, packed with the reduction
  split into fixed chunks, plain)
  and keeps the first whose row 0 is bit-identical at every probed row count.

Norms, rotary embeddings and activations work row by row and are invariant as they are.

Models computing through transformers' own forward (prefill, the reference ``generate``) use the
same attention: ``use_invariant_attention`` registers it as the model's attention implementation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specdec.attention_kernel import kernel_applies, ragged_attention

ATTENTION_NAME = "specdec_invariant"
"""The attention implementation name ``use_invariant_attention`` registers with transformers."""
KEY_BLOCK = 256
"""Keys are padded to a multiple of this, and the value product runs one block of this many keys at a
time: a longer (masked) key axis then appends whole blocks and never reshuffles earlier ones."""
PROBE_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)
"""Row counts a probe compares row 0 across: single rows, chains, trees and batched sessions."""


def round_up(n: int, block: int = KEY_BLOCK) -> int:
    """``n`` rounded up to a multiple of ``block``."""
    return -(-n // block) * block


def padded_keys(t: torch.Tensor, length: int) -> torch.Tensor:
    """Keys or values ``t [B, H, T, hd]`` extended to ``length >= T`` along the key axis.

    A ``specdec.kvcache.GrowableLayer`` hands out views of a buffer that already holds the padding
    (zero-initialised, later stale but finite entries that the mask hides), so the view is widened in
    place; any other tensor is padded with zeros (a copy).
    """
    batch, heads, have, dim = t.shape
    if length == have:
        return t
    stride = t.stride()
    in_place = (
        stride[3] == 1
        and stride[2] == dim
        and length * stride[2] <= stride[1]  # stays inside each head's slab of the buffer
        and t.storage_offset() + (batch - 1) * stride[0] + (heads - 1) * stride[1] + length * dim
        <= t.untyped_storage().nbytes() // t.element_size()
    )
    if in_place:
        return t.as_strided((batch, heads, length, dim), stride)
    return F.pad(t, (0, 0, 0, length - have))


def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` as bool (True: attend): an additive float mask hides a key with -inf or its dtype's min."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _visible(mask: torch.Tensor | None, rows: int, keys: int, padded: int, device) -> torch.Tensor:
    """``[..., rows, padded]`` bool: which keys each query row sees. ``mask`` (``[..., rows, keys]``,
    True: attend) or, when None, causal with the queries at the end of the keys."""
    if mask is None:
        key_pos = torch.arange(padded, device=device)
        query_pos = torch.arange(keys - rows, keys, device=device)
        return key_pos[None, :] <= query_pos[:, None]  # [rows, padded]; the padding lies past every query
    return F.pad(bool_mask(mask), (0, padded - keys), value=False)


@functools.cache
def batched_products_invariant(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether attention products over many query rows at once give each row the bits it gets alone,
    probed once per dtype and device on the default target's head shape (3 groups of 3 query heads,
    64 wide) at several query and key counts."""
    if device == "meta":
        return True  # no numbers to compare: device placement checks run the batched path
    gen = torch.Generator(device="cpu").manual_seed(0)
    groups, per_group, dim = 3, 3, 64
    keys = torch.randn(groups, 3 * KEY_BLOCK, dim, generator=gen).to(device, dtype)
    query = torch.randn(groups, per_group, max(PROBE_ROWS), dim, generator=gen).to(device, dtype)
    for length in (KEY_BLOCK, 3 * KEY_BLOCK):
        k = keys[:, :length]
        alone = torch.cat(
            [_products(query[:, :, r : r + 1], k, k, None, 0.125, batched=True) for r in range(len(query[0, 0]))], dim=2
        )
        for rows in PROBE_ROWS[1:]:
            if not torch.equal(_products(query[:, :, :rows], k, k, None, 0.125, batched=True), alone[:, :, :rows]):
                return False
    return True


def _products(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float, batched: bool
) -> torch.Tensor:
    """Attention of grouped queries ``q [G, P, n, hd]`` over keys and values ``[G, Tp, hd]`` (G: key
    groups, P: query heads per group); ``visible`` ``[n, Tp]``, ``[G, n, Tp]`` or None (every key).
    Returns ``[G, P, n, hd]``. ``batched``: the rows share one product (row-invariant where
    ``batched_products_invariant`` says so), else one product per row."""
    groups, per_group, rows, dim = q.shape
    if not batched:
        outs = [_products(q[:, :, r : r + 1], k, v, None if visible is None else _row(visible, r), scale, True)
                for r in range(rows)]  # fmt: skip
        return torch.cat(outs, dim=2)
    scores = torch.bmm(q.reshape(groups, per_group * rows, dim), k.transpose(1, 2)).float() * scale  # [G, P n, Tp]
    scores = scores.view(groups, per_group, rows, -1)
    if visible is not None:
        # [n, Tp] for every group alike, or [G, n, Tp] per group (sessions stacked: ``attend_sessions``)
        scores = scores.masked_fill(~(visible if visible.dim() == 2 else visible[:, None]), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(groups, per_group * rows, -1)  # [G, P n, Tp]
    # One product per key block, added in key order in float32: a product's reduction never spans a
    # block, so more keys (masked, weight 0) only append exact zeros to the sum.
    out = torch.bmm(probs[:, :, :KEY_BLOCK], v[:, :KEY_BLOCK]).float()  # [G, P n, hd]
    for lo in range(KEY_BLOCK, probs.shape[-1], KEY_BLOCK):
        out += torch.bmm(probs[:, :, lo : lo + KEY_BLOCK], v[:, lo : lo + KEY_BLOCK])
    return out.to(v.dtype).view(groups, per_group, rows, dim)


def _row(visible: torch.Tensor, r: int) -> torch.Tensor:
    """Row ``r`` of ``visible`` (``[n, Tp]`` or ``[G, n, Tp]``), keeping its dimensions."""
    return visible[r : r + 1] if visible.dim() == 2 else visible[:, r : r + 1]


def _gathered_products(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, batched: bool
) -> torch.Tensor:
    """``_products`` for rows whose visible keys have gaps (a token tree's nodes see their ancestors,
    not their cousins), each row computed as if it were verified alone: its visible keys gathered, in
    order, into a key axis of its own, on which it runs exactly the one-row ``_products``.

    A shared prefix with a per-row tail would copy less, but splits each row's products differently
    from a chain's, and a reordered float32 sum then shows in a bf16 result now and then. Trees are a
    few dozen rows at most, so each row pays one copy of its keys instead. Where the products of many
    (group, row) pairs in one batched call give each pair the bits it gets alone
    (``batched_entries_invariant``), every row's gathered keys go through one call, their key axes
    padded to the longest row's (whole masked blocks: exact zeros); else one call per row.
    """
    groups, per_group, rows, dim = q.shape
    counts = visible.sum(-1)  # [n] keys each row sees
    padded = round_up(max(int(counts.max()), 1))
    # Each row's visible slots in position order, then slot 0 as padding (masked by ``seen``).
    slots = torch.arange(visible.shape[-1], device=visible.device).expand_as(visible)
    order = torch.where(visible, slots, visible.shape[-1]).sort(-1).values[:, :padded]  # [n, Tp]
    seen = order < visible.shape[-1]  # [n, Tp]
    order = order.masked_fill(~seen, 0)
    if not (batched and batched_entries_invariant(q.dtype, str(q.device))):
        return torch.cat(
            [
                _products(q[:, :, r : r + 1], k[:, order[r]], v[:, order[r]], seen[r : r + 1], scale, True)
                for r in range(rows)
            ],
            dim=2,
        )
    # One entry per (group, row): queries [G n, P, hd] over that row's keys [G n, Tp, hd].
    rows_q = q.permute(0, 2, 1, 3).reshape(groups * rows, per_group, 1, dim)
    rows_k = k[:, order].reshape(groups * rows, padded, dim)
    rows_v = v[:, order].reshape(groups * rows, padded, dim)
    rows_seen = seen[None].expand(groups, -1, -1).reshape(groups * rows, 1, padded)
    out = _products(rows_q, rows_k, rows_v, rows_seen, scale, True)  # [G n, P, 1, hd]
    return out.reshape(groups, rows, per_group, dim).permute(0, 2, 1, 3)


@functools.cache
def batched_entries_invariant(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether a batched product gives each of its entries the bits that entry gets in a call of its
    own, at the entry counts a token tree's rows make (``_gathered_products``), probed once per dtype
    and device on the default target's head shape."""
    if device == "meta":
        return True
    gen = torch.Generator(device="cpu").manual_seed(1)
    groups, per_group, dim = 3, 3, 64
    entries = groups * max(PROBE_ROWS)
    # The two shapes an entry's products take: scores [P, hd] x [hd, T], a value block [P, K] x [K, hd].
    for length in (KEY_BLOCK, 2 * KEY_BLOCK):
        q = torch.randn(entries, per_group, dim, generator=gen).to(device, dtype)
        k = torch.randn(entries, dim, length, generator=gen).to(device, dtype)
        p = torch.rand(entries, per_group, KEY_BLOCK, generator=gen).to(device, dtype)
        v = torch.randn(entries, KEY_BLOCK, dim, generator=gen).to(device, dtype)
        for a, b in ((q, k), (p, v)):
            alone = torch.cat([torch.bmm(a[i : i + 1], b[i : i + 1]) for i in range(entries)])
            for rows in PROBE_ROWS[1:]:
                n = groups * rows
                if not torch.equal(torch.bmm(a[:n], b[:n]), alone[:n]):
                    return False
    return True


def has_gaps(mask: torch.Tensor | None) -> bool:
    """Whether some row of ``mask [..., n, T]`` (True: attend) sees two keys with a hidden one between
    them: a token tree's, not a chain's or a sliding window's."""
    if mask is None or mask.dtype != torch.bool or mask.device.type == "meta":
        return False
    # Runs of visible keys a row has: one that starts at key 0, plus one per hidden-to-visible step.
    runs = mask[..., 0].long() + (mask[..., 1:] & ~mask[..., :-1]).sum(dim=-1)
    return bool((runs > 1).any())


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    gaps: bool = False,
) -> torch.Tensor:
    """Grouped-query attention whose every query row gets the same bits at any number of query rows,
    any number of masked keys after its own, and (with ``gaps``) whichever keys hide between the ones
    it sees.

    ``query [B, Hq, n, hd]``, ``key`` and ``value [B, Hkv, T, hd]`` (Hq a multiple of Hkv), ``mask``
    ``[n, T]`` or ``[B, 1, n, T]`` bool (True: attend) or None (causal, queries at the end of the
    keys). ``gaps``: the mask may hide keys between visible ones (``has_gaps``; a token tree), whose
    rows then attend as ``_gathered_products`` says. Returns ``[B, Hq, n, hd]``.
    """
    batch, heads, rows, dim = query.shape
    groups, length = key.shape[1], key.shape[2]
    if kernel_applies(query, key, value):
        return _kernel_attention(query, key, value, mask, scale)
    padded = round_up(length)
    key, value = padded_keys(key, padded), padded_keys(value, padded)  # [B, Hkv, Tp, hd]
    visible = _visible(mask, rows, length, padded, query.device)
    batched = batched_products_invariant(query.dtype, str(query.device))
    products = _gathered_products if gaps else _products
    outs = []
    for b in range(batch):
        seen = visible if visible.dim() == 2 else visible[b, 0]  # [n, Tp]
        q = query[b].reshape(groups, heads // groups, rows, dim)  # head h reads key group h // (Hq / Hkv)
        outs.append(products(q, key[b], value[b], seen, scale, batched).reshape(heads, rows, dim))
    return torch.stack(outs)


def _kernel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``invariant_attention`` on the compiled kernel (``specdec.attention_kernel``): each batch entry
    one session of ``n`` rows. Returns ``[B, Hq, n, hd]``."""
    batch, heads, rows, dim = query.shape
    mask = None if mask is None else bool_mask(mask)
    if mask is not None and mask.dim() == 4:  # [B or 1, 1, n, T]: each entry's own
        masks = [mask[b if mask.shape[0] > 1 else 0, 0] for b in range(batch)]
    else:
        masks = [mask] * batch
    out = ragged_attention(
        query.transpose(1, 2).reshape(batch * rows, heads, dim),  # [B n, Hq, hd]
        [key[b : b + 1] for b in range(batch)],
        [value[b : b + 1] for b in range(batch)],
        list(range(0, (batch + 1) * rows, rows)),
        masks,
        scale,
    )  # [B n, Hq hd]
    return out.view(batch, rows, heads, dim).transpose(1, 2)


@dataclass(frozen=True)
class BatchPlan:
    """How several sessions' chain rows (no mask with gaps) attend in one call (``attend_batch``): the
    same for every layer of a pass, so a pass builds it once (``batch_plan``), not once per layer.

    Each session's rows are padded to ``rows`` and its keys to ``padded``; a padding row repeats one of
    its session's queries and sees one key, so its (discarded) output stays finite. A row's bits are
    those it gets alone: the products are row-invariant, and extra keys are whole masked blocks.
    """

    rows: int
    padded: int
    gather: torch.Tensor | slice
    """``[S rows]``: the pass block's row each padded row reads, or the slice of the block they are."""
    visible: torch.Tensor
    """``[S G, rows, padded]`` bool: the keys each row of each session's key group sees."""


def batch_plan(
    starts: list[int],
    counts: list[int],
    keys: list[int],
    masks: list[torch.Tensor | None],
    groups: int,
    device: torch.device | str,
) -> BatchPlan:
    """The plan for sessions whose ``counts`` rows start at block rows ``starts``, attending over
    ``keys`` keys each (their rows included) under ``masks`` (None: causal), with ``groups`` key heads."""
    rows = max(counts)
    padded = round_up(max(keys))
    seen = []
    for n, length, mask in zip(counts, keys, masks):
        visible = _visible(mask, n, length, padded, device)  # [n, Tp]
        filler = torch.zeros(rows - n, padded, dtype=torch.bool, device=device)
        filler[:, 0] = True
        seen.append(torch.cat([visible, filler]))
    visible = torch.stack(seen)[:, None].expand(-1, groups, -1, -1).reshape(-1, rows, padded)  # [S G, n, Tp]
    gather = [start + min(j, n - 1) for start, n in zip(starts, counts) for j in range(rows)]
    if gather == list(range(starts[0], starts[0] + len(gather))):
        return BatchPlan(rows, padded, slice(starts[0], starts[0] + len(gather)), visible)
    return BatchPlan(rows, padded, torch.tensor(gather, device=device), visible)


def attend_batch(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], plan: BatchPlan, scale: float
) -> torch.Tensor:
    """``invariant_attention`` of several sessions' chain rows in one call, as ``plan`` lays them out:
    ``query [1, Hq, N, hd]`` holds every row of the pass, ``keys`` and ``values`` ``[1, Hkv, T_i, hd]``
    each session's own. Returns ``[S rows, Hq hd]``, session by session, padding rows included.
    Callers check ``batched_products_invariant`` first (else one session at a time)."""
    heads, dim = query.shape[1], query.shape[3]
    sessions, groups = len(keys), keys[0].shape[1]
    if isinstance(plan.gather, slice):
        rows = query[0, :, plan.gather]  # [Hq, S n, hd]
    else:
        rows = query[0].index_select(1, plan.gather)
    q = rows.reshape(heads, sessions, plan.rows, dim).transpose(0, 1)  # [S, Hq, n, hd]
    q = q.reshape(sessions * groups, heads // groups, plan.rows, dim)  # [S G, P, n, hd]
    if sessions == 1:  # the cache's own buffer, widened in place: no copy
        k = padded_keys(keys[0], plan.padded).reshape(groups, plan.padded, dim)
        v = padded_keys(values[0], plan.padded).reshape(groups, plan.padded, dim)
    else:
        k = torch.cat([padded_keys(t, plan.padded) for t in keys]).reshape(-1, plan.padded, dim)  # [S G, Tp, hd]
        v = torch.cat([padded_keys(t, plan.padded) for t in values]).reshape(-1, plan.padded, dim)
    out = _products(q, k, v, plan.visible, scale, True)  # [S G, P, n, hd]
    return out.reshape(sessions, heads, plan.rows, dim).transpose(1, 2).reshape(sessions * plan.rows, heads * dim)


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``invariant_attention`` behind transformers' attention interface: ``[B, n, Hq, hd]`` out."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{ATTENTION_NAME} attention has no logit soft-capping or attention sinks")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is not None:
        attention_mask = bool_mask(attention_mask)
        # A left-padded batch's padding rows see no key: let them see every key, as transformers' SDPA
        # fix does, so their (unused) outputs and cached keys stay finite instead of NaN, which a zero
        # attention weight would carry into the real rows.
        attention_mask = attention_mask | ~attention_mask.any(dim=-1, keepdim=True)
    out = invariant_attention(query, key, value, attention_mask, scale)  # [B, Hq, n, hd]
    return out.transpose(1, 2).contiguous(), None


def use_invariant_attention(model: nn.Module) -> bool:
    """Makes transformers' forward of ``model`` attend with ``invariant_attention``, so its prefill and
    a reference ``generate`` compute what the ragged pass computes; returns whether it did. A model
    whose attention soft-caps its logits or has attention sinks (Gemma 2, gpt-oss) keeps its own: it
    has no ragged pass either, and verifies one pass per session."""
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "sinks", None):
        return False
    AttentionInterface.register(ATTENTION_NAME, _hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    return True


def row_invariant(kernel, in_features: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> bool:
    """Whether ``kernel`` (rows ``[n, in_features]`` to ``[n, out]``) gives every row the bits it gets
    alone at each row count of ``PROBE_ROWS``. Every row is compared, not only the first: in bf16 a
    reordered float32 sum changes the rounded output only now and then."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max(PROBE_ROWS), in_features, generator=gen).to(device, dtype)
    with torch.inference_mode():
        alone = torch.cat([kernel(x[r : r + 1]) for r in range(len(x))])  # [R, out]
        return all(torch.equal(kernel(x[:rows]), alone[:rows]) for rows in PROBE_ROWS[1:])
