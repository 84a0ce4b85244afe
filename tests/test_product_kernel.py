"""The compiled bf16 product kernel (``specdec.product_kernel``): right numbers, and each row's bits its own."""

from __future__ import annotations

import pytest
import torch

from specdec.packed_linear import PackedLinear, RowProduct, invariant_product
from specdec.product_kernel import pack, product, product_kernel, weight_slot

pytestmark = pytest.mark.skipif(product_kernel() is None, reason="no compiler, or a CPU without AVX-512 BF16")

# Output and input counts: whole blocks and pairs, a ragged last block, an odd input count, the
# default target's MLP shape.
SHAPES = [(64, 32), (37, 51), (100, 130), (576, 1536)]


def _weights(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape[0], generator=gen).bfloat16()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_product_is_the_float_product_rounded_to_bf16(shape):
    weight, bias = _weights(shape, 0)
    x = torch.randn(11, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    got = RowProduct(weight, bias)(x)
    want = x.float() @ weight.float().T + bias.float()  # [11, out]
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # A float32 sum in another order, then one bf16 rounding: within a bf16 step of the exact value.
    torch.testing.assert_close(got.float(), want, atol=1e-3 * shape[1] ** 0.5, rtol=2**-7)
    # And as close as oneDNN's bf16 product, which rounds the same way.
    theirs = PackedLinear(weight, bias)(x).float()
    assert (got.float() - want).abs().max() <= 2 * (theirs - want).abs().max() + 1e-6


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_row_gets_the_same_bits_at_every_row_count_and_place(shape):
    weight, bias = _weights(shape, 2)
    packed = pack(weight)
    x = torch.randn(21, shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    alone = torch.cat([product(x[r : r + 1], packed, bias.float(), shape[0]) for r in range(len(x))])
    for rows in range(2, len(x) + 1):  # tiles of 8 rows, and every remainder
        assert torch.equal(product(x[:rows], packed, bias.float(), shape[0]), alone[:rows]), rows
    shifted = product(x[5:], packed, bias.float(), shape[0])  # row r now sits in another tile slot
    assert torch.equal(shifted, alone[5:])


def test_threads_do_not_change_bits():
    weight, _ = _weights((200, 96), 4)
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(5)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = RowProduct(weight)(x)
        torch.set_num_threads(2)
        two = RowProduct(weight)(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_inputs_are_refused():
    weight, _ = _weights((64, 32), 6)
    packed = pack(weight)
    with pytest.raises(RuntimeError, match="inputs"):
        product(torch.zeros(2, 30, dtype=torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        product(torch.zeros(2, 32), packed, None, 64)
    with pytest.raises(RuntimeError, match="n does not match"):
        product(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None, 20)
    with pytest.raises(RuntimeError, match="bias"):
        product(torch.zeros(2, 32, dtype=torch.bfloat16), packed, torch.zeros(64, dtype=torch.bfloat16), 64)


def test_the_slot_op_is_the_product_of_the_weight_in_its_slot():
    """``specdec_kernels::row_product``, the op a compiled graph calls: any leading shape, the bits of
    ``product``; a slot that holds nothing, or another output count, is refused."""
    weight, bias = _weights((100, 130), 7)
    packed, float_bias = pack(weight), bias.float()
    slot = weight_slot(packed, float_bias, 100)
    other = weight_slot(pack(weight[:64, :]), None, 64)
    x = torch.randn(2, 3, 130).bfloat16()
    got = torch.ops.specdec_kernels.row_product(x, slot, 100)
    assert got.shape == (2, 3, 100)
    assert torch.equal(got.reshape(6, 100), product(x.reshape(6, 130), packed, float_bias, 100))
    assert torch.equal(
        torch.ops.specdec_kernels.row_product(x, other, 64).reshape(6, 64),
        product(x.reshape(6, 130), pack(weight[:64, :]), None, 64),
    )
    with pytest.raises(RuntimeError, match="no weight in slot"):
        torch.ops.specdec_kernels.row_product(x, other + 1000, 64)
    with pytest.raises(RuntimeError, match="has 100 outputs, not 64"):
        torch.ops.specdec_kernels.row_product(x, slot, 64)


def test_bf16_products_take_the_kernel_and_float32_keeps_onednn():
    weight, bias = _weights((96, 64), 7)
    assert isinstance(invariant_product(weight, bias), RowProduct)
    assert not isinstance(invariant_product(weight.float(), bias.float()), RowProduct)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_streamed_product_has_the_bits_of_a_cached_one(shape):
    """The non-temporal prefetch of a streamed weight changes how it is read, never a sum: the same
    bits by ``product``, by ``RowProduct`` and through the slot op, at every tile's row count."""
    weight, bias = _weights(shape, 8)
    packed, float_bias = pack(weight), bias.float()
    x = torch.randn(19, shape[1], generator=torch.Generator().manual_seed(9)).bfloat16()
    for rows in (1, 2, 8, 9, 19):
        cached = product(x[:rows], packed, float_bias, shape[0])
        assert torch.equal(product(x[:rows], packed, float_bias, shape[0], stream=True), cached), rows
    streamed = RowProduct(weight, bias, stream=True)
    assert torch.equal(streamed(x), RowProduct(weight, bias)(x))
    slot = streamed.slot()
    assert torch.equal(torch.ops.specdec_kernels.row_product(x, slot, shape[0]), streamed(x))
