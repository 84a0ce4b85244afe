"""Hidden states on the wire: the target's rows as fp16 bytes, and back, for the feature draft.

Both directions run on a service's event-loop thread, so they convert with numpy, never with a
parallel torch op: that thread must not start an OpenMP team of its own (see ``specdec.model_thread``).
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.kvcache import HiddenRows
from specdec.v1 import common_pb2


def hidden_to_pb(hidden: HiddenRows) -> common_pb2.HiddenStates:
    """Wire form of hidden states: fp16 bytes, row-major."""
    with np.errstate(over="ignore"):  # as torch does: past fp16's range is inf, which the draft refuses
        rows = hidden.rows.detach().cpu().numpy().astype(np.float16)  # [n, D], round to nearest
    return common_pb2.HiddenStates(start=hidden.start, dim=rows.shape[1], fp16=rows.tobytes())


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
    rows = np.frombuffer(msg.fp16, dtype=np.float16).reshape(-1, dim).astype(np.float32)  # [n, D]
    if not np.isfinite(rows).all():
        raise ValueError("hidden.fp16: hidden states must be finite")
    return HiddenRows(msg.start, torch.from_numpy(rows))
