"""The compiled attention kernel (``specdec.attention_kernel``): right numbers, and each row's bits its own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from specdec.attention_kernel import attention_kernel, ragged_attention
from specdec.kvcache import GrowableCache

pytestmark = pytest.mark.skipif(attention_kernel() is None, reason="no C++ compiler to build the kernel")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference: rows ``q [n, Hq, hd]`` over ``k``, ``v`` ``[1, Hkv, T, hd]``; returns ``[n, Hq hd]``."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), k.float(), v.float(), attn_mask=mask, scale=0.3, enable_gqa=True
    )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sessions_of_different_lengths_match_sdpa(dtype):
    gen = torch.Generator().manual_seed(0)
    lengths, rows = [7, 40, 1], [3, 5, 1]
    # Keys as a cache holds them: views of the valid prefix of a longer buffer.
    keys = [torch.randn(1, 2, 64, 16, generator=gen).to(dtype)[:, :, :t] for t in lengths]
    values = [torch.randn(1, 2, 64, 16, generator=gen).to(dtype)[:, :, :t] for t in lengths]
    q = torch.randn(sum(rows), 6, 16, generator=gen).to(dtype)
    bounds = [0, 3, 8, 9]
    out = ragged_attention(q, keys, values, bounds, [None] * 3, 0.3)
    for i, (t, n) in enumerate(zip(lengths, rows)):
        causal = torch.arange(t)[None, :] <= torch.arange(t - n, t)[:, None]
        want = _sdpa(q[bounds[i] : bounds[i + 1]], keys[i], values[i], causal)
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out[bounds[i] : bounds[i + 1]].float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_keeps_its_bits_alone_in_a_chain_in_a_tree_and_beside_others(dtype):
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 3, 50, 64, generator=gen).to(dtype), torch.randn(1, 3, 50, 64, generator=gen).to(dtype)
    q = torch.randn(6, 9, 64, generator=gen).to(dtype)
    alone = ragged_attention(q[:1], [k[:, :, :45]], [v[:, :, :45]], [0, 1], [None], 0.125)
    chain = ragged_attention(q[:5], [k[:, :, :49]], [v[:, :, :49]], [0, 5], [None], 0.125)
    assert torch.equal(chain[:1], alone)
    # A tree node at position 47 whose parent is at 44 sees keys 0..44 and itself, not 45 and 46.
    tree_mask = torch.zeros(3, 48, dtype=torch.bool)
    tree_mask[:, :45] = True
    tree_mask[0, 45:] = False
    tree_mask[2, 47] = True
    tree_k = k[:, :, :48].clone()
    tree_k[:, :, 47] = k[:, :, 45]  # the node's own key, as a chain at position 45 computed it
    tree_v = v[:, :, :48].clone()
    tree_v[:, :, 47] = v[:, :, 45]
    node = ragged_attention(q[[0, 1, 1]], [tree_k], [tree_v], [0, 3], [tree_mask], 0.125)
    second = ragged_attention(q[1:2], [k[:, :, :46]], [v[:, :, :46]], [0, 1], [None], 0.125)
    assert torch.equal(node[2:3], second)
    rows = torch.cat([q[3:6], q[:1]])
    keys, values = [k[:, :, :20], k[:, :, :45]], [v[:, :, :20], v[:, :, :45]]
    beside = ragged_attention(rows, keys, values, [0, 3, 4], [None] * 2, 0.125)
    assert torch.equal(beside[3:], alone)


def test_bad_shapes_are_refused_not_read_past():
    q = torch.randn(2, 4, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="mask"):
        ragged_attention(q, [k], [k], [0, 2], [torch.ones(2, 4, dtype=torch.bool)], 1.0)
    with pytest.raises(RuntimeError, match="rows among its keys"):
        ragged_attention(torch.randn(7, 4, 8), [k], [k], [0, 7], [None], 1.0)


def test_new_rows_are_written_into_claimed_cache_room_then_attended():
    """The pass's path: each session claims room in its cache layer, the kernel writes the rows' keys and
    values there and attends, as growing the cache first and attending after does."""
    gen = torch.Generator().manual_seed(3)
    pasts, rows = [5, 300], [2, 1]  # the second session's buffer must double past 256
    written, grown = [GrowableCache() for _ in pasts], [GrowableCache() for _ in pasts]
    for cache_a, cache_b, past in zip(written, grown, pasts):
        k, v = torch.randn(1, 2, past, 16, generator=gen), torch.randn(1, 2, past, 16, generator=gen)
        cache_a.update(k, v, 0)
        cache_b.update(k, v, 0)
    q = torch.randn(3, 4, 16, generator=gen)
    new_k, new_v = torch.randn(1, 2, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen)
    claims = [cache.layer(0).claim(new_k, n) for cache, n in zip(written, rows)]
    got = ragged_attention(
        q,
        [c[0] for c in claims],
        [c[1] for c in claims],
        [0, 2, 3],
        [None, None],
        0.25,
        lengths=[start + n for (_, _, start), n in zip(claims, rows)],
        new=(new_k, new_v),
        rows=5,
    )
    views = [
        cache.update(new_k[:, :, lo:hi], new_v[:, :, lo:hi], 0) for cache, (lo, hi) in zip(grown, [(0, 2), (2, 3)])
    ]
    want = ragged_attention(q, [w[0] for w in views], [w[1] for w in views], [0, 2, 3], [None, None], 0.25)
    assert torch.equal(got[:3], want) and torch.equal(got[3:], torch.zeros(2, 64))
    for cache_a, cache_b in zip(written, grown):
        assert torch.equal(cache_a.layers[0].keys, cache_b.layers[0].keys)
        assert torch.equal(cache_a.layers[0].values, cache_b.layers[0].values)


def test_attention_that_needs_a_gradient_or_mixes_dtypes_runs_on_torch_ops():
    """The kernel has no backward and takes one dtype: training, and mixed inputs under autocast (a
    bf16 draft's training step), attend on torch ops."""
    from specdec.invariance import invariant_attention

    q = torch.randn(1, 4, 3, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    invariant_attention(q, k, v, None, 0.3).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = invariant_attention(q.detach(), k.bfloat16(), v.bfloat16(), None, 0.3)
    assert torch.isfinite(mixed).all()


def test_the_layer_op_needs_its_pass_handed_over_on_its_thread():
    """``specdec_attention::layer_attention`` (a compiled pass's op) reads what ``set_pass`` handed over
    for its runner on this thread; on another thread, with nothing handed over, or after
    ``clear_pass``, it refuses."""
    kernel = attention_kernel()
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16)
    cache = GrowableCache().layer(0)
    keys, values, start = cache.claim(k, 2)
    kernel.set_pass(987, [[keys]], [[values]], [0, 2], [start + 2], [[None]], [0.25])
    out = torch.ops.specdec_attention.layer_attention(q, k, k, 987, 0)
    want = ragged_attention(q[0].transpose(0, 1), [keys], [values], [0, 2], [None], 0.25, lengths=[start + 2])
    assert torch.equal(out, want)
    with ThreadPoolExecutor(1) as other:  # a compile beside serving keeps its passes apart
        elsewhere = other.submit(torch.ops.specdec_attention.layer_attention, q, k, k, 987, 0)
        with pytest.raises(RuntimeError, match="no pass in progress"):
            elsewhere.result()
    kernel.clear_pass(987)
    with pytest.raises(RuntimeError, match="no pass in progress"):
        torch.ops.specdec_attention.layer_attention(q, k, k, 987, 0)
    with pytest.raises(RuntimeError, match="no pass in progress"):
        torch.ops.specdec_attention.layer_attention(q, k, k, 988, 0)
