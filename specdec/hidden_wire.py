"""Hidden states on the wire: the target's rows as fp16 bytes, and back, for the feature draft.

Both directions run on a service's event-loop thread, so they convert with numpy, never with a
parallel torch op: that thread must not start an OpenMP team of its own (see ``specdec.model_thread``).
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.kvcache import HiddenRows
from specdec.v1 import common_pb2


def hidden_to_fp16(hidden: HiddenRows) -> tuple[int, int, bytes]:
    """Hidden states as they travel: (start, dim, fp16 bytes, row-major)."""
    with np.errstate(over="ignore"):  # as torch does: past fp16's range is inf, which the draft refuses
        rows = hidden.rows.detach().cpu().numpy().astype(np.float16)  # [n, D], round to nearest
    return hidden.start, rows.shape[1], rows.tobytes()


def hidden_from_fp16(start: int, width: int, fp16: bytes, dim: int) -> HiddenRows | None:
    """Hidden states from their travelling form (fp32 rows), or None when there are none.

    Raises ``ValueError`` when the width is not ``dim`` or the bytes are not whole fp16 rows.
    """
    if not fp16:
        return None
    if width != dim:
        raise ValueError(f"hidden.dim: this draft reads hidden states of width {dim}, got {width}")
    if len(fp16) % (2 * dim):
        raise ValueError(f"hidden.fp16: {len(fp16)} bytes are not whole rows of {dim} float16 values")
    rows = np.frombuffer(fp16, dtype=np.float16).reshape(-1, dim).astype(np.float32)  # [n, D]
    if not np.isfinite(rows).all():
        raise ValueError("hidden.fp16: hidden states must be finite")
    return HiddenRows(start, torch.from_numpy(rows))


def hidden_to_pb(hidden: HiddenRows) -> common_pb2.HiddenStates:
    """Wire form of hidden states: fp16 bytes, row-major."""
    start, dim, fp16 = hidden_to_fp16(hidden)
    return common_pb2.HiddenStates(start=start, dim=dim, fp16=fp16)


def hidden_from_pb(msg: common_pb2.HiddenStates, dim: int) -> HiddenRows | None:
    """Hidden states from the wire (fp32 rows), or None when the message carries none (see
    ``hidden_from_fp16``)."""
    return hidden_from_fp16(msg.start, msg.dim, msg.fp16, dim)
