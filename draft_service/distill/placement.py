"""Where and in what precision ``specdec distill`` computes: ``--device`` and ``--dtype``.

The target runs (references, collection, features) in the resolved dtype on the device. The draft
keeps float32 weights (the optimiser's master copy, and what is saved) and, when its training dtype
is bfloat16, computes its training passes under autocast: mixed-precision training, since pure bf16
weights lose AdamW's small updates.

``auto`` picks bfloat16 for the target wherever the device computes it natively, but trains under
bf16 autocast on a GPU only: on this project's CPU (AVX-512 BF16, no AMX) a bf16 target pass is
faster than a float32 one (batch-4 greedy collection 12.7 s against 20.3 s), while a draft's
training step under bf16 autocast was slower than in float32 (5.0 s against 2.9 s for 2,048 tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from draft_service.distill.config import DEVICES, DTYPES
from specdec.models import native_bf16


class DeviceUnavailable(RuntimeError):
    """``--device cuda`` where torch sees no CUDA device; the message says so for the user."""


def require_device(device: str) -> None:
    """Raises ``DeviceUnavailable`` when ``device`` is ``cuda`` and torch sees no CUDA device."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise DeviceUnavailable(
            f"--device cuda: no CUDA device is available (torch {torch.__version__} is {build}); "
            "run on a machine with a GPU, or use --device cpu"
        )


@dataclass(frozen=True)
class Placement:
    """The resolved device and dtype of one run."""

    device: str
    dtype: torch.dtype
    """The target's dtype (its references, continuations and features)."""
    train_dtype: torch.dtype = torch.float32
    """The draft's training autocast dtype (float32: no autocast)."""

    @property
    def dtype_name(self) -> str:
        """The dtype as the card records it (``bfloat16``, ``float32``)."""
        return str(self.dtype).removeprefix("torch.")

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a draft's training pass runs in: bf16 autocast, or nothing in float32."""
        if self.train_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.train_dtype)


def resolve_placement(device: str, dtype: str) -> Placement:
    """``--device`` and ``--dtype`` resolved. ``auto``: the target in bfloat16 where the device computes
    it natively (a GPU; a CPU with AVX-512 BF16 or AMX, ``specdec.models.native_bf16``), float32
    elsewhere, and training under bf16 autocast on a GPU only (see the module's docstring). A named
    dtype is used for both."""
    require_device(device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype == "auto":
        target = torch.bfloat16 if native_bf16(device) else torch.float32
        return Placement(device, target, torch.bfloat16 if device != "cpu" else torch.float32)
    return Placement(device, getattr(torch, dtype), getattr(torch, dtype))


def to_device(batch, device: str | torch.device):
    """A dataclass batch with every tensor field moved to ``device`` (the same object on its device)."""
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor) and getattr(batch, f.name).device != torch.device(device)
    }
    return dataclasses.replace(batch, **moved) if moved else batch
