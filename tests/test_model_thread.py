"""The model's one thread (``specdec.model_thread``) and the hidden-state wire that keeps torch off the
event loop's thread."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.hidden_wire import hidden_from_pb, hidden_to_pb
from specdec.kvcache import HiddenRows
from specdec.model_thread import model_executor, on_model_thread
from specdec.v1 import common_pb2


def test_a_model_is_built_on_the_thread_that_then_serves_it():
    executor = model_executor("test")
    before = torch.get_num_threads()
    try:
        built = on_model_thread(executor, 1, lambda: (threading.get_ident(), torch.get_num_threads()))
        served = executor.submit(threading.get_ident).result()
    finally:
        executor.shutdown()
        torch.set_num_threads(before)
    assert built == (served, 1) and served != threading.get_ident()


def test_hidden_states_cross_the_wire_as_torch_rounds_them_to_fp16():
    rows = torch.randn(37, 96) * 30
    rows[0, 0], rows[1, 1], rows[2, 2] = 65519.0, 1e-6, -2.5e-8  # fp16's edge, a subnormal, a flush to zero
    msg = hidden_to_pb(HiddenRows(3, rows))
    assert (msg.start, msg.dim) == (3, 96)
    assert msg.fp16 == rows.to(torch.float16).numpy().tobytes()
    strided = torch.randn(5, 192)[:, ::2]  # rows of a wider block, not contiguous
    assert hidden_to_pb(HiddenRows(0, strided)).fp16 == strided.to(torch.float16).contiguous().numpy().tobytes()
    back = hidden_from_pb(msg, 96)
    assert back.start == 3 and back.rows.dtype == torch.float32
    assert torch.equal(back.rows, rows.to(torch.float16).float())


def test_hidden_states_past_fp16_range_are_refused_by_the_reader():
    rows = torch.ones(2, 8)
    rows[1, 3] = 1e6  # inf in fp16
    with pytest.raises(ValueError, match="finite"):
        hidden_from_pb(hidden_to_pb(HiddenRows(0, rows)), 8)
    with pytest.raises(ValueError, match="width 3"):
        hidden_from_pb(hidden_to_pb(HiddenRows(0, torch.ones(2, 8))), 3)
    with pytest.raises(ValueError, match="whole rows"):
        hidden_from_pb(common_pb2.HiddenStates(dim=8, fp16=bytes(10)), 8)
