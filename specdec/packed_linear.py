"""Linear layers with oneDNN-prepacked weights, so verifying k+1 tokens costs about as much as one.

On CPU, ``torch.nn.functional.linear`` runs MKL's GEMM for more than one row, and for the skinny
shapes of a verify pass (2 to 9 rows) it costs up to twice a one-row GEMV. oneDNN with the weight
reordered once into its blocked layout keeps the cost nearly flat in the number of rows, which is
what makes speculation pay on a CPU (measured per layer shape in ``tests/test_packed_linear.py``).

The results equal plain ``linear`` up to float rounding (a different summation order), not
bit for bit; greedy decoding can differ only where the top two logits nearly tie.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    """True when this torch build has oneDNN's linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """An inference-only ``nn.Linear`` whose weight lives in oneDNN's prepacked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().float().contiguous()  # [out, in]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")  # [N, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replaces every fp32 ``nn.Linear`` of an inference model in place; returns how many."""
    if not packing_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
