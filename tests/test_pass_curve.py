"""The pass curve's roofline: which products a pass runs, what they read, and the rates reported."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bench.pass_curve as pass_curve
from bench.pass_curve import PRODUCT_ROWS, _roofline, cached_rate, pass_products, product_macs, time_products


class Recording(nn.Module):
    """A product that keeps the shape of every input it is given."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.seen: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape))
        return x.new_zeros(x.shape[0], self.out_features)


class Model(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def products() -> list[Recording]:
    return [Recording(torch.empty(out, width)) for out, width in ((12, 4), (4, 12), (8, 4))]


def test_a_pass_runs_its_layers_products_then_the_head_and_each_once_with_rows_of_its_width():
    layers, head = products(), Recording(torch.empty(50, 4))
    chosen = pass_products(Model(head), layers)
    assert chosen == [*layers, head]
    assert product_macs(chosen) == 12 * 4 + 4 * 12 + 8 * 4 + 50 * 4
    time_products(chosen, 3, torch.float32)
    assert [p.seen for p in chosen] == [[(3, 4)], [(3, 12)], [(3, 4)], [(3, 4)]]


def test_the_roofline_reads_each_sweeps_rate_from_its_one_row_products(monkeypatch):
    monkeypatch.setattr(pass_curve, "cached_rate", lambda kind, width, dtype: 2e9)
    chosen = [Recording(torch.empty(1000, 1000, device="meta")) for _ in range(3)]  # 6 MB in bf16
    times = {"products-1": [2.0, 4.0, 1.0], "products-8": [5.0, 6.0, 9.0]}
    times |= {"1": [9.0, 11.0, 8.5], "8": [13.0, 13.5, 14.0]}
    roof = _roofline(chosen, times, torch.bfloat16)
    assert roof["weights_mb"] == 6.0
    assert roof["products_ms"] == {str(PRODUCT_ROWS[0]): 2.0, str(PRODUCT_ROWS[1]): 6.0}
    assert roof["read_gb_per_s"] == 3.0  # 6 MB in the median 2 ms
    assert roof["cached_gmacs_per_s"] == 2.0
    assert roof["rows8_at_cached_rate_ms"] == 12.0  # 8 rows x 3M multiply-adds at 2G a second
    # Each sweep's rate beside its own passes, slowest reading first.
    assert roof["sweeps"] == [[1.5, 11.0, 13.5], [3.0, 9.0, 13.0], [6.0, 8.5, 14.0]]


def test_the_cached_rate_counts_the_multiply_adds_of_the_rows_it_ran(monkeypatch):
    made: list[Recording] = []

    def kind(weight: torch.Tensor) -> Recording:
        made.append(Recording(weight))
        return made[-1]

    monkeypatch.setattr(pass_curve, "CACHED_OUTPUTS", 16)
    clock = iter(range(1000))
    monkeypatch.setattr(pass_curve.time, "perf_counter", lambda: next(clock) * 0.5)  # every call: 0.5 s
    rate = cached_rate(kind, 6, torch.float32, rows=3, repeats=8)
    assert rate == pytest.approx(3 * 16 * 6 / 0.5)
    assert made[0].in_features == 6 and made[0].out_features == 16
    assert made[0].seen == [(3, 6)] * (8 // 4 + 8)
