"""A compiled CPU kernel for batch-invariant attention over many sessions at once (``csrc/ragged_attention.cpp``).

The torch-op attention (``specdec.invariance``) keeps a row's bits by padding keys to whole blocks and
batching only where a probe found a kernel row-invariant; on a CPU it spends most of its time on
dispatching its many small ops (about 230 us a layer for one session's one row on the default target)
and, for a batch of sessions, on copying every session's keys into one padded block. This kernel
computes each (row, key head) as its own work item straight from the sessions' cache buffers: no
padding, no copy, one call a layer for every session, chains and token trees alike. Each
item's arithmetic is fixed (scores in key order, a float32 softmax, values summed in key order), so a
position gets the same bits alone, in a chain, as a tree node or beside other sessions, by construction.

torch builds it on first use for the CPU it runs on (``specdec.native``, ~30 s, then cached). Where it
cannot be built (no compiler), off the CPU, and where a gradient or autocast's mixed dtypes are
involved (training a draft), attention runs on torch ops (``specdec.invariance``), with the same
invariance. A process builds it once, so its passes and its reference forward compute alike.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from specdec.native import build


@functools.cache
def attention_kernel() -> ModuleType | None:
    """The built kernel module, or None where it cannot be built (logged once). Loading it also
    registers ``torch.ops.specdec_attention.layer_attention``, the op a compiled pass calls at each
    layer (``specdec.compiled``), which reads the pass's caches from the kernel's ``set_pass``."""
    kernel = build("specdec_ragged_attention", "ragged_attention.cpp")
    if kernel is not None:
        torch.library.register_fake("specdec_attention::layer_attention")(_layer_attention_shape)
    return kernel


def _layer_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runner: int, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[2], q.shape[1] * q.shape[3])


def kernel_applies(q: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether attention over ``q`` (and keys, values ``others``) runs on the kernel: CPU tensors of one
    dtype, none needing a gradient (the kernel has no backward: training attends on torch ops), and
    the kernel built."""
    tensors = (q, *others)
    return (
        all(t.device.type == "cpu" and t.dtype == q.dtype and not t.requires_grad for t in tensors)
        and attention_kernel() is not None
    )


def ragged_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    bounds: list[int],
    masks: list[torch.Tensor | None],
    scale: float,
    lengths: list[int] | None = None,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """Attention of rows ``q [N, Hq, hd]``: session i's rows ``bounds[i] .. bounds[i + 1]`` over the first
    ``lengths[i]`` (by default all) of its keys and values ``[1, Hkv, C_i, hd]``, its new rows' included,
    under ``masks[i]`` (bool ``[n_i, lengths[i]]``, True: attend) or None (causal: its rows are the last
    of its keys). ``new``: the rows' keys and values ``[1, Hkv, N, hd]``, written first into each
    session's buffers at its last ``n_i`` positions (a cache's ``GrowableLayer.claim``). Returns
    ``[rows or N, Hq hd]`` in ``q``'s dtype; rows past ``N`` are zeros (a compiled pass's padding)."""
    kernel = attention_kernel()
    assert kernel is not None, "kernel_applies() first"
    total = q.shape[0] if rows is None else rows
    out = (torch.empty if total == q.shape[0] else torch.zeros)(total, q.shape[1] * q.shape[2], dtype=q.dtype)
    lengths = [k.shape[2] for k in keys] if lengths is None else lengths
    masks = [None if m is None else m.contiguous() for m in masks]
    new_keys, new_values = new if new is not None else (None, None)
    kernel.ragged_attention(q, keys, values, bounds, lengths, masks, scale, out, new_keys, new_values)
    return out
