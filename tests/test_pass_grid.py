"""The pass-cost grid (timed on the tiny target) and the speculation ceiling it implies."""

from __future__ import annotations

import pytest

from bench.pass_grid import measure_pass_grid
from coordinator.adaptive import speculation_ceiling
from target_service.engine import TargetEngine


def test_grid_times_every_level_and_draft_length_and_releases_its_caches(tiny_target):
    engine = TargetEngine(tiny_target, 8)
    sweeps = []
    grid = measure_pass_grid(
        engine, [[5, 6, 7], [9] * 12, [3, 4]], levels=[1, 4], k_max=2, repeats=1, between=sweeps.append
    )
    assert sweeps == [0, 1, 0, 1]  # after the warm-up sweep and the timed one, at each level
    assert sorted(grid) == [1, 4]
    assert all(len(row) == 3 and all(ms > 0 for ms in row) for row in grid.values())
    assert len(engine.caches) == 0


def test_ceiling_is_the_best_expected_tokens_per_pass_cost():
    # Rows free: the longest k wins, E(2) = 1 + 0.5 + 0.25. Rows as dear as passes: k = 0 wins.
    # In between: k = 1 commits 1.5 tokens for 1.2 passes.
    grid = {1: [100.0, 100.0, 100.0], 8: [100.0, 200.0, 300.0], 16: [100.0, 120.0, 180.0]}
    ceiling = speculation_ceiling(grid, 0.5)
    assert ceiling[1] == pytest.approx((1.75, 2))
    assert ceiling[8] == pytest.approx((1.0, 0))
    assert ceiling[16] == pytest.approx((1.25, 1))
