"""Linear layers with oneDNN-prepacked weights, so verifying k+1 tokens costs little more than one.

On CPU, ``torch.nn.functional.linear`` runs MKL's GEMM for more than one row, and for the skinny
shapes of a verify pass (2 to 9 rows) it costs up to twice a one-row GEMV. oneDNN with the weight
reordered once into its blocked layout grows far less with the number of rows, which is what
makes speculation pay on a CPU.

Sibling projections that read the same input (an attention layer's q/k/v, with their biases where
a family has them, and a gated MLP's gate/up) are packed as one stacked weight; a family that fuses
them itself (Phi-3's ``qkv_proj`` and ``gate_up_proj``) has one linear layer each already. A decode
pass is about 200 small products whose fixed cost per call dominates at this size: on the 2-core
development CPU, 30 layers of fused products took 45 ms for one row where the 7 separate ones took
52 ms (and 57 against 65 ms for five rows).

The results equal plain ``linear`` up to float rounding (a different summation order), not
bit for bit; greedy decoding can differ only where the top two logits nearly tie. Fusing changed no
bit of them on the models tested (the default target at 1 to 100 rows, the tiny test models).

For bf16 on a CPU with AVX-512 BF16, specdec's own kernel (``RowProduct``, ``specdec.product_kernel``)
comes first: for the one to eight rows of a verify pass its products ran 1.7 to 2 times faster than
oneDNN's on the development CPU, and it keeps every row's bits by construction. oneDNN's kernels
serve float32 and other CPUs.

Every kernel must also be *row-invariant* (``specdec.invariance``): row 0's bits may not depend on
how many rows share the product. Which kernels are depends on the shape and the dtype: on the 2-core
development CPU, packed products over 576 inputs are, but a packed product over the MLP's 1536 inputs
is not (one row takes a kernel of its own), nor is plain fp32 ``linear`` (MKL) at
any shape, nor plain bf16 ``linear`` over 1536 inputs. So ``pack_linears`` probes, once per weight shape, the
packed kernel, then the packed kernel fed at least two rows (oneDNN's one-row kernel is the odd one
out), then the packed kernel with its reduction split into fixed chunks of at most ``SPLIT_INPUTS``
inputs summed in order, then the plain layer, and keeps the first that is invariant.

oneDNN compiles a kernel for each weight shape and number of rows it meets and keeps it in two
caches, its own primitive cache and ideep's, 1024 entries each by default. A batched pass feeds a
different number of rows nearly every time (1 to ``max_batch_rows``: the sessions' pending and draft
tokens, folded prompts), so a served model meets hundreds of shapes and keeps every kernel resident:
about 0.4 MiB each (the tiny test models' shapes and the default target's alike), 425 MiB for the
default target's four layer shapes at 1 to 256 rows. ``pack_linears`` therefore caps both caches at
``KERNEL_CACHE_ENTRIES``; a shape evicted and met again costs its kernel's compilation once per pass,
1 to 2 ms a shape on the 2-core development CPU, where the pass runs each shape once per layer.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from specdec.host import last_level_cache_bytes
from specdec.invariance import row_invariant
from specdec.product_kernel import pack, product, product_kernel, weight_slot

# Children of one module that read the same input, fused into one product when all are present.
SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Entries each of oneDNN's kernel caches keeps (see the module's docstring): a model has four or five
# packed weight shapes, so this holds 25 to 32 row counts of each.
KERNEL_CACHE_ENTRIES = 128
# Longest reduction a split packed product runs as one chunk: the default target's 576-input products
# are row-invariant packed, its 1536-input one is not.
SPLIT_INPUTS = 576
# The variables oneDNN (under either of its prefixes) and ideep read their cache's capacity from.
_KERNEL_CACHE_VARIABLES = (
    ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"),
    ("LRU_CACHE_CAPACITY",),
)


def bound_kernel_caches(entries: int | None = None) -> None:
    """Caps oneDNN's and ideep's kernel caches at ``entries`` (by default ``KERNEL_CACHE_ENTRIES``)
    each, where the environment sets no capacity of its own. Each cache reads its capacity when the
    process creates its first oneDNN primitive (a packed weight's reorder is one), so this must run
    before; later it changes nothing."""
    for names in _KERNEL_CACHE_VARIABLES:
        if not any(name in os.environ for name in names):
            os.environ[names[0]] = str(KERNEL_CACHE_ENTRIES if entries is None else entries)


def packing_available() -> bool:
    """True when this torch build has oneDNN's linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """An inference-only linear layer whose weight ``[out, in]`` lives in oneDNN's prepacked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        dtype = weight.dtype
        weight = weight.detach().contiguous()  # [out, in]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
        bias = None if bias is None else bias.detach().to(dtype).contiguous()
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        """The packed twin of ``linear``."""
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")  # [N, out]
        return out.reshape(*x.shape[:-1], self.out_features)


class PairedPackedLinear(PackedLinear):
    """A packed product that never runs one row alone: a lone row is doubled and half the result kept.

    oneDNN computes a single row with a matrix-vector kernel whose reduction order differs from the
    matrix kernel it runs from two rows on, which keeps every row's bits at any count of two or more
    (the default target's 1536-input product: row-invariant this way, and over twice as fast as
    splitting its reduction)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        if rows.shape[0] != 1:
            return super().forward(x)
        pair = rows.expand(2, -1).contiguous()  # [2, in]
        out = torch.ops.mkldnn._linear_pointwise(pair, self.packed_weight, self.bias, "none", [], "")[:1]
        return out.reshape(*x.shape[:-1], self.out_features)


class RowProduct(nn.Module):
    """An inference-only bf16 linear layer on specdec's own kernel (``specdec.product_kernel``): its
    weight ``[out, in]`` packed once into the kernel's blocks, its bias kept in float32. ``stream``:
    read the weight with the non-temporal hint (``pack_linears`` decides)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, stream: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.stream = stream
        self.register_buffer("packed_weight", pack(weight), persistent=False)
        bias = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)
        self._slot: int | None = None

    def slot(self) -> int:
        """This layer's weight slot for ``torch.ops.specdec_kernels.row_product``, taken on first use
        (``specdec.product_kernel.weight_slot``); it keeps the weight alive as long as the process."""
        if self._slot is None:
            self._slot = weight_slot(self.packed_weight, self.bias, self.out_features, self.stream)
        return self._slot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        out = product(rows, self.packed_weight, self.bias, self.out_features, self.stream)  # [N, out]
        return out.reshape(*x.shape[:-1], self.out_features)


class SplitPackedLinear(nn.Module):
    """A packed product whose reduction over the inputs runs in fixed chunks of at most
    ``SPLIT_INPUTS``, added in order: each chunk is a shape oneDNN blocks the same way at every row
    count, so the sum is row-invariant where one long reduction is not."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, chunk: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        chunk = chunk or SPLIT_INPUTS
        cuts = list(range(0, self.in_features, chunk))
        self.bounds = [(lo, min(lo + chunk, self.in_features)) for lo in cuts]
        self.parts = nn.ModuleList(PackedLinear(weight[:, lo:hi], bias if lo == 0 else None) for lo, hi in self.bounds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parts[0](x[..., : self.bounds[0][1]])
        for (lo, hi), part in zip(self.bounds[1:], self.parts[1:]):
            out = out + part(x[..., lo:hi])
        return out


def invariant_product(weight: torch.Tensor, bias: torch.Tensor | None, stream: bool = False) -> nn.Module | None:
    """The fastest row-invariant packed kernel for ``weight [out, in]`` (see the module docstring), or
    None when only a plain layer qualifies or none does (then the plain layer stays). ``stream``:
    specdec's own kernel reads the weight with the non-temporal hint (``pack_linears``)."""
    own = weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and product_kernel() is not None
    for kind in ((RowProduct,) if own else ()) + (PackedLinear, PairedPackedLinear, SplitPackedLinear):
        if kind is SplitPackedLinear and weight.shape[1] <= SPLIT_INPUTS:
            continue
        # specdec's own kernel is row-invariant by construction (``tests/test_product_kernel.py``): no
        # probe, whose random weight for the LM head alone takes a second of a service's start.
        if kind is RowProduct:
            return RowProduct(weight, bias, stream)
        if kernel_invariant(kind, tuple(weight.shape), bias is not None, weight.dtype):
            return kind(weight, bias)
    return None


@functools.cache
def kernel_invariant(kind: type[nn.Module], shape: tuple[int, int], bias: bool, dtype: torch.dtype) -> bool:
    """Whether packed kernel ``kind`` over a weight of ``shape [out, in]`` and ``dtype`` is row-invariant,
    probed once per process on a random weight of that shape."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).to(dtype)
    return row_invariant(kind(weight, torch.zeros(shape[0], dtype=dtype) if bias else None), shape[1], dtype)


class FusedProjections(nn.Module):
    """Several linear layers over the same input as one packed product, split per layer.

    It stands behind ``ProjectionSlice`` modules, so the model code that calls ``q_proj(x)``,
    ``k_proj(x)``, ``v_proj(x)`` stays unchanged: the first slice called with a new input runs the
    product, and the others take their part of it. That hand-over is not thread-safe: a model is run
    by one thread at a time, as each service runs its model on one worker thread (``CacheServicer``).
    """

    def __init__(self, linears: list[nn.Linear], product: nn.Module | None = None) -> None:
        """``product``: the kernel over the stacked weight (``stacked(linears)``); by default packed."""
        super().__init__()
        self.product = product if product is not None else PackedLinear(*stacked(linears))
        self.sizes = [lin.out_features for lin in linears]
        self._input: torch.Tensor | None = None
        self._parts: list[torch.Tensor | None] = []

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Output ``[..., sizes[index]]`` of projection ``index`` for input ``x``."""
        if self._input is not x or self._parts[index] is None:
            self._input, self._parts = x, list(self.product(x).split(self.sizes, dim=-1))
        out, self._parts[index] = self._parts[index], None
        if all(p is None for p in self._parts):
            self._input = None  # every part taken: hold no activations between passes
        return out


def stacked(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights ``[sum(out), in]`` of sibling linear layers stacked, and their biases (zeros for a
    layer without one; None when none has one)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out), in]
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat(
        [
            b.detach() if b is not None else torch.zeros(lin.out_features, dtype=weight.dtype)
            for b, lin in zip(biases, linears)
        ]
    )


class ProjectionSlice(nn.Module):
    """One projection of a ``FusedProjections``, in the place of the linear layer it replaced."""

    def __init__(self, fused: FusedProjections, index: int) -> None:
        super().__init__()
        self.fused = fused
        self.index = index
        self.in_features = fused.product.in_features
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


def _packable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.dtype in (torch.float32, torch.bfloat16)


def streams_weights(model: nn.Module, cache_bytes: int | None) -> bool:
    """Whether ``model``'s linear weights outgrow a last-level cache of ``cache_bytes`` (None: not
    known), so that its products should read them with the non-temporal hint.

    A pass reads every weight once and reads it again only after all the others, so a model larger than
    the cache gets no hit from caching its weights; streamed through the cache they only evict what
    is used again between passes, by the process and by the others on the host (a small draft's
    weights, for one). A small model, a draft's, keeps its weights cached from one call to the next.
    """
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if _packable(m))
    return cache_bytes is not None and weights > cache_bytes


def pack_linears(model: nn.Module, stream: bool | None = None) -> int:
    """Replaces the fp32 and bf16 ``nn.Linear`` layers of an inference model in place by their fastest
    row-invariant kernels, fusing sibling projections; returns how many linear layers were replaced (a
    layer whose only row-invariant kernel is its plain self stays). The process's oneDNN kernel caches
    are bounded first (``bound_kernel_caches``). ``stream``: whether specdec's own kernel reads the
    weights with the non-temporal hint; by default, when they outgrow this host's last-level cache
    (``streams_weights``)."""
    if not packing_available():
        return 0
    bound_kernel_caches()
    if stream is None:
        stream = streams_weights(model, last_level_cache_bytes())
    replaced = 0
    for parent in list(model.modules()):
        for names in SIBLING_PROJECTIONS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(_packable(lin) for lin in linears) or len({lin.in_features for lin in linears}) != 1:
                continue
            if len({lin.weight.dtype for lin in linears}) != 1:
                continue
            product = invariant_product(*stacked(linears), stream)
            if product is None:
                continue
            fused = FusedProjections(linears, product)
            for index, name in enumerate(names):
                setattr(parent, name, ProjectionSlice(fused, index))
            replaced += len(names)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _packable(child)
    ]
    for parent, name, child in targets:
        kernel = invariant_product(child.weight.detach(), None if child.bias is None else child.bias.detach(), stream)
        if kernel is not None:
            setattr(parent, name, kernel)
            replaced += 1
    return replaced
