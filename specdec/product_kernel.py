"""A compiled CPU kernel for row-invariant bf16 weight products (``csrc/row_product.cpp``).

A verify pass multiplies a few rows (one to a few dozen) by every weight of the model once, so its
time is the time to read the weights. oneDNN's bf16 kernels read them at about half the rate this
kernel reaches for such skinny products (about 17 against 31 GB/s for one row on the 2-core
development CPU), and keep a row's bits at every row count only from two rows on. This kernel
streams weights packed once into contiguous blocks, shares each load among up to eight rows, and
accumulates each (row, output) in one fixed chain of AVX-512 BF16 dot-product instructions, so a row
gets the same bits alone, in a chain, in a tree or beside other sessions, by construction.

It is built for CPUs with AVX-512 BF16 (``specdec.native``); elsewhere, and where it cannot be built,
``specdec.packed_linear`` keeps oneDNN's kernels.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from specdec.native import build


@functools.cache
def product_kernel() -> ModuleType | None:
    """The built kernel module where it computes on this CPU (AVX-512 BF16), else None. Loading it
    also registers the ``specdec_kernels::row_product`` op (see ``weight_slot``)."""
    kernel = build("specdec_row_product", "row_product.cpp")
    if kernel is None or not kernel.supported():
        return None
    torch.library.register_fake("specdec_kernels::row_product")(_row_product_shape)
    return kernel


def _row_product_shape(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (bf16) in the kernel's blocked layout (a copy)."""
    kernel = product_kernel()
    assert kernel is not None, "product_kernel() first"
    return kernel.pack(weight.detach().contiguous())


def weight_slot(packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, stream: bool = False) -> int:
    """Keeps a ``pack``-ed weight (and its float32 bias) for the lifetime of the process, for
    ``torch.ops.specdec_kernels.row_product(x [..., in], slot, out_features)``: the same product as
    ``product`` (``stream`` as there), which a compiled graph calls through the dispatcher with no
    Python in between (a pass makes about 120 such calls; a Python op spends several microseconds on
    each)."""
    kernel = product_kernel()
    assert kernel is not None, "product_kernel() first"
    return kernel.add_slot(packed, bias, out_features, stream)


def product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, stream: bool = False
) -> torch.Tensor:
    """Rows ``x [M, K]`` (bf16) times a ``pack``-ed weight of ``out_features`` outputs, plus ``bias``
    (float32 ``[out_features]`` or None): ``[M, out_features]`` bf16. ``stream``: read the weight with
    the non-temporal prefetch hint, for a model whose weights outgrow the last-level cache (the same
    bits; ``specdec.packed_linear.pack_linears`` decides)."""
    kernel = product_kernel()
    assert kernel is not None, "product_kernel() first"
    return kernel.product(x.contiguous(), packed, bias, out_features, stream)
