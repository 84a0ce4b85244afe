"""Batch invariance: a position scores to the same bits alone, in a chain, in a tree, or beside other
sessions, in bf16 and fp32; and the check fails on kernels that lack it (SDPA, a batch-coupled linear)."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import specdec.invariance as invariance
import specdec.ragged
from specdec.invariance import KEY_BLOCK, has_gaps, invariant_attention, row_invariant
from specdec.kvcache import GrowableCache
from specdec.models import load_model
from specdec.packed_linear import SplitPackedLinear, pack_linears
from specdec.ragged import RaggedItem, ragged_forward, row_groups

TOKEN, OTHER = 7, 9


Forward = Callable[[list[RaggedItem]], tuple[list[torch.Tensor], list[torch.Tensor]]]


def _cache(model, prompt: list[int], forward: Forward | None = None) -> GrowableCache:
    cache = GrowableCache()
    (forward or functools.partial(ragged_forward, model))([RaggedItem(cache, prompt, 1)])
    return cache


def _first_row(forward: Forward, cache: GrowableCache, item_of) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and hidden state of the first fed row of ``cache``'s item in a pass built by ``item_of``;
    the cache is cropped back afterwards."""
    before = cache.get_seq_length()
    items, index = item_of(cache)
    logits, hidden = forward(items)
    fed = len(items[index].tokens)
    cache.crop(-(cache.get_seq_length() - before))
    return logits[index][-fed], hidden[index][0]


def invariance_failures(model, past: int, forward: Forward | None = None) -> list[str]:
    """Which ways of feeding TOKEN after ``past`` prompt tokens change its logits or hidden state
    from those of TOKEN fed alone, in ``model``'s ragged pass (or through ``forward``, a compiled one)."""
    forward = forward or functools.partial(ragged_forward, model)
    vocab = model.config.vocab_size
    prompt = [(3 + 5 * i) % vocab for i in range(past)]
    cache = _cache(model, prompt, forward)
    others = [_cache(model, prompt[: 5 + 37 * i], forward) for i in range(3)]

    def alone(c):
        return [RaggedItem(c, [TOKEN], 1)], 0

    def chain(k):
        return lambda c: ([RaggedItem(c, [TOKEN] + [OTHER] * k, k + 1)], 0)

    def tree(c):  # TOKEN is the root; two children, each with a child
        return [RaggedItem(c, [TOKEN, OTHER, 4, 5, 6], 5, parents=(-1, 0, 0, 1, 2))], 0

    def beside(c):
        rows = [[3, 4], [5] * 9, [1]]
        items = [RaggedItem(o, r, len(r)) for o, r in zip(others, rows)]
        return items[:1] + [RaggedItem(c, [TOKEN, OTHER, OTHER], 3)] + items[1:], 1

    def beside_a_prompt(c):  # one row beside a prompt's 40 and another one-row session: two attention calls
        items = [RaggedItem(others[0], [7] * 40, 1), RaggedItem(c, [TOKEN], 1), RaggedItem(others[1], [2], 1)]
        return items, 1

    want_logits, want_hidden = _first_row(forward, cache, alone)
    ways = {f"chain of {k + 1}": chain(k) for k in (1, 2, 4, 7, 15, 32)} | {"tree": tree, "beside 3 sessions": beside}
    ways["beside a prompt"] = beside_a_prompt
    failures = []
    for name, way in ways.items():
        logits, hidden = _first_row(forward, cache, way)
        if not (torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)):
            failures.append(name)
    return failures


@pytest.fixture(params=["kernel", "torch-ops"])
def attention(request, monkeypatch):
    """Runs a test on the compiled attention kernel, then on the torch-op attention (GPUs, no compiler)."""
    if request.param == "torch-ops":
        for module in (specdec.ragged, invariance):
            monkeypatch.setattr(module, "kernel_applies", lambda *tensors: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("past", [20, KEY_BLOCK - 3])  # the second: chains cross a key block
def test_the_tiny_pass_is_batch_invariant(tiny_dir, dtype, past, attention):
    loaded = load_model(str(tiny_dir / "target"), tiny_dir, dtype=dtype, pack=True)
    assert invariance_failures(loaded.model, past) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_default_targets_pass_is_batch_invariant(dtype, attention):
    model = _default(dtype)  # packed, as the target service runs it
    assert invariance_failures(model, KEY_BLOCK - 3) == []


def _default(dtype: torch.dtype):
    return load_model("default", Path.home() / ".cache" / "specdec", dtype=dtype, pack=True).model


def _sdpa_rows(q, keys, values, bounds, masks, scale, lengths=None, new=None, rows=None):
    """``specdec.attention_kernel.ragged_attention``'s contract on SDPA, one session at a time."""
    lengths = lengths or [k.shape[2] for k in keys]
    outs = []
    for (lo, hi), k, v, length, mask in zip(itertools.pairwise(bounds), keys, values, lengths, masks):
        if new is not None:  # the rows' keys and values go into the session's buffers first
            k[:, :, length - (hi - lo) : length] = new[0][:, :, lo:hi]
            v[:, :, length - (hi - lo) : length] = new[1][:, :, lo:hi]
        k, v = k[:, :, :length], v[:, :, :length]
        if mask is None:
            mask = torch.arange(length)[None, :] <= torch.arange(length - (hi - lo), length)[:, None]
        block = q[lo:hi].transpose(0, 1)[None]  # [1, Hq, n, hd]
        out = F.scaled_dot_product_attention(block, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1).reshape(hi - lo, -1))
    out = torch.cat(outs)
    return F.pad(out, (0, 0, 0, (rows or len(out)) - len(out)))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch-ops"])
def test_the_check_fails_with_sdpa_in_place_of_the_invariant_attention(monkeypatch, kernel):
    """SDPA's CPU kernel changes a row's bits once a chain has 8 or more rows: the check must see it,
    on the packed bf16 default target, whose linears alone keep every row's bits."""
    model = _default(torch.bfloat16)
    if kernel:
        monkeypatch.setattr(specdec.ragged, "ragged_attention", _sdpa_rows)
    else:

        def sdpa(q, k, v, mask, scale, gaps=False):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        monkeypatch.setattr(specdec.ragged, "kernel_applies", lambda *tensors: False)
        monkeypatch.setattr(specdec.ragged, "invariant_attention", sdpa)
    assert invariance_failures(model, KEY_BLOCK - 3) != []


class _BatchCoupled(torch.nn.Module):
    """A linear layer plus a trace of the mean over every row of its input: rows see each other."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + 1e-3 * x.mean(dim=-2, keepdim=True)[..., : self.linear.out_features]


def test_the_check_fails_with_a_linear_whose_rows_see_each_other(tiny_dir):
    """A kernel that lets a row's result depend on the batch (here by a reduction over all rows) fails."""
    loaded = load_model(str(tiny_dir / "target"), tiny_dir, dtype=torch.float32)
    model = copy.deepcopy(loaded.model)
    model.model.layers[0].mlp.down_proj = _BatchCoupled(model.model.layers[0].mlp.down_proj)
    assert invariance_failures(model, 20) != []


def test_the_row_probe_tells_invariant_kernels_from_batch_coupled_ones():
    weight = torch.randn(64, 48)
    assert not row_invariant(lambda x: x @ weight.T + x.sum(0)[:64].mean(), 48, torch.float32)
    assert row_invariant(lambda x: torch.stack([r @ weight.T for r in x]), 48, torch.float32)


def test_packing_keeps_only_invariant_kernels(tiny_dir):
    """Every kernel ``pack_linears`` leaves in a model passes the row probe."""
    for dtype in (torch.bfloat16, torch.float32):
        loaded = load_model(str(tiny_dir / "target"), tiny_dir, dtype=dtype)
        pack_linears(loaded.model)
        for module in loaded.model.modules():
            product = getattr(module, "product", None) or (module if isinstance(module, SplitPackedLinear) else None)
            if product is not None:
                assert row_invariant(product, product.in_features, dtype)


def test_attention_rows_keep_their_bits_across_query_and_key_counts():
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 6, 20, 16, generator=gen).to(dtype)
        k = torch.randn(1, 2, 2 * KEY_BLOCK + 40, 16, generator=gen).to(dtype)
        v = torch.randn_like(k)
        for past in (10, KEY_BLOCK - 2, 2 * KEY_BLOCK - 1):
            alone = invariant_attention(q[:, :, :1], k[:, :, : past + 1], v[:, :, : past + 1], None, 0.25)
            for rows in (2, 9, 20):
                out = invariant_attention(q[:, :, :rows], k[:, :, : past + rows], v[:, :, : past + rows], None, 0.25)
                assert torch.equal(out[:, :, :1], alone), (dtype, past, rows)


def test_attention_matches_sdpa_up_to_rounding():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 6, 5, 16, generator=gen)
    k, v = torch.randn(1, 2, 30, 16, generator=gen), torch.randn(1, 2, 30, 16, generator=gen)
    mask = torch.arange(30)[None, :] <= torch.arange(25, 30)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(invariant_attention(q, k, v, mask, 0.25), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(invariant_attention(q, k, v, None, 0.25), want, atol=1e-5, rtol=1e-5)


def test_a_left_padded_batch_through_transformers_stays_finite_and_close_to_each_row_alone(tiny_dir):
    """Padding rows see no key; they must not turn into NaN keys that poison the real rows."""
    model = load_model(str(tiny_dir / "target"), tiny_dir, dtype=torch.float32).model
    short, full = [3, 4, 5], [6, 7, 8, 9, 10, 11]
    ids = torch.tensor([[0] * 3 + short, full])
    mask = torch.tensor([[0] * 3 + [1] * 3, [1] * 6])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        batched = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        alone = [model(input_ids=torch.tensor([p])).logits[0, -1] for p in (short, full)]
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched, torch.stack(alone), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("past", [20, KEY_BLOCK + 17])
def test_a_tree_node_scores_as_the_same_path_does_as_a_chain(tiny_dir, dtype, past):
    """The root, then two children of it, the first with a child: that grandchild sees the root and its
    parent but not its parent's sibling, one hidden key between visible ones. Its logits and hidden
    state must be those of the same path fed as a chain (the case that once slipped past the check
    for gaps)."""
    model = load_model(str(tiny_dir / "target"), tiny_dir, dtype=dtype, pack=True).model
    vocab = model.config.vocab_size
    cache = _cache(model, [(3 + 5 * i) % vocab for i in range(past)])
    tree_logits, tree_hidden = ragged_forward(model, [RaggedItem(cache, [TOKEN, 3, 4, 5], 4, parents=(-1, -1, 0))])
    cache.crop(-4)
    chain_logits, chain_hidden = ragged_forward(model, [RaggedItem(cache, [TOKEN, 3, 5], 3)])
    assert torch.equal(tree_logits[0][3], chain_logits[0][2]) and torch.equal(tree_hidden[0][3], chain_hidden[0][2])
    assert torch.equal(tree_logits[0][1], chain_logits[0][1])


def test_sessions_attend_in_calls_of_like_row_counts():
    """A prompt's rows never pad the one-row sessions beside it; tree sessions attend on their own."""
    assert row_groups([1, 1, 5, 50, 4, 1, 64, 65], [False] * 4 + [True] + [False] * 3) == [[0, 1, 5], [2], [3, 6], [7]]
    assert row_groups([3], [True]) == []


def test_has_gaps_tells_a_tree_row_from_a_chain_or_a_window():
    rows = torch.tensor
    assert has_gaps(rows([[True, True, True, False, True]]))  # sees all but its parent's sibling
    assert not has_gaps(rows([[True, True, True, False, False], [True, True, True, True, False]]))  # causal
    assert not has_gaps(rows([[False, True, True, True, False]]))  # a sliding window
    assert not has_gaps(None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tree_rows_attend_alike_in_one_batched_call_and_one_call_each(tiny_dir, dtype, monkeypatch):
    """A tree's rows attend to their gathered keys in one batched product where the probe allows it;
    the bits are those of one product per row (the path taken where it does not)."""
    model = load_model(str(tiny_dir / "target"), tiny_dir, dtype=dtype, pack=True).model
    cache = _cache(model, [(3 + 5 * i) % model.config.vocab_size for i in range(KEY_BLOCK - 2)])
    parents = (-1, -1, 0, 0, 1, 2, 4)  # crosses a key block: rows see different numbers of blocks

    def tree_logits() -> torch.Tensor:
        logits, _ = ragged_forward(model, [RaggedItem(cache, [TOKEN, 3, 4, 5, 6, 7, 8, 9], 8, parents=parents)])
        cache.crop(-8)
        return logits[0]

    assert invariance.batched_entries_invariant(dtype)
    batched = tree_logits()
    monkeypatch.setattr(invariance, "batched_entries_invariant", lambda *args: False)
    assert torch.equal(tree_logits(), batched)
