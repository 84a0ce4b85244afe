"""Hidden states on the wire: the target's rows as fp16 bytes, and back, for the feature draft."""

from __future__ import annotations

import torch

from specdec.kvcache import HiddenRows
from specdec.v1 import common_pb2


def hidden_to_pb(hidden: HiddenRows) -> common_pb2.HiddenStates:
    """Wire form of hidden states: fp16 bytes, row-major."""
    rows = hidden.rows.detach().to(torch.float16).cpu().contiguous()  # [n, D]
    return common_pb2.HiddenStates(start=hidden.start, dim=rows.shape[1], fp16=rows.numpy().tobytes())


def hidden_from_pb(msg: common_pb2.HiddenStates, dim: int) -> HiddenRows | None:
    """Hidden states from the wire (fp32 rows), or None when the message carries none.

    Raises ``ValueError`` when the width is not ``dim`` or the bytes are not whole fp16 rows.
    """
    if not msg.fp16:
        return None
    if msg.dim != dim:
        raise ValueError(f"hidden.dim: this draft reads hidden states of width {dim}, got {msg.dim}")
    if len(msg.fp16) % (2 * dim):
        raise ValueError(f"hidden.fp16: {len(msg.fp16)} bytes are not whole rows of {dim} float16 values")
    rows = torch.frombuffer(bytearray(msg.fp16), dtype=torch.float16).view(-1, dim).float()  # [n, D]
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("hidden.fp16: hidden states must be finite")
    return HiddenRows(msg.start, rows)
