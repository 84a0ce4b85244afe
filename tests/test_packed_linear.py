"""Prepacked oneDNN linear layers compute what nn.Linear computes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from specdec.packed_linear import (
    FusedProjections,
    PackedLinear,
    ProjectionSlice,
    RowProduct,
    pack_linears,
    packing_available,
    streams_weights,
)
from specdec.product_kernel import product_kernel

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(1, rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        got = PackedLinear.of(linear)(x)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_packed_model_gives_same_greedy_tokens(tiny_target):
    packed = copy.deepcopy(tiny_target.model)
    assert pack_linears(packed) == 2 * 7 + 1  # 2 layers × (q, k, v, o, gate, up, down) + lm_head
    ids = torch.tensor([[3, 4, 5, 9, 10]])
    with torch.inference_mode():
        plain = tiny_target.model.generate(ids, max_new_tokens=30, do_sample=False)
        fast = packed.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.allclose(tiny_target.model(ids).logits, packed(ids).logits, atol=1e-4)
    assert torch.equal(plain, fast)


def _packed_unfused(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.of(child))
    return model


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_fused_projections_change_no_bit_of_the_logits(tiny_target, rows):
    fused = copy.deepcopy(tiny_target.model)
    pack_linears(fused)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(attn.k_proj, ProjectionSlice) and attn.k_proj.fused is attn.q_proj.fused
    assert isinstance(mlp.up_proj, ProjectionSlice) and isinstance(mlp.down_proj, PackedLinear)
    ids = torch.arange(3, 3 + rows)[None]
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, _packed_unfused(tiny_target.model)(ids).logits)


def test_fused_projections_hold_no_activation_after_a_pass(tiny_target):
    fused = copy.deepcopy(tiny_target.model)
    pack_linears(fused)
    with torch.inference_mode():
        fused(torch.tensor([[3, 4, 5]]))
    assert all(m._input is None for m in fused.modules() if hasattr(m, "_input"))


@pytest.mark.parametrize("biases", [(True, True, True), (True, False, True)], ids=["all", "mixed"])
def test_fused_projections_with_biases_match_each_layer(biases):
    """Models with projection biases (Qwen's q/k/v): a layer without one gets zeros in the product."""
    torch.manual_seed(1)
    layers = [nn.Linear(48, n, bias=b) for n, b in zip((48, 16, 16), biases)]
    fused = FusedProjections(layers)
    x = torch.randn(1, 3, 48)
    with torch.inference_mode():
        for index, layer in enumerate(layers):
            torch.testing.assert_close(fused.part(x, index), layer(x), rtol=1e-5, atol=1e-5)


_KERNEL_SWEEP = """
import ctypes, sys
import torch
from torch import nn
import specdec.packed_linear as packed

torch.set_num_threads(1)
packed.KERNEL_CACHE_ENTRIES = int(sys.argv[1])
libc = ctypes.CDLL("libc.so.6")


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


libc.mallinfo2.restype = Mallinfo2  # uordblks: heap bytes in use
model = nn.Sequential(nn.Linear(32, 96), nn.Linear(96, 32), nn.Linear(32, 128), nn.Linear(128, 64))
packed.pack_linears(model)
with torch.inference_mode():
    model(torch.randn(1, 32))
    before = libc.mallinfo2().uordblks
    for rows in range(1, 101):  # 400 shapes: 100 row counts of 4 weights
        model(torch.randn(rows, 32))
print((libc.mallinfo2().uordblks - before) / 2**20)
"""


def _kernel_sweep_mib(entries: int, env: dict[str, str]) -> float:
    """Heap bytes (MiB) still in use after a fresh process's packed layers met 400 (weight, rows) shapes."""
    clean = {k: v for k, v in os.environ.items() if "CACHE_CAPACITY" not in k}
    out = subprocess.run(
        [sys.executable, "-c", _KERNEL_SWEEP, str(entries)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures glibc's heap (mallinfo2)")
def test_kernel_caches_are_bounded_whatever_row_counts_the_passes_feed():
    """oneDNN keeps a kernel per (weight shape, rows) it meets; batched passes feed ever new row
    counts, so unbounded (1024 entries per cache by default) the kernels alone kept a served target
    growing. Packing caps both caches; an operator's own capacity still wins."""
    capped = _kernel_sweep_mib(16, {})
    uncapped = _kernel_sweep_mib(16, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"})
    assert capped < 40 < uncapped, (capped, uncapped)


def test_a_model_streams_its_weights_only_when_they_outgrow_the_last_level_cache():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64)).to(torch.bfloat16)  # 8 KiB of weights
    assert streams_weights(model, 4 * 1024) and not streams_weights(model, 8 * 1024)
    assert not streams_weights(model, None)  # a host that does not say keeps the plain reads
    if product_kernel() is None:
        return
    streamed = copy.deepcopy(model)
    pack_linears(streamed, stream=True)
    pack_linears(model, stream=False)
    assert all(isinstance(m, RowProduct) and m.stream for m in streamed)
    assert all(isinstance(m, RowProduct) and not m.stream for m in model)
