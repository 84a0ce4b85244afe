"""The target's residual stream after chosen layers, sent beside its final-norm hidden states.

A feature draft with side layers (``FeatureDraftArch.side_layers``, the EAGLE-3 idea) reads, at each
committed position, the target's final-norm hidden state followed by the output of each side layer:
rows ``[n, D * (1 + S)]``. Training (``draft_service.distill.features``) and serving (the target service)
build those rows with the functions here, so they are laid out alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

MAX_SIDE_LAYERS = 4
"""Most side layers a request may ask for: each adds the hidden size to every row sent."""


def check_side_layers(side_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``side_layers`` as a tuple, or ValueError naming the field when one is no layer of the target,
    repeats, or there are too many."""
    layers = tuple(int(j) for j in side_layers)
    if len(layers) > MAX_SIDE_LAYERS:
        raise ValueError(f"hidden_side_layers: at most {MAX_SIDE_LAYERS}, got {len(layers)}")
    if len(set(layers)) != len(layers) or any(not 0 <= j < num_layers for j in layers):
        raise ValueError(f"hidden_side_layers: distinct layers in [0, {num_layers}) expected, got {list(layers)}")
    return layers


@contextmanager
def layer_outputs(layers: nn.ModuleList, wanted: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """While open, every forward of the decoder layers ``wanted`` stores its output in the yielded dict."""
    outputs: dict[int, torch.Tensor] = {}

    def keeper(index: int):
        def hook(module, args, output):
            outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    hooks = [layers[j].register_forward_hook(keeper(j)) for j in wanted]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


def with_sides(hidden: torch.Tensor, outputs: dict[int, torch.Tensor], side_layers: Sequence[int]) -> torch.Tensor:
    """Final-norm hidden states ``[..., D]`` followed by the side layers' outputs: ``[..., D * (1 + S)]``."""
    if not side_layers:
        return hidden
    return torch.cat([hidden, *(outputs[j] for j in side_layers)], dim=-1)
